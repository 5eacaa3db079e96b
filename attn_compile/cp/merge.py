"""Merging partial attention results over disjoint key sets, by their log-sum-exp."""
import torch

from attn_compile.kernels.reference import lse_dtype


def empty_result(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The running (out, lse) before any key is seen: out 0, lse -inf, in the LSE's dtype
    (float32, or float64 for float64 inputs)."""
    dtype = lse_dtype(q.dtype)
    out = q.new_zeros((*q.shape[:-1], v.shape[-1]), dtype=dtype)
    lse = q.new_full(q.shape[:-1], float("-inf"), dtype=dtype)
    return out, lse


def merge_(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor) -> None:
    """In place: (out, lse) becomes the attention over both key sets.

    out + sigmoid(part_lse - lse) * (part_out - out) is the softmax-weighted mean of the two
    without exp overflow. A side that saw no key has lse -inf and weight 0; when neither saw
    one the difference is NaN, and the row stays (0, -inf).
    """
    weight = torch.sigmoid(part_lse - lse).nan_to_num_(0.0).unsqueeze(-1)
    out.add_(weight * (part_out - out))
    lse.copy_(torch.logaddexp(lse, part_lse))
