"""On CUDA: attn_cp.attention in bf16 against the float64 oracle, forward and gradients, and the
kernel each shape dispatches to. Run on the device machine: pytest -m gpu -s tests/test_gpu_op.py"""
import pytest
import torch

import attn_compile  # noqa: F401
from attn_compile.kernels import dispatch, select_kernel
from attn_compile.kernels.aten import Cudnn, Efficient, Flash
from oracle import naive_attention, rel_err

pytestmark = pytest.mark.gpu
TOL = 2e-2

SHAPES = {  # (h_q, h_kv, d_qk, d_v)
    "mha 8h d128": (8, 8, 128, 128),
    "gqa 8/2 d128": (8, 2, 128, 128),
    "mla 8h 192/128": (8, 8, 192, 128),
    "gqa+mla 16/1 192/128": (16, 1, 192, 128),
    "mha 8h d64": (8, 8, 64, 64),
}
MASKS = ["full", "causal", "bool", "additive", "window"]


def _case(shape, mask, seq=256):
    h_q, h_kv, d_qk, d_v = SHAPES[shape]
    q = torch.randn(2, h_q, seq, d_qk, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, h_kv, seq, d_qk, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, h_kv, seq, d_v, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kwargs = {"is_causal": mask == "causal", "window": (32, 8) if mask == "window" else (-1, -1), "attn_mask": None}
    if mask == "bool":
        kwargs["attn_mask"] = torch.rand(seq, seq, device="cuda") > 0.2
    elif mask == "additive":
        kwargs["attn_mask"] = torch.randn(2, 1, seq, seq, device="cuda", dtype=torch.bfloat16)
    return q, k, v, kwargs


def test_softcap_against_float64():
    """Softcapped scores run on Triton (no aten kernel takes a cap), causal and with a window."""
    torch.manual_seed(1)
    for mask in ("causal", "window"):
        q, k, v, kw = _case("gqa+mla 16/1 192/128", mask, seq=300)
        out, _ = torch.ops.attn_cp.attention(q, k, v, None, kw["is_causal"], None, *kw["window"], softcap=1.5)
        want = naive_attention(q.cpu(), k.cpu(), v.cpu(), is_causal=kw["is_causal"], window=kw["window"],
                               softcap=1.5)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        want_grads = torch.autograd.grad(want, (q, k, v), dout.cpu().double())
        errors = [rel_err(out.cpu(), want)] + [rel_err(g.cpu(), w.cpu()) for g, w in zip(grads, want_grads)]
        print(f"\nsoftcap 1.5 {mask:7s} errors out/dq/dk/dv = " + " ".join(f"{e:.1e}" for e in errors))
        assert max(errors) <= TOL


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_bf16_against_float64(shape, mask):
    torch.manual_seed(0)
    q, k, v, kw = _case(shape, mask)
    out, lse = torch.ops.attn_cp.attention(q, k, v, kw["attn_mask"], kw["is_causal"], None, *kw["window"])
    want = naive_attention(q.cpu(), k.cpu(), v.cpu(), attn_mask=None if kw["attn_mask"] is None else kw["attn_mask"].cpu(),
                           is_causal=kw["is_causal"], window=kw["window"])
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    want_grads = torch.autograd.grad(want, (q, k, v), dout.cpu().double())
    errors = [rel_err(out.cpu(), want)] + [rel_err(g.cpu(), w.cpu()) for g, w in zip(grads, want_grads)]
    kernel = select_kernel(q, k, v, is_causal=kw["is_causal"], window=kw["window"], attn_mask=kw["attn_mask"])
    print(f"\n{shape:22s} {mask:9s} kernel={kernel:10s} errors out/dq/dk/dv = " + " ".join(f"{e:.1e}" for e in errors))
    assert max(errors) <= TOL


@pytest.mark.parametrize("backend", ["cudnn", "flash", "efficient"])
@pytest.mark.parametrize("mask", ["full", "causal"])
def test_each_fused_kernel_when_it_is_the_one_enabled(backend, mask, monkeypatch):
    """SDPA's backend switches steer the aten kernels: each is checked on its own, with the Triton
    kernel (which those switches do not govern) taken out of the dispatch."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    monkeypatch.setattr(dispatch, "FUSED", (Cudnn, Flash, Efficient))

    chosen = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
              "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend]
    torch.manual_seed(0)
    q, k, v, kw = _case("mha 8h d128", mask)
    with sdpa_kernel([chosen]):
        assert select_kernel(q, k, v, is_causal=kw["is_causal"]) == backend
        out, _ = torch.ops.attn_cp.attention(q, k, v, None, kw["is_causal"])
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    want = naive_attention(q.cpu(), k.cpu(), v.cpu(), is_causal=kw["is_causal"])
    want_grads = torch.autograd.grad(want, (q, k, v), dout.cpu().double())
    errors = [rel_err(out.cpu(), want)] + [rel_err(g.cpu(), w.cpu()) for g, w in zip(grads, want_grads)]
    assert max(errors) <= TOL, errors


def test_plain_shapes_use_fused_kernels(without_fa4):
    """Without flash-attn-4, plain shapes run on cuDNN and the others on Triton (FA4's choices are
    test_gpu_fa4's)."""
    q, k, v, _ = _case("mha 8h d128", "causal")
    assert select_kernel(q, k, v, is_causal=True) == "cudnn"
    q, k, v, _ = _case("mla 8h 192/128", "full")
    assert select_kernel(q, k, v) == "cudnn"
    assert select_kernel(q, k, v, window=(32, 0)) == "triton"
    assert select_kernel(q, k, v, is_causal=True, q_offset=64) == "triton"
    assert select_kernel(q, k, v, is_causal=True, softcap=50.0) == "triton"


def _hf_mask(seq, padding, window, device):
    """The mask a Hugging Face model builds: causal from arange comparisons, a sliding window, the
    (B, S) padding mask."""
    i = torch.arange(seq, device=device)
    mask = i[None, :] <= i[:, None]
    if window is not None:
        mask = mask & (i[None, :] > i[:, None] - window)
    if padding is not None:
        mask = mask[None, None] & padding[:, None, None, :].bool()
    return mask


def _hf_style_attention(q, k, v, padding, window):
    """SDPA with that mask; the passes turn it back into structure."""
    mask = _hf_mask(q.shape[2], padding, window, q.device)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


@pytest.mark.parametrize("padding, window, kernel", [(True, 64, "triton"), (False, None, "cudnn")],
                         ids=["triton", "cudnn"])
def test_cuda_graphs_replay_the_op(padding, window, kernel, without_fa4):
    """mode="reduce-overhead" records the op into CUDA graphs and replays it on new inputs: no
    graph is skipped, and every call matches the oracle, forward and gradients."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(_hf_style_attention, backend="attn_cp", mode="reduce-overhead")
    seq = 256
    for step in range(4):  # warm-up, recording, replays
        torch.manual_seed(step)
        q = torch.randn(2, 8, seq, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(2, 2, seq, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                for _ in range(2))
        attention_mask = torch.ones(2, seq, dtype=torch.long, device="cuda")
        attention_mask[1, seq - 8 * (step + 1):] = 0  # fewer than the window: every query sees a key
        key_padding = attention_mask if padding else None
        out = compiled(q, k, v, key_padding, window)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        q64, k64, v64 = (x.detach().cpu().double().requires_grad_() for x in (q, k, v))
        want = naive_attention(q64, k64, v64, attn_mask=_hf_mask(seq, key_padding, window, "cuda").cpu())
        want_grads = torch.autograd.grad(want, (q64, k64, v64), dout.cpu().double())
        errors = [rel_err(out.cpu(), want)] + [rel_err(g.cpu(), w) for g, w in zip(grads, want_grads)]
        assert max(errors) <= TOL, (step, errors)
    assert select_kernel(q, k, v, is_causal=True, window=(window - 1 if window else -1, -1),
                         key_padding_mask=attention_mask.bool() if padding else None) == kernel
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
