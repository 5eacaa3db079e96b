"""What the context-parallel custom ops share: their fake outputs and their autograd wiring.

Every strategy is a pair of ops in the ``attn_cp`` namespace, ``<name>(q, k, v, *config) ->
(out, lse)`` and ``<name>_backward(dout, q, k, v, out, lse, *config) -> (dq, dk, dv)``. The
LSE is returned for merging and inspection; it carries no gradient.
"""
import torch

from attn_compile.kernels.reference import lse_dtype


def fake_result(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) shaped as every op returns them: out (*q.shape[:-1], d_v), lse q.shape[:-1]."""
    return q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty(q.shape[:-1], dtype=lse_dtype(q.dtype))


def fake_grads(q, k, v) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv), contiguous whatever the layout of q, k and v."""
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def register_strategy(op, backward_op) -> None:
    """The fakes and the autograd of a strategy's (out, lse) op and its backward op."""
    op.register_fake(lambda q, k, v, *config: fake_result(q, v))
    backward_op.register_fake(lambda dout, q, k, v, out, lse, *config: fake_grads(q, k, v))
    _register_autograd(op, backward_op)


def _register_autograd(op, backward_op) -> None:
    def setup_context(ctx, inputs, output):
        q, k, v, *config = inputs
        out, lse = output
        ctx.mark_non_differentiable(lse)
        ctx.tensor_slots = [i for i, item in enumerate(config) if isinstance(item, torch.Tensor)]  # cu_seqlens
        ctx.save_for_backward(q, k, v, out, lse, *(config[i] for i in ctx.tensor_slots))
        ctx.config = [None if i in ctx.tensor_slots else item for i, item in enumerate(config)]

    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, *tensors = ctx.saved_tensors
        config = ctx.config.copy()
        for i, tensor in zip(ctx.tensor_slots, tensors):
            config[i] = tensor
        return (*backward_op(dout, q, k, v, out, lse, *config), *[None] * len(config))

    op.register_autograd(backward, setup_context=setup_context)
