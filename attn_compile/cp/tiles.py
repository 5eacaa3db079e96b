"""Local queries against a block of keys held as chunks of known document and position: the
kernel calls that cover every visible (query, key) pair once, and running them into merged results.

Ring (one rank's keys per step) and all-gather (the whole sequence, or batch of packed documents)
work through here. Every (query chunk, key chunk) pair is classified from positions alone: a pair
from different documents or outside the mask is skipped, a fully
visible one runs unmasked, a partly visible one runs masked at its positions. Fully visible pairs
that are adjacent in both buffers run as one call, so a zigzag step off the diagonal is one
half-size call. A shard's causal attention to its own keys is one causal call over its rows
(``_causal_over_rows``): fewer, larger calls, and causal ones, which cuDNN's backward runs faster
than full ones (about 470 against 300 TFLOP/s for MLA 192/128 on an H200). In one document, a
query chunk's partly visible key chunks and the visible chunks that continue them in buffer and
position are one masked call: under the all-gather each query chunk of a causal zigzag shard is
one call to its whole visible prefix, which FA4's bottom-right alignment takes, with no merge.

Packed documents give a few tiles per document; ``plan_calls`` cuts each band tile of a window
into squares on the band's edges and fully visible rectangles (``_band_parts``) and runs the tiles
of one kind across documents as one varlen call (``packed_tiles``), so a step's calls do not grow
with its documents. Where the kernels align each segment's masks at its end (FA4: ``ends_aligned``,
``dispatch.runs_ends_aligned``), a query chunk's keys up to it stay one tile, uncut, as in one
document: the all-gather then runs a zigzag shard in two varlen calls (each document's first
chunk against its prefix, then its second chunk, whose keys overlap the first's), a contiguous
one in one, with no merge.
"""
import functools
import itertools
from dataclasses import dataclass

from attn_compile.kernels import attention_backward, attention_forward
from attn_compile.kernels.visibility import Visibility, classify, effective_window

from .layout import Chunk
from .packed_tiles import ends_together, packed_calls, packs

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

    @property
    def q_parts(self) -> tuple[slice, ...]:
        """The query rows this call gives a result for (``packed_tiles.PackedTiles.q_parts``)."""
        return (self.q_rows,)

    @property
    def k_parts(self) -> tuple[slice, ...]:
        return (self.k_rows,)

    def split_queries(self) -> tuple["Tile", ...]:
        """The tile as two: the first half of its query rows and the rest, each against the keys
        it sees (a causal square's first half against the first half of its keys)."""
        n, m = self.q_rows.stop - self.q_rows.start, self.k_rows.stop - self.k_rows.start
        left, right = effective_window(self.masking["is_causal"], self.masking["window"]) if self.masking \
            else NO_WINDOW
        shift = self.masking["q_offset"] - self.masking["k_offset"] if self.masking else 0
        parts = []
        for a, b in ((0, n // 2), (n // 2, n)):  # key j sees query i where -left <= j - i - shift <= right
            lo = 0 if left == -1 else max(0, a + shift - left)
            hi = m if right == -1 else min(m, b - 1 + shift + right + 1)
            if b > a and hi > lo:
                masking = self.masking and {**self.masking, "q_offset": self.masking["q_offset"] + a,
                                            "k_offset": self.masking["k_offset"] + lo}
                parts.append(Tile(slice(self.q_rows.start + a, self.q_rows.start + b),
                                  slice(self.k_rows.start + lo, self.k_rows.start + hi), masking))
        return tuple(parts)


def _rows(chunks) -> slice:
    return slice(chunks[0].row, chunks[-1].row + chunks[-1].length)


def _adjacent_runs(chunks, keep, in_position=False):
    """Runs of consecutive chunks that satisfy ``keep`` and lie next to each other in their buffer
    (and, ``in_position``, in their document)."""
    runs = []
    for chunk in chunks:
        if not keep(chunk):
            continue
        last = runs[-1][-1] if runs else None
        if last and last.row + last.length == chunk.row and (
                not in_position or last.position + last.length == chunk.position):
            runs[-1].append(chunk)
        else:
            runs.append([chunk])
    return runs


def _spanning(run) -> Chunk:
    """The chunks of ``run`` (contiguous in buffer and position) as one chunk."""
    return Chunk(run[0].row, run[0].position, sum(chunk.length for chunk in run), run[0].document)


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
def plan_tiles(q_chunks: tuple, k_chunks: tuple, is_causal: bool, window: tuple = NO_WINDOW,
               ends_aligned: bool = False) -> tuple[Tile, ...]:
    """Tiles for the query chunks against the key chunks (``layout.Chunk``s). ``ends_aligned``: the
    kernels take packed segments that end together, so among packed documents too a query chunk's
    masked run of keys that ends where the chunk does is one tile (under the all-gather, each
    chunk's whole visible prefix), not a tile per key chunk."""
    if _causal_over_rows(q_chunks, k_chunks, is_causal, window):
        start = q_chunks[0].position
        return (Tile(_rows(q_chunks), _rows(k_chunks), dict(is_causal=True, window=window, q_offset=start,
                                                            k_offset=start)),)
    left, right = effective_window(is_causal, window)
    masks = (left, right) != NO_WINDOW
    by_document = {}
    for chunk in k_chunks:
        by_document.setdefault(chunk.document, []).append(chunk)
    one_document = len({chunk.document for chunk in q_chunks}) == 1
    tiles, full_keys = [], []
    for q in q_chunks:
        keys = by_document.get(q.document, [])
        visibility = {k: _diagonal_or(classify(q.position, q.length, k.position, k.length, left, right), q, k,
                                      is_causal) for k in keys}
        runs = _adjacent_runs(keys, lambda k: visibility[k] is not Visibility.NONE, in_position=True)
        if one_document:  # a masked chunk and the visible chunks next to it: one masked call, no merge
            masked = [run for run in runs if any(visibility[k] is Visibility.PARTIAL for k in run)]
        else:  # packed documents: tiles of a kind pack across documents (plan_calls)
            # where the kernels take it, a run that ends with the chunk is one tile, masked even
            # where all of it is visible (a one-token chunk's), so that no fully visible call is left
            whole = [run for run in runs if ends_aligned and masks
                     and ends_together(_cropped(q, _spanning(run), is_causal, window))]
            masked = whole + [[k] for k in keys if visibility[k] is Visibility.PARTIAL
                              and not any(k in run for run in whole)]
        tiles += [_cropped(q, _spanning(run), is_causal, window) for run in masked]
        visibility.update({k: Visibility.NONE for run in masked for k in run})
        runs = _adjacent_runs(keys, lambda k: visibility[k] is Visibility.FULL)
        full_keys.append((q, tuple(_rows(run) for run in runs)))
    # adjacent query chunks that see the same keys fully run as one call
    for rows, group in itertools.groupby(full_keys, key=lambda item: item[1]):
        for run in _adjacent_runs([q for q, _ in group], lambda q: True):
            tiles += [Tile(_rows(run), k_rows, {}) for k_rows in rows]
    return tuple(tiles)


def _part(tile, rows: tuple, cols: tuple, masking: dict) -> Tile:
    """The part of ``tile`` over its local rows [a, b) and columns [c, d); a square under a mask
    takes ``masking`` at equal offsets: its mask depends on the position difference alone."""
    q, k = tile.q_rows.start, tile.k_rows.start
    at = tile.masking["q_offset"] + rows[0]
    return Tile(slice(q + rows[0], q + rows[1]), slice(k + cols[0], k + cols[1]),
                {**masking, "q_offset": at, "k_offset": at} if masking else {})


_CAUSAL_SQUARE = dict(is_causal=True, window=NO_WINDOW)  # keys up to the diagonal
_ANTICAUSAL_SQUARE = dict(is_causal=False, window=(0, -1))  # keys from the diagonal on


def _band_rows(a: int, b: int, m: int, lo, hi) -> list[tuple]:
    """(rows, columns, masking) parts covering rows [a, b) of a band ``lo <= j - i <= hi`` over
    columns [0, m), where either edge may lie outside every row (None: unbounded)."""
    lower = lo is not None and a + lo >= 0  # the rows start at column i + lo, inside the tile
    upper = hi is not None and b + hi <= m  # the rows end at column i + hi, inside the tile
    if not lower and not upper:
        return [((a, b), (0, m), {})]
    if not lower:  # rows end at column i + hi: a causal square on that edge, all columns before it
        return [((a, b), (a + hi, b + hi), _CAUSAL_SQUARE), ((a, b), (0, a + hi), {})]
    if not upper:  # rows start at column i + lo: a square that sees from its diagonal on, the rest after it
        return [((a, b), (a + lo, b + lo), _ANTICAUSAL_SQUARE), ((a, b), (b + lo, m), {})]
    width = hi - lo
    parts = []
    for start in range(a, b, width):  # blocks no taller than the band is wide, so its edges do not meet
        end = min(b, start + width)
        parts += [((start, end), (start + lo, end + lo), _ANTICAUSAL_SQUARE),
                  ((start, end), (end + lo, start + hi), {}),
                  ((start, end), (start + hi, end + hi), _CAUSAL_SQUARE)]
    return parts


def _band_parts(tile, ends_aligned: bool = False) -> tuple[Tile, ...]:
    """A masked tile off the diagonal as squares whose diagonals lie on its band's edges and fully
    visible rectangles: tiles of the kinds that pack (``packed_tiles``), whatever the document.

    In the tile's own rows i and columns j the band is ``lo <= j - i <= hi``. The rows split where
    an edge leaves the tile (the first rows may see from column 0, the last rows up to the last
    column); in each part the edges that cut become squares: a causal one on the upper edge, one
    that sees from its diagonal on at the lower edge, and what lies between is fully visible. A band
    narrower than its rows is cut into blocks of its width. A band of one diagonal stays whole, and
    so, ``ends_aligned`` (the kernels take such tiles packed), does a tile that ends together."""
    mask = tile.masking
    n, m = tile.q_rows.stop - tile.q_rows.start, tile.k_rows.stop - tile.k_rows.start
    if not mask or packs(tile, ends_aligned):
        return (tile,)
    left, right = effective_window(mask["is_causal"], mask["window"])
    shift = mask["k_offset"] - mask["q_offset"]
    lo = None if left == -1 else -left - shift
    hi = None if right == -1 else right - shift
    if lo is not None and hi is not None and hi <= lo:
        return (tile,)
    # the first row whose band starts inside the tile, and the first whose band ends past it
    edges = (0 if lo is None else -lo, n if hi is None else m - hi)
    cuts = sorted({0, n, *(min(n, max(0, r)) for r in edges)})
    parts = [part for a, b in itertools.pairwise(cuts) for part in _band_rows(a, b, m, lo, hi)]
    parts = [(rows, cols, masking) for rows, cols, masking in parts if rows[0] < rows[1] and cols[0] < cols[1]]
    if any(cols[0] < 0 or cols[1] > m for _, cols, _ in parts):  # a tile not cut to its band
        return (tile,)
    return tuple(_part(tile, rows, cols, masking) for rows, cols, masking in parts)


@functools.lru_cache(maxsize=1024)
def plan_calls(q_chunks: tuple, k_chunks: tuple, is_causal: bool, window: tuple = NO_WINDOW,
               ends_aligned: bool = False) -> tuple:
    """The kernel calls that run ``plan_tiles``' tiles: ``Tile``s, and where the queries hold several
    documents, ``packed_tiles.PackedTiles`` for the tiles of one kind across them. A dense
    sequence (one document) keeps one call per tile. ``ends_aligned``: the kernels take packed
    segments that end together (``dispatch.runs_ends_aligned``)."""
    tiles = plan_tiles(q_chunks, k_chunks, is_causal, window, ends_aligned)
    if len({chunk.document for chunk in q_chunks}) < 2:
        return tiles
    return packed_calls([part for tile in tiles for part in _band_parts(tile, ends_aligned)], ends_aligned)


def q_parts(calls) -> list[slice]:
    """The query rows of each part ``calls`` add to a result (``merge.MergedResult``, ``grad_sum.GradSum``)."""
    return [rows for call in calls for rows in call.q_parts]


def k_parts(calls) -> list[slice]:
    return [rows for call in calls for rows in call.k_parts]


def attend_tiles(q, k, v, calls, scale: float, result) -> None:
    """Adds the attention of q to (k, v) over ``plan_calls``' calls into ``result`` (a
    ``merge.MergedResult`` told their ``q_parts``, or a ``merge.IndexedResult``)."""
    for call in calls:
        result.add_call(call, *call.forward(q, k, v, scale))


def attend_tiles_backward(dout, q, k, v, out, lse, calls, scale: float, dq, dk, dv) -> None:
    """Adds (k, v)'s share of the gradients into dq, dk, dv (``grad_sum.gradient_sum``'s sums, a
    ``GradSum`` told the calls' ``q_parts`` or ``k_parts``); out and lse are final."""
    for call in calls:
        for total, side, grad in zip((dq, dk, dv), "qkk", call.backward(dout, q, k, v, out, lse, scale)):
            total.add_call(call, side, grad)
