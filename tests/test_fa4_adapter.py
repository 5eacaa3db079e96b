"""FlashAttention-4's adapter (kernels/fa4.py) on the CPU: which problems it takes, how the op's
masks and positions map onto FA4's bottom-right aligned windows, and the key-padding algorithm
(each row's run through FA4's packed path, holes through the Triton kernels), with FA4's entry
points replaced by a stand-in that follows FA4's conventions over the float64 reference and records
what it was handed. The real FA4 runs in tests/test_gpu_fa4.py."""
import dataclasses
import itertools

import pytest
import torch

from attn_compile.kernels import dispatch, fa4, ranking, reference
from attn_compile.kernels.triton_runs import fill_runs, find_runs, finish_key_grads
from attn_compile.kernels.kernel import Kernel
from attn_compile.kernels.problem import Problem
from oracle import errors_against_oracle, rel_err


class StandIn:
    """``_flash_attn_fwd`` and ``_flash_attn_bwd`` as FA4 defines them: (B, S, H, D) tensors, or
    packed (total, H, D) ones whose batch entry b is rows [cu[b], cu[b] + seqused[b]); masks
    aligned bottom-right (the last query sees the last key); a negative or absent window side
    unbounded; results written on the covered rows only, and gradient buffers FA4 allocates left
    unwritten elsewhere (NaN here)."""

    def __init__(self):
        self.calls = []

    @staticmethod
    def _segments(q, k, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k):
        if q.dim() == 4:
            return [((b, slice(None)), (b, slice(None))) for b in range(q.shape[0])]

        def rows(cu, used, b):
            start = int(cu[b])
            n = int(used[b]) if used is not None else int(cu[b + 1]) - start
            return (slice(start, start + n),)
        return [(rows(cu_seqlens_q, seqused_q, b), rows(cu_seqlens_k, seqused_k, b))
                for b in range(len(cu_seqlens_q) - 1)]

    @staticmethod
    def _masking(causal, softcap, left, right, s_q, s_k):
        left = -1 if left is None or left < 0 else left
        right = 0 if causal else (-1 if right is None or right < 0 else right)
        return dict(window=(left, right), q_offset=s_k - s_q, softcap=softcap or 0.0)

    @staticmethod
    def _heads_first(x):
        return x.transpose(0, 1)[None].double()

    def _flash_attn_fwd(self, q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                        max_seqlen_q=None, max_seqlen_k=None, softmax_scale=None, causal=False, softcap=None,
                        window_size_left=None, window_size_right=None, out=None, lse=None, return_lse=False):
        self.calls.append(dict(direction="fwd", q=q, causal=causal, cu_seqlens_q=cu_seqlens_q,
                               cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q, seqused_k=seqused_k,
                               window=(window_size_left, window_size_right)))
        packed = q.dim() == 3
        if out is None:
            out = q.new_empty(*q.shape[:-1], v.shape[-1])
            lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32) if packed else \
                torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32)
        for q_rows, k_rows in self._segments(q, k, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k):
            qs, ks, vs = (self._heads_first(x[rows]) for x, rows in ((q, q_rows), (k, k_rows), (v, k_rows)))
            o, l = reference.attention_forward(qs, ks, vs, scale=softmax_scale, **self._masking(
                causal, softcap, window_size_left, window_size_right, qs.shape[2], ks.shape[2]))
            out[q_rows] = o[0].transpose(0, 1).to(out.dtype)
            (lse[(slice(None), *q_rows)] if packed else lse[q_rows[0]])[...] = l[0].float()
        return out, lse, None, None, None

    def _flash_attn_bwd(self, q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0,
                        window_size_left=None, window_size_right=None, cu_seqlens_q=None, cu_seqlens_k=None,
                        seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None, dq=None, dk=None,
                        dv=None):
        self.calls.append(dict(direction="bwd", q=q, causal=causal, cu_seqlens_q=cu_seqlens_q,
                               seqused_q=seqused_q, seqused_k=seqused_k, dq=dq))
        packed = q.dim() == 3
        dq, dk, dv = (torch.full_like(x, float("nan")) if g is None else g for x, g in ((q, dq), (k, dk), (v, dv)))
        for q_rows, k_rows in self._segments(q, k, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k):
            qs, os_, dos = (self._heads_first(x[q_rows]) for x in (q, out, dout))
            ks, vs = (self._heads_first(x[k_rows]) for x in (k, v))
            ls = (lse[(slice(None), *q_rows)] if packed else lse[q_rows[0]])[None].double()
            grads = reference.attention_backward(dos, qs, ks, vs, os_, ls, scale=softmax_scale, **self._masking(
                causal, softcap, window_size_left, window_size_right, qs.shape[2], ks.shape[2]))
            for into, rows, grad in zip((dq, dk, dv), (q_rows, k_rows, k_rows), grads):
                into[rows] = grad[0].transpose(0, 1).to(into.dtype)
        return dq, dk, dv


@pytest.fixture
def standin(monkeypatch):
    stand_in = StandIn()
    monkeypatch.setattr(fa4, "interface", lambda: stand_in)
    return stand_in


def _on(problem, **facts):
    return dataclasses.replace(problem, **{"device_type": "cuda", "sm": (9, 0), **facts})


def _problem(h_q=4, h_kv=4, d_qk=64, d_v=64, s_q=32, s_k=32, dtype=torch.bfloat16, **masking):
    q, k, v = (torch.empty(1, h, s, d, dtype=dtype, device="meta")
               for h, s, d in ((h_q, s_q, d_qk), (h_kv, s_k, d_qk), (h_kv, s_k, d_v)))
    return Problem.of(q, k, v, **masking)


# What the adapter takes -------------------------------------------------------------------------------------

SUPPORTS = {  # name: (problem, facts, taken)
    "causal": (_problem(is_causal=True), {}, True),
    "before sm90": (_problem(is_causal=True), {"sm": (8, 0)}, False),
    "float32": (_problem(dtype=torch.float32), {}, False),
    "head dim 264": (_problem(d_qk=264, d_v=264), {}, False),
    "head dim not a multiple of 8": (_problem(d_qk=60, d_v=60), {}, False),
    "sm100 192/128": (_problem(d_qk=192, d_v=128), {"sm": (10, 0)}, True),
    "sm100 160/160": (_problem(d_qk=160, d_v=160), {"sm": (10, 0)}, False),
    "tensor mask": (_problem(attn_mask=torch.empty(0)), {}, False),
    "document ids": (_problem(document_ids=torch.empty(0)), {}, False),
    "key padding, causal": (_problem(is_causal=True, key_padding_mask=torch.empty(0)), {}, True),
    "key padding with a window": (_problem(window=(4, 0), key_padding_mask=torch.empty(0)), {}, False),
    "gqa+mla forward": (_problem(h_q=8, h_kv=2, d_qk=192, d_v=128, is_causal=True), {}, True),
    "gqa+mla backward": (_problem(h_q=8, h_kv=2, d_qk=192, d_v=128, is_causal=True, backward=True), {}, False),
    "mla backward": (_problem(d_qk=192, d_v=128, is_causal=True, backward=True), {}, True),
    "ring tile, causal at an offset": (_problem(s_q=16, is_causal=True, q_offset=64, k_offset=0), {}, True),
    "band FA4 cannot align": (_problem(window=(-1, 8), q_offset=0, k_offset=20), {}, False),
}


@pytest.mark.parametrize("name", list(SUPPORTS))
def test_supports(standin, name):
    problem, facts, taken = SUPPORTS[name]
    assert fa4.supports(_on(problem, **facts)) is taken


def test_nothing_without_flash_attn_4(monkeypatch):
    monkeypatch.setattr(fa4, "interface", lambda: None)
    assert not fa4.supports(_on(_problem(is_causal=True)))


@pytest.mark.parametrize("is_causal, window, s_q, s_k, k_shift, sides", [
    (True, (-1, -1), 32, 32, 0, (None, 0)),  # square causal: FA4's own
    (False, (8, 2), 32, 32, 0, (8, 2)),
    (True, (-1, -1), 16, 32, -16, (None, 0)),  # the last query chunk against every key: bottom-right
    (True, (-1, -1), 32, 32, -64, (None, 64)),  # keys 64 places before the queries
    (False, (200, 0), 32, 32, -128, (72, 128)),  # a window reaching into keys 128 places back
    (False, (100, 0), 32, 32, -128, None),  # its lower edge past the first key FA4 would align
    (False, (-1, 8), 32, 32, 20, None),  # a negative side: not expressible
])
def test_window_sides(is_causal, window, s_q, s_k, k_shift, sides):
    assert fa4.window_sides(is_causal, window, s_q, s_k, k_shift) == sides


# The dispatch's order ---------------------------------------------------------------------------------------

DISPATCH = {  # name: (problem, forward kernel, backward kernel)
    "causal": (_problem(is_causal=True), "fa4", "fa4"),
    "softcap": (_problem(is_causal=True, softcap=30.0), "triton", "fa4"),
    "gqa+mla": (_problem(h_q=8, h_kv=2, d_qk=192, d_v=128, is_causal=True), "fa4", "cudnn"),
    "document ids": (_problem(is_causal=True, document_ids=torch.empty(0)), "triton", "fa4 mask_mod"),
    "document ids, 8192 tokens": (_problem(s_q=8192, s_k=8192, is_causal=True, document_ids=torch.empty(0)),
                                  "fa4 segments", "fa4 segments"),
    "document ids, d 256": (_problem(d_qk=256, d_v=256, is_causal=True, document_ids=torch.empty(0)),
                            "triton", "fa4 segments"),
    "document ids, gqa+mla": (_problem(h_q=8, h_kv=2, d_qk=192, d_v=128, is_causal=True, document_ids=torch.empty(0)),
                              "triton", "triton"),
    "document ids, gqa+mla, 8192 tokens": (_problem(h_q=8, h_kv=2, d_qk=192, d_v=128, s_q=8192, s_k=8192,
                                                    is_causal=True, document_ids=torch.empty(0)),
                                           "fa4 segments", "triton"),
    "document ids with softcap": (_problem(is_causal=True, softcap=30.0, document_ids=torch.empty(0)), "triton",
                                  "triton"),
    "document ids with softcap and a window, d 256, 8192 tokens": (
        _problem(s_q=8192, s_k=8192, d_qk=256, d_v=256, is_causal=True, softcap=50.0, window=(8, -1),
                 document_ids=torch.empty(0)), "triton", "fa4 segments"),
    "document ids with a window": (_problem(is_causal=True, window=(8, -1), document_ids=torch.empty(0)), "triton",
                                   "triton"),
    "band FA4 cannot align": (_problem(window=(-1, 8), q_offset=0, k_offset=20), "triton", "triton"),
    "key padding, 4096 tokens": (_problem(s_q=4096, s_k=4096, is_causal=True, key_padding_mask=torch.empty(0)),
                                 "fa4 mask_mod", "fa4 mask_mod"),
    "key padding, 8192 tokens": (_problem(s_q=8192, s_k=8192, is_causal=True, key_padding_mask=torch.empty(0)),
                                 "fa4", "fa4"),
    "key padding with a window": (_problem(is_causal=True, window=(8, -1), key_padding_mask=torch.empty(0)),
                                  "fa4 mask_mod", "fa4 mask_mod"),
    "key padding, queries fewer than keys": (_problem(s_q=16, is_causal=True, key_padding_mask=torch.empty(0)),
                                             "triton", "triton"),
}


@pytest.mark.parametrize("name", list(DISPATCH))
def test_dispatch_order(standin, name):
    problem, forward, backward = DISPATCH[name]
    for direction, expected in ((False, forward), (True, backward)):
        assert dispatch._first(dispatch.FUSED, _on(problem, backward=direction)).name == expected


def test_every_measured_figure_names_a_kernel_of_its_class():
    """A misspelt kernel in the table would leave its figure unused and the order silently fixed."""
    for name, rows in ranking.TABLE.items():
        kernels = dispatch.FUSED_VARLEN if name.startswith("packed") else dispatch.FUSED
        for row in rows:
            assert {*row.forward, *row.backward} <= {kernel.name for kernel in kernels}, name
    classes = {ranking.problem_class(_problem(**masking), packed) for masking, packed in (
        ({}, False), (dict(window=(4, 0)), False), (dict(is_causal=True, q_offset=8), False),
        (dict(softcap=1.0), False), (dict(softcap=1.0, document_ids=torch.empty(0)), False),
        (dict(document_ids=torch.empty(0)), False),
        (dict(document_ids=torch.empty(0), window=(4, 0)), False), (dict(key_padding_mask=torch.empty(0)), False),
        (dict(key_padding_mask=torch.empty(0), window=(4, 0)), False), ({}, True))}
    assert classes == set(ranking.TABLE)


def test_dispatch_without_flash_attn_4_is_unchanged(monkeypatch):
    monkeypatch.setattr(fa4, "interface", lambda: None)
    assert dispatch._first(dispatch.FUSED, _on(_problem(is_causal=True))).name == "cudnn"
    assert dispatch._first(dispatch.FUSED_VARLEN, _on(_problem(is_causal=True))).name == "triton"


# Numerics through the stand-in ------------------------------------------------------------------------------


def _projected(batch, h, s, d):
    """A (B, H, S, D) transposed view of a (B, S, H, D) tensor, as a model's projection gives it."""
    return torch.randn(batch, s, h, d).transpose(1, 2).requires_grad_()


def _against_oracle(q, k, v, **masking):
    scale = q.shape[-1] ** -0.5
    out, lse = fa4.attention_forward(q.detach(), k.detach(), v.detach(), scale=scale, **masking)
    dout = torch.randn_like(out)
    grads = fa4.attention_backward(dout, q.detach(), k.detach(), v.detach(), out, lse, scale=scale, **masking)
    errors = errors_against_oracle(q, k, v, dout, out, grads, **masking)
    assert max(errors) <= 1e-4, errors
    _, want_lse = reference.attention_forward(*(x.detach().double() for x in (q, k, v)), scale=scale, **masking)
    torch.testing.assert_close(lse, want_lse.float())  # -inf where a query sees no key
    return out, grads


@pytest.mark.parametrize("masking", [dict(is_causal=True), dict(window=(5, 2)),
                                     dict(is_causal=True, q_offset=24, k_offset=8), dict(softcap=2.0)])
def test_dense_mapping(standin, masking):
    torch.manual_seed(0)
    s_q = 16 if "q_offset" in masking else 32
    q, k, v = _projected(2, 4, s_q, 16), _projected(2, 2, 32, 16), _projected(2, 2, 32, 8)
    out, grads = _against_oracle(q, k, v, **masking)
    handed = standin.calls[0]["q"]
    assert handed.data_ptr() == q.data_ptr() and handed.shape == (2, s_q, 4, 16)  # FA4's layout, as a view
    assert out.transpose(1, 2).is_contiguous()  # q's memory order
    assert all(g.stride() == x.stride() for g, x in zip(grads, (q, k, v)))


def key_padding(lengths, s, side="right", holes=False):
    """(B, S) bool: each row's run of real tokens, at the start (``side="right"``: right padding),
    the end ("left") or the middle ("middle": padding on both sides), with one hole in the middle
    of each run of more than 4 with ``holes``."""
    rows = []
    for n in lengths:
        first = {"right": 0, "left": s - n, "middle": (s - n) // 2}[side]
        real = (torch.arange(s) >= first) & (torch.arange(s) < first + n)
        if holes and n > 4:
            real[first + n // 2] = False
        rows.append(real)
    return torch.stack(rows)


@pytest.fixture
def poisoned_empty(monkeypatch):
    """Floating tensors made by ``torch.empty``, ``torch.empty_like`` and ``Tensor.new_empty`` come
    filled with NaN, so that an element the adapter leaves unwritten, or reads before writing, shows up."""
    def poisoned(make):
        def made(*args, **kwargs):
            x = make(*args, **kwargs)
            return x.fill_(float("nan")) if x.is_floating_point() else x
        return made
    monkeypatch.setattr(torch, "empty", poisoned(torch.empty))
    monkeypatch.setattr(torch, "empty_like", poisoned(torch.empty_like))
    monkeypatch.setattr(torch.Tensor, "new_empty", poisoned(torch.Tensor.new_empty))


PADDED = {  # name: (lengths, side, holes, causal)
    "right padding, causal": ([24, 17, 5, 1], "right", False, True),
    "left padding, causal": ([24, 17, 5, 1], "left", False, True),
    "right padding, full": ([24, 17, 5, 1], "right", False, False),
    "left padding, full": ([24, 17, 5, 1], "left", False, False),
    "holes, causal": ([24, 17, 5, 3], "right", True, True),
    "padding on both sides, causal": ([24, 17, 5, 1], "middle", False, True),
    "a row without a real key": ([13, 0], "right", False, True),
}


@pytest.mark.parametrize("name", list(PADDED))
def test_key_padding_against_oracle(standin, poisoned_empty, name):
    torch.manual_seed(1)
    lengths, side, holes, causal = PADDED[name]
    q, k, v = (_projected(len(lengths), h, 24, d) for h, d in ((4, 16), (2, 16), (2, 8)))
    mask = key_padding(lengths, 24, side, holes)
    _against_oracle(q, k, v, is_causal=causal, key_padding_mask=mask)
    forward_calls = [call for call in standin.calls if call["direction"] == "fwd"]
    assert len(forward_calls) == (2 if causal else 1)  # the runs, and the rows' other queries
    run = torch.tensor(lengths, dtype=torch.int32)  # a hole stays inside its row's run
    assert torch.equal(forward_calls[0]["seqused_k"], run)
    if causal:
        assert torch.equal(forward_calls[0]["seqused_q"], run) and forward_calls[0]["causal"]
        after = forward_calls[1]
        end = torch.where(mask, torch.arange(24) + 1, 0).amax(1)
        # the queries after each run see all of it, in a second call; a row with none after its
        # run (left padding) gives that call no key
        assert not after["causal"] and torch.equal(after["seqused_q"], (24 - end).int())
        assert torch.equal(after["seqused_k"], torch.where(end < 24, run, 0))


def test_find_runs():
    """One launch finds what the packed calls need: each row's run, the queries before and after
    it, and whether its real keys have holes."""
    mask = key_padding([6, 3, 0, 4, 5], 8, "right")
    mask[1] = key_padding([3], 8, "left")[0]
    mask[3] = key_padding([4], 8, "middle")[0]
    mask[4, 2] = False  # a hole: the run is [0, 5), 4 real keys
    runs = find_runs(mask)
    assert {name: field.tolist() for name, field in runs._asdict().items()} == {
        "rows": [0, 8, 16, 24, 32, 40],
        "starts": [0, 13, 24, 26, 32, 40],  # a row without a real key: its run starts at the next row
        "after": [6, 16, 16, 30, 37, 40],
        "length": [6, 3, 0, 4, 5],
        "before": [0, 5, 0, 2, 0],
        "after_length": [2, 0, 8, 2, 3],
        "after_keys": [6, 0, 0, 4, 5],
        "holes": [0, 0, 0, 0, 1]}


def test_fill_runs():
    """A constant in each run's rows, nothing written elsewhere: here an LSE, (H, rows) seen as
    (rows, H, 1)."""
    torch.manual_seed(0)
    starts, lengths = torch.tensor([0, 10, 20], dtype=torch.int32), torch.tensor([7, 0, 20], dtype=torch.int32)
    lse = torch.randn(3, 40)
    want = lse.clone()
    want[:, 0:7] = want[:, 20:40] = float("-inf")
    fill_runs(lse.t().unsqueeze(-1), starts, lengths, 20, float("-inf"))
    assert torch.equal(lse, want)


@pytest.mark.parametrize("with_part", [False, True])
def test_finish_key_grads(with_part):
    """Zero outside each row's run; inside it, the second call's part added where that call had
    keys, and nothing read or written where it had none. NaN marks what must not be read."""
    torch.manual_seed(0)
    mask = key_padding([40, 23, 9], 40, "right")
    mask[1] = key_padding([23], 40, "left")[0]
    runs = find_runs(mask)  # row 0: full, 1: left-padded (its second call has no key), 2: right-padded
    grad, part = torch.randn(120, 3, 8), torch.randn(120, 8, 3).transpose(1, 2)  # any strides
    padding = ~mask.flatten()
    grad[padding] = float("nan")
    part[padding] = float("nan")
    part[40:80] = float("nan")  # the left-padded row's part is never read
    want = torch.where(padding[:, None, None], 0.0, grad)
    if with_part:
        want[80:89] += part[80:89]
    finish_key_grads(grad, part if with_part else None, runs, 40)
    assert torch.equal(grad, want)


def test_varlen_mapping(standin):
    torch.manual_seed(2)
    lengths = [7, 1, 12]
    cu = torch.tensor([0, 7, 8, 20], dtype=torch.int32)
    q, k, v = (torch.randn(20, h, d, dtype=torch.float64) for h, d in ((4, 16), (2, 16), (2, 8)))
    out, lse = fa4.varlen_forward(q, k, v, cu, cu, 12, 12, scale=0.25, is_causal=True, window=(3, 0))
    assert lse.shape == (20, 4) and lse.is_contiguous()
    want, want_lse = reference.varlen_forward(q, k, v, cu, cu, 12, 12, scale=0.25, is_causal=True, window=(3, 0))
    assert rel_err(out, want) <= 1e-12 and rel_err(lse, want_lse) <= 1e-6  # FA4's LSE is float32
    dout = torch.randn_like(out)
    grads = fa4.varlen_backward(dout, q, k, v, out, lse, cu, cu, 12, 12, scale=0.25, is_causal=True, window=(3, 0))
    want_grads = reference.varlen_backward(dout, q, k, v, want, want_lse, cu, cu, 12, 12, scale=0.25, is_causal=True,
                                           window=(3, 0))
    assert max(rel_err(g, w) for g, w in zip(grads, want_grads)) <= 1e-6
    assert standin.calls[0]["window"] == (3, 0) and len(lengths) == len(cu) - 1


# Context-parallel tiles -------------------------------------------------------------------------------------


def _tile_kinds(layout, is_causal, window):
    """{tile kind: (taken by FA4, count)} over every ring step and the all-gather of 4 ranks with
    shards of 256 tokens (chunk lengths of 128 or 256)."""
    from attn_compile.cp.layout import SequenceSharding
    from attn_compile.cp.tiles import plan_tiles

    sharding = SequenceSharding(4, layout, 256)
    kinds = {}
    for q_rank in range(4):
        q_chunks = sharding.chunks(q_rank)
        key_sets = [sharding.chunks(rank) for rank in range(4)] + [sharding.whole_chunks()]
        for k_chunks in key_sets:
            for tile in plan_tiles(q_chunks, k_chunks, is_causal, window):
                masking = tile.masking
                kind = ("unmasked" if not masking else "causal square" if masking["q_offset"] == masking[
                    "k_offset"] and tile.q_rows.stop - tile.q_rows.start == tile.k_rows.stop - tile.k_rows.start
                        else "masked at an offset")
                problem = _on(_problem(s_q=tile.q_rows.stop - tile.q_rows.start,
                                       s_k=tile.k_rows.stop - tile.k_rows.start, **masking))
                taken, count = kinds.get(kind, (True, 0))
                kinds[kind] = (taken and fa4.supports(problem), count + 1)
    return kinds


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_context_parallel_tiles_go_to_fa4(standin, layout):
    """Every tile the ring and the all-gather plan, causal or with a causal window of 300 on global
    positions, can be expressed in FA4's bottom-right alignment, so each goes to FA4."""
    causal = _tile_kinds(layout, True, (-1, -1))
    windowed = _tile_kinds(layout, True, (300, -1))
    assert {kind for kind, _ in causal.items()} >= {"unmasked", "causal square"}
    assert "masked at an offset" in windowed
    assert all(taken for taken, _ in (*causal.values(), *windowed.values())), (causal, windowed)


def _packed_calls(cp, layout, window, ends_aligned=False):
    """Every packed call (``packed_tiles.PackedTiles``) of the ring's steps and the all-gather on
    ``cp`` ranks, causal, over documents of mixed lengths; ``ends_aligned``: planned for kernels
    that take segments that end together."""
    from attn_compile.cp.documents import DocumentSharding
    from attn_compile.cp.packed_tiles import PackedTiles
    from attn_compile.cp.tiles import plan_calls

    sharding = DocumentSharding((0, *itertools.accumulate([37, 1, 5, 120, 64, 3, 90, 17, 200])), cp, layout)
    for rank in range(cp):
        for keys in [*(sharding.chunks(source) for source in range(cp)), sharding.whole_chunks()]:
            calls = plan_calls(sharding.chunks(rank), keys, True, window, ends_aligned)
            yield from (c for c in calls if isinstance(c, PackedTiles))


@pytest.mark.parametrize("window", [(-1, -1), (24, 0)])
def test_context_parallel_packed_calls_go_to_fa4(standin, window):
    """A packed call's segments are squares on the diagonal (and fillers), each aligned on its own,
    so FA4 takes every one, though the call's query and key spans differ in length either way.
    Planned for segments that end together, FA4 takes those calls too."""
    spans = set()
    for cp, layout, ends_aligned in itertools.product((2, 4), ("zigzag", "contiguous"), (False, True)):
        for call in _packed_calls(cp, layout, window, ends_aligned):
            s_q, s_k = (rows.stop - rows.start for rows in (call.q_rows, call.k_rows))
            spans.add((s_q > s_k) - (s_q < s_k))
            alignment = dict(aligned=False, ends_aligned=True) if call.ends_aligned else {}
            assert fa4.supports_varlen(_on(_problem(s_q=s_q, s_k=s_k, **alignment, **call.masking))), (call, s_q, s_k)
    assert spans == {-1, 0, 1}


def test_segments_that_end_together_run_where_a_kernel_aligns_them_so(standin, monkeypatch):
    """Packed segments that end together under a mask go to FA4, which aligns each segment's masks
    bottom-right, not to a kernel that takes only squares (Triton's varlen kernel aligns top-left);
    where no fused kernel takes them but one would take squares, the all-gather plans squares
    (``runs_ends_aligned`` false). On the CPU the reference runs both, so it plans them."""
    class OnCuda(Problem):
        @classmethod
        def of(cls, *args, **kwargs):
            return _on(Problem.of(*args, **kwargs))

    squares_only = Kernel("triton", lambda p: p.device_type == "cuda" and not p.offset, None, None)
    q, k, v = (torch.empty(1, h, 256, 64, dtype=torch.bfloat16) for h in (8, 2, 2))
    masking = dict(is_causal=True, window=(64, 0))
    with monkeypatch.context() as patch:
        patch.setattr(dispatch, "Problem", OnCuda)
        patch.setattr(dispatch, "FUSED_VARLEN", (dispatch.FA4Varlen, squares_only))
        assert dispatch.runs_ends_aligned(q, k, v, **masking)
        patch.setattr(fa4, "interface", lambda: None)
        assert not dispatch.runs_ends_aligned(q, k, v, **masking)
        assert dispatch.runs_ends_aligned(q, k, v)  # no mask: squares or not, the same call
    assert dispatch.runs_ends_aligned(q, k, v, **masking)


@pytest.mark.parametrize("ends_aligned", [False, True])
@pytest.mark.parametrize("window", [(-1, -1), (24, 0)])
def test_context_parallel_packed_calls_on_fa4_match_the_reference(standin, monkeypatch, window, ends_aligned):
    """Through the stand-in (FA4's bottom-right alignment per segment), each packed call of 2 ranks
    gives the reference's out, LSE and gradients, filler rows included; so do the calls of
    segments that end together (the reference aligning them so)."""
    from attn_compile.cp import packed_tiles

    torch.manual_seed(3)
    q, k, v, dout = (torch.randn(1, h, 600, d, dtype=torch.float64) for h, d in ((4, 16), (2, 16), (2, 8), (4, 8)))
    on_fa4 = {"varlen_forward": fa4.varlen_forward, "varlen_backward": fa4.varlen_backward}
    calls = list(_packed_calls(2, "zigzag", window, ends_aligned))
    assert all(call.ends_aligned is (ends_aligned and bool(call.masking)) for call in calls)
    for call in calls:
        results = []
        for kernels in ({}, on_fa4):
            with monkeypatch.context() as patch:
                for name, kernel in kernels.items():
                    patch.setattr(packed_tiles, name, lambda *args, aligned, ends_aligned=False, _kernel=kernel, **kw:
                                   _kernel(*args, **kw))
                out, lse = call.forward(q, k, v, 0.25)
                span_out, span_lse = torch.zeros_like(dout), torch.full(q.shape[:3], float("-inf"), dtype=torch.float64)
                span_out[:, :, call.q_rows], span_lse[:, :, call.q_rows] = out, lse
                results.append((out, lse, *call.backward(dout, q, k, v, span_out, span_lse, 0.25)))
        for got, want in zip(*reversed(results)):
            seen = want.isfinite()  # the LSE of a filler row, which sees no key, is -inf on both
            assert torch.equal(got.isfinite(), seen) and rel_err(got[seen], want[seen]) <= 1e-5, call
    assert len(standin.calls) == 2 * len(calls)

