"""Local queries against a block of keys held as chunks of known global position: the kernel
calls that cover every visible (query, key) pair once, and running them into merged results.

Ring (one block per step) and all-gather (one block of every key) both work through here.
Every (query chunk, key chunk) pair is classified from global positions alone: an invisible
pair is skipped, a fully visible one runs unmasked, a partly visible one runs masked at its
global positions. Fully visible pairs that are adjacent in both buffers run as one call, so a
zigzag step off the diagonal is one half-size call and a diagonal chunk one square causal call.
"""
import itertools
from dataclasses import dataclass

from attn_compile.kernels import attention_backward, attention_forward
from attn_compile.kernels.visibility import Visibility, classify, effective_window

from .merge import merge_

NO_WINDOW = (-1, -1)


@dataclass(frozen=True)
class Tile:
    q_rows: slice
    k_rows: slice
    masking: dict  # the kernels' mask arguments; empty when every query sees every key


def _full_runs(visibility) -> tuple[tuple[int, int], ...]:
    """(first, end) of each run of adjacent fully visible key chunks."""
    runs, index = [], 0
    for full, run in itertools.groupby(v is Visibility.FULL for v in visibility):
        length = len(list(run))
        if full:
            runs.append((index, index + length))
        index += length
    return tuple(runs)


def plan_tiles(q_starts, k_starts, length: int, is_causal: bool) -> list[Tile]:
    """Tiles for query chunks at global positions ``q_starts`` against key chunks at ``k_starts``,
    every chunk ``length`` rows, chunks laid out in their buffers in the order given."""
    left, right = effective_window(is_causal, NO_WINDOW)

    def rows(first, end):
        return slice(first * length, end * length)

    tiles, full_runs = [], []
    for i, q_start in enumerate(q_starts):
        visibility = [classify(q_start, length, k_start, length, left, right) for k_start in k_starts]
        tiles += [
            Tile(rows(i, i + 1), rows(j, j + 1), dict(is_causal=is_causal, q_offset=q_start, k_offset=k_start))
            for j, (k_start, v) in enumerate(zip(k_starts, visibility)) if v is Visibility.PARTIAL
        ]
        full_runs.append(_full_runs(visibility))
    index = 0
    for runs, group in itertools.groupby(full_runs):  # adjacent query chunks that see the same keys
        count = len(list(group))
        tiles += [Tile(rows(index, index + count), rows(first, end), {}) for first, end in runs]
        index += count
    return tiles


def attend_tiles(q, k, v, tiles, scale: float, out, lse) -> None:
    """Adds the attention of q to (k, v) over ``tiles`` into the running (out, lse), in place."""
    for tile in tiles:
        q_rows, k_rows = tile.q_rows, tile.k_rows
        part_out, part_lse = attention_forward(q[:, :, q_rows], k[:, :, k_rows], v[:, :, k_rows], scale=scale,
                                               **tile.masking)
        merge_(out[:, :, q_rows], lse[:, :, q_rows], part_out, part_lse)


def attend_tiles_backward(dout, q, k, v, out, lse, tiles, scale: float, dq, dk, dv) -> None:
    """Adds (k, v)'s share of the gradients into dq, dk, dv, in place; out and lse are final."""
    for tile in tiles:
        q_rows, k_rows = tile.q_rows, tile.k_rows
        grads = attention_backward(dout[:, :, q_rows], q[:, :, q_rows], k[:, :, k_rows], v[:, :, k_rows],
                                   out[:, :, q_rows], lse[:, :, q_rows], scale=scale, **tile.masking)
        for acc, rows, grad in zip((dq, dk, dv), (q_rows, k_rows, k_rows), grads):
            acc[:, :, rows] += grad
