"""On an sm90/sm100 GPU with flash-attn-4 installed: the FA4 kernel module in bf16 against the float64
oracle, forward and gradients, for every mask class the dispatch hands it, with its outputs
poisoned first; which kernel the op dispatches each class to; and a CUDA-graph capture.
Run on the device machine: pytest -m gpu -s tests/test_gpu_fa4.py"""
import pytest
import torch

import attn_compile  # noqa: F401
from attn_compile.kernels import fa4, fa4_mask_mod, fa4_segments, select_kernel
from attn_compile.kernels.documents import same_document_mask
from attn_compile.kernels.problem import Problem, capability
from attn_compile.kernels.result_layout import empty_out
from oracle import naive_attention, rel_err
from shapes import document_runs
from test_fa4_adapter import key_padding

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or fa4.interface() is None or capability(torch.device("cuda"))[0] not in (9, 10),
    reason="needs flash-attn-4 on an sm90 or sm100 GPU")]
TOL = 2e-2
BF16 = torch.bfloat16


def _poison():
    """Fills the memory the next allocations will reuse with NaN, so a result element that a
    kernel leaves unwritten shows up."""
    torch.empty(1 << 28, dtype=BF16, device="cuda").fill_(float("nan"))


def _qkv(batch, h_q, h_kv, s_q, s_k, d_qk, d_v, projected=True):
    """q, k, v as (B, H, S, D); ``projected``: transposed views of (B, S, H, D) tensors, as a model's
    projections hand them over."""
    def make(h, s, d):
        x = torch.randn(batch, s, h, d, device="cuda", dtype=BF16) if projected else \
            torch.randn(batch, h, s, d, device="cuda", dtype=BF16)
        return (x.transpose(1, 2) if projected else x).requires_grad_()
    return make(h_q, s_q, d_qk), make(h_kv, s_k, d_qk), make(h_kv, s_k, d_v)


def _on_cpu(masking):
    """The oracle's masking, on the CPU: document ids as the mask they mean."""
    cpu = {n: m.cpu() if torch.is_tensor(m) else m for n, m in masking.items()}
    if "document_ids" in cpu:
        cpu["attn_mask"] = same_document_mask(cpu.pop("document_ids"))
    return cpu


def _check(q, k, v, name, backward=True, kernel=fa4, **masking):
    """FA4's forward (and backward) through ``kernel`` (a kernel module) against the oracle;
    returns the errors."""
    assert kernel.supports(Problem.of(q, k, v, **masking)), name
    _poison()
    out, lse = kernel.attention_forward(q, k, v, scale=q.shape[-1] ** -0.5, **masking)
    assert out.stride() == empty_out(q, v.shape[-1]).stride(), name
    want = naive_attention(*(x.detach().cpu() for x in (q, k, v)), **_on_cpu(masking))
    errors = {"out": rel_err(out.cpu(), want)}
    assert not out.isnan().any(), name
    if backward:
        assert kernel.supports(Problem.of(q, k, v, **masking, backward=True)), name
        dout = torch.randn_like(out)
        _poison()
        grads = kernel.attention_backward(dout, q.detach(), k.detach(), v.detach(), out, lse, scale=q.shape[-1] ** -0.5,
                                       **masking)
        qd, kd, vd = (x.detach().cpu().double().requires_grad_() for x in (q, k, v))
        ref = naive_attention(qd, kd, vd, **_on_cpu(masking))
        want_grads = torch.autograd.grad(ref, (qd, kd, vd), dout.cpu().double())
        for n, g, w, x in zip(("dq", "dk", "dv"), grads, want_grads, (q, k, v)):
            assert g.shape == x.shape and g.stride() == torch.empty_like(x).stride(), (name, n)
            errors[n] = rel_err(g.cpu(), w)
    print(f"\n{name:42s} " + " ".join(f"{n} {e:.1e}" for n, e in errors.items()))
    assert max(errors.values()) <= TOL, (name, errors)
    return errors


DENSE = {  # name: (batch, h_q, h_kv, s_q, s_k, d_qk, d_v, masking, backward)
    "mha d128 causal": (2, 8, 8, 256, 256, 128, 128, dict(is_causal=True), True),
    "mha d128 full": (2, 8, 8, 256, 256, 128, 128, {}, True),
    "gqa 8/2 d128 causal": (2, 8, 2, 256, 256, 128, 128, dict(is_causal=True), True),
    "mla 8h 192/128 causal": (2, 8, 8, 256, 256, 192, 128, dict(is_causal=True), True),
    "gqa+mla 16/2 192/128 causal (fwd)": (2, 16, 2, 256, 256, 192, 128, dict(is_causal=True), False),
    "window (32, 8)": (2, 8, 2, 256, 256, 128, 128, dict(window=(32, 8)), True),
    "window (64, -1) causal": (2, 8, 2, 256, 256, 128, 128, dict(window=(64, -1), is_causal=True), True),
    "keys from the diagonal on, window (0, -1)": (2, 8, 2, 256, 256, 128, 128, dict(window=(0, -1)), True),
    "softcap 1.5 causal": (2, 8, 2, 256, 256, 128, 128, dict(is_causal=True, softcap=1.5), True),
    "d256 gqa 4/2 window softcap": (1, 4, 2, 256, 256, 256, 256, dict(window=(64, 0), softcap=5.0), True),
    "ring tile: causal, queries after keys": (2, 8, 2, 128, 256, 128, 128,
                                              dict(is_causal=True, q_offset=256, k_offset=0), True),
    "ring tile: causal square at an offset": (2, 8, 2, 128, 128, 128, 128,
                                              dict(is_causal=True, q_offset=128, k_offset=128), True),
    "ring tile: window at an offset": (2, 8, 2, 128, 128, 128, 128,
                                       dict(window=(160, 0), q_offset=256, k_offset=128), True),
    "d64 not projected": (2, 4, 4, 200, 200, 64, 64, dict(is_causal=True), True),
}


@pytest.mark.parametrize("name", list(DENSE))
def test_dense_against_float64(name):
    torch.manual_seed(0)
    batch, h_q, h_kv, s_q, s_k, d_qk, d_v, masking, backward = DENSE[name]
    q, k, v = _qkv(batch, h_q, h_kv, s_q, s_k, d_qk, d_v, projected="not projected" not in name)
    _check(q, k, v, name, backward=backward, **masking)


def test_tile_fa4_cannot_express_is_refused():
    """A band that needs a negative FA4 side: queries that see keys only from 12 positions back."""
    q, k, v = _qkv(1, 2, 2, 64, 64, 64, 64)
    assert not fa4.supports(Problem.of(q, k, v, window=(-1, 8), q_offset=0, k_offset=20))


PADDED = {  # name: (lengths, side, holes, causal)
    "right padding causal": ([256, 200, 77, 1], "right", False, True),
    "left padding causal": ([256, 200, 77, 1], "left", False, True),
    "right padding full": ([256, 200, 77, 1], "right", False, False),
    "left padding full": ([256, 200, 77, 1], "left", False, False),
    "holes causal": ([256, 200, 77, 3], "right", True, True),
    "padding on both sides causal": ([256, 200, 77, 1], "middle", False, True),
    "a row without a real key, causal": ([130, 0], "right", False, True),
}


@pytest.mark.parametrize("name", list(PADDED))
def test_key_padding_against_float64(name):
    torch.manual_seed(1)
    lengths, side, holes, causal = PADDED[name]
    q, k, v = _qkv(len(lengths), 8, 2, 256, 256, 128, 128)
    _check(q, k, v, name, is_causal=causal, key_padding_mask=key_padding(lengths, 256, side, holes).cuda())


MASK_MOD_PADDED = {  # name: (lengths, side, holes, masking)
    **{name: (lengths, side, holes, dict(is_causal=causal)) for name, (lengths, side, holes, causal) in PADDED.items()},
    "right padding, causal window 64": ([256, 200, 77, 1], "right", False, dict(is_causal=True, window=(64, -1))),
    "left padding, window (40, 24)": ([256, 200, 77, 1], "left", False, dict(window=(40, 24))),
    "holes, mla 192/128": ([256, 200, 77, 3], "right", True, dict(is_causal=True)),
}


@pytest.mark.parametrize("name", list(MASK_MOD_PADDED))
def test_key_padding_on_mask_mod_against_float64(name):
    """Key padding as FA4's mask_mod, its block tables from the mask; windows included."""
    torch.manual_seed(1)
    lengths, side, holes, masking = MASK_MOD_PADDED[name]
    d_qk, h_kv = (192, 8) if "mla" in name else (128, 2)
    q, k, v = _qkv(len(lengths), 8, h_kv, 256, 256, d_qk, 128)
    _check(q, k, v, name, kernel=fa4_mask_mod, key_padding_mask=key_padding(lengths, 256, side, holes).cuda(),
           **masking)


def _document_ids(rows):
    """(B, S) int64 ids: each row's documents of the given lengths, in order."""
    return torch.stack([document_runs(*row) for row in rows])


DOCUMENTS = {  # name: (h_q, h_kv, s, d_qk, d_v, ids, masking)
    "gqa 8/2 d128 causal, S 300": (8, 2, 300, 128, 128, _document_ids([[60, 7, 150, 83], [300]]), dict(is_causal=True)),
    "gqa 8/2 d128 full, S 300": (8, 2, 300, 128, 128, _document_ids([[60, 7, 150, 83], [129, 171]]), {}),
    "mla 8h 192/128 causal, S 384": (8, 8, 384, 192, 128, _document_ids([[100, 200, 84], [1, 383]]),
                                     dict(is_causal=True)),
    "d64 causal, ids that come back": (4, 4, 256, 64, 64, torch.tensor([[0] * 50 + [1] * 100 + [0] * 106,
                                                                       [2] * 128 + [5] * 64 + [2] * 64]),
                                       dict(is_causal=True)),
    "d128 causal, bool ids": (4, 4, 256, 128, 128, torch.arange(256)[None].repeat(2, 1) % 100 < 40,
                              dict(is_causal=True)),
    "gqa 8/2 d128 causal window 100, S 500": (8, 2, 500, 128, 128, _document_ids([[300, 150, 50], [17, 483]]),
                                               dict(is_causal=True, window=(100, -1))),
    "mla 8h 192/128 window (150, 40), S 384": (8, 8, 384, 192, 128, _document_ids([[100, 200, 84], [384]]),
                                                dict(window=(150, 40))),
}


@pytest.mark.parametrize("name", list(DOCUMENTS))
def test_document_ids_against_float64(name):
    """Document ids on FA4's mask_mod path, its block tables made on the device."""
    torch.manual_seed(4)
    h_q, h_kv, s, d_qk, d_v, ids, masking = DOCUMENTS[name]
    q, k, v = _qkv(ids.shape[0], h_q, h_kv, s, s, d_qk, d_v)
    _check(q, k, v, name, kernel=fa4_mask_mod, document_ids=ids.cuda(), **masking)


SEGMENTS_ONLY = {  # name: as DOCUMENTS; classes the mask_mod path does not take, and rows of several chunks
    "gqa 8/2 d128 causal softcap 5, S 300": (8, 2, 300, 128, 128, _document_ids([[60, 7, 150, 83], [300]]),
                                             dict(is_causal=True, softcap=5.0)),
    "d256 gqa 4/2 window (64, 0), S 300": (4, 2, 300, 256, 256, _document_ids([[200, 100], [16, 284]]),
                                           dict(window=(64, 0))),
    "d256 gqa 4/2 causal window 64 softcap 50, S 300 (Gemma 2)": (
        4, 2, 300, 256, 256, _document_ids([[200, 100], [16, 284]]), dict(is_causal=True, window=(64, -1),
                                                                          softcap=50.0)),
    # three chunks of triton_run_chunks' 1024 ids, runs across their edges; by default row 0's 4
    # runs exceed the forward's budget of 3 (Triton) but not the backward's 6 (FA4)
    "gqa 4/2 d64 causal, S 2600": (4, 2, 2600, 64, 64, _document_ids([[5, 1019, 1200, 376], [2600]]),
                                   dict(is_causal=True)),
}


@pytest.mark.parametrize("budget", ["fa4 rows", "default"])
@pytest.mark.parametrize("name", list(DOCUMENTS) + list(SEGMENTS_ONLY))
def test_document_segments_against_float64(name, budget, monkeypatch):
    """Document ids on FA4's varlen kernel, their segments made on the device. ``fa4 rows``: a
    budget of a segment per 4 tokens, so FA4 runs every row whose ids never fall; by default the
    rows of short documents here run on Triton."""
    if budget == "fa4 rows":
        monkeypatch.setattr(fa4_segments, "MEAN_LENGTH", {False: 4, True: 4})
    torch.manual_seed(4)
    h_q, h_kv, s, d_qk, d_v, ids, masking = {**DOCUMENTS, **SEGMENTS_ONLY}[name]
    q, k, v = _qkv(ids.shape[0], h_q, h_kv, s, s, d_qk, d_v)
    _check(q, k, v, name, kernel=fa4_segments, document_ids=ids.cuda(), **masking)


def test_varlen_against_float64():
    torch.manual_seed(2)
    lengths = [100, 37, 200, 1]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    total = sum(lengths)
    q, k, v = (torch.randn(total, h, d, device="cuda", dtype=BF16) for h, d in ((8, 192), (8, 192), (8, 128)))
    _poison()
    out, lse = fa4.varlen_forward(q, k, v, cu, cu, max(lengths), max(lengths), scale=192 ** -0.5, is_causal=True,
                                  window=(50, 0))
    dout = torch.randn_like(out)
    grads = fa4.varlen_backward(dout, q, k, v, out, lse, cu, cu, max(lengths), max(lengths), scale=192 ** -0.5,
                                is_causal=True, window=(50, 0))
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        docs = [x[a:b].transpose(0, 1)[None].cpu().double().requires_grad_() for x in (q, k, v)]
        want = naive_attention(*docs, is_causal=True, window=(50, 0))
        got = out[a:b].transpose(0, 1)[None].cpu()
        want_grads = torch.autograd.grad(want, docs, dout[a:b].transpose(0, 1)[None].cpu().double())
        errors = [rel_err(got, want)] + [rel_err(g[a:b].transpose(0, 1)[None].cpu(), w)
                                         for g, w in zip(grads, want_grads)]
        print(f"\nvarlen document {n} ({b - a} tokens): " + " ".join(f"{e:.1e}" for e in errors))
        assert max(errors) <= TOL
    assert lse.shape == (total, 8)


DISPATCH = {  # name: (h_q, h_kv, d_qk, d_v, masking, expected)
    "causal": (8, 8, 128, 128, dict(is_causal=True), "fa4"),
    "window": (8, 2, 128, 128, dict(window=(64, 0)), "fa4"),
    "softcap": (8, 2, 128, 128, dict(is_causal=True, softcap=30.0), "triton (backward fa4)"),
    "gqa+mla": (16, 2, 192, 128, dict(is_causal=True), "fa4 (backward cudnn)"),
    "ring tile, causal at an offset": (8, 2, 128, 128, dict(is_causal=True, q_offset=256, k_offset=0), "fa4"),
    "tile FA4 cannot align": (8, 2, 128, 128, dict(window=(-1, 8), q_offset=0, k_offset=20), "triton"),
    "document ids": (8, 2, 128, 128, dict(is_causal=True, document_ids=torch.zeros(1, 256, dtype=torch.int32)),
                     "triton (backward fa4 mask_mod)"),
    "document ids, window": (8, 2, 128, 128, dict(window=(64, 0), document_ids=torch.zeros(1, 256, dtype=torch.int32)),
                             "triton"),
    "key padding": (8, 2, 128, 128, dict(is_causal=True, key_padding_mask=torch.ones(1, 256, dtype=torch.bool)),
                    "fa4 mask_mod"),
    "key padding, window": (8, 2, 128, 128, dict(window=(64, 0), key_padding_mask=torch.ones(1, 256, dtype=torch.bool)),
                            "fa4 mask_mod"),
    "document ids, softcap": (8, 2, 128, 128, dict(is_causal=True, softcap=30.0,
                                                    document_ids=torch.zeros(1, 256, dtype=torch.int32)), "triton"),
}


@pytest.mark.parametrize("name", list(DISPATCH))
def test_dispatch(name):
    h_q, h_kv, d_qk, d_v, masking, expected = DISPATCH[name]
    q, k, v = _qkv(1, h_q, h_kv, 256, 128 if "offset" in name else 256, d_qk, d_v)
    assert select_kernel(q, k, v, **masking) == expected


@pytest.mark.parametrize("masking", ["key padding", "document ids"])
def test_cuda_graph_capture(masking):
    """The op, forward and backward through FA4 with key padding or document ids, recorded into
    one CUDA graph and replayed on new data: nothing in it syncs with the host."""
    torch.manual_seed(3)
    q, k, v = _qkv(2, 8, 2, 256, 256, 128, 128)
    mask = {"key_padding_mask": key_padding([256, 100], 256).cuda()} if masking == "key padding" else \
        {"document_ids": _document_ids([[100, 156], [30, 200, 26]]).cuda()}
    static = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    dout = torch.randn(2, 8, 256, 128, device="cuda", dtype=BF16)

    def step():
        out, _ = torch.ops.attn_cp.attention(*static, None, True, None, **mask)
        return (out, *torch.autograd.grad(out, static, dout))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        results = step()
    fresh = [torch.randn_like(x) for x in static]
    with torch.no_grad():
        for x, new in zip(static, fresh):
            x.copy_(new)
    graph.replay()
    expected = step()  # FA4's backward adds dQ up with atomics, so bits may differ from run to run
    for got, want in zip(results, expected):
        assert rel_err(got, want) <= 1e-2
