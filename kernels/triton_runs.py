"""Row runs for the key padding path of ``fa4.py``, on the device in a few launches (the host
cost of a padded call is what a short sequence pays).

``find_runs``: each batch row's real keys as one run ``[start, end)``, and what FA4's packed calls
need around it (``Runs``), in one launch (as torch ops it took some twenty, 0.30 ms of host time
on an H100 machine against 0.05).
``fill_runs``: a constant in rows no call writes (0 for outputs and dQ, -inf for LSEs).
``finish_key_grads``: dK or dV outside each run set to 0 (padding keys, which no call sees), and
inside it, the second call's part added where that call had keys.

Packed tensors are (rows, H, D), any strides; batch row b owns rows ``[b * S, (b + 1) * S)``. The
kernels read and write only the rows they change, so other buffers may be left uninitialized and
a run of length 0 costs nothing.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .launch_math import cdiv, next_power_of_2, scan_block
from .visibility import mask_bytes

BLOCK_ROWS = 32


class Runs(NamedTuple):
    """int32 vectors on the device. Segment tables of B + 1 entries (row offsets into the packed
    rows): ``rows`` (each batch row's first), ``starts`` (each run's first), ``after`` (the row after
    each run). Per batch row: ``length`` of the run, ``before`` (queries before a non-empty run),
    ``after_length`` (queries after it), ``after_keys`` (the run's length where a query comes after
    it, else 0) and ``holes`` (1 where the row's real keys do not fill its run)."""
    rows: torch.Tensor
    starts: torch.Tensor
    after: torch.Tensor
    length: torch.Tensor
    before: torch.Tensor
    after_length: torch.Tensor
    after_keys: torch.Tensor
    holes: torch.Tensor


@triton.jit
def _find_runs_kernel(Mask, Table, batch, s, stride_mb, stride_ms, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    row = b * s
    width = batch + 1  # the table is (fields, batch + 1): each field a contiguous int32 vector
    if b == batch:  # the segment tables' closing entries
        tl.store(Table + 0 * width + b, row)
        tl.store(Table + 1 * width + b, row)
        tl.store(Table + 2 * width + b, row)
        return
    first = tl.full((BLOCK,), s, tl.int32)
    last = tl.zeros((BLOCK,), tl.int32)
    count = tl.zeros((BLOCK,), tl.int32)
    for offset in range(0, s, BLOCK):
        positions = offset + tl.arange(0, BLOCK)
        real = tl.load(Mask + b * stride_mb + positions * stride_ms, mask=positions < s, other=0) != 0
        first = tl.minimum(first, tl.where(real, positions, s))
        last = tl.maximum(last, tl.where(real, positions + 1, 0))
        count += real.to(tl.int32)
    start, end, count = tl.min(first, 0), tl.max(last, 0), tl.sum(count, 0)
    length = tl.maximum(end - start, 0)
    has_after = end < s  # a row without a real key (end 0) counts all its queries as after its empty run
    tl.store(Table + 0 * width + b, row)
    tl.store(Table + 1 * width + b, row + start)
    tl.store(Table + 2 * width + b, row + end)
    tl.store(Table + 3 * width + b, length)
    tl.store(Table + 4 * width + b, tl.where(length > 0, start, 0))
    tl.store(Table + 5 * width + b, s - end)
    tl.store(Table + 6 * width + b, tl.where(has_after, length, 0))
    tl.store(Table + 7 * width + b, (count != length).to(tl.int32))


def find_runs(key_padding_mask) -> Runs:
    """The runs of a (B, S) key padding mask (True on real keys)."""
    batch, s = key_padding_mask.shape
    mask = mask_bytes(key_padding_mask)
    table = torch.empty(len(Runs._fields), batch + 1, dtype=torch.int32, device=mask.device)
    _find_runs_kernel[(batch + 1,)](mask, table, batch, s, *mask.stride(), BLOCK=scan_block(s))
    return Runs(*table[:3], *table[3:, :batch])


@triton.jit
def _row_block(Starts, n_cols, dim2, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """(within: row offsets of this program's block from its batch row's start, rows as int64,
    heads, dims, column mask)."""
    block, batch = tl.program_id(0), tl.program_id(1)  # row blocks first: grid dim 0 has no 65535 bound
    within = block * BLOCK_R + tl.arange(0, BLOCK_R)
    rows = tl.cast(tl.load(Starts + batch) + within, tl.int64)
    cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    return within, rows, cols // dim2, cols % dim2, cols < n_cols


@triton.jit
def _ptrs(Base, rows, heads, dims, stride0, stride1, stride2):
    """Pointers to the (rows, heads x dims) block of a packed (rows, H, D) tensor of these strides."""
    return Base + rows[:, None] * stride0 + (heads * stride1 + dims * stride2)[None, :]


@triton.jit
def _fill_runs_kernel(Into, Starts, Lengths, value, n_cols, dim2, stride_i0, stride_i1, stride_i2,
                      BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    length = tl.load(Lengths + tl.program_id(1))
    if tl.program_id(0) * BLOCK_R >= length:
        return
    within, rows, heads, dims, cols_ok = _row_block(Starts, n_cols, dim2, BLOCK_R, BLOCK_C)
    ptrs = _ptrs(Into, rows, heads, dims, stride_i0, stride_i1, stride_i2)
    tl.store(ptrs, tl.full((BLOCK_R, BLOCK_C), value, tl.float32).to(Into.dtype.element_ty),
             mask=(within < length)[:, None] & cols_ok[None, :])


@triton.jit
def _finish_key_grads_kernel(Grad, Part, Rows, Starts, Lengths, PartKeys, s, n_cols, dim2,
                             stride_g0, stride_g1, stride_g2, stride_p0, stride_p1, stride_p2,
                             HAS_PART: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    batch = tl.program_id(1)
    first = tl.load(Starts + batch) - tl.load(Rows + batch)  # the run, from its batch row's first row
    length = tl.load(Lengths + batch)
    added = 0  # how many of the run's rows the second call's part adds to
    if HAS_PART:
        added = tl.where(tl.load(PartKeys + batch) > 0, length, 0)
    block_first = tl.program_id(0) * BLOCK_R
    if (block_first >= first + added) & (block_first + BLOCK_R <= first + length):
        return  # run rows with nothing to add: as the first call wrote them
    within, rows, heads, dims, cols_ok = _row_block(Rows, n_cols, dim2, BLOCK_R, BLOCK_C)
    ptrs = _ptrs(Grad, rows, heads, dims, stride_g0, stride_g1, stride_g2)
    value = tl.zeros((BLOCK_R, BLOCK_C), tl.float32)  # padding keys: no query sees them
    summed = (within >= first) & (within < first + added)
    if HAS_PART:
        both = summed[:, None] & cols_ok[None, :]
        part_ptrs = _ptrs(Part, rows, heads, dims, stride_p0, stride_p1, stride_p2)
        value = tl.where(both, tl.load(ptrs, mask=both, other=0.0).to(tl.float32)
                         + tl.load(part_ptrs, mask=both, other=0.0).to(tl.float32), value)
    padding = (within < first) | (within >= first + length)
    written = ((within < s) & (padding | summed))[:, None] & cols_ok[None, :]
    tl.store(ptrs, value.to(Grad.dtype.element_ty), mask=written)


def _grid(into, batch, longest):
    n_cols = into.shape[1] * into.shape[2]
    block_c = min(next_power_of_2(n_cols), 256)
    return (cdiv(longest, BLOCK_ROWS), batch, cdiv(n_cols, block_c)), n_cols, block_c


def fill_runs(into, starts, lengths, longest, value):
    """``into[r] = value`` for the rows r of every run ``[starts[b], starts[b] + lengths[b])``, in
    place; ``longest`` bounds the lengths (a host int)."""
    grid, n_cols, block_c = _grid(into, len(lengths), longest)
    _fill_runs_kernel[grid](into, starts, lengths, value, n_cols, into.shape[2], *into.stride(),
                            BLOCK_R=BLOCK_ROWS, BLOCK_C=block_c)


def finish_key_grads(grad, part, runs, s):
    """dK or dV as the first packed call wrote it on the runs (``grad``), in place: 0 outside each
    run, and ``part`` (the second call's, or None) added inside runs where that call had keys."""
    grid, n_cols, block_c = _grid(grad, len(runs.length), s)
    has_part = part is not None
    part = grad if part is None else part
    _finish_key_grads_kernel[grid](grad, part, runs.rows, runs.starts, runs.length, runs.after_keys, s,
                                   n_cols, grad.shape[2], *grad.stride(), *part.stride(), HAS_PART=has_part,
                                   BLOCK_R=BLOCK_ROWS, BLOCK_C=block_c)
