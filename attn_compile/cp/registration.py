"""What the context-parallel custom ops share: their fake outputs and their autograd wiring.

Every strategy is a pair of ops in the ``attn_cp`` namespace. Ring and all-gather
(``register_kept_kv``) return the K and V they received beside (out, lse), for their backward,
which takes them, or None where the op kept nothing (``nothing_kept``). Ulysses and hybrid
(``register_head_exchange``) exchange heads for sequence: their op returns (out, lse, q_h, k_h,
v_h, out_h, lse_h), the head shards it attended, and their backward takes ``(dout, q_h, k_h,
v_h, out_h, lse_h, h_kv, *config)``, so nothing is exchanged twice (packed documents' head
shards come in buffers of a bound their shape can name, ``ulysses.kept_head_shards``). The LSE
is returned for merging and inspection; it carries no gradient.
"""
import torch

from attn_compile.kernels.reference import lse_dtype


def fake_result(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) as the head-exchanging ops return them: out (*q.shape[:-1], d_v) and lse
    q.shape[:-1], contiguous (ring and all-gather: ``merge.empty_result``)."""
    return q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty(q.shape[:-1], dtype=lse_dtype(q.dtype))


def fake_grads(q, k, v) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv), each laid out as its input (``torch.empty_like``)."""
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def nothing_kept(k, v) -> tuple[torch.Tensor, torch.Tensor]:
    """What a ``register_kept_kv`` op returns in place of the K and V it did not keep."""
    return k.new_empty(0), v.new_empty(0)


def register_head_exchange(op, backward_op) -> None:
    """The backward's fake and the autograd of a strategy whose op also returns its head shards
    (the op registers its own fake: their shapes depend on its group size)."""
    def fake_backward(dout, q, k, v, out, lse, kv_heads, *config):
        batch, _, seq = dout.shape[:3]
        return (dout.new_empty((*dout.shape[:-1], q.shape[-1])), k.new_empty((batch, kv_heads, seq, k.shape[-1])),
                v.new_empty((batch, kv_heads, seq, v.shape[-1])))

    def setup_context(ctx, inputs, output):
        q, k, v, *config = inputs
        out, lse, *heads = output
        ctx.mark_non_differentiable(lse, *heads)
        ctx.tensor_slots = [i for i, item in enumerate(config) if isinstance(item, torch.Tensor)]  # cu_seqlens
        ctx.save_for_backward(*heads, *(config[i] for i in ctx.tensor_slots))
        ctx.config = [None if i in ctx.tensor_slots else item for i, item in enumerate(config)]
        ctx.kv_heads = k.shape[1]

    def backward(ctx, dout, *_):
        heads, tensors = ctx.saved_tensors[:5], ctx.saved_tensors[5:]
        config = ctx.config.copy()
        for i, tensor in zip(ctx.tensor_slots, tensors):
            config[i] = tensor
        return (*backward_op(dout, *heads, ctx.kv_heads, *config), *[None] * len(config))

    backward_op.register_fake(fake_backward)
    op.register_autograd(backward, setup_context=setup_context)


def register_kept_kv(op, backward_op) -> None:
    """The backward's fake and the autograd of ``op(q, k, v, group_name, group_size, scale, is_causal,
    layout, recompute_kv, window_left, window_right, cu_seqlens, max_seqlen) -> (out, lse, k_kept,
    v_kept)`` and ``backward_op(dout, q, k, v, out, lse, k_kept, v_kept, group_name, scale,
    is_causal, layout, window_left, window_right, cu_seqlens, max_seqlen) -> (dq, dk, dv)``: the
    kept K and V are saved between the passes, unless ``recompute_kv``, and then the backward gets
    None for them."""
    def setup_context(ctx, inputs, output):
        q, k, v, group_name, _, scale, is_causal, layout, recompute_kv, window_left, window_right, cu_seqlens, \
            max_seqlen = inputs
        out, lse, k_kept, v_kept = output
        ctx.mark_non_differentiable(lse, k_kept, v_kept)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, *(() if recompute_kv else (k_kept, v_kept)))
        ctx.config = (group_name, scale, is_causal, layout, window_left, window_right)
        ctx.max_seqlen = max_seqlen

    def backward(ctx, dout, *_):
        q, k, v, out, lse, cu_seqlens, *kept = ctx.saved_tensors
        grads = backward_op(dout, q, k, v, out, lse, *(kept or (None, None)), *ctx.config, cu_seqlens, ctx.max_seqlen)
        return *grads, *[None] * 10

    backward_op.register_fake(lambda dout, q, k, v, *rest: fake_grads(q, k, v))
    op.register_autograd(backward, setup_context=setup_context)
