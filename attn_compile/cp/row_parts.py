"""A result over the rows of (B, H, S, D) tensors that comes as parts, one kernel call at a time:
the outputs of a step's calls, which merge (``merge.py``), and their gradients, which add up
(``grad_sum.py``).

Every part's rows are told up front, so the rows fall into segments (cut at every part's edges)
that each know how many parts they get: the first part is taken as it is and the last writes the
result. A segment of two parts keeps its first part where the part lies, uncopied, until the
second combines with it; one of three or more parts runs in a float32 buffer.
"""
import itertools

import torch

from . import device_copies


def call_rows(call, side: str) -> tuple[tuple[slice, ...], slice]:
    """(the parts, the span) of a kernel call's ``side``: "q", the query rows it gives results
    for, or "k", the key rows it gives gradients for."""
    return (call.q_parts, call.q_rows) if side == "q" else (call.k_parts, call.k_rows)


def call_pieces(call, side: str) -> list[tuple[slice, slice]]:
    """For each part of a call's ``side`` (``call_rows``): (its rows, the same rows counted from the
    span's start, where the call's results hold them)."""
    parts, span = call_rows(call, side)
    return [(rows, slice(rows.start - span.start, rows.stop - span.start)) for rows in parts]


def by_index(calls, side: str) -> bool:
    """Whether the results or gradients of ``calls`` are updated by index (``rows_on_device``):
    where some call's ``side`` rows lie in several parts (packed documents)."""
    return any(len(call_rows(call, side)[0]) > 1 for call in calls)


def rows_on_device(call, side: str, device) -> torch.Tensor:
    """The rows of a call's ``side`` (``call_rows``), part after part, as one int32 index on
    ``device``, kept there for the next calls (``device_copies``): updating them by index takes
    one launch a call, however many parts its rows lie in."""
    parts, _ = call_rows(call, side)
    rows, = device_copies.on_device(call, f"{side} rows", device, lambda: (
        torch.cat([torch.arange(r.start, r.stop, dtype=torch.int32) for r in parts]),))
    return rows


def segments(rows: int, parts_rows: list[slice]) -> tuple[list[slice], list[int]]:
    """Rows 0..``rows`` cut at every part's edges, and how many parts cover each segment."""
    cuts = sorted({0, rows, *(r.start for r in parts_rows), *(r.stop for r in parts_rows)})
    cut = [slice(a, b) for a, b in itertools.pairwise(cuts)]
    return cut, [sum(r.start <= s.start and s.stop <= r.stop for r in parts_rows) for s in cut]


class RowParts:
    """``running``: (a tensor shaped and laid out as the result, the dtype) of the float32 buffer
    where three or more parts combine, made when first needed."""

    def __init__(self, rows: int, parts_rows: list[slice], running: tuple):
        self._segments, self._parts = segments(rows, parts_rows)
        self._seen = [0] * len(self._segments)
        self._kept = {}  # segment index: (its first part, the row where that part starts)
        self._running_spec = running
        self._running = None

    def complete(self) -> bool:
        """Whether every segment has had all its parts."""
        return self._seen == self._parts

    def uncovered(self) -> list[slice]:
        """The segments no part covers."""
        return [segment for segment, parts in zip(self._segments, self._parts) if parts == 0]

    def runs(self, rows: slice):
        """For the part over ``rows``: (first, last, run, segment, piece) for each run of neighbouring
        segments it finds in the same state (first part or not, last or not, kept where one part
        lies), which one copy or combine writes: ``segment`` the run's rows, ``piece`` them within
        the part. A packed call's part spans many segments."""
        covered = [i for i, s in enumerate(self._segments) if rows.start <= s.start and s.stop <= rows.stop]

        def state(i):
            kept = self._kept.get(i)
            return self._seen[i] == 0, self._seen[i] + 1 == self._parts[i], None if kept is None else id(kept[0])

        for (first, last, _), run in itertools.groupby(covered, key=state):
            run = list(run)
            segment = slice(self._segments[run[0]].start, self._segments[run[-1]].stop)
            yield first, last, run, segment, slice(segment.start - rows.start, segment.stop - rows.start)
            for i in run:
                self._seen[i] += 1

    def keep(self, run: list, part: torch.Tensor, start: int) -> bool:
        """Keeps ``part`` (starting at row ``start``) as the first part of the segments ``run``
        where each has two parts; returns whether it did."""
        if not all(self._parts[i] == 2 for i in run):
            return False
        self._kept.update({i: (part, start) for i in run})
        return True

    def running_rows(self, segment: slice) -> torch.Tensor:
        """Rows ``segment`` of the float32 buffer where parts combine."""
        if self._running is None:
            like, dtype = self._running_spec
            self._running = torch.empty_like(like, dtype=dtype)
        return self._running[:, :, segment]

    def kept_or_running(self, run: list, segment: slice) -> torch.Tensor:
        """What the segments ``run`` (rows ``segment``) hold so far: their first part where kept,
        else the running buffer's rows."""
        kept = [self._kept.pop(i, None) for i in run][0]  # one first part for the run (``runs``' state)
        if kept is None:
            return self.running_rows(segment)
        first, start = kept
        return first[:, :, segment.start - start:segment.stop - start]
