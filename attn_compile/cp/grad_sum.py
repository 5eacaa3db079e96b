"""Summing a gradient whose parts come one kernel call at a time (a step's calls, other ranks'
shares), each over some rows (``row_parts.py``)."""
import torch

from attn_compile.kernels.dispatch import add_rows_into
from attn_compile.kernels.result_layout import lies_as_grad

from .row_parts import RowParts, by_index, call_pieces, call_rows, rows_on_device, segments
from .words import copy_into


class GradSum(RowParts):
    """The sum of parts over rows of a (B, H, S, D) gradient shaped and laid out like ``like``
    (``torch.empty_like``), computed in float32 and rounded once to ``dtype`` (like's by default).
    A row of one part is that part copied in, and a part that is the whole result (laid out as the
    result) is taken as it is; a row of two parts is their sum written once, with no float32
    buffer (an add of two half-precision tensors computes in float32 and rounds once), where
    float32 zeros cost a fill, an add per part and a cast. Rows no part covers are 0.
    """

    def __init__(self, like: torch.Tensor, parts_rows: list[slice], dtype=None):
        self._like, self._dtype = like, like.dtype if dtype is None else dtype
        running_dtype = torch.promote_types(self._dtype, torch.float32)
        super().__init__(like.shape[2], parts_rows, running=(like, running_dtype))
        self._total = None
        for segment in self.uncovered():
            self._rows(segment).zero_()

    def _rows(self, segment: slice) -> torch.Tensor:
        if self._total is None:
            self._total = torch.empty_like(self._like, dtype=self._dtype)
        return self._total[:, :, segment]

    def add_call(self, call, side: str, grad: torch.Tensor) -> None:
        """Adds a kernel call's gradient over its ``side`` rows (``row_parts.call_rows``): each part."""
        for rows, piece in call_pieces(call, side):
            self.add(rows, grad[:, :, piece])

    def add(self, rows: slice, part: torch.Tensor) -> None:
        """Adds the gradient ``part`` of rows ``rows``."""
        for first, last, run, segment, piece in self.runs(rows):
            grad = part[:, :, piece]
            if first and last:
                if self._total is None and grad.shape == self._like.shape and grad.dtype == self._dtype \
                        and lies_as_grad(grad, self._like):
                    self._total = grad
                else:
                    copy_into(self._rows(segment), grad)
            elif first:
                if not self.keep(run, part, rows.start):
                    self.running_rows(segment).copy_(grad)
            else:
                so_far = self.kept_or_running(run, segment)
                into = self._rows(segment) if last else so_far
                computed_in = torch.promote_types(so_far.dtype, grad.dtype)  # an add computes in its inputs' dtype
                if torch.promote_types(computed_in, into.dtype) == computed_in:
                    torch.add(so_far, grad, out=into)
                else:  # two bf16 parts of a float32 result: added there, not rounded to bf16 first
                    into.copy_(so_far)
                    into.add_(grad)

    def result(self) -> torch.Tensor:
        """The sum, once every part has come."""
        if not self.complete():
            raise RuntimeError("GradSum.result() called before every part it was told of had been added")
        if self._total is None:  # no rows
            self._rows(slice(0, 0))
        return self._total


class IndexedGradSum:
    """The sum of a (B, H, S, D) gradient's parts where a kernel call's rows lie in several parts (a
    packed call's document chunks): kept in float32 over every row, each call's rows added in one
    launch (``add_rows_into``, the rows by index), and rounded to ``dtype`` (like's by default)
    once, when ``result`` is first read. Laid out as ``like``; rows no part covers are 0. Part by
    part (``GradSum``), a call of a zigzag shard's packed documents adds one part per document
    chunk it holds, each an add or a copy of its own: with one H200 playing each rank of the
    4-rank zigzag ring on ``bench cp --documents``' batch, its host took 20-29 ms a fwd+bwd that
    way with the window of 4096 and 21-25 ms without, against 14-18 and 4-5 ms summing by index
    (BENCHMARKS.md)."""

    def __init__(self, like: torch.Tensor, dtype=None):
        self._like, self._dtype = like, like.dtype if dtype is None else dtype
        running = torch.promote_types(self._dtype, torch.float32)
        # the fused sum reads and writes rows of unit stride
        self._sum = (torch.zeros_like(like, dtype=running) if like.stride(-1) == 1 else
                     torch.zeros(like.shape, dtype=running, device=like.device))
        self._result = None

    def add_call(self, call, side: str, grad: torch.Tensor) -> None:
        """Adds a kernel call's gradient over its ``side`` rows (``row_parts.call_rows``) in one launch;
        the rest of its span (filler rows between the parts) is not read."""
        _, span = call_rows(call, side)
        add_rows_into(self._sum, grad, rows_on_device(call, side, grad.device), span.start)

    def add(self, rows: slice, part: torch.Tensor) -> None:
        """Adds the gradient ``part`` of rows ``rows``."""
        self._sum[:, :, rows] += part

    def result(self) -> torch.Tensor:
        """The sum, once every part has come."""
        if self._result is None:
            same = self._sum.dtype == self._dtype and lies_as_grad(self._sum, self._like)
            self._result = self._sum if same else torch.empty_like(self._like, dtype=self._dtype).copy_(self._sum)
        return self._result


def gradient_sum(like: torch.Tensor, calls, side: str, dtype=None, more_parts=()):
    """The sum that the gradients of ``calls`` over their ``side`` rows (``row_parts.call_rows``), and
    ``more_parts`` (the rows of parts added with ``add``), add into: by index where some call's rows
    lie in several parts (packed documents), else part by part."""
    if by_index(calls, side):
        return IndexedGradSum(like, dtype)
    return GradSum(like, [rows for call in calls for rows in call_rows(call, side)[0]] + list(more_parts), dtype)


def most_parts(parts_rows: list[slice]) -> int:
    """The most parts any row gets."""
    return max(segments(max((r.stop for r in parts_rows), default=0), parts_rows)[1], default=0)
