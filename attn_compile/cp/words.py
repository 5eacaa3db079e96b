"""Copies of bf16 (or other narrow) tensors as 8-byte words.

PyTorch copies a non-contiguous tensor one element per thread step, so the copies that cut,
join or gather rows of bf16 shards move 2 bytes a step: the zigzag join of Ulysses' head shards
ran at 1.1 TB/s on an H200, and at 3.0-3.5 TB/s with each row viewed as int64 words
(BENCHMARKS.md). A copy that keeps every row whole may move words instead.
"""
import torch


def as_words(tensors, dim=None) -> list:
    """``tensors`` with their last dim viewed as 8-byte words, for a copy of whole rows: one that
    cuts or joins them along ``dim`` (not the last), or copies them whole (None). All as they are
    where their dtypes differ (no bits of one are read as another), one's strides or sizes do not
    allow it, or autograd records one."""
    def fits(x):
        size = x.element_size()
        return (x.dim() > 0 and (dim is None or dim % x.dim() != x.dim() - 1) and size < 8 and x.stride(-1) == 1
                and not (x.requires_grad and torch.is_grad_enabled())
                and not any(n * size % 8 for n in (x.shape[-1], x.storage_offset(), *x.stride()[:-1])))
    tensors = list(tensors)
    same_dtype = len({x.dtype for x in tensors}) == 1
    return [x.view(torch.int64) for x in tensors] if same_dtype and all(map(fits, tensors)) else tensors


def from_words(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``as_words`` undone (a view in another dtype is not differentiable, so none is made in the same one)."""
    return x if x.dtype == dtype else x.view(dtype)


def contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x.contiguous()``, copied as words where x's rows allow."""
    if x.is_contiguous():
        return x
    (words,) = as_words([x])
    return from_words(words.contiguous(), x.dtype)


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, copied as words where both tensors' rows allow."""
    dst_words, src_words = as_words([dst, src])
    dst_words.copy_(src_words)


def index_rows(x: torch.Tensor, index: torch.Tensor, out=None) -> torch.Tensor:
    """``torch.index_select(x, 0, index, out=out)``: whole rows gathered, as words where x's rows
    (and out's) allow; index_select, too, copies one element per thread step."""
    words = as_words([x] if out is None else [x, out], 0)
    picked = torch.index_select(words[0], 0, index, out=None if out is None else words[1])
    return out if out is not None else from_words(picked, x.dtype)
