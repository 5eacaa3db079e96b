"""On CUDA: packed-document attention in bf16 against the float32 per-document reference, for each
varlen kernel forced on its own (Triton, and FA2's, which pads V for MLA), and the dispatch.
Run on the device machine: pytest -m gpu -s tests/test_gpu_varlen.py"""
import itertools

import pytest
import torch

import attn_compile
from attn_compile.kernels import dispatch, reference, select_varlen_kernel
from attn_compile.kernels.aten import FlashVarlen
from attn_compile.kernels.triton_attention import TritonVarlen
import test_gpu_op
from oracle import rel_err

pytestmark = pytest.mark.gpu
TOL = 2e-2
SHAPES = {name: test_gpu_op.SHAPES[name] for name in ("mha 8h d128", "gqa 8/2 d128", "mla 8h 192/128")}
SHAPES["gqa+mla 16/2 192/128"] = (16, 2, 192, 128)  # (h_q, h_kv, d_qk, d_v)
LENGTHS = [1, 300, 7, 1024, 3, 513, 64]
MASKS = {"full": (False, (-1, -1)), "causal": (True, (-1, -1)), "causal window 64": (True, (64, 0)),
         "window 64/64": (False, (64, 64))}


def _case(shape):
    h_q, h_kv, d_qk, d_v = SHAPES[shape]
    total = sum(LENGTHS)
    q, k, v = (torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for h, d in ((h_q, d_qk), (h_kv, d_qk), (h_kv, d_v)))
    cu = torch.tensor([0, *itertools.accumulate(LENGTHS)], dtype=torch.int32, device="cuda")
    return q, k, v, cu


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("kernel", [TritonVarlen, FlashVarlen], ids=["triton", "flash"])
def test_bf16_against_float32(kernel, shape, mask, monkeypatch):
    monkeypatch.setattr(dispatch, "FUSED_VARLEN", (kernel,))
    torch.manual_seed(0)
    q, k, v, cu = _case(shape)
    is_causal, window = MASKS[mask]
    longest = max(LENGTHS)
    assert select_varlen_kernel(q, k, v, is_causal=is_causal, window=window) == kernel.name
    out = attn_compile.varlen_attention(q, k, v, cu, cu, longest, longest, is_causal=is_causal, window=window)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    masking = dict(scale=q.shape[-1] ** -0.5, is_causal=is_causal, window=window)
    q32, k32, v32, dout32 = (x.detach().float() for x in (q, k, v, dout))
    want_out, want_lse = reference.varlen_forward(q32, k32, v32, cu, cu, longest, longest, **masking)
    want = (want_out, *reference.varlen_backward(dout32, q32, k32, v32, want_out, want_lse, cu, cu, longest,
                                                 longest, **masking))
    errors = [rel_err(g, w) for g, w in zip((out, *grads), want)]
    print(f"\n{kernel.name:7s} {shape:22s} {mask:17s} errors out/dq/dk/dv = " + " ".join(f"{e:.1e}" for e in errors))
    assert max(errors) <= TOL, errors


def test_dispatch_picks_triton_for_packed_documents(without_fa4):
    q, k, v, _ = _case("mla 8h 192/128")
    assert select_varlen_kernel(q, k, v, is_causal=True, window=(64, 0)) == "triton"


@pytest.mark.parametrize("precision, tol", [("highest", 2e-5), ("high", 5e-3)], ids=["ieee", "tf32"])
@pytest.mark.parametrize("d_qk, d_v", [(64, 64), (128, 128), (192, 128), (256, 256)])
def test_float32_fits_shared_memory(d_qk, d_v, precision, tol, matmul_precision):
    """float32 tiles are twice as wide in bytes: the Triton kernels must still launch, with IEEE
    float32 dots at PyTorch's default matmul precision and TF32 ones once it allows them."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, h, 512, d, device="cuda") for h, d in ((4, d_qk), (2, d_qk), (2, d_v)))
    masking = dict(scale=d_qk ** -0.5, is_causal=True, window=(100, 0))
    assert dispatch.select_kernel(q, k, v, is_causal=True, window=(100, 0)) == "triton"
    matmul_precision(precision)
    out, lse = dispatch.attention_forward(q, k, v, **masking)
    dout = torch.randn_like(out)
    got = (out, *dispatch.attention_backward(dout, q, k, v, out, lse, **masking))
    q, k, v, dout = (x.double() for x in (q, k, v, dout))
    want_out, want_lse = reference.attention_forward(q, k, v, **masking)
    want = (want_out, *reference.attention_backward(dout, q, k, v, want_out, want_lse, **masking))
    errors = [rel_err(g.double(), w) for g, w in zip(got, want)]
    print(f"\nfloat32 {d_qk}/{d_v}, {precision}: errors out/dq/dk/dv = " + " ".join(f"{e:.1e}" for e in errors))
    assert max(errors) <= tol, errors
