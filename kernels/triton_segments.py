"""(B, S) document ids as the segments of one FlashAttention-4 varlen call (``fa4_segments.py``),
made on the device in one launch: no host sync, so a call stays inside a CUDA graph.

Each batch row's runs of equal ids are its segments, at most ``budget`` per row: row b owns the
slots ``[b * budget, (b + 1) * budget)`` of the tables, its runs first, in order, then empty slots
at the row's end. A row FA4 cannot take this way is marked for the Triton kernels instead, and
gives FA4 no rows (every slot of it empty):
- its ids fall somewhere: an id may then come back after another document, which one segment
  cannot express (ids that never fall count the documents, as Hugging Face's packing gives them);
- it has more runs than the budget.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .triton_tiles import scan_block


class Segments(NamedTuple):
    """``starts``: int32 (B * budget + 1,), each slot's first packed row (FA4's ``cu_seqlens``);
    ``used``: int32 (B * budget,), each slot's length (FA4's ``seqused``), 0 for an empty slot and
    throughout a marked row; ``marked``: bool (B, S), True throughout a row FA4 does not run."""
    starts: torch.Tensor
    used: torch.Tensor
    marked: torch.Tensor


@triton.jit
def _segments_kernel(Ids, stride_b, s, batch, budget, Starts, Used, Marked, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    row = Ids + b * stride_b
    slots = Starts + b * budget
    lanes = tl.arange(0, BLOCK)
    runs = tl.zeros((1,), tl.int32)
    falls = tl.zeros((1,), tl.int32)
    for offset in range(0, s, BLOCK):
        positions = offset + lanes
        inside = positions < s
        ids = tl.load(row + positions, mask=inside, other=0)
        previous = tl.load(row + positions - 1, mask=inside & (positions > 0), other=0)
        new = inside & ((positions == 0) | (ids != previous))
        slot = runs + tl.cumsum(new.to(tl.int32), 0) - 1
        tl.store(slots + slot, b * s + positions, mask=new & (slot < budget))
        runs += tl.sum(new.to(tl.int32), 0)
        falls += tl.sum((inside & (positions > 0) & (ids < previous)).to(tl.int32), 0)
    marked = (runs > budget) | (falls > 0)
    tl.debug_barrier()  # the starts stored above are read back below, across threads
    kept = tl.minimum(runs, budget)
    end = b * s + s
    for offset in range(0, budget, BLOCK):
        j = offset + lanes
        start = tl.where(j < kept, tl.load(slots + j, mask=j < kept, other=0), end)
        following = tl.where(j + 1 < kept, tl.load(slots + j + 1, mask=j + 1 < kept, other=0), end)
        tl.store(slots + j, start, mask=j < budget)
        tl.store(Used + b * budget + j, tl.where(marked, 0, following - start), mask=j < budget)
    for offset in range(0, s, BLOCK):
        positions = offset + lanes
        tl.store(Marked + b * s + positions, tl.zeros((BLOCK,), tl.int8) + marked.to(tl.int8), mask=positions < s)
    if b == batch - 1:  # the tables' closing entry
        tl.store(Starts + batch * budget, batch * s)


def document_segments(ids, budget) -> Segments:
    """The segments of (B, S) document ``ids`` (any integer or bool dtype, unit last stride), at
    most ``budget`` per row."""
    batch, s = ids.shape
    starts = torch.empty(batch * budget + 1, dtype=torch.int32, device=ids.device)
    used = torch.empty(batch * budget, dtype=torch.int32, device=ids.device)
    marked = torch.empty(batch, s, dtype=torch.bool, device=ids.device)
    _segments_kernel[(batch,)](ids.view(torch.uint8) if ids.dtype == torch.bool else ids, ids.stride(0), s, batch,
                               budget, starts, used, marked.view(torch.int8), BLOCK=scan_block(s))
    return Segments(starts, used, marked)
