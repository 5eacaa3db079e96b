"""(B, S) document ids as the segments of one FlashAttention-4 varlen call (``fa4_segments.py``),
made on the device in two launches over chunks of each row (``triton_run_chunks.py``): no host
sync, so a call stays inside a CUDA graph. The same launches make the Triton kernels' arguments
for the rows FA4 does not take (``Segments.tables``), which would otherwise cost three more: a
launch with its buffers took 20-35 us of host time on the H200 machines, and host time is what
bounds this path on short documents.

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

from .triton_run_chunks import CHUNK, chunk_runs, chunk_summaries, chunks
from .triton_tiles import document_tables, store_spans
from .visibility import mask_bytes


class Segments(NamedTuple):
    """``starts``: int32 (B * budget + 1,), each slot's first packed row (FA4's ``cu_seqlens``);
    ``used``: int32 (B * budget,), each slot's length (FA4's ``seqused``), 0 for an empty slot and
    throughout a marked row; ``marked``: bool (B, S), True throughout a row FA4 does not run;
    ``tables``: ``triton_tiles.mask_args`` of ``marked`` as the key padding mask and the ids, for the
    Triton kernels that run the marked rows."""
    starts: torch.Tensor
    used: torch.Tensor
    marked: torch.Tensor
    tables: tuple


@triton.jit
def _segments_kernel(Ids, stride_b, s, batch, budget, Summary, Starts, Used, Marked, Spans, Runs, Bounds):
    """One program per chunk of a batch row (``triton_run_chunks.py``): the slots of the runs that
    start in the chunk, the chunk's marks and its document spans; the row's first chunk also writes
    its empty slots, its runs flag and the padding bounds of its marks."""
    positions, inside, starts, slot, first, end, runs, falls = chunk_runs(Ids, stride_b, s, Summary)
    c, b = tl.program_id(0), tl.program_id(1)
    marked = (runs > budget) | (falls > 0)
    kept = starts & (slot < budget)
    tl.store(Starts + b * budget + slot, b * s + positions, mask=kept)
    tl.store(Used + b * budget + slot, tl.where(marked, 0, end - positions), mask=kept)
    tl.store(Marked + b * s + positions, tl.zeros((CHUNK,), tl.int8) + marked.to(tl.int8), mask=inside)
    store_spans(Spans, Runs, s, positions, inside, first, end, falls)
    if c == 0:
        tl.store(Bounds + 2 * b, tl.where(marked, s, 0))  # a marked row's keys are all real, the others' none
        tl.store(Bounds + 2 * b + 1, tl.where(marked, s, 0))
        for offset in range(runs, budget, CHUNK):
            j = offset + tl.arange(0, CHUNK)
            tl.store(Starts + b * budget + j, b * s + s, mask=j < budget)
            tl.store(Used + b * budget + j, 0, mask=j < budget)
        if b == batch - 1:  # the tables' closing entry
            tl.store(Starts + batch * budget, batch * s)


def document_segments(ids, budget) -> Segments:
    """The segments of (B, S) document ``ids`` (any integer or bool dtype, unit last stride, S > 0),
    at most ``budget`` per row."""
    batch, s = ids.shape
    ids = mask_bytes(ids)
    starts = torch.empty(batch * budget + 1, dtype=torch.int32, device=ids.device)
    used = torch.empty(batch * budget, dtype=torch.int32, device=ids.device)
    marked = torch.empty(batch, s, dtype=torch.bool, device=ids.device)
    spans, runs = document_tables(batch, s, ids.device)
    bounds = torch.empty(batch, 2, dtype=torch.int32, device=ids.device)
    _segments_kernel[(chunks(s), batch)](ids, ids.stride(0), s, batch, budget, chunk_summaries(ids), starts, used,
                                         marked.view(torch.int8), spans, runs, bounds)
    marks = marked.view(torch.uint8)  # as key_padding_args hands a mask to the kernels
    return Segments(starts, used, marked, (marks, marks.stride(0), bounds, ids, ids.stride(0), spans, runs))
