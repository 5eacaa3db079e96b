"""The Triton attention kernels against the float64 oracle, forward and backward.

Without CUDA they run under TRITON_INTERPRET=1 (one 16x16 tile configuration, so every call
crosses several tiles) in exact float32, plus float16; the interpreter's bf16 dot multiplies
the raw bits, so bf16 is left to the GPU tests. With CUDA every test runs on the device
(float32 dots in IEEE float32, PyTorch's default matmul precision), and the tests marked gpu
sweep bf16 shapes over several tiles.
"""
import itertools
import os
import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    if "triton" in sys.modules:  # its own library (tl.sum, tl.cdiv...) is then compiled code the interpreter cannot call
        raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set: set it in tests/conftest.py")
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="the Triton kernels need the triton package")

from attn_compile.kernels import reference, triton_backward, triton_forward, triton_tiles  # noqa: E402
from attn_compile.kernels import triton_attention as ta  # noqa: E402
from attn_compile.kernels.documents import same_document_mask  # noqa: E402
from attn_compile.kernels.launch_math import cdiv, next_power_of_2  # noqa: E402
from attn_compile.kernels.problem import Problem  # noqa: E402
from attn_compile.kernels.triton_backward import _dkdv_kernel, _dq_kernel  # noqa: E402
from attn_compile.kernels.triton_forward import _forward_kernel  # noqa: E402
from attn_compile.kernels.triton_tiles import (_PICKS, document_args, dot_precision, key_padding_args,  # noqa: E402
                                               seq_bucket, short_walk)
from oracle import naive_attention, rel_err  # noqa: E402
from shapes import document_runs, make_qkv  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _oracle(q, k, v, dout, **masking):
    """(out, lse, dq, dk, dv) in float64 on the CPU."""
    q, k, v = (x.detach().cpu().double().requires_grad_() for x in (q, k, v))
    masking = {name: x.cpu() if isinstance(x, torch.Tensor) else x for name, x in masking.items()}
    out = naive_attention(q, k, v, **masking)
    grads = torch.autograd.grad(out, (q, k, v), dout.cpu().double())
    _, lse = reference.attention_forward(q.detach(), k.detach(), v.detach(), **masking)
    return (out.detach(), lse, *grads)


def _assert_close(got, want, tol):
    """(out, lse, dq, dk, dv) against the oracle's: no NaN, the same rows that see no key."""
    names = ("out", "lse", "dq", "dk", "dv")
    got = [g.cpu() for g in got]
    assert not any(g.isnan().any() for g in got), [n for n, g in zip(names, got) if g.isnan().any()]
    seen = ~want[1].isneginf()
    assert torch.equal(~got[1].isneginf(), seen), "lse: the rows that see no key differ"
    got[1], want = got[1][seen], (want[0], want[1][seen], *want[2:])
    errors = {n: rel_err(g, w) for n, g, w in zip(names, got, want)}
    assert max(errors.values()) <= tol, errors


def _run(q, k, v, dout, **masking):
    out, lse = ta.attention_forward(q, k, v, **masking)
    return (out, lse, *ta.attention_backward(dout, q, k, v, out, lse, **masking))


def _check(heads, s_q, s_k, dtype=torch.float32, batch=1, **masking):
    q, k, v = make_qkv(heads, batch=batch, s_q=s_q, s_k=s_k, dtype=dtype, device=DEVICE, requires_grad=False)
    dout = torch.randn(*q.shape[:-1], v.shape[-1], dtype=dtype, device=DEVICE)
    masking.setdefault("scale", q.shape[-1] ** -0.5)
    got = _run(q, k, v, dout, **masking)
    _assert_close(got, _oracle(q, k, v, dout, **masking), TOL[dtype])
    return got


CASES = {
    "mha-full": ("mha", 40, 33, {}),
    "gqa-causal": ("gqa", 48, 48, dict(is_causal=True)),
    "mla-causal": ("mla", 33, 33, dict(is_causal=True)),  # d_qk 24 is padded to a 32-wide tile
    "gqa_mla-window": ("gqa_mla", 40, 56, dict(window=(7, 3))),
    "causal-window": ("gqa", 48, 48, dict(is_causal=True, window=(10, -1))),
    "ring-step": ("mla", 24, 40, dict(is_causal=True, q_offset=40, k_offset=16)),  # the diagonal cuts tiles
    "gqa-causal-softcap": ("gqa", 48, 48, dict(is_causal=True, softcap=1.0)),  # scores ~ N(0, 1): the cap bends them
    "ring-step-softcap": ("mla", 24, 40, dict(is_causal=True, q_offset=40, k_offset=16, softcap=0.5)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_oracle(case):
    torch.manual_seed(0)
    heads, s_q, s_k, masking = CASES[case]
    _check(heads, s_q, s_k, batch=2, **masking)


@pytest.mark.parametrize("case", ["gqa_mla-window", "ring-step-softcap", "key-padding", "document-ids"])
def test_dk_and_dv_from_separate_launches(case, monkeypatch):
    """The wide-head backward (``split_grads``): dK and dV each from a launch of their own."""
    monkeypatch.setattr(triton_backward, "split_grads", lambda d_qk, d_v: True)
    torch.manual_seed(3)
    if case == "key-padding":
        _check("gqa_mla", 40, 40, batch=2, is_causal=True, key_padding_mask=_key_padding(2, 40, left=19, right=13))
    elif case == "document-ids":
        _check_documents("gqa", DOCUMENT_IDS["runs"], is_causal=True)
    else:
        heads, s_q, s_k, masking = CASES[case]
        _check(heads, s_q, s_k, batch=2, **masking)


def _record_walks(monkeypatch) -> list:
    """The ``own`` of every ``walked`` call the forward and backward make, in order."""
    owns = []
    for module in (triton_forward, triton_backward):
        def recording(x, own, walked=module.walked):
            owns.append(own)
            return walked(x, own)
        monkeypatch.setattr(module, "walked", recording)
    return owns


@pytest.mark.parametrize("case", ["mha-full", "causal-window", "ring-step-softcap", "key-padding", "document-ids"])
def test_descriptors_made_on_the_host(case, monkeypatch):
    """Launches long enough to repay descriptors made on the host (``pays_host_walk``; every
    launch here, its threshold at 0) read their walked tiles through them: the forward's K and V,
    and on windows the backward's too."""
    monkeypatch.setattr(triton_tiles, "HOST_WALK_FLOPS", 0)
    owns = _record_walks(monkeypatch)
    torch.manual_seed(5)
    if case == "key-padding":
        padding = _key_padding(2, 40, left=7, right=5)
        _check("gqa", 40, 40, batch=2, is_causal=True, window=(9, 0), key_padding_mask=padding)
    elif case == "document-ids":
        _check_documents("gqa", DOCUMENT_IDS["runs"], is_causal=True, window=(9, 0))
    else:
        heads, s_q, s_k, masking = CASES[case]
        _check(heads, s_q, s_k, batch=2, **masking)
    window = case != "mha-full" and case != "ring-step-softcap"
    # two walked tensors a launch: the forward's, the dQ kernel's, the dK/dV kernel's
    assert owns == [False] * 2 + [not window] * 4, owns


def test_short_launches_make_their_own_descriptors(monkeypatch):
    """A launch below ``HOST_WALK_FLOPS`` is bound by its host time: its programs make their own
    descriptors, whose encoding costs the host nothing."""
    owns = _record_walks(monkeypatch)
    torch.manual_seed(6)
    _check("gqa", 48, 48, batch=2, is_causal=True, window=(10, 0))
    assert owns == [True] * 6
    assert not triton_tiles.pays_host_walk(2, 32, 4096, 4096, 1023, 0, 128, 128)  # a Mistral-shaped layer
    assert triton_tiles.pays_host_walk(1, 32, 8192, 8192, triton_tiles.UNBOUNDED, 0, 128, 128)  # causal, 8192


def test_float16():
    torch.manual_seed(1)
    _check("gqa_mla", 40, 40, dtype=torch.float16, is_causal=True, window=(12, 5))


def test_rows_that_see_no_key():
    """Queries at 0..19 come before every key (20..43): output 0, LSE -inf, zero gradients."""
    torch.manual_seed(2)
    out, lse, dq, _, _ = _check("gqa", 40, 24, is_causal=True, k_offset=20)
    assert torch.all(out[:, :, :20] == 0) and torch.all(lse[:, :, :20] == float("-inf"))
    assert torch.all(dq[:, :, :20] == 0) and torch.all(lse[:, :, 20:].isfinite())


def _key_padding(batch, s_k, left, right):
    """Batch row 0 padded on the left, row 1 on the right, any further row all padding."""
    mask = torch.zeros(batch, s_k, dtype=torch.bool, device=DEVICE)
    mask[0, left:] = True
    mask[1, :s_k - right] = True
    return mask


PADDED_CASES = {
    "gqa-causal": ("gqa", 48, 48, dict(is_causal=True)),  # keys 0..15, unmasked for queries 16..31, are padding
    "mla-window": ("mla", 40, 56, dict(window=(7, 3))),
    "gqa_mla-full": ("gqa_mla", 33, 40, {}),
    "ring-step": ("mha", 24, 40, dict(is_causal=True, q_offset=40, k_offset=16)),
    "gqa_mla-window-softcap": ("gqa_mla", 40, 56, dict(window=(7, 3), softcap=0.7)),
}


@pytest.mark.parametrize("case", list(PADDED_CASES))
def test_key_padding(case):
    torch.manual_seed(10)
    heads, s_q, s_k, masking = PADDED_CASES[case]
    _check(heads, s_q, s_k, batch=2, key_padding_mask=_key_padding(2, s_k, left=19, right=13), **masking)


def test_padding_bounds_across_blocks():
    """(prefix, end) per batch row: keys before prefix are real, keys from end on are padding."""
    mask = torch.rand(5, 2500, device=DEVICE) > 0.3
    mask[0] = True
    mask[1] = False
    mask[2, :1500] = True
    mask[3, 2100:] = False
    mask[4, 1024] = True
    mask[4, :1024] = False
    mask[4, 1025:] = False
    bounds = key_padding_args(mask)[2].cpu().tolist()
    for row, (prefix, end) in zip(mask.cpu(), bounds):
        real = row.nonzero().flatten().tolist()
        assert prefix == next((i for i, r in enumerate(row.tolist()) if not r), len(row))
        assert end == (real[-1] + 1 if real else 0)
    assert [tuple(b) for b in bounds[:2]] == [(2500, 2500), (0, 0)] and bounds[4] == [0, 1025]


def test_key_padding_with_holes():
    """Padding between real keys, a whole tile of it, and a row whose last two key tiles are padding:
    the kernels skip the mask on tiles before the first padded key and visit none after the last
    real one."""
    torch.manual_seed(12)
    mask = torch.ones(2, 64, dtype=torch.bool, device=DEVICE)
    mask[0, 20:24] = mask[0, 32:48] = mask[0, 55] = False
    mask[1, 30:] = False
    _check("gqa", 64, 64, batch=2, is_causal=True, key_padding_mask=mask)
    _check("gqa_mla", 40, 64, batch=2, key_padding_mask=mask)


def test_key_padding_of_every_key():
    """A batch row whose keys are all padding gives output 0, LSE -inf and zero gradients."""
    torch.manual_seed(11)
    mask = _key_padding(3, 40, left=5, right=21)
    out, lse, dq, dk, dv = _check("gqa_mla", 40, 40, batch=3, is_causal=True, window=(12, -1), key_padding_mask=mask)
    assert torch.all(lse[2] == float("-inf")) and torch.all(lse[0, :, 5:].isfinite())
    assert all(torch.all(x[2] == 0) for x in (out, dq, dk, dv))
    assert torch.all(dk[0, :, :5] == 0) and torch.all(dv[1, :, 19:] == 0)


def test_strided_inputs():
    """(B, S, H, D) memory, as models hand it over; the output keeps that layout."""
    torch.manual_seed(3)
    q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2)
               for x in make_qkv("gqa_mla", s_q=40, device=DEVICE, requires_grad=False))
    dout = torch.randn(q.shape[0], q.shape[2], q.shape[1], v.shape[-1], device=DEVICE).transpose(1, 2)
    masking = dict(scale=0.3, is_causal=True, window=(9, -1))
    got = _run(q, k, v, dout, **masking)
    assert got[0].transpose(1, 2).is_contiguous()
    _assert_close(got, _oracle(q, k, v, dout, **masking), TOL[torch.float32])


def test_unaligned_inputs():
    """Tensor descriptors need 16-byte aligned rows and starts: a float32 head dim of 5 (20-byte
    rows) and a q that starts one element into its storage are copied into aligned rows first."""
    torch.manual_seed(5)
    storage = torch.randn(2 * 4 * 40 * 5 + 1, device=DEVICE)
    q = storage[1:].view(2, 4, 40, 5)
    k, v = torch.randn(2, 2, 40, 5, device=DEVICE), torch.randn(2, 2, 40, 3, device=DEVICE)
    ready = ta._descriptor_ready(q, k, v)
    assert all(x.data_ptr() % 16 == 0 and x.stride(-2) % 4 == 0 and torch.equal(x, y) for x, y in zip(ready, (q, k, v)))
    aligned = torch.randn(2, 2, 40, 8, device=DEVICE)
    assert ta._descriptor_ready(aligned)[0] is aligned
    dout = torch.randn(2, 4, 40, 3, device=DEVICE)
    masking = dict(scale=0.4, is_causal=True, window=(11, -1))
    _assert_close(_run(q, k, v, dout, **masking), _oracle(q, k, v, dout, **masking), TOL[torch.float32])


def test_invisible_tiles_are_never_loaded():
    """Queries at 136..151 with a window of 8 see keys 128..151; NaN keys elsewhere, filling whole
    tiles of up to 128 keys, would reach the result if a skipped tile were loaded."""
    torch.manual_seed(4)
    q, k, v = make_qkv("gqa", s_q=16, s_k=384, device=DEVICE, requires_grad=False)
    dout = torch.randn(*q.shape[:-1], v.shape[-1], device=DEVICE)
    masking = dict(scale=0.25, is_causal=True, window=(8, -1), q_offset=136)
    want = _oracle(q, k, v, dout, **masking)
    for x in (k, v):
        x[:, :, :128] = float("nan")
        x[:, :, 256:] = float("nan")
    got = _run(q, k, v, dout, **masking)
    _assert_close(got, want, TOL[torch.float32])


def _check_documents(heads, document_ids, dtype=torch.float32, **masking):
    """Document ids read on the device, against the oracle given their (B, 1, S, S) mask."""
    s = document_ids.shape[1]
    q, k, v = make_qkv(heads, batch=document_ids.shape[0], s_q=s, dtype=dtype, device=DEVICE, requires_grad=False)
    dout = torch.randn(*q.shape[:-1], v.shape[-1], dtype=dtype, device=DEVICE)
    masking.setdefault("scale", q.shape[-1] ** -0.5)
    got = _run(q, k, v, dout, document_ids=document_ids.to(DEVICE), **masking)
    _assert_close(got, _oracle(q, k, v, dout, attn_mask=same_document_mask(document_ids), **masking), TOL[dtype])


DOCUMENT_IDS = {  # (B, 48): boundaries inside 16-row tiles and on them, one document over a whole row
    "runs": torch.stack([document_runs(5, 11, 16, 3, 13), document_runs(48)]),
    "ids that come back": torch.stack([torch.arange(48) // 5 % 3, document_runs(20, 28).flip(0)]),
    "one token each": torch.stack([torch.arange(48), torch.arange(48) // 2]),
}
DOCUMENT_MASKS = {
    "causal": dict(is_causal=True),
    "full": {},
    "causal window": dict(is_causal=True, window=(6, -1)),
    "window": dict(window=(9, 4)),
    "causal softcap": dict(is_causal=True, softcap=1.2),
}


@pytest.mark.parametrize("ids, mask", [("runs", mask) for mask in DOCUMENT_MASKS] + [
    ("ids that come back", "causal"), ("ids that come back", "window"), ("one token each", "full"),
    ("one token each", "causal window")])
def test_document_ids(ids, mask):
    torch.manual_seed(13)
    _check_documents("mla", DOCUMENT_IDS[ids], **DOCUMENT_MASKS[mask])


def test_document_ids_with_key_padding():
    """Documents and key padding ANDed: row 0 left-padded inside its first document, row 1 padded
    on the right over whole documents; the ids come as a strided view."""
    torch.manual_seed(14)
    ids = DOCUMENT_IDS["runs"].t().contiguous().t()  # a last stride of 2: copied for the kernels
    ids[1] = document_runs(10, 25, 13)
    _check_documents("gqa", ids, is_causal=True, key_padding_mask=_key_padding(2, 48, left=3, right=20))


def test_document_spans():
    """Rows whose ids never fall: each token's span is its run, and the row is flagged as runs
    (runs of one id, over several 1024-token blocks of the spans kernel). Any other row: the whole
    row, unflagged."""
    ids = torch.stack([document_runs(3, 1, 2000, 500, 96), torch.arange(2600) // 700 % 2, torch.full((2600,), -4)])
    got_ids, stride, spans, runs = document_args(ids.to(DEVICE))
    assert torch.equal(got_ids.cpu(), ids) and stride == 2600 and runs.tolist() == [1, 0, 1]
    cuts = [0, 3, 4, 2004, 2504, 2600]
    first = torch.cat([torch.full((b - a,), a) for a, b in zip(cuts, cuts[1:])])
    end = torch.cat([torch.full((b - a,), b) for a, b in zip(cuts, cuts[1:])])
    assert torch.equal(spans[0].cpu(), torch.stack([first, end], 1).int())
    assert torch.all(spans[1, :, 0] == 0) and torch.all(spans[1, :, 1] == 2600)
    assert torch.all(spans[2, :, 0] == 0) and torch.all(spans[2, :, 1] == 2600)
    bools = document_args(torch.tensor([[True, True, False]], device=DEVICE))
    assert bools[0].dtype == torch.uint8 and bools[3].tolist() == [0]


def test_tiles_of_other_documents_are_never_loaded():
    """Documents on whole tiles (128 rows, the largest of any configuration): the middle one's
    results stay exact with NaN keys and values in every tile of the other two, so none of those
    tiles was read for it."""
    torch.manual_seed(15)
    ids = document_runs(128, 128, 128)[None].to(DEVICE)
    q, k, v = make_qkv("gqa", batch=1, s_q=384, device=DEVICE, requires_grad=False)
    dout = torch.randn(*q.shape[:-1], v.shape[-1], device=DEVICE)
    masking = dict(scale=0.3, is_causal=True)
    middle = slice(128, 256)
    want = _oracle(*(x[:, :, middle] for x in (q, k, v, dout)), **masking)
    for x in (k, v):
        x[:, :, :128] = x[:, :, 256:] = float("nan")
    got = _run(q, k, v, dout, document_ids=ids, **masking)
    _assert_close([x[:, :, middle] for x in got], want, TOL[torch.float32])


def _document(x, start, end):
    """Rows [start, end) of a packed (total, H, ...) tensor as a batch of one, (1, H, end - start, ...)."""
    return x[start:end].transpose(0, 1)[None]


def _check_varlen(q, k, v, dout, cu_q, cu_k, tol, **masking):
    """Each document of the packed call against the oracle run on that document alone."""
    lengths = (cu_q, cu_k, int((cu_q[1:] - cu_q[:-1]).max()), int((cu_k[1:] - cu_k[:-1]).max()))
    out, lse = ta.varlen_forward(q, k, v, *lengths, **masking)
    dq, dk, dv = ta.varlen_backward(dout, q, k, v, out, lse, *lengths, **masking)
    assert lse.shape == q.shape[:-1]
    for q0, q1, k0, k1 in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
        got = [_document(x, q0, q1) for x in (out, lse, dq)] + [_document(x, k0, k1) for x in (dk, dv)]
        want = _oracle(_document(q, q0, q1), _document(k, k0, k1), _document(v, k0, k1), _document(dout, q0, q1),
                       **masking)
        if k1 - k0 == 1:  # one key: its softmax is 1 whatever the key, so dk is 0 and only rounding remains
            terms = (_document(q, q0, q1).norm(dim=-1) * _document(dout, q0, q1).norm(dim=-1)).sum() * v[k0].norm()
            assert got[3].norm() <= tol * terms.cpu(), (got[3].norm(), terms)
            got[3] = want[3]
        _assert_close(got, want, tol)


@pytest.mark.parametrize("lens_q,lens_k,masking", [
    ([1, 17, 30, 5], [1, 17, 30, 5], dict(is_causal=True, window=(6, -1))),
    ([3, 20, 9], [12, 1, 25], dict(window=(4, 8))),
    ([9, 30, 2], [9, 30, 2], dict(is_causal=True, softcap=0.6)),
])
def test_varlen_documents_are_independent(lens_q, lens_k, masking):
    torch.manual_seed(5)
    q, k, v = (x[0].transpose(0, 1) for x in make_qkv("gqa_mla", batch=1, s_q=sum(lens_q), s_k=sum(lens_k),
                                                       device=DEVICE, requires_grad=False))
    dout = torch.randn(*q.shape[:-1], v.shape[-1], device=DEVICE)
    cu_q, cu_k = (torch.tensor([0, *lens], device=DEVICE).cumsum(0).int() for lens in (lens_q, lens_k))
    _check_varlen(q, k, v, dout, cu_q, cu_k, TOL[torch.float32], scale=0.3, **masking)


def test_ring_steps_merge_to_the_whole():
    """Two calls over halves of the keys, merged, equal one call over all; each backward given
    the merged out and LSE returns its share of the gradients. Queries 16..23 see no key of the
    second half, so the merge meets LSE -inf."""
    torch.manual_seed(6)
    q, k, v = make_qkv("gqa_mla", s_q=32, s_k=48, device=DEVICE, requires_grad=False)
    dout = torch.randn(*q.shape[:-1], v.shape[-1], device=DEVICE)
    masking = dict(scale=0.3, is_causal=True, q_offset=16)
    halves = [dict(masking, k_offset=start) for start in (0, 24)]
    parts = [ta.attention_forward(q, k[:, :, s:s + 24], v[:, :, s:s + 24], **m) for s, m in zip((0, 24), halves)]
    out, lse = ta.merge_forward(*parts[0], *parts[1])
    grads = [ta.attention_backward(dout, q, k[:, :, s:s + 24], v[:, :, s:s + 24], out, lse, **m)
             for s, m in zip((0, 24), halves)]
    got = (out, lse, grads[0][0] + grads[1][0], *(torch.cat([a, b], 2) for a, b in zip(grads[0][1:], grads[1][1:])))
    _assert_close(got, _oracle(q, k, v, dout, **masking), TOL[torch.float32])


@pytest.mark.parametrize("shape", [(2, 3, 37, 24), (29, 3, 8)], ids=["dense", "varlen"])
def test_merge_handles_empty_sides(shape):
    torch.manual_seed(7)
    out_a = torch.randn(shape, device=DEVICE)
    out_b = torch.randn(shape, device=DEVICE, dtype=torch.float16)
    lse_a, lse_b = torch.randn(shape[:-1], device=DEVICE), torch.randn(shape[:-1], device=DEVICE)
    rows_a, rows_b = lse_a.view(-1), lse_b.view(-1)
    rows_a[::3] = float("-inf")
    rows_b[::4] = float("-inf")  # every 12th row is empty on both sides
    out_a.view(-1, shape[-1])[::3] = float("nan")  # an empty side's output is never read
    out, lse = ta.merge_forward(out_a, lse_a, out_b, lse_b)
    want_lse = torch.logaddexp(lse_a.double(), lse_b.double())
    weights = [torch.exp(x.double() - want_lse).nan_to_num(0.0)[..., None] for x in (lse_a, lse_b)]
    want = (weights[0] * out_a.double().nan_to_num(0.0) + weights[1] * out_b.double()).nan_to_num(0.0)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert torch.equal(lse.isneginf(), want_lse.isneginf()) and torch.all(out.view(-1, shape[-1])[::12] == 0)
    assert rel_err(out, want) <= 1e-6 and rel_err(lse[lse.isfinite()], want_lse[want_lse.isfinite()]) <= 1e-6


def test_merge_in_place_into_rows_of_a_running_result():
    """As the ring merges a tile: the running float32 (out, lse) of all rows, updated in place on a
    slice of its rows (strided out and lse), against the reference merge."""
    torch.manual_seed(8)
    out, lse = torch.randn(2, 3, 40, 24, device=DEVICE), torch.randn(2, 3, 40, device=DEVICE)
    lse[:, :, ::5] = float("-inf")
    out[lse.isneginf()] = 0.0  # a row that has seen no key yet holds 0
    part_out = torch.randn(2, 3, 16, 24, device=DEVICE, dtype=torch.bfloat16)
    part_lse = torch.randn(2, 3, 16, device=DEVICE)
    part_lse[:, :, ::3] = float("-inf")
    want_out, want_lse = out.clone(), lse.clone()
    reference.merge_into(want_out[:, :, 8:24], want_lse[:, :, 8:24], part_out, part_lse)
    rows = slice(8, 24)
    ta.merge_forward(out[:, :, rows], lse[:, :, rows], part_out, part_lse, out=out[:, :, rows], lse=lse[:, :, rows])
    assert torch.equal(lse.isneginf(), want_lse.isneginf())
    assert rel_err(out, want_out) <= 1e-6 and rel_err(lse[lse.isfinite()], want_lse[want_lse.isfinite()]) <= 1e-6


def test_merge_of_a_first_part_kept_in_bf16_into_the_output():
    """As a row of two parts merges: the first part's bf16 output, where it lies, with the second
    part, written into the bf16 output rows: float32 arithmetic, one rounding."""
    torch.manual_seed(9)
    first, second = (torch.randn(2, 3, 16, 24, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    lse_first, lse_second = torch.randn(2, 3, 16, device=DEVICE), torch.randn(2, 3, 16, device=DEVICE)
    lse_second[:, :, ::4] = float("-inf")
    want_out, want_lse = first.float(), lse_first.clone()
    reference.merge_into(want_out, want_lse, second.float(), lse_second)
    out, lse = torch.empty(2, 3, 40, 24, device=DEVICE, dtype=torch.bfloat16), lse_first.clone()
    ta.merge_forward(first, lse, second, lse_second, out=out[:, :, 8:24], lse=lse)
    assert rel_err(out[:, :, 8:24], want_out) <= 4e-3  # bf16's rounding, once
    assert rel_err(lse, want_lse) <= 1e-6


def test_merge_rows_into_a_running_result_by_index():
    """As a packed call merges into the ring's running result: the call's rows, given by index (two
    runs, the filler rows between them and NaN in them never read), merged in place into the
    float32 (out, lse) of every row; a token-major part, against the reference."""
    torch.manual_seed(10)
    acc, acc_lse = torch.randn(1, 3, 40, 24, device=DEVICE), torch.randn(1, 3, 40, device=DEVICE)
    acc_lse[:, :, ::5] = float("-inf")
    acc[acc_lse.isneginf()] = 0.0
    part = torch.randn(1, 16, 3, 24, device=DEVICE, dtype=torch.float16).transpose(1, 2)
    part_lse = torch.randn(1, 16, 3, device=DEVICE).transpose(1, 2)
    part_lse[:, :, ::3] = float("-inf")
    rows = torch.tensor([*range(8, 12), *range(15, 24)], device=DEVICE, dtype=torch.int32)
    part[:, :, 4:7] = float("nan")  # the filler rows 12..14
    part_lse[:, :, 4:7] = float("nan")
    want_out, want_lse = acc.double(), acc_lse.double()
    reference.merge_rows_into(want_out, want_lse, part.double(), part_lse.double(), rows.long(), 8)
    ta.merge_rows_into(acc, acc_lse, part, part_lse, rows, 8)
    assert torch.equal(acc_lse.isneginf(), want_lse.isneginf()) and not acc.isnan().any()
    assert rel_err(acc, want_out) <= 1e-6
    assert rel_err(acc_lse[acc_lse.isfinite()], want_lse[want_lse.isfinite()]) <= 1e-6


def test_add_rows_into_a_gradient_sum_by_index():
    """As a packed call's gradient adds into the ring's float32 sum: the call's rows, given by index
    (two runs, the filler rows between them and NaN in them never read), added in place; a
    token-major part in bf16 into a token-major sum, against the reference."""
    torch.manual_seed(11)
    acc = torch.randn(1, 40, 3, 24, device=DEVICE).transpose(1, 2)
    part = torch.randn(1, 16, 3, 24, device=DEVICE, dtype=torch.bfloat16).transpose(1, 2)
    rows = torch.tensor([*range(8, 12), *range(15, 24)], device=DEVICE, dtype=torch.int32)
    part[:, :, 4:7] = float("nan")  # the filler rows 12..14
    want = acc.double()
    reference.add_rows_into(want, part.double(), rows.long(), 8)
    untouched = acc[:, :, [r for r in range(40) if r not in rows.tolist()]].clone()
    ta.add_rows_into(acc, part, rows, 8)
    assert not acc.isnan().any() and rel_err(acc, want) <= 1e-6
    assert torch.equal(acc[:, :, [r for r in range(40) if r not in rows.tolist()]], untouched)


def _bad_calls():
    q, k, v = make_qkv("gqa", s_q=8, requires_grad=False)
    out, lse = torch.zeros(*q.shape[:-1], v.shape[-1]), torch.zeros(q.shape[:-1])
    cu = torch.tensor([0, 8], dtype=torch.int32)
    return {
        "attn_mask": lambda: ta.attention_forward(q, k, v, scale=1.0, attn_mask=torch.ones(8, 8, dtype=torch.bool)),
        "key_padding_mask": lambda: ta.attention_backward(out, q, k, v, out, lse, scale=1.0,
                                                          key_padding_mask=torch.ones(1, 8, dtype=torch.bool)),
        "scale": lambda: ta.attention_forward(q, k, v, scale=-1.0),
        "softcap": lambda: ta.attention_backward(out, q, k, v, out, lse, scale=1.0, softcap=float("nan")),
        "document_ids": lambda: ta.attention_forward(q, k, v, scale=1.0, document_ids=torch.zeros(2, 8)),
        "k:": lambda: ta.attention_forward(q[:, :3], k, v, scale=1.0),
        "v:": lambda: ta.attention_forward(q, k, v.half(), scale=1.0),
        "q:": lambda: ta.attention_forward(q.new_zeros(*q.shape[:-1], 320), k, v, scale=1.0),
        "window": lambda: ta.attention_forward(q, k, v, scale=1.0, window=(-2, 0)),
        "q_offset": lambda: ta.attention_forward(q, k, v, scale=1.0, is_causal=True, q_offset=1 << 30),
        "lse": lambda: ta.attention_backward(out, q, k, v, out, lse[..., :4], scale=1.0),
        "cu_seqlens_q": lambda: ta.varlen_forward(q[0], k[0], v[0], cu.long(), cu, 8, 8, scale=1.0),
        "max_seqlen_q, max_seqlen_k": lambda: ta.varlen_forward(q[0], k[0], v[0], cu, cu, 1 << 28, 8, scale=1.0),
        "lse_b": lambda: ta.merge_forward(out, lse, out, lse[0]),
        "acc:": lambda: ta.merge_rows_into(out, lse, out, lse, torch.arange(8), 0),
        "rows:": lambda: ta.merge_rows_into(out[:1].float(), lse[:1].float(), out[:1], lse[:1],
                                            torch.arange(8.0), 0),
        "part:": lambda: ta.add_rows_into(out[:1].float(), out[:1, :1], torch.arange(8), 0),
        "rows: 2-D": lambda: ta.add_rows_into(out[:1].float(), out[:1], torch.arange(8)[None], 0),
        "into: writes in place": lambda: ta.attention_forward(q, k, v, scale=1.0, into=(out, lse)),
        "into: dk must have shape": lambda: ta.attention_backward(
            out, q, k, v, out, lse, scale=1.0, key_padding_mask=torch.ones(2, 8, dtype=torch.bool),
            into=(q, k[:, :1], v)),
    }


def test_into_keeps_the_sequences_with_no_real_key():
    """With ``into``, the sequences whose mask has real keys get what a call of their own gives, in
    place; a sequence with none keeps what ``into`` held (FA4's padded path has the Triton kernels
    recompute the rows with holes this way)."""
    torch.manual_seed(13)
    q, k, v = make_qkv("gqa", batch=3, s_q=40, s_k=40, device=DEVICE, requires_grad=False)
    dout = torch.randn(*q.shape[:-1], v.shape[-1], device=DEVICE)
    mask = torch.ones(3, 40, dtype=torch.bool, device=DEVICE)
    mask[0, 10:14] = False  # a hole
    mask[1] = False  # no real key
    mask[2, 30:] = False
    masking = dict(scale=0.25, is_causal=True, key_padding_mask=mask)
    alone = _run(q, k, v, dout, **masking)
    held = [torch.full_like(x, 7.0) for x in alone]
    out, lse = ta.attention_forward(q, k, v, **masking, into=held[:2])
    grads = ta.attention_backward(dout, q, k, v, *alone[:2], **masking, into=held[2:])
    for name, got, kept, want in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), held, alone):
        assert got is kept, name
        assert rel_err(got[[0, 2]], want[[0, 2]]) <= 1e-6 and (got[1] == 7.0).all(), name


@pytest.mark.parametrize("batch, s_k", [(1, 0), (0, 8)], ids=["no keys", "no batch"])
def test_nothing_to_attend_to(batch, s_k):
    """Output 0, LSE -inf and zero gradients; the backward's work split must not divide by its empty grid."""
    torch.manual_seed(0)
    q = torch.randn(batch, 4, 8, 16, device=DEVICE)
    k, v = (torch.randn(batch, 2, s_k, d, device=DEVICE) for d in (16, 8))
    out, lse = ta.attention_forward(q, k, v, scale=0.25, window=(2, 2))
    grads = ta.attention_backward(torch.randn_like(out), q, k, v, out, lse, scale=0.25, window=(2, 2))
    assert out.shape == (batch, 4, 8, 8) and not out.any() and lse.isneginf().all()
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape] and not any(g.any() for g in grads)


def test_no_packed_tokens():
    cu = torch.tensor([0, 0], dtype=torch.int32, device=DEVICE)
    q, k, v = (torch.randn(0, h, 8, device=DEVICE) for h in (2, 1, 1))
    out, lse = ta.varlen_forward(q, k, v, cu, cu, 0, 0, scale=0.5)
    grads = ta.varlen_backward(out, q, k, v, out, lse, cu, cu, 0, 0, scale=0.5)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


@pytest.mark.parametrize("argument", list(_bad_calls()))
def test_bad_arguments_name_themselves(argument):
    with pytest.raises(ValueError, match=f"^{argument}"):
        _bad_calls()[argument]()


def test_supports():
    def like(*shape):
        return SimpleNamespace(shape=shape, dtype=torch.bfloat16, device=torch.device("cuda"))

    base = Problem.of(like(1, 64, 4096, 192), like(1, 4, 4096, 192), like(1, 4, 4096, 128), is_causal=True,
                      window=(1023, -1), q_offset=4096)
    assert ta.supports(base) == ta.supports(replace(base, has_key_padding=True, has_documents=True)) == \
        torch.cuda.is_available()
    for change in (dict(device_type="cpu"), dict(has_mask=True),
                   dict(dtype=torch.float64), dict(d_qk=320)):
        assert not ta.supports(replace(base, **change)), change


def test_launch_math_matches_triton():
    """The host side's cdiv and next_power_of_2 (kernels/launch_math.py, cheaper to call) agree
    with Triton's on the sizes the launches give them."""
    import triton

    sizes = [*range(1, 5000), *(2 ** e + delta for e in range(12, 29) for delta in (-1, 0, 1))]
    assert [next_power_of_2(n) for n in sizes] == [triton.next_power_of_2(n) for n in sizes]
    pairs = [(a, b) for a in range(0, 3000, 7) for b in (1, 16, 64, 128, 1024)]
    assert [cdiv(a, b) for a, b in pairs] == [triton.cdiv(a, b) for a, b in pairs]


def test_float32_dots_follow_the_matmul_precision(matmul_precision):
    """IEEE float32 at PyTorch's default "highest", TF32 once torch.matmul may use it; half
    precisions are unaffected."""
    for precision, want in (("highest", "ieee"), ("high", "tf32"), ("medium", "tf32")):
        matmul_precision(precision)
        assert dot_precision(torch.float32) == want, precision
        assert dot_precision(torch.bfloat16) == dot_precision(torch.float16) == "tf32", precision


def test_windows_are_tuned_apart_from_long_walks():
    """A sliding window gets its own autotuned tiles, at any offsets; causal and full attention share theirs."""
    def walk(is_causal, window, q_offset=0, k_offset=0):
        return short_walk(*ta._reaches(is_causal, window, q_offset, k_offset, 8192))

    assert walk(True, (1024, 0)) and walk(False, (100, 100)) and walk(True, (1024, 0), 2112, 64)
    assert not (walk(True, (-1, -1)) or walk(False, (-1, -1)) or walk(True, (-1, -1), 2112, 64))
    assert not walk(False, (4096, 0))
    for kernel in (_forward_kernel, _dq_kernel, _dkdv_kernel):
        assert {"PRECISION", "SHORT_WALK"} <= set(kernel.keys), kernel


def test_each_kind_of_descriptor_is_tuned_apart(monkeypatch):
    """Calls of one length may read their tiles through the host's descriptors or their own
    (``pays_host_walk``): each kind gets a pick compiled and checked for it."""
    for kernel in (_forward_kernel, _dq_kernel, _dkdv_kernel):
        assert "OWN_WALK" in kernel.keys, kernel
    torch.manual_seed(7)
    picks = {}
    monkeypatch.setattr(triton_tiles, "_PICKS", picks)
    _check("gqa", 48, 48, batch=2, is_causal=True, window=(10, 0))
    monkeypatch.setattr(triton_tiles, "HOST_WALK_FLOPS", 0)
    _check("gqa", 48, 48, batch=2, is_causal=True, window=(10, 0))
    for kernel in (_forward_kernel, _dq_kernel, _dkdv_kernel):
        owns = {key[1 + kernel.keys.index("OWN_WALK")] for key in picks if key[0] is kernel}
        assert owns == {True, False}, (kernel, owns)


def test_lengths_are_tuned_by_powers_of_two():
    """Tiles tuned on a short first call are not kept for long ones: the longer sequence, rounded
    up to a power of two, is part of every kernel's autotuning key."""
    assert [seq_bucket(s_q, s_k) for s_q, s_k in ((1, 1), (16, 3), (17, 16), (100, 300), (4097, 8))] == \
        [16, 16, 32, 512, 8192]
    for s_q, s_k in ((20, 20), (40, 24), (12, 60)):
        q, k, v = make_qkv("gqa", batch=1, s_q=s_q, s_k=s_k, device=DEVICE)
        _run(q, k, v, torch.randn(1, q.shape[1], s_q, v.shape[-1], device=DEVICE), scale=0.5)
    for kernel in (_forward_kernel, _dq_kernel, _dkdv_kernel):
        at = 1 + kernel.keys.index("seq_bucket")  # a pick's key: the kernel, then its autotuning key
        assert {32, 64} <= {key[at] for key in _PICKS if key[0] is kernel}, kernel


def _forward_with_configs(monkeypatch, configs, failing=(), at_launch=None, untuned_bucket=0, compiled=None,
                          too_large=()):
    """The forward kernel autotuned over ``configs`` (which differ in num_stages) for a new key of
    24 keys (``UNTUNED_BUCKET`` set to ``untuned_bucket``): ``failing`` ones fail to compile as an
    MLIR pass did on an H100, ``too_large`` ones compile but need more shared memory than the GPU
    has (Triton raises that when it loads the compiled kernel, at its first launch or before), and
    ``at_launch`` (an exception) is raised when a configuration runs. The stages of each
    configuration compiled go into the list ``compiled``. Returns the pick, after checking the
    result against the oracle."""
    import triton
    import attn_compile.kernels.triton_tiles as tiles

    run = _forward_kernel.fn.run
    failing_stages = {config.num_stages for config in failing}
    large_stages = {config.num_stages for config in too_large}

    def out_of_shared_memory():
        raise triton.runtime.errors.OutOfResources(262200, 232448, "shared memory")

    def running(*args, warmup, **kwargs):  # Triton compiles in run, for a warmup as for a launch
        if warmup and compiled is not None:
            compiled.append(kwargs["num_stages"])
        if kwargs["num_stages"] in failing_stages:
            raise RuntimeError("PassManager::run failed\nFailures have been detected while processing an MLIR pass "
                               "pipeline ... Pipeline failed while executing `LLVMDIScope`")
        if kwargs["num_stages"] in large_stages:
            if warmup:
                return SimpleNamespace(_init_handles=out_of_shared_memory)
            out_of_shared_memory()
        if at_launch is not None and not warmup:
            raise at_launch
        return run(*args, warmup=warmup, **kwargs)

    timed = itertools.count()

    def timing(kernel_call, quantiles):  # the interpreter has no benchmarker: the first one timed wins
        kernel_call()
        return [float(next(timed))] * len(quantiles)

    monkeypatch.setattr(tiles, "_PICKS", {})
    monkeypatch.setattr(tiles, "UNTUNED_BUCKET", untuned_bucket)
    monkeypatch.setattr(_forward_kernel, "configs", configs)
    monkeypatch.setattr(_forward_kernel, "early_config_prune", None)
    monkeypatch.setattr(_forward_kernel.fn, "run", running)
    monkeypatch.setitem(_forward_kernel.__dict__, "do_bench", timing)
    q, k, v = make_qkv("gqa", batch=1, s_q=24, s_k=24, device=DEVICE)
    out, lse = ta.attention_forward(q, k, v, scale=0.5, is_causal=True)
    assert rel_err(out, naive_attention(q.double(), k.double(), v.double(), scale=0.5, is_causal=True)) < TOL[q.dtype]
    (pick,) = {pick for key, pick in tiles._PICKS.items() if key[0] is _forward_kernel}
    return pick


def _two_configurations():
    """The kernel's first configuration, and one like it with 2 stages (the interpreter has one)."""
    import triton

    first = _forward_kernel.configs[0]
    second = triton.Config(first.kwargs, num_warps=first.num_warps, num_stages=2, pre_hook=first.pre_hook)
    assert first.num_stages != second.num_stages
    return [first, second]


def test_a_configuration_that_fails_to_compile_is_rejected(monkeypatch, caplog):
    """Triton's autotuner rejects only OutOfResources, CompileTimeAssertionFailure and PTXASError;
    any other compile failure of one configuration (an MLIR pass on sm90) rejects it the same way,
    logged once, and the kernel runs with another."""
    import attn_compile.kernels.triton_tiles as tiles

    monkeypatch.setattr(tiles, "_LOGGED", set(), raising=False)
    bad, good = _two_configurations()
    for _ in range(2):
        with caplog.at_level("WARNING", logger="attn_compile"):
            assert _forward_with_configs(monkeypatch, [bad, good], failing=[bad]) is good
    (record,) = caplog.records
    assert record.getMessage().startswith(f"Triton kernel _forward_kernel: configuration {bad} failed to compile "
                                          f"or load and is not used (RuntimeError: PassManager::run failed)")


def test_a_configuration_out_of_shared_memory_is_rejected_before_it_runs(monkeypatch, caplog):
    """Also where no candidate is timed (a short call): a configuration whose kernel compiles but
    does not fit the GPU's shared memory is rejected when it is loaded, and the next one runs. That
    rejection is expected (d 256 tiles on sm90), so it is logged at debug level, not as a warning."""
    import attn_compile.kernels.triton_tiles as tiles

    big, good = _two_configurations()
    for untuned_bucket in (1024, 0):
        with monkeypatch.context() as patch, caplog.at_level("DEBUG", logger="attn_compile"):
            patch.setattr(tiles, "_LOGGED", set())
            caplog.clear()
            assert _forward_with_configs(patch, [big, good], too_large=[big], untuned_bucket=untuned_bucket) is good
            (record,) = [record for record in caplog.records if "failed to compile" in record.getMessage()]
            assert record.levelname == "DEBUG" and "(OutOfResources: " in record.getMessage()


def test_every_configuration_failing_to_compile_raises(monkeypatch):
    configs = _two_configurations()
    with pytest.raises(RuntimeError, match=r"^Triton kernel _forward_kernel: every autotuning configuration was "
                                           r"rejected for \{'BLOCK_DQK': 16, 'BLOCK_DV': 16, .*\}: .*RuntimeError: "
                                           r"PassManager::run failed; .*RuntimeError: PassManager::run failed$"):
        _forward_with_configs(monkeypatch, configs, failing=configs)


def test_short_calls_take_the_first_configuration_that_compiles(monkeypatch):
    """Up to UNTUNED_BUCKET keys the candidates after the first that compiles are neither compiled
    nor timed; beyond it every candidate is compiled and the fastest wins."""
    first, second = _two_configurations()
    for failing, untuned_bucket, pick, stages in (([], 1024, first, [first.num_stages]),
                                                  ([first], 1024, second, [first.num_stages, second.num_stages]),
                                                  ([], 16, first, [first.num_stages, second.num_stages])):
        compiled = []
        with monkeypatch.context() as patch:
            assert _forward_with_configs(patch, [first, second], failing=failing, untuned_bucket=untuned_bucket,
                                         compiled=compiled) is pick
        assert compiled == stages


def test_autotuning_off_takes_the_first_configuration_that_compiles_at_any_length(monkeypatch):
    """ATTN_COMPILE_AUTOTUNE=0: what a call of UNTUNED_BUCKET keys or fewer does, for every call."""
    first, second = _two_configurations()
    for setting, stages in (("0", [first.num_stages]), ("1", [first.num_stages, second.num_stages])):
        compiled = []
        with monkeypatch.context() as patch:
            patch.setenv("ATTN_COMPILE_AUTOTUNE", setting)
            assert _forward_with_configs(patch, [first, second], untuned_bucket=16, compiled=compiled) is first
        assert compiled == stages
    monkeypatch.setenv("ATTN_COMPILE_AUTOTUNE", "off")
    with pytest.raises(ValueError, match=r"^ATTN_COMPILE_AUTOTUNE must be 0 \(each Triton kernel runs its first "
                                         r"candidate that compiles\) or 1 \(.*\); got 'off'$"):
        _forward_with_configs(monkeypatch, [first, second], untuned_bucket=16)


@pytest.mark.parametrize("candidates", [1, 2])
def test_an_error_when_a_configuration_runs_is_raised(monkeypatch, candidates):
    """Only compile failures reject a configuration: an error at launch, the one configuration's
    or while several are timed, is the call's."""
    configs = _two_configurations()[:candidates]
    with pytest.raises(ValueError, match="^launch failed$"):
        _forward_with_configs(monkeypatch, configs, at_launch=ValueError("launch failed"))


def _poison_free_memory():
    """Fill the CUDA allocator's cached blocks with NaN, so an output element the kernels never
    write shows up as NaN."""
    blocks = [torch.full((1 << 26,), float("nan"), device="cuda")]
    blocks += [torch.full((1 << 17,), float("nan"), device="cuda") for _ in range(64)]
    del blocks


GPU_CASES = {
    "mha-causal": (2, 8, 8, 1000, 1000, 128, 128, dict(is_causal=True)),
    "gqa_mla-causal": (1, 16, 1, 777, 777, 192, 128, dict(is_causal=True)),
    "gqa-window": (1, 8, 2, 1024, 1500, 128, 128, dict(window=(128, 32))),
    "ring-step-half-tile": (1, 4, 4, 512, 2048, 128, 128, dict(is_causal=True, q_offset=2112, k_offset=64)),
    "d256-full": (1, 4, 4, 300, 300, 256, 256, {}),
    "odd-dims": (1, 4, 4, 256, 333, 96, 80, dict(is_causal=True, window=(50, 20))),
    "unaligned-rows": (2, 4, 2, 200, 260, 20, 12, dict(is_causal=True)),  # 40- and 24-byte rows: copied
    "gqa-softcap-window": (2, 16, 8, 1000, 1000, 256, 256, dict(is_causal=True, window=(300, -1), softcap=1.5)),
    "mla-softcap-causal": (1, 8, 8, 900, 900, 192, 128, dict(is_causal=True, softcap=0.8)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_gpu_bf16(case):
    torch.manual_seed(8)
    batch, h_q, h_kv, s_q, s_k, d_qk, d_v, masking = GPU_CASES[case]
    q = torch.randn(batch, h_q, s_q, d_qk, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, h_kv, s_k, d_qk, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(batch, h_kv, s_k, d_v, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn(batch, h_q, s_q, d_v, device="cuda", dtype=torch.bfloat16)
    masking["scale"] = d_qk ** -0.5
    _poison_free_memory()
    got = _run(q, k, v, dout, **masking)
    _assert_close(got, _oracle(q, k, v, dout, **masking), TOL[torch.bfloat16])


@pytest.mark.gpu
def test_gpu_bf16_key_padding():
    """Causal with left and right padding over several tiles, and a batch row of padding only."""
    torch.manual_seed(10)
    q = torch.randn(3, 8, 700, 192, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(3, 2, 700, 192, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(3, 2, 700, 128, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn(3, 8, 700, 128, device="cuda", dtype=torch.bfloat16)
    masking = dict(scale=192 ** -0.5, is_causal=True, key_padding_mask=_key_padding(3, 700, left=300, right=77))
    _poison_free_memory()
    got = _run(q, k, v, dout, **masking)
    _assert_close(got, _oracle(q, k, v, dout, **masking), TOL[torch.bfloat16])


@pytest.mark.gpu
def test_gpu_bf16_varlen():
    torch.manual_seed(9)
    lens = [1, 100, 513, 64, 1000]
    cu = torch.tensor([0, *lens], device="cuda").cumsum(0).int()
    q = torch.randn(sum(lens), 8, 192, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(lens), 2, 192, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(sum(lens), 2, 128, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn(sum(lens), 8, 128, device="cuda", dtype=torch.bfloat16)
    _poison_free_memory()
    _check_varlen(q, k, v, dout, cu, cu, TOL[torch.bfloat16], scale=192 ** -0.5, is_causal=True)


@pytest.mark.gpu
def test_gpu_bf16_document_ids():
    """Documents read on the device over many tiles: runs with boundaries inside tiles, and ids that
    come back, with GQA+MLA, causal with a window, and key padding."""
    torch.manual_seed(16)
    runs = torch.repeat_interleave(torch.arange(6), torch.tensor([1, 300, 7, 257, 3, 432]))
    ids = torch.stack([runs, torch.arange(1000) // 70 % 4]).cuda()
    q = torch.randn(2, 8, 1000, 192, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 2, 1000, 192, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 2, 1000, 128, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn(2, 8, 1000, 128, device="cuda", dtype=torch.bfloat16)
    for masking in (dict(is_causal=True), dict(is_causal=True, window=(200, -1), key_padding_mask=_key_padding(
            2, 1000, left=150, right=90))):
        masking["scale"] = 192 ** -0.5
        _poison_free_memory()
        got = _run(q, k, v, dout, document_ids=ids, **masking)
        _assert_close(got, _oracle(q, k, v, dout, attn_mask=same_document_mask(ids), **masking),
                      TOL[torch.bfloat16])
