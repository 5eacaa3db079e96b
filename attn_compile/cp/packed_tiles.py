"""Tiles of many documents run as one packed (varlen) kernel call per kind of mask.

A step of packed documents has a few tiles per document; one kernel call each costs far more host
time than the tile's work where documents are short (FA4's CuTe DSL dispatch: 100 us or more a
call). Tiles that every query sees fully make one non-causal varlen call, and squares whose
queries and keys sit at the same positions one call per mask: the diagonal's under the plan's
mask, and the squares ``tiles._band_parts`` cuts on the edges of a window's band (causal, or
seeing from the diagonal on). Each tile is a segment, and its positions start at 0 in both
buffers, so the mask means the same there. Where the kernel aligns each segment's masks at its
end (FA4, ``ends_aligned``), any masked tiles whose last query and last key share a position pack
the same way: a query chunk against its document's keys up to it.

A varlen call's segments partition a contiguous run of rows in each buffer, in order, so tiles go
into chains whose query rows and key rows both increase (``_chains``), and the rows between two
tiles become filler segments: the query rows with no key, the key rows with no query. What the
kernel writes in filler rows is never read: a call's part of a result is its tiles' rows alone
(``q_parts``, ``k_parts``), so a zigzag shard's rows that a call spans but does not attend are
neither filled nor merged nor added. The calls take the ``(1, H, S, D)`` shards as packed
``(S, H, D)`` views: packed documents are one batch entry.
"""
import functools
from dataclasses import dataclass

import torch

from attn_compile.kernels import varlen_backward, varlen_forward
from attn_compile.kernels.documents import packed, unpacked
from attn_compile.kernels.visibility import effective_window

from . import device_copies


def coalesced(rows) -> tuple[slice, ...]:
    """Increasing, disjoint row ranges with the neighbours among them joined."""
    joined = []
    for r in rows:
        if joined and joined[-1].stop == r.start:
            joined[-1] = slice(joined[-1].start, r.stop)
        else:
            joined.append(r)
    return tuple(joined)


def on_diagonal(tile) -> bool:
    """A masked tile whose queries and keys sit at the same positions, as many of each: its mask
    means the same under either alignment of a varlen kernel."""
    mask = tile.masking
    return (mask["q_offset"] == mask["k_offset"]
            and tile.q_rows.stop - tile.q_rows.start == tile.k_rows.stop - tile.k_rows.start)


def ends_together(tile) -> bool:
    """A masked tile whose last query sits at its last key's position: its mask means the same under
    a varlen kernel's bottom-right alignment (a query chunk against its document's keys up to it)."""
    mask = tile.masking
    return (mask["q_offset"] + tile.q_rows.stop - tile.q_rows.start
            == mask["k_offset"] + tile.k_rows.stop - tile.k_rows.start)


def packs(tile, ends_aligned: bool) -> bool:
    """Whether a packed call takes the masked ``tile`` as a segment: one that ends together where
    the kernel aligns segments at their ends (``ends_aligned``), else a square on the diagonal
    (which also ends together)."""
    return ends_together(tile) if ends_aligned else on_diagonal(tile)


@dataclass(frozen=True)
class PackedTiles:
    """Tiles (``tiles.Tile``) run as one varlen call with ``masking`` (is_causal, window, or none),
    their query rows and key rows each disjoint and increasing. ``ends_aligned``: its masked tiles
    end together (``ends_together``) and the kernel aligns them so; else they are squares on the
    diagonal, which any alignment takes."""
    tiles: tuple
    masking: dict
    ends_aligned: bool = False

    def __post_init__(self):
        if self.masking and not all(packs(tile, self.ends_aligned) for tile in self.tiles):
            rule = "tiles that end together" if self.ends_aligned else "squares on the diagonal"
            raise ValueError(f"a masked packed call takes {rule} only; got {self.tiles}")

    @property
    def q_rows(self) -> slice:
        return slice(self.tiles[0].q_rows.start, self.tiles[-1].q_rows.stop)

    @property
    def k_rows(self) -> slice:
        return slice(self.tiles[0].k_rows.start, self.tiles[-1].k_rows.stop)

    @functools.cached_property
    def q_parts(self) -> tuple[slice, ...]:
        """The query rows the call attends: its tiles', without the filler rows between them."""
        return coalesced(tile.q_rows for tile in self.tiles)

    @functools.cached_property
    def k_parts(self) -> tuple[slice, ...]:
        return coalesced(tile.k_rows for tile in self.tiles)

    @functools.cached_property
    def _host_segments(self) -> tuple[list, list]:
        """(query lengths, key lengths) of the segments, fillers included."""
        q_lengths, k_lengths = [], []
        q_row, k_row = self.q_rows.start, self.k_rows.start
        for tile in self.tiles:
            if tile.q_rows.start > q_row:
                q_lengths.append(tile.q_rows.start - q_row)
                k_lengths.append(0)
            if tile.k_rows.start > k_row:
                q_lengths.append(0)
                k_lengths.append(tile.k_rows.start - k_row)
            q_lengths.append(tile.q_rows.stop - tile.q_rows.start)
            k_lengths.append(tile.k_rows.stop - tile.k_rows.start)
            q_row, k_row = tile.q_rows.stop, tile.k_rows.stop
        return q_lengths, k_lengths

    def _cu_seqlens(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The call's cumulative segment lengths on ``device`` (``device_copies``)."""
        def build():
            return tuple(torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
                         for lengths in self._host_segments)
        return device_copies.on_device(self, "segments", device, build)

    @functools.cached_property
    def _longest(self) -> tuple[int, int]:
        return max(self._host_segments[0]), max(self._host_segments[1])

    def forward(self, q, k, v, scale):
        """(out (1, h_q, span, d_v), lse (1, h_q, span)) over the query span; filler rows hold
        whatever the kernel wrote (``q_parts``)."""
        out, lse = varlen_forward(*self._operands((q,), (k, v)), *self._cu_seqlens(q.device), *self._longest,
                                  scale=scale, **self._alignment, **self.masking)
        return unpacked(out, 1), unpacked(lse, 1)

    def backward(self, dout, q, k, v, out, lse, scale):
        """(dq over the query span, dk and dv over the key span), each (1, H, span, D); filler rows
        hold whatever the kernel wrote."""
        dout, q, k, v, out, lse = self._operands((dout, q), (k, v), (out, lse))
        grads = varlen_backward(dout, q, k, v, out, lse, *self._cu_seqlens(q.device), *self._longest, scale=scale,
                                **self._alignment, **self.masking)
        return tuple(unpacked(grad, 1) for grad in grads)

    @property
    def _alignment(self) -> dict:
        """How the kernel must align each segment's queries with its keys (``varlen_forward``)."""
        return dict(aligned=False, ends_aligned=True) if self.ends_aligned else dict(aligned=True)

    def _operands(self, *groups):
        """Packed views of the span's rows: groups alternate query rows, key rows, query rows."""
        spans = (self.q_rows, self.k_rows, self.q_rows)
        return [packed(x[:, :, rows]) for rows, group in zip(spans, groups) for x in group]


def _chains(tiles) -> list[list]:
    """Tiles in chains whose query rows and key rows both increase, each tile in the first chain it
    extends: a query row seen through two key ranges, or keys seen by two query ranges, need two."""
    chains = []
    for tile in sorted(tiles, key=lambda t: (t.q_rows.start, t.k_rows.start)):
        chain = next((c for c in chains if c[-1].q_rows.stop <= tile.q_rows.start
                      and c[-1].k_rows.stop <= tile.k_rows.start), None)
        if chain is None:
            chains.append([tile])
        else:
            chain.append(tile)
    return chains


def _kind(tile, ends_aligned: bool):
    """The masking of the packed call a tile can join, as sorted items, or None (a single call):
    fully visible tiles, and squares whose queries and keys sit at the same positions (the
    diagonal, or a square a band's edge runs through, ``tiles._band_parts``), or with
    ``ends_aligned`` any masked tile whose queries and keys end together, one call per mask."""
    if not tile.masking:
        return ()
    if not packs(tile, ends_aligned):
        return None
    # the window as the mask means it, so that causal squares with and without (-1, 0) pack together
    mask = tile.masking
    return ("is_causal", mask["is_causal"]), ("window", effective_window(mask["is_causal"], mask["window"]))


def packed_calls(tiles, ends_aligned: bool = False) -> tuple:
    """``tiles`` as kernel calls: ``PackedTiles`` where two or more pack, else the tiles themselves.
    ``ends_aligned``: the kernels take segments that end together (``dispatch.runs_ends_aligned``)."""
    calls, kinds = [], {}
    for tile in tiles:
        kind = _kind(tile, ends_aligned)
        if kind is None:
            calls.append(tile)
        else:
            kinds.setdefault(kind, []).append(tile)
    for kind, members in kinds.items():
        calls += [chain[0] if len(chain) == 1 else PackedTiles(tuple(chain), dict(kind), ends_aligned and bool(kind))
                  for chain in _chains(members)]
    return tuple(calls)
