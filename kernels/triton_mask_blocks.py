"""The block sparsity of a same-document mask, built on the device in one launch from (B, S)
document ids, for FlashAttention-4's ``mask_mod`` path (``fa4_mask_mod.py``); no host sync. A
key padding mask is the same mask with ids on the keys alone (``keys_only``): 1 on a real key, 0
on padding, and 1 on every query, so a key block of padding is skipped and one of real keys is
full.

FA4 takes a mask it has no flag for as ``mask_mod`` plus block tables: per row block, the column
blocks it visits, split into *partial* ones (``mask_mod`` evaluated per element) and *full* ones
(no mask at all). The forward's rows are query blocks over key blocks; the backward's are key
blocks over query blocks, in its own block sizes. A pair of blocks is judged from each block's
smallest and largest id, which is exact for any ids and tight where documents are runs, and
from the band ``i - left <= j <= i + right`` (``visibility.py``; -1 unbounded, causal is right 0):
- skipped where the id ranges do not overlap, or no pair is inside the band (the loop over a
  row's column blocks visits only the blocks the band reaches);
- full where both blocks hold one id throughout, every pair is inside the band, and neither
  block reaches past S (FA4 masks the sequence's end only where it masks at all);
- partial otherwise.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .launch_math import cdiv, next_power_of_2

BLOCK_COLUMNS = 16


class BlockTables(NamedTuple):
    """int32, each (B, 1, rows) or (B, 1, rows, columns): the one head broadcasts. Index rows
    hold their column blocks in ascending order in the first ``count`` entries; the rest is
    unwritten, as FA4 reads no further."""
    partial_count: torch.Tensor
    partial_index: torch.Tensor
    full_count: torch.Tensor
    full_index: torch.Tensor


@triton.jit
def _id_range(Ids, stride_s, s, first, size, SIZE: tl.constexpr, ALL_ONE: tl.constexpr):
    """(smallest id, largest id, whole) of each block of ``size`` positions starting at ``first``
    (a vector of block starts); ``whole``: the block ends at or before s. ``ALL_ONE``: the ids
    are not read, every one is 1 (the queries of a key padding mask)."""
    if ALL_ONE:
        low = tl.zeros_like(first).to(tl.int64) + 1
        high = low
    else:
        positions = first[:, None] + tl.arange(0, SIZE)[None, :]
        inside = (tl.arange(0, SIZE)[None, :] < size) & (positions < s)
        ids = tl.load(Ids + positions * stride_s, mask=inside, other=0).to(tl.int64)
        low = tl.min(tl.where(inside, ids, 9223372036854775807), 1)
        high = tl.max(tl.where(inside, ids, -9223372036854775807), 1)
    return low, high, first + size <= s


@triton.jit
def _blocks_kernel(Ids, PartialCount, PartialIndex, FullCount, FullIndex, s, stride_b, stride_s, row_size,
                   column_size, rows, columns, left, right, ROW_SIZE: tl.constexpr, COLUMN_SIZE: tl.constexpr,
                   ROWS_ARE_QUERIES: tl.constexpr, ROW_IDS_ONE: tl.constexpr, COLUMN_IDS_ONE: tl.constexpr,
                   BLOCK: tl.constexpr):
    b, r = tl.program_id(0), tl.program_id(1)
    Ids += b * stride_b
    row_first = r * row_size + tl.zeros((1,), tl.int32)
    row_low, row_high, row_whole = _id_range(Ids, stride_s, s, row_first, row_size, ROW_SIZE, ROW_IDS_ONE)
    row_last = tl.minimum(row_first + row_size, s) - 1
    partial_count = tl.zeros((1,), tl.int32)
    full_count = tl.zeros((1,), tl.int32)
    index_row = (b * rows + r) * columns
    # The band in the row's terms: a column position p pairs with the row inside it when
    # row_first - after <= p <= row_last + before (queries as rows: keys up to `right` after them
    # and `left` before; keys as rows: queries up to `left` after them and `right` before).
    if ROWS_ARE_QUERIES:
        before, after = right, left
    else:
        before, after = left, right
    begin, end = 0, columns
    if after >= 0:
        begin = tl.maximum(r * row_size - after, 0) // column_size
    if before >= 0:
        end = tl.minimum(columns, (tl.minimum(r * row_size + row_size, s) - 1 + before) // column_size + 1)
    for c0 in range(begin, end, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        first = c * column_size
        low, high, whole = _id_range(Ids, stride_s, s, first, column_size, COLUMN_SIZE, COLUMN_IDS_ONE)
        last = tl.minimum(first + column_size, s) - 1
        seen = (c < end) & (low <= row_high) & (high >= row_low)
        # one id on each side, and the ranges overlap (seen): the same id
        full = seen & (low == high) & (row_low == row_high) & whole & row_whole
        if before >= 0:
            full = full & (last <= row_first + before)
        if after >= 0:
            full = full & (first >= row_last - after)
        partial = seen & ~full
        slot = partial_count + tl.cumsum(partial.to(tl.int32), 0) - 1
        tl.store(PartialIndex + index_row + slot, c, mask=partial)
        slot = full_count + tl.cumsum(full.to(tl.int32), 0) - 1
        tl.store(FullIndex + index_row + slot, c, mask=full)
        partial_count += tl.sum(partial.to(tl.int32), 0)
        full_count += tl.sum(full.to(tl.int32), 0)
    tl.store(PartialCount + b * rows + r + tl.arange(0, 1), partial_count)
    tl.store(FullCount + b * rows + r + tl.arange(0, 1), full_count)


def mask_blocks(ids, query_block, key_block, window, rows_are_queries=True, keys_only=False) -> BlockTables:
    """The tables of (B, S) document ``ids`` under the band ``window`` = (left, right) (causal:
    ``visibility.effective_window``) for blocks of ``query_block`` queries and ``key_block`` keys:
    per query block (forward) or, with ``rows_are_queries=False``, per key block (backward).
    ``keys_only``: the ids are the keys' (a key padding mask as 0 and 1), every query's is 1."""
    batch, s = ids.shape
    row_size, column_size = (query_block, key_block) if rows_are_queries else (key_block, query_block)
    rows, columns = cdiv(s, row_size), cdiv(s, column_size)
    device = ids.device
    counts = torch.empty(2, batch, 1, rows, dtype=torch.int32, device=device)
    indices = torch.empty(2, batch, 1, rows, columns, dtype=torch.int32, device=device)
    _blocks_kernel[(batch, rows)](
        ids, counts[0], indices[0], counts[1], indices[1], s, ids.stride(0),
        ids.stride(1), row_size, column_size, rows, columns, *window,
        ROW_SIZE=next_power_of_2(row_size), COLUMN_SIZE=next_power_of_2(column_size),
        ROWS_ARE_QUERIES=rows_are_queries, ROW_IDS_ONE=keys_only and rows_are_queries,
        COLUMN_IDS_ONE=keys_only and not rows_are_queries, BLOCK=BLOCK_COLUMNS)
    return BlockTables(counts[0], indices[0], counts[1], indices[1])
