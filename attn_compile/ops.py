"""``torch.ops.attn_cp.attention``: the op every rewritten attention site calls.

Layout is SDPA's (B, H, S, D). It returns ``(out, lse)`` with ``out`` of shape
``(*q.shape[:-1], v.shape[-1])`` (h_q heads, d_v dims: GQA and MLA at once), in q's memory
order (kernels/result_layout.py), and ``lse`` of shape (B, h_q, S_q), float32. The LSE is for
merging partial results and is not differentiable. Masks (all that are given are ANDed):
``is_causal`` (SDPA's top-left alignment), ``window_left``/``window_right`` (query i sees keys
i-left..i+right, -1 unbounded), ``attn_mask`` (bool or additive, broadcast to (B, h_q, S_q, S_k)),
``key_padding_mask`` ((B, S_k) bool, True = a real key) and ``document_ids`` ((B, S) ids of
packed documents, S_q == S_k: query i sees key j only when their ids are equal). ``q_offset``
shifts the queries' positions for the causal and window masks: a query shard at global offset
q_offset attends to keys numbered from 0. ``softcap`` > 0 caps the scaled scores as
``softcap * tanh(scores / softcap)`` before the masks (Gemma 2); 0 leaves them. Kernel choice
happens below, in ``attn_compile.kernels.dispatch``.
"""
from typing import Optional

import torch
from torch import Tensor

from .kernels import attention_backward as _kernel_backward
from .kernels import attention_forward as _kernel_forward
from .kernels.reference import lse_dtype
from .kernels.result_layout import as_grad, as_out, empty_out
from .validation import check_attention_args


def default_scale(q: Tensor, scale: Optional[float]) -> float:
    return q.shape[-1] ** -0.5 if scale is None else scale


@torch.library.custom_op("attn_cp::attention", mutates_args=())
def attention(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None, is_causal: bool = False,
    scale: Optional[float] = None, window_left: int = -1, window_right: int = -1,
    key_padding_mask: Optional[Tensor] = None, q_offset: int = 0, document_ids: Optional[Tensor] = None,
    softcap: float = 0.0,
) -> tuple[Tensor, Tensor]:
    window = (window_left, window_right)
    check_attention_args(q, k, v, attn_mask, window, key_padding_mask, document_ids, q_offset, softcap)
    out, lse = _kernel_forward(q, k, v, scale=default_scale(q, scale), is_causal=is_causal, window=window,
                               attn_mask=attn_mask, key_padding_mask=key_padding_mask, q_offset=q_offset,
                               document_ids=document_ids, softcap=softcap)
    return as_out(out, q), lse.contiguous()


@attention.register_fake
def _(q, k, v, attn_mask=None, is_causal=False, scale=None, window_left=-1, window_right=-1, key_padding_mask=None,
      q_offset=0, document_ids=None, softcap=0.0):
    check_attention_args(q, k, v, attn_mask, (window_left, window_right), key_padding_mask, document_ids, q_offset,
                         softcap)
    return empty_out(q, v.shape[-1]), q.new_empty(q.shape[:-1], dtype=lse_dtype(q.dtype))


@torch.library.custom_op("attn_cp::attention_backward", mutates_args=())
def attention_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, attn_mask: Optional[Tensor],
    is_causal: bool, scale: Optional[float], window_left: int, window_right: int, key_padding_mask: Optional[Tensor],
    q_offset: int, document_ids: Optional[Tensor] = None, softcap: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    grads = _kernel_backward(dout, q, k, v, out, lse, scale=default_scale(q, scale), is_causal=is_causal,
                             window=(window_left, window_right), attn_mask=attn_mask,
                             key_padding_mask=key_padding_mask, q_offset=q_offset, document_ids=document_ids,
                             softcap=softcap)
    return tuple(as_grad(g, x) for g, x in zip(grads, (q, k, v)))


@attention_backward.register_fake
def _(dout, q, k, v, out, lse, attn_mask, is_causal, scale, window_left, window_right, key_padding_mask, q_offset,
      document_ids=None, softcap=0.0):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    (q, k, v, attn_mask, is_causal, scale, window_left, window_right, key_padding_mask, q_offset, document_ids,
     softcap) = inputs
    if attn_mask is not None and attn_mask.requires_grad:
        raise ValueError("attn_mask must not require grad: attn_cp.attention does not differentiate the mask")
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, attn_mask, key_padding_mask, document_ids)
    ctx.flags = (is_causal, scale, window_left, window_right)
    ctx.q_offset, ctx.softcap = q_offset, softcap


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, attn_mask, key_padding_mask, document_ids = ctx.saved_tensors
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, attn_mask, *ctx.flags, key_padding_mask, ctx.q_offset,
                                    document_ids, ctx.softcap)
    return dq, dk, dv, *[None] * 9


attention.register_autograd(_backward, setup_context=_setup_context)
