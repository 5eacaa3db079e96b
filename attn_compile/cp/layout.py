"""Which part of the sequence each context-parallel rank holds.

``zigzag`` (load-balanced): the sequence is cut into 2·cp chunks and rank r holds chunks r and
2cp-1-r, so under a causal mask every rank has the same amount of work. ``contiguous``: the
sequence is cut into cp chunks and rank r holds chunk r.

A sharding (``SequenceSharding`` here, ``DocumentSharding`` for packed documents in
documents.py) tells the strategies where each row of a shard sits in the sequence, as
``Chunk``s, and moves between per-rank shards and the whole sequence.
"""
import functools
from dataclasses import dataclass

import torch

from .comm import all_gather_stacked, cp_rank, cp_size, process_groups
from .words import as_words, from_words

LAYOUTS = ("zigzag", "contiguous")


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")


def chunks_per_rank(layout: str) -> int:
    return 2 if layout == "zigzag" else 1


def chunk_ids(rank: int, cp: int, layout: str) -> tuple[int, ...]:
    return (rank, 2 * cp - 1 - rank) if layout == "zigzag" else (rank,)


def chunk_starts(rank: int, cp: int, layout: str, shard_len: int) -> list[int]:
    """Global position of the first row of each chunk of rank's shard, in shard order."""
    length = shard_len // chunks_per_rank(layout)
    return [chunk * length for chunk in chunk_ids(rank, cp, layout)]


@dataclass(frozen=True)
class Chunk:
    """Rows [row, row + length) of a buffer: positions [position, position + length) of a document."""
    row: int
    position: int
    length: int
    document: int = 0


@dataclass(frozen=True)
class SequenceSharding:
    """One sequence of cp · shard_len rows per batch entry, in ``layout``."""
    cp: int
    layout: str
    shard_len: int

    def local_len(self, rank: int) -> int:
        return self.shard_len

    @functools.cached_property
    def _chunk_len(self) -> int:
        return self.shard_len // chunks_per_rank(self.layout)

    def chunks(self, rank: int) -> tuple[Chunk, ...]:
        """Rank's shard, chunk by chunk."""
        length = self._chunk_len
        return tuple(Chunk(i * length, start, length)
                     for i, start in enumerate(chunk_starts(rank, self.cp, self.layout, self.shard_len)))

    def whole_chunks(self) -> tuple[Chunk, ...]:
        """The whole sequence (``join``'s result), chunk by chunk."""
        length = self._chunk_len
        return tuple(Chunk(i * length, i * length, length) for i in range(self.cp * chunks_per_rank(self.layout)))

    def pad(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return x

    def split(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return split_sequence(x, self.cp, self.layout, dim)

    def join(self, shards: torch.Tensor, dim: int) -> torch.Tensor:
        """The whole sequence from the stacked shards (``split`` undone)."""
        return join_shards(shards.unbind(0), self.layout, dim)


def take_shard(x: torch.Tensor, rank: int, cp: int, layout: str, dim: int) -> torch.Tensor:
    (words,) = as_words([x], dim)
    chunks = words.tensor_split(cp * chunks_per_rank(layout), dim)
    return from_words(torch.cat([chunks[c] for c in chunk_ids(rank, cp, layout)], dim), x.dtype)


def split_sequence(x: torch.Tensor, cp: int, layout: str, dim: int) -> torch.Tensor:
    """Every rank's shard of the whole sequence x, stacked in rank order: (cp, *shard's shape),
    written in one pass (a stack of taken shards would copy twice)."""
    (words,) = as_words([x], dim)
    length = x.shape[dim] // (cp * chunks_per_rank(layout))
    shards = words.new_empty((cp, *words.shape[:dim], words.shape[dim] // cp, *words.shape[dim + 1:]))
    for rank in range(cp):
        for slot, chunk in enumerate(chunk_ids(rank, cp, layout)):
            shards[rank].narrow(dim, slot * length, length).copy_(words.narrow(dim, chunk * length, length))
    return from_words(shards, x.dtype)


def join_shards(shards, layout: str, dim: int) -> torch.Tensor:
    """The whole sequence from every rank's shard, given in rank order: split_sequence undone."""
    dtype = shards[0].dtype
    shards = as_words(shards, dim)
    cp, per_rank = len(shards), chunks_per_rank(layout)
    chunks = [None] * (cp * per_rank)
    for rank, shard in enumerate(shards):
        for chunk, piece in zip(chunk_ids(rank, cp, layout), shard.tensor_split(per_rank, dim)):
            chunks[chunk] = piece
    return from_words(torch.cat(chunks, dim), dtype)


def shard_sequence(x: torch.Tensor, group, seq_dim: int = 2, layout: str = "zigzag") -> torch.Tensor:
    """This rank's shard of the whole sequence ``x`` (no communication; differentiable).

    ``group``: a ProcessGroup or a 1-D or 2-D DeviceMesh (for the hybrid strategy)."""
    check_layout(layout)
    groups = process_groups(group)
    cp = cp_size(groups)
    multiple = cp * chunks_per_rank(layout)
    if x.shape[seq_dim] % multiple:
        raise ValueError(
            f"x.shape[{seq_dim}] (the sequence length) must be a multiple of {multiple} "
            f"({'2·cp' if layout == 'zigzag' else 'cp'} with cp={cp}) for layout={layout!r}; got {x.shape[seq_dim]}"
        )
    return take_shard(x, cp_rank(groups), cp, layout, seq_dim)


def unshard_sequence(x_local: torch.Tensor, group, seq_dim: int = 2, layout: str = "zigzag") -> torch.Tensor:
    """The whole sequence, on every rank, from each rank's shard: shard_sequence undone.

    It all-gathers and is not differentiable: pass a tensor that does not require grad."""
    check_layout(layout)
    if x_local.requires_grad and torch.is_grad_enabled():
        raise ValueError("x_local requires grad, but unshard_sequence is not differentiable; "
                         "pass x_local.detach() or call it under torch.no_grad()")
    if x_local.shape[seq_dim] % chunks_per_rank(layout):
        raise ValueError(f"x_local.shape[{seq_dim}] (the local sequence length) must be even for layout='zigzag'; "
                         f"got {x_local.shape[seq_dim]}")
    groups = process_groups(group)
    return join_shards(all_gather_stacked(x_local, groups).unbind(0), layout, seq_dim)
