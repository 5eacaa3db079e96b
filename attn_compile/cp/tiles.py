"""Local queries against a block of keys held as chunks of known document and position: the
kernel calls that cover every visible (query, key) pair once, and running them into merged results.

Ring (one rank's keys per step) and all-gather (the whole sequence, or batch of packed documents)
work through here. Every (query chunk, key chunk) pair is classified from positions alone: a pair
from different documents or outside the mask is skipped, a fully
visible one runs unmasked, a partly visible one runs masked at its positions. Fully visible pairs
that are adjacent in both buffers run as one call, so a zigzag step off the diagonal is one
half-size call. A shard's causal attention to its own keys is one causal call over its rows
(``_causal_over_rows``): fewer, larger calls, and causal ones, which cuDNN's backward runs faster
than full ones (about 470 against 300 TFLOP/s for MLA 192/128 on an H200).

Packed documents give a few tiles per document; ``plan_calls`` runs the tiles of one kind across
documents as one varlen call (``packed_tiles``), so a step's calls do not grow with its documents.
"""
import functools
import itertools
from dataclasses import dataclass

from attn_compile.kernels import attention_backward, attention_forward
from attn_compile.kernels.visibility import Visibility, classify, effective_window

from .packed_tiles import packed_calls

NO_WINDOW = (-1, -1)


@dataclass(frozen=True)
class Tile:
    q_rows: slice
    k_rows: slice
    masking: dict  # the kernels' mask arguments; empty when every query sees every key

    def forward(self, q, k, v, scale):
        return attention_forward(q[:, :, self.q_rows], k[:, :, self.k_rows], v[:, :, self.k_rows], scale=scale,
                                 **self.masking)

    def backward(self, dout, q, k, v, out, lse, scale):
        q_rows, k_rows = self.q_rows, self.k_rows
        return attention_backward(dout[:, :, q_rows], q[:, :, q_rows], k[:, :, k_rows], v[:, :, k_rows],
                                  out[:, :, q_rows], lse[:, :, q_rows], scale=scale, **self.masking)


def _rows(chunks) -> slice:
    return slice(chunks[0].row, chunks[-1].row + chunks[-1].length)


def _adjacent_runs(chunks, keep):
    """Runs of consecutive chunks that satisfy ``keep`` and lie next to each other in their buffer."""
    runs = []
    for chunk in chunks:
        if not keep(chunk):
            continue
        if runs and runs[-1][-1].row + runs[-1][-1].length == chunk.row:
            runs[-1].append(chunk)
        else:
            runs.append([chunk])
    return runs


def _causal_only(is_causal, window) -> bool:
    """The mask is plain causal: no window, or one that a causal mask makes no narrower."""
    return is_causal and effective_window(is_causal, window) == (NO_WINDOW[0], 0)


def _causal_over_rows(q_chunks, k_chunks, is_causal, window) -> bool:
    """Causal attention over buffer rows equals it over positions: the keys are the queries' own
    chunks, of one document, back to back in the buffer and in increasing position (gaps allowed:
    a later chunk sees all of an earlier one, an earlier none of a later)."""
    return (
        _causal_only(is_causal, window) and q_chunks == k_chunks
        and len({chunk.document for chunk in q_chunks}) == 1
        and all(a.row + a.length == b.row and a.position + a.length <= b.position
                for a, b in zip(q_chunks, q_chunks[1:]))
    )


def _diagonal_or(visibility, q, k, is_causal) -> Visibility:
    """A chunk against itself under a causal mask is a masked square even where it is one token,
    which sees itself fully: the diagonals of many documents then pack as one causal call
    (``packed_tiles``), and the token's full tile would overlap its neighbour chunk's."""
    return Visibility.PARTIAL if is_causal and q == k and visibility is Visibility.FULL else visibility


def _cropped(q, k, is_causal, window) -> Tile:
    """The masked tile of query chunk q against key chunk k, cut to the rows that see a key and the
    keys a row sees: less work, and a band whose corners reach the tile's edges, which kernels that
    align their masks to a tile's corner (FA4: bottom-right) express with non-negative sides."""
    left, right = effective_window(is_causal, window)
    q_last, k_last = q.position + q.length - 1, k.position + k.length - 1
    rows = (0 if right == -1 else max(0, k.position - right - q.position),
            q.length if left == -1 else min(q.length, k_last + left - q.position + 1))
    cols = (0 if left == -1 else max(0, q.position - left - k.position),
            k.length if right == -1 else min(k.length, q_last + right - k.position + 1))
    return Tile(slice(q.row + rows[0], q.row + rows[1]), slice(k.row + cols[0], k.row + cols[1]),
                dict(is_causal=is_causal, window=window, q_offset=q.position + rows[0],
                     k_offset=k.position + cols[0]))


@functools.lru_cache(maxsize=1024)
def plan_tiles(q_chunks: tuple, k_chunks: tuple, is_causal: bool, window: tuple = NO_WINDOW) -> tuple[Tile, ...]:
    """Tiles for the query chunks against the key chunks (``layout.Chunk``s)."""
    if _causal_over_rows(q_chunks, k_chunks, is_causal, window):
        start = q_chunks[0].position
        return (Tile(_rows(q_chunks), _rows(k_chunks), dict(is_causal=True, window=window, q_offset=start,
                                                            k_offset=start)),)
    left, right = effective_window(is_causal, window)
    by_document = {}
    for chunk in k_chunks:
        by_document.setdefault(chunk.document, []).append(chunk)
    tiles, full_keys = [], []
    for q in q_chunks:
        keys = by_document.get(q.document, [])
        visibility = {k: _diagonal_or(classify(q.position, q.length, k.position, k.length, left, right), q, k,
                                      is_causal) for k in keys}
        tiles += [_cropped(q, k, is_causal, window) for k in keys if visibility[k] is Visibility.PARTIAL]
        runs = _adjacent_runs(keys, lambda k: visibility[k] is Visibility.FULL)
        full_keys.append((q, tuple(_rows(run) for run in runs)))
    # adjacent query chunks that see the same keys fully run as one call
    for rows, group in itertools.groupby(full_keys, key=lambda item: item[1]):
        for run in _adjacent_runs([q for q, _ in group], lambda q: True):
            tiles += [Tile(_rows(run), k_rows, {}) for k_rows in rows]
    return tuple(tiles)


def _split_at_queries(tile) -> tuple[Tile, ...]:
    """A causal tile whose keys start before its queries and end with them (a chunk against its
    document's start, in the all-gather) as the keys before the queries, which every query sees,
    and the square on the queries' own positions: two tiles of the kinds that pack."""
    mask = tile.masking
    before = mask["q_offset"] - mask["k_offset"] if mask else 0
    q_len, k_len = tile.q_rows.stop - tile.q_rows.start, tile.k_rows.stop - tile.k_rows.start
    if not (mask and _causal_only(mask["is_causal"], mask["window"]) and before > 0
            and k_len - before == q_len):
        return (tile,)
    split = tile.k_rows.start + before
    return (Tile(tile.q_rows, slice(tile.k_rows.start, split), {}),
            Tile(tile.q_rows, slice(split, tile.k_rows.stop), {**mask, "k_offset": mask["q_offset"]}))


@functools.lru_cache(maxsize=1024)
def plan_calls(q_chunks: tuple, k_chunks: tuple, is_causal: bool, window: tuple = NO_WINDOW) -> tuple:
    """The kernel calls that run ``plan_tiles``' tiles: ``Tile``s, and where the queries hold several
    documents, ``packed_tiles.PackedTiles`` for the tiles of one kind across them. A dense
    sequence (one document) keeps one call per tile."""
    tiles = plan_tiles(q_chunks, k_chunks, is_causal, window)
    if len({chunk.document for chunk in q_chunks}) < 2:
        return tiles
    return packed_calls([part for tile in tiles for part in _split_at_queries(tile)], is_causal, window)


def attend_tiles(q, k, v, calls, scale: float, result) -> None:
    """Adds the attention of q to (k, v) over ``plan_calls``' calls into ``result`` (a ``merge.MergedResult``)."""
    for call in calls:
        result.add(call.q_rows, *call.forward(q, k, v, scale))


def attend_tiles_backward(dout, q, k, v, out, lse, calls, scale: float, dq, dk, dv) -> None:
    """Adds (k, v)'s share of the gradients into dq, dk, dv, in place; out and lse are final."""
    for call in calls:
        grads = call.backward(dout, q, k, v, out, lse, scale)
        for acc, rows, grad in zip((dq, dk, dv), (call.q_rows, call.k_rows, call.k_rows), grads):
            acc[:, :, rows] += grad
