"""Packed documents (THD) sharded for context parallelism.

``layout="zigzag"``: every document is cut into 2·cp chunks whose sizes differ by at most one,
and rank r holds chunks r and 2cp-1-r of each document, documents in order, so causal work is
equal on every rank. A document shorter than 2·cp leaves some chunks empty: no document length is
ever refused and no padding token is ever seen by the caller. ``layout="contiguous"``: the batch,
as it lies, is cut into cp pieces, and rank r holds piece r; a document may span ranks. Under a
sliding window shorter than a piece a rank then needs the keys of the rank before it only (a ring
of two steps), where zigzag chunks shorter than the window need every rank's.

Ranks may hold different numbers of tokens; the collectives move shards padded at the end to the
longest one (``shard_len``), and no chunk covers a padding row, so padding is never attended and
gets no gradient.

The hybrid strategy joins the shards of each inner mesh group into one buffer and runs a ring
over those buffers: ``hybrid_shardings`` describes both levels (their chunks are uneven too).
"""
import dataclasses
import functools
import itertools
from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import device_copies
from .comm import all_gather_stacked, cp_rank, cp_size, process_groups
from .layout import Chunk, check_layout, chunk_ids, chunks_per_rank
from .words import index_rows


def chunk_bounds(length: int, pieces: int) -> list[int]:
    """Start of each of ``pieces`` chunks of a document and its end, as ``torch.tensor_split`` cuts."""
    base, extra = divmod(length, pieces)
    return [i * base + min(i, extra) for i in range(pieces + 1)]


class ChunkSharding:
    """What a sharding of uneven shards derives from ``held``: per rank, its ``Chunk``s in shard
    order and the (start, end) rows of the whole buffer each one holds. A subclass gives ``held``,
    ``cp`` and ``total`` (the whole buffer's rows)."""

    def local_len(self, rank: int) -> int:
        return sum(chunk.length for chunk in self.held[rank][0])

    @functools.cached_property
    def shard_len(self) -> int:
        return max(self.local_len(rank) for rank in range(self.cp))

    def chunks(self, rank: int) -> tuple[Chunk, ...]:
        return tuple(self.held[rank][0])

    @functools.cached_property
    def _indices(self) -> list[torch.Tensor]:
        """Per rank, the whole buffer's rows it holds, in shard order."""
        return [torch.cat([torch.arange(a, b) for a, b in ranges]) if ranges else torch.zeros(0, dtype=torch.long)
                for _, ranges in self.held]

    @functools.cached_property
    def _slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """For each row of the whole buffer, the rank that holds it and its row in that rank's shard."""
        ranks, rows = (torch.empty(self.total, dtype=torch.long) for _ in range(2))
        for rank, index in enumerate(self._indices):
            ranks[index], rows[index] = rank, torch.arange(len(index))
        return ranks, rows

    @functools.cached_property
    def _padding_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(rank, row) of each row that pads a shard to ``shard_len``."""
        slots = [(rank, row) for rank in range(self.cp) for row in range(self.local_len(rank), self.shard_len)]
        return tuple(torch.tensor([slot[i] for slot in slots], dtype=torch.long) for i in range(2))

    def _to(self, name: str, device) -> tuple:
        """The tensors of the cached property ``name`` (a tensor, or a sequence of them) on ``device``
        (``device_copies``)."""
        def build():
            value = getattr(self, name)
            return (value,) if torch.is_tensor(value) else tuple(value)
        return device_copies.on_device(self, name, device, build)

    def _at(self, stacked: torch.Tensor, dim: int, slots: str) -> tuple:
        """The index into ``stacked.movedim(0, dim)`` (rank next to row) of the (rank, row) slots
        named ``slots``."""
        return (slice(None),) * dim + self._to(slots, stacked.device)

    def pad(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        missing = self.shard_len - x.shape[dim]
        if missing == 0:
            return x
        return torch.cat([x, x.new_zeros((*x.shape[:dim], missing, *x.shape[dim + 1:]))], dim)

    def take(self, x: torch.Tensor, rank: int, dim: int) -> torch.Tensor:
        return x.index_select(dim, self._to("_indices", x.device)[rank])

    def split(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's shard padded with zeros to ``shard_len``, stacked in rank order, written in one pass."""
        shards = x.new_empty((self.cp, *x.shape[:dim], self.shard_len, *x.shape[dim + 1:]))
        by_rank = shards.movedim(0, dim)
        by_rank[self._at(shards, dim, "_slots")] = x
        # a device zero: a Python 0 is copied from pageable host memory, which waits for the GPU
        by_rank[self._at(shards, dim, "_padding_slots")] = x.new_zeros(())
        return shards

    def join(self, shards: torch.Tensor, dim: int) -> torch.Tensor:
        """The whole buffer from the stacked padded shards (``split`` undone), gathered in one pass."""
        return shards.movedim(0, dim)[self._at(shards, dim, "_slots")]

    @functools.cached_property
    def _stacked_rows(self) -> torch.Tensor:
        """For each row of the whole buffer, its row in the stacked padded shards flattened."""
        ranks, rows = self._slots
        return ranks * self.shard_len + rows

    def gather_rows(self, shards: torch.Tensor, out=None) -> torch.Tensor:
        """``join`` on dim 1 of token-major shards (cp, shard_len, ...): whole rows, one index_select,
        where ``join`` of a head-major tensor gathers element by element; into ``out`` (total, ...)
        where given."""
        rows = self._to("_stacked_rows", shards.device)[0]
        return index_rows(shards.flatten(0, 1), rows, out)

    @functools.cached_property
    def _shard_sources(self) -> torch.Tensor:
        """For each row of the stacked padded shards flattened, the whole buffer's row it holds;
        row 0 for a padding row."""
        sources = torch.zeros(self.cp * self.shard_len, dtype=torch.long)
        sources[self._stacked_rows] = torch.arange(self.total)
        return sources

    def scatter_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``gather_rows`` undone: (total, ...) -> (cp, shard_len, ...), also by one row gather (an
        index_copy_ into the shards ran at a third of its speed on H200s). A padding row holds a
        copy of row 0: no chunk covers it, so nothing reads it."""
        rows = self._to("_shard_sources", x.device)[0]
        return index_rows(x, rows).unflatten(0, (self.cp, self.shard_len))


@dataclass(frozen=True)
class DocumentSharding(ChunkSharding):
    cu_seqlens: tuple  # the whole batch's cumulative document lengths, starting at 0
    cp: int
    layout: str

    @property
    def total(self) -> int:
        return self.cu_seqlens[-1]

    @functools.cached_property
    def held(self) -> tuple:
        """zigzag: every document cut into 2·cp chunks, rank r taking chunks r and 2cp-1-r of each;
        contiguous: the batch cut into cp pieces, rank r taking piece r (the parts of documents in it)."""
        if self.layout == "contiguous":
            return self._pieces_of_batch()
        pieces = self.cp * chunks_per_rank(self.layout)
        ranks = [([], []) for _ in range(self.cp)]
        rows = [0] * self.cp
        for document, (start, end) in enumerate(itertools.pairwise(self.cu_seqlens)):
            bounds = chunk_bounds(end - start, pieces)
            for rank, (chunks, ranges) in enumerate(ranks):
                for piece in chunk_ids(rank, self.cp, self.layout):
                    lo, hi = bounds[piece], bounds[piece + 1]
                    if hi > lo:
                        chunks.append(Chunk(rows[rank], lo, hi - lo, document))
                        ranges.append((start + lo, start + hi))
                        rows[rank] += hi - lo
        return tuple((tuple(chunks), tuple(ranges)) for chunks, ranges in ranks)

    def _pieces_of_batch(self) -> tuple:
        bounds = chunk_bounds(self.total, self.cp)
        held = []
        for lo, hi in itertools.pairwise(bounds):
            chunks, ranges, row = [], [], 0
            for document, (start, end) in enumerate(itertools.pairwise(self.cu_seqlens)):
                a, b = max(start, lo), min(end, hi)
                if b > a:
                    chunks.append(Chunk(row, a - start, b - a, document))
                    ranges.append((a, b))
                    row += b - a
            held.append((tuple(chunks), tuple(ranges)))
        return tuple(held)

    @functools.cached_property
    def _cu_seqlens(self) -> torch.Tensor:
        return torch.tensor(self.cu_seqlens, dtype=torch.int32)

    def cu_seqlens_on(self, device) -> torch.Tensor:
        """``cu_seqlens`` as an int32 tensor on ``device``, copied there once."""
        return self._to("_cu_seqlens", device)[0]

    @functools.cached_property
    def max_seqlen(self) -> int:
        return max(b - a for a, b in itertools.pairwise(self.cu_seqlens))

    def whole_chunks(self) -> tuple[Chunk, ...]:
        """The whole batch (``join``'s result), one chunk per document."""
        return tuple(Chunk(start, 0, end - start, document)
                     for document, (start, end) in enumerate(itertools.pairwise(self.cu_seqlens)) if end > start)

    def local_cu_seqlens(self, rank: int) -> list[int]:
        """Cumulative lengths of the documents' parts on rank (a document's two chunks are one part)."""
        lengths = [0] * (len(self.cu_seqlens) - 1)
        for chunk in self.held[rank][0]:
            lengths[chunk.document] += chunk.length
        return [0, *itertools.accumulate(lengths)]


@dataclass(frozen=True)
class GivenSharding(ChunkSharding):
    """A sharding given rank by rank (``held``), over a whole buffer of ``total`` rows."""
    held: tuple
    total: int

    @property
    def cp(self) -> int:
        return len(self.held)


def _join(sharding: ChunkSharding, ranks) -> tuple:
    """The shards of ``ranks`` joined into one buffer, their chunks in (document, position) order:
    (the buffer's (chunks, rows of the whole buffer), a ``GivenSharding`` of the buffer over ``ranks``).
    Chunks that continue one another become one chunk of the buffer."""
    held = sorted(((rank, i, chunk, rows) for rank in ranks
                   for i, (chunk, rows) in enumerate(zip(*sharding.held[rank]))),
                  key=lambda item: (item[2].document, item[2].position))
    chunks, wholes, joined_rows, row = [], [], {}, 0
    for rank, i, chunk, (start, end) in held:
        joined_rows[rank, i] = (row, row + chunk.length)
        last = chunks[-1] if chunks else None
        if last and last.document == chunk.document and last.position + last.length == chunk.position:
            chunks[-1] = dataclasses.replace(last, length=last.length + chunk.length)
            wholes[-1] = (wholes[-1][0], end)
        else:
            chunks.append(Chunk(row, chunk.position, chunk.length, chunk.document))
            wholes.append((start, end))
        row += chunk.length
    members = tuple((sharding.held[rank][0], tuple(joined_rows[rank, i] for i in range(len(sharding.held[rank][0]))))
                    for rank in ranks)
    return (tuple(chunks), tuple(wholes)), GivenSharding(members, row)


@functools.lru_cache(maxsize=64)
def hybrid_shardings(sharding: ChunkSharding, inner_size: int, outer_rank: int) -> tuple[GivenSharding,
                                                                                        GivenSharding]:
    """The hybrid's shardings of packed documents on a mesh (outer, inner): (how the inner group of
    ``outer_rank``, context-parallel ranks ``outer_rank * inner_size ...``, holds the buffer its
    Ulysses exchange joins, how the outer ring holds those joined buffers)."""
    joined = [_join(sharding, range(outer * inner_size, (outer + 1) * inner_size))
              for outer in range(sharding.cp // inner_size)]
    return joined[outer_rank][1], GivenSharding(tuple(buffer for buffer, _ in joined), sharding.total)


@functools.lru_cache(maxsize=64)
def document_sharding(cu_seqlens: tuple, cp: int, layout: str) -> DocumentSharding:
    return DocumentSharding(cu_seqlens, cp, layout)


_host_values = WeakIdKeyDictionary()


def host_values(cu_seqlens: torch.Tensor) -> list[int]:
    """``cu_seqlens.tolist()``, read once per tensor and version. On a GPU each read waits for the
    device, and every layer of a step, forward and backward, passes the same tensor."""
    if cu_seqlens.is_inference():  # no version counter to tell a change by
        return cu_seqlens.tolist()
    version, values = _host_values.get(cu_seqlens, (None, None))
    if version != cu_seqlens._version:
        version, values = cu_seqlens._version, cu_seqlens.tolist()
        _host_values[cu_seqlens] = (version, values)
    return values


def check_cu_seqlens(name: str, cu_seqlens: torch.Tensor) -> None:
    """What can be checked without reading the values (no device sync)."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 \
            or cu_seqlens.numel() < 2:
        got = f"{cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}" if isinstance(cu_seqlens, torch.Tensor) \
            else type(cu_seqlens).__name__
        raise ValueError(f"{name} must be a 1-D int32 tensor of (documents + 1) cumulative lengths starting at 0; "
                         f"got {got}")


def cu_seqlens_error(name: str, values: list, total: int, total_name: str, max_seqlen=None, max_name=""):
    """Why the cumulative lengths ``values`` cannot describe ``total`` packed tokens (named
    ``total_name``) with no document longer than ``max_seqlen`` (named ``max_name``), or None."""
    if values[0] != 0:
        return f"{name} must start at 0; got {values[0]}"
    decrease = next((i for i in range(1, len(values)) if values[i] < values[i - 1]), None)
    if decrease is not None:
        return (f"{name} must be non-decreasing (cumulative document lengths); got {values[decrease - 1]} then "
                f"{values[decrease]} at index {decrease}")
    if values[-1] != total:
        return f"{name} must end at the token count {total_name} = {total}; got {values[-1]}"
    longest = max(b - a for a, b in itertools.pairwise(values))
    if max_seqlen is not None and max_seqlen < longest:
        return f"{max_name} must be at least the longest document in {name}, {longest} tokens; got {max_seqlen}"
    return None


def _sharding(cu_seqlens, groups, layout, total=None) -> DocumentSharding:
    """``total``: the token count of x (x.shape[0]), where the whole batch is at hand."""
    check_layout(layout)
    check_cu_seqlens("cu_seqlens", cu_seqlens)
    values = host_values(cu_seqlens)
    error = cu_seqlens_error("cu_seqlens", values, values[-1] if total is None else total, "x.shape[0]")
    if error:
        raise ValueError(error)
    return document_sharding(tuple(values), cp_size(groups), layout)


def shard_varlen(x: torch.Tensor, cu_seqlens: torch.Tensor, group, layout: str = "zigzag"):
    """(x_local, cu_seqlens_local): this rank's tokens of the packed batch ``x`` (total, ...) and the
    cumulative lengths of its part of each document (no communication; differentiable).

    ``layout="zigzag"``: a document's two chunks are adjacent in x_local; ``"contiguous"``: x_local
    is the rank's piece of the batch as it lies. cu_seqlens_local is int32, on x's device."""
    groups = process_groups(group)
    sharding = _sharding(cu_seqlens, groups, layout, total=x.shape[0])
    rank = cp_rank(groups)
    local_cu = torch.tensor(sharding.local_cu_seqlens(rank), dtype=torch.int32, device=x.device)
    return sharding.take(x, rank, 0), local_cu


def unshard_varlen(x_local: torch.Tensor, cu_seqlens: torch.Tensor, group, layout: str = "zigzag") -> torch.Tensor:
    """The whole packed batch (total, ...), on every rank, from each rank's ``shard_varlen`` tokens.

    It all-gathers and is not differentiable: pass a tensor that does not require grad."""
    if x_local.requires_grad and torch.is_grad_enabled():
        raise ValueError("x_local requires grad, but unshard_varlen is not differentiable; "
                         "pass x_local.detach() or call it under torch.no_grad()")
    groups = process_groups(group)
    sharding = _sharding(cu_seqlens, groups, layout)
    expected = sharding.local_len(cp_rank(groups))
    if x_local.shape[0] != expected:
        raise ValueError(f"x_local.shape[0] must be this rank's token count from cu_seqlens (shard_varlen's output), "
                         f"{expected}; got {x_local.shape[0]}")
    return sharding.join(all_gather_stacked(sharding.pad(x_local, 0), groups), 0)
