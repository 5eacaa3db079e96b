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


def test_plain_shapes_use_fused_kernels():
    q, k, v, _ = _case("mha 8h d128", "causal")
    assert select_kernel(q, k, v, is_causal=True) == "cudnn"
    q, k, v, _ = _case("mla 8h 192/128", "full")
    assert select_kernel(q, k, v) == "cudnn"
    assert select_kernel(q, k, v, window=(32, 0)) == "triton"
    assert select_kernel(q, k, v, is_causal=True, q_offset=64) == "triton"
