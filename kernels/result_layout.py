"""Where the op's results lie in memory. The output takes the query's order of (B, H, S), as
SDPA's does; each gradient takes its input's strides. A query handed over as a transposed
(B, S, H, D) projection then gives an output whose transpose back is contiguous, so no copy is
made on either side of the op. Fake and real results follow the same rules, so a compiled graph
sees the strides it gets.
"""
import torch


def _out_strides(q, d) -> tuple:
    strides, step = [0] * (q.dim() - 1) + [1], d
    for dim in sorted(range(q.dim() - 1), key=q.stride):
        strides[dim] = step
        step *= q.shape[dim]
    return tuple(strides)


def empty_out(q, d):
    """An uninitialised output for query ``q`` with head dim ``d``."""
    return torch.empty_strided((*q.shape[:-1], d), _out_strides(q, d), dtype=q.dtype, device=q.device)


def as_out(out, q):
    """``out``, copied into ``empty_out``'s strides where it lies otherwise."""
    return out if out.stride() == _out_strides(q, out.shape[-1]) else empty_out(q, out.shape[-1]).copy_(out)


def lies_as_grad(grad, x) -> bool:
    """Whether ``grad`` has ``torch.empty_like(x)``'s strides, as a gradient of ``x`` is returned."""
    return grad.stride() == torch.empty_like(x, device="meta").stride()


def as_grad(grad, x):
    """``grad``, copied into ``torch.empty_like(x)``'s strides where it lies otherwise."""
    return grad if lies_as_grad(grad, x) else torch.empty_like(x).copy_(grad)
