"""The aten adapters hand each kernel memory laid out as the kernel reads it, checked on the CPU
with the aten kernels replaced by stand-ins that read their arguments as the CUDA kernels do."""
import types

import pytest
import torch

from attn_compile.kernels import aten as aten_kernels
from attn_compile.kernels import reference
from attn_compile.kernels.aten import Efficient
from attn_compile.kernels.result_layout import as_out
from oracle import rel_err


def _efficient_backward(dout, q, k, v, bias, out, lse, seed, offset, dropout, mask, is_causal, *, scale):
    """The efficient backward's contract: out is read with the row stride of a contiguous
    (B, S, H, D) tensor (``o_strideM() = head_dim_value * num_heads`` in PyTorch's
    mem_eff_attention/kernel_backward.h), whatever its strides say."""
    batch, heads, seq, d = out.shape
    as_read = out.as_strided(out.shape, (seq * heads * d, d, heads * d, 1))
    grads = reference.attention_backward(dout, q, k, v, as_read, lse, scale=scale, is_causal=is_causal)
    return (*grads, None)


@pytest.mark.parametrize("q_layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_efficient_backward_gets_out_in_the_layout_it_reads(q_layout, is_causal, monkeypatch):
    """The op's out follows q's order of dims (``result_layout``), which for a contiguous
    (B, H, S, D) q is not the layout the kernel reads: gradients against float64 either way."""
    monkeypatch.setattr(aten_kernels, "aten", types.SimpleNamespace(
        _scaled_dot_product_efficient_attention_backward=_efficient_backward))
    torch.manual_seed(0)
    shapes = ((2, 3, 5, 8), (2, 3, 5, 8), (2, 3, 5, 8), (2, 3, 5, 8))
    if q_layout == "bshd":
        q, k, v, dout = (torch.randn(b, s, h, d, dtype=torch.float64).transpose(1, 2) for b, h, s, d in shapes)
    else:
        q, k, v, dout = (torch.randn(*shape, dtype=torch.float64) for shape in shapes)
    masking = dict(scale=8 ** -0.5, is_causal=is_causal)
    out, lse = reference.attention_forward(q, k, v, **masking)
    out = as_out(out, q)  # as the op returns it
    grads = Efficient.backward(dout, q, k, v, out, lse, **masking)
    want = reference.attention_backward(dout, q, k, v, out, lse, **masking)
    assert max(rel_err(g, w) for g, w in zip(grads, want)) <= 1e-12
