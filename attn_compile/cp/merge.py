"""Merging partial attention results over disjoint key sets, by their log-sum-exp."""
import itertools

import torch

from attn_compile.kernels.dispatch import merge_into
from attn_compile.kernels.reference import lse_dtype


class MergedResult:
    """The attention of the local queries to keys that come one call at a time (ring steps,
    all-gather tiles), merged as the parts come.

    It is told every part's query rows up front, so each row knows its first and its last part:
    the first is copied in, later ones merge in float32 (the LSE's dtype), and the last merge
    writes the output in q's dtype. A float32 result started at (0, -inf) cost a fill, a merge
    and a cast more per row: 3% of the GQA ring's forward at 64K tokens on 2 H200s. A row of two
    parts keeps its first part's output where the part lies, uncopied, until the second merges
    with it: the part comes in q's dtype, so a float32 copy adds nothing but a pass (0.25 ms of
    that forward's 27.5). Rows that no part covers come out 0 with LSE -inf.
    """

    def __init__(self, q: torch.Tensor, v: torch.Tensor, parts_rows: list[slice]):
        n = q.shape[2]
        cuts = sorted({0, n, *(r.start for r in parts_rows), *(r.stop for r in parts_rows)})
        self._segments = [slice(a, b) for a, b in zip(cuts, cuts[1:])]
        self._parts = [sum(r.start <= s.start and s.stop <= r.stop for r in parts_rows) for s in self._segments]
        self._seen = [0] * len(self._segments)
        self._first_parts = {}  # segment index: (the first part's output, the row where it starts)
        self.out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        self.lse = q.new_empty(q.shape[:-1], dtype=lse_dtype(q.dtype))
        self._running = None
        for segment, parts in zip(self._segments, self._parts):
            if parts == 0:
                self.out[:, :, segment].zero_()
                self.lse[:, :, segment].fill_(float("-inf"))

    def _running_rows(self, rows: slice) -> torch.Tensor:
        if self._running is None:
            self._running = torch.empty_like(self.out, dtype=self.lse.dtype)
        return self._running[:, :, rows]

    def add(self, rows: slice, part_out: torch.Tensor, part_lse: torch.Tensor) -> None:
        """Merges in a part: the attention of query rows ``rows`` to keys no earlier part held.
        Neighbouring segments that this part finds in the same state (first part or not, last or
        not, kept uncopied or not) are one run, written by one copy or merge: a packed call's part
        spans many segments."""
        covered = [i for i, s in enumerate(self._segments) if rows.start <= s.start and s.stop <= rows.stop]

        def state(i):  # (first part, last part, the running output: where it lies, uncopied)
            first, kept = self._seen[i] == 0, self._first_parts.get(i)
            return first, self._seen[i] + 1 == self._parts[i], None if kept is None else id(kept[0])

        for (first, last, _), run in itertools.groupby(covered, key=state):
            run = list(run)
            segment = slice(self._segments[run[0]].start, self._segments[run[-1]].stop)
            piece = slice(segment.start - rows.start, segment.stop - rows.start)
            out, lse = part_out[:, :, piece], part_lse[:, :, piece]
            if first:
                if last:
                    self.out[:, :, segment].copy_(out)
                elif all(self._parts[i] == 2 for i in run):
                    self._first_parts.update({i: (part_out, rows.start) for i in run})
                else:
                    self._running_rows(segment).copy_(out)
                self.lse[:, :, segment].copy_(lse)
            else:
                merge_into(self._kept_or_running(run, segment), self.lse[:, :, segment], out, lse,
                           into=self.out[:, :, segment] if last else None)
            for i in run:
                self._seen[i] += 1

    def _kept_or_running(self, run: list, segment: slice) -> torch.Tensor:
        """The running output of the segments ``run`` (rows ``segment``): their first part's, where kept."""
        kept = [self._first_parts.pop(i, None) for i in run][0]  # one first part for the run (``add``'s state)
        if kept is None:
            return self._running_rows(segment)
        first_out, start = kept
        return first_out[:, :, segment.start - start:segment.stop - start]
