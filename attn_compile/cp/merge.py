"""Merging partial attention results over disjoint key sets, by their log-sum-exp."""
import torch

from attn_compile.kernels.dispatch import merge_into as merge_
from attn_compile.kernels.reference import lse_dtype

__all__ = ["empty_result", "merge_"]


def empty_result(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The running (out, lse) before any key is seen: out 0, lse -inf, in the LSE's dtype
    (float32, or float64 for float64 inputs)."""
    dtype = lse_dtype(q.dtype)
    out = q.new_zeros((*q.shape[:-1], v.shape[-1]), dtype=dtype)
    lse = q.new_full(q.shape[:-1], float("-inf"), dtype=dtype)
    return out, lse
