"""The runs of equal ids along each row of (B, S) document ids, found by programs that each take one
chunk of a row. A scan along a row (``triton_tiles.document_args``' spans, ``triton_segments.py``'s
segment tables) is then two launches of B x chunks programs; one program stepping through a row
of 32K ids took 66-103 us on an H200, the two launches 6-7.5 us.

The first launch (``chunk_summaries``) writes four numbers per chunk: its runs' first positions
counted, the falls in it (a position whose id is below the one before it), its last run start and
its first run end. In the second, each program reads its row's summaries (``chunk_runs``) and
carries across chunks what its own chunk cannot see: the runs before it, the row's totals, and the
start and end of the runs that cross its edges.
"""
import torch
import triton
import triton.language as tl

from .launch_math import cdiv

CHUNK = tl.constexpr(1024)
FIELDS = tl.constexpr(4)  # numbers per chunk's summary
SUMMARY_BLOCK = tl.constexpr(1024)  # summaries a program reads at a time


@triton.jit
def _larger(a, b):
    return tl.maximum(a, b)


@triton.jit
def _smaller(a, b):
    return tl.minimum(a, b)


@triton.jit
def _boundaries(Ids, stride_b, b, c, s):
    """Chunk c of row b: (positions, inside, starts, ends, falls), the last three masks of the
    positions that start a run, end one, and hold an id below the one before."""
    positions = c * CHUNK + tl.arange(0, CHUNK)
    inside = positions < s
    row = Ids + b * stride_b
    ids = tl.load(row + positions, mask=inside, other=0)
    previous = tl.load(row + positions - 1, mask=inside & (positions > 0), other=0)
    following = tl.load(row + positions + 1, mask=positions + 1 < s, other=0)
    starts = inside & ((positions == 0) | (ids != previous))
    ends = inside & ((positions == s - 1) | (ids != following))
    falls = inside & (positions > 0) & (ids < previous)
    return positions, inside, starts, ends, falls


@triton.jit
def _summary_kernel(Ids, stride_b, s, Summary):
    c, b = tl.program_id(0), tl.program_id(1)
    positions, inside, starts, ends, falls = _boundaries(Ids, stride_b, b, c, s)
    summary = Summary + (b * tl.num_programs(0) + c) * FIELDS
    tl.store(summary, tl.sum(starts.to(tl.int32), 0))
    tl.store(summary + 1, tl.sum(falls.to(tl.int32), 0))
    tl.store(summary + 2, tl.max(tl.where(starts, positions, -1), 0))  # -1: no run starts here
    tl.store(summary + 3, tl.min(tl.where(ends, positions + 1, s), 0))  # s: none ends here


def chunks(s: int) -> int:
    """Programs per row of ``s`` ids: the second launch's grid is (chunks, B)."""
    return cdiv(s, CHUNK.value)


def chunk_summaries(ids: torch.Tensor) -> torch.Tensor:
    """int32 (B, chunks, 4) summaries of (B, S) ``ids`` (integer, or bool as uint8; unit last
    stride, S > 0), for ``chunk_runs``."""
    batch, s = ids.shape
    summary = torch.empty(batch, chunks(s), FIELDS.value, dtype=torch.int32, device=ids.device)
    _summary_kernel[(chunks(s), batch)](ids, ids.stride(0), s, summary)
    return summary


@triton.jit
def chunk_runs(Ids, stride_b, s, Summary):
    """The runs seen from this program's chunk (program ids: chunk, batch row), given the row's
    ``chunk_summaries``: (positions, inside, starts, slot, first, end, runs, falls). ``slot``: the
    index in the row of each position's run; ``first`` and ``end``: its run's first position and
    the position after its last; ``runs`` and ``falls``: the row's counts. ``first`` and ``end``
    are the runs of equal neighbours, so an id that comes back after another starts a new run."""
    c, b = tl.program_id(0), tl.program_id(1)
    n_chunks = tl.num_programs(0)
    positions, inside, starts, ends, _ = _boundaries(Ids, stride_b, b, c, s)
    runs_before = 0
    runs = 0
    falls = 0
    start_before = 0
    end_after = s
    for j0 in range(0, n_chunks, SUMMARY_BLOCK):
        j = j0 + tl.arange(0, SUMMARY_BLOCK)
        summary = Summary + (b * n_chunks + j) * FIELDS
        ok = j < n_chunks
        counts = tl.load(summary, mask=ok, other=0)
        runs_before += tl.sum(tl.where(j < c, counts, 0), 0)
        runs += tl.sum(counts, 0)
        falls += tl.sum(tl.load(summary + 1, mask=ok, other=0), 0)
        start_before = tl.maximum(start_before, tl.max(tl.load(summary + 2, mask=ok & (j < c), other=0), 0))
        end_after = tl.minimum(end_after, tl.min(tl.load(summary + 3, mask=ok & (j > c), other=s), 0))
    slot = runs_before + tl.cumsum(starts.to(tl.int32), 0) - 1
    first = tl.maximum(tl.associative_scan(tl.where(starts, positions, -1), 0, _larger), start_before)
    end = tl.minimum(tl.associative_scan(tl.where(ends, positions + 1, s), 0, _smaller, reverse=True), end_after)
    return positions, inside, starts, slot, first, end, runs, falls
