"""Merging partial attention results over disjoint key sets, by their log-sum-exp."""
import functools

import torch

from attn_compile.kernels.dispatch import merge_into, merge_rows_into
from attn_compile.kernels.reference import lse_dtype
from attn_compile.kernels.result_layout import empty_out

from .row_parts import RowParts, by_index, call_pieces, rows_on_device
from .words import copy_into


def empty_result(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) as a merged result lies in memory: out (*q.shape[:-1], d_v) in q's order of (B,
    H, S), as the single-GPU op's (``result_layout.py``), so that the parts of packed documents and of
    transposed projections (token-major) copy and merge row by row; lse q.shape[:-1]."""
    return empty_out(q, v.shape[-1]), q.new_empty(q.shape[:-1], dtype=lse_dtype(q.dtype))


class MergedResult(RowParts):
    """The attention of the local queries to keys that come one call at a time (ring steps,
    all-gather tiles), merged as the parts come (``row_parts.py``): the first part is copied in,
    later ones merge in float32 (the LSE's dtype), and the last merge writes the output in q's
    dtype. A float32 result started at (0, -inf) cost a fill, a merge and a cast more per row: 3%
    of the GQA ring's forward at 64K tokens on 2 H200s. A row of two parts keeps its first part's
    output uncopied: the part comes in q's dtype, so a float32 copy adds nothing but a pass (0.25
    ms of that forward's 27.5). Rows that no part covers come out 0 with LSE -inf.
    """

    def __init__(self, q: torch.Tensor, v: torch.Tensor, parts_rows: list[slice]):
        self.out, self.lse = empty_result(q, v)
        super().__init__(q.shape[2], parts_rows, running=(self.out, self.lse.dtype))
        for segment in self.uncovered():
            self.out[:, :, segment].zero_()
            self.lse[:, :, segment].fill_(float("-inf"))

    def add_call(self, call, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Merges in the result of a kernel call over the query rows ``call.q_rows``: each of its
        ``q_parts`` (``tiles.attend_tiles``)."""
        for rows, piece in call_pieces(call, "q"):
            self.add(rows, out[:, :, piece], lse[:, :, piece])

    def add(self, rows: slice, part_out: torch.Tensor, part_lse: torch.Tensor) -> None:
        """Merges in a part: the attention of query rows ``rows`` to keys no earlier part held."""
        for first, last, run, segment, piece in self.runs(rows):
            out, lse = part_out[:, :, piece], part_lse[:, :, piece]
            if first:
                if last:
                    copy_into(self.out[:, :, segment], out)
                elif not self.keep(run, part_out, rows.start):
                    self.running_rows(segment).copy_(out)
                self.lse[:, :, segment].copy_(lse)
            else:
                merge_into(self.kept_or_running(run, segment), self.lse[:, :, segment],
                           out, lse, into=self.out[:, :, segment] if last else None)


class IndexedResult:
    """The attention of the local queries to keys that come one call at a time, where a call's
    rows lie in several parts (a packed call's document chunks): the running result is kept in
    the LSE's dtype over every row, each call's rows merge into it in one launch
    (``merge_rows_into``, the rows by index), and the output is cast to q's dtype once, when
    ``out`` is first read, after the last call. Part by part (``MergedResult``) the zigzag ring of
    4 H200s launched 73-102 merges and 34-149 copies a forward on packed documents, and its host
    took 21-22 ms a forward for 5-7 ms of FA4 (BENCHMARKS.md). Rows that no call covers come out
    0 with LSE -inf."""

    def __init__(self, q: torch.Tensor, v: torch.Tensor):
        self._q = q
        self._acc = q.new_zeros((*q.shape[:-1], v.shape[-1]), dtype=lse_dtype(q.dtype))
        self.lse = q.new_full(q.shape[:-1], float("-inf"), dtype=lse_dtype(q.dtype))

    def add_call(self, call, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Merges in the result of a kernel call over the query rows ``call.q_rows``: the rows of its
        ``q_parts``; the rest of its span (filler rows between them) is not read."""
        merge_rows_into(self._acc, self.lse, out, lse, rows_on_device(call, "q", out.device), call.q_rows.start)

    @functools.cached_property
    def out(self) -> torch.Tensor:
        return empty_out(self._q, self._acc.shape[-1]).copy_(self._acc)


def running_result(q: torch.Tensor, v: torch.Tensor, calls):
    """The result that the outputs of ``calls`` merge into: by index where some call's rows lie in
    several parts (packed documents), else part by part."""
    if by_index(calls, "q"):
        return IndexedResult(q, v)
    return MergedResult(q, v, [rows for call in calls for rows in call.q_parts])
