"""Packed documents sharded for context parallelism: DocumentSharding, shard_varlen / unshard_varlen,
and the tiles planned over document chunks."""
import itertools
import re

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from attn_compile import shard_varlen, unshard_varlen
from attn_compile.cp.documents import DocumentSharding, chunk_bounds, host_values, hybrid_shardings
from attn_compile.cp.ring import ring_steps
from attn_compile.cp.tiles import plan_tiles
from attn_compile.cp.ulysses import head_rows_bound
from attn_compile.kernels.visibility import effective_window, visible
from dist_harness import run_distributed
from tile_coverage import covered

LAYOUTS = ("zigzag", "contiguous")


def _cu(lengths) -> tuple:
    return (0, *itertools.accumulate(lengths))


def _random_lengths(cp, seed):
    """Shuffled document lengths: 0, 1, shorter than 2·cp (some chunks empty) and longer."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [0, 1, 0, *torch.randint(1, 2 * cp, (2,), generator=generator).tolist(),
               *torch.randint(2 * cp, 6 * cp + 3, (3,), generator=generator).tolist()]
    return [lengths[i] for i in torch.randperm(len(lengths), generator=generator)]


def _documents_and_positions(cu):
    """For every token of the batch, its document and its position in that document."""
    lengths = torch.tensor(cu).diff()
    document = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    return document, torch.arange(cu[-1]) - torch.tensor(cu)[document]


def _held(sharding):
    """Per rank, the batch tokens it holds, in shard order."""
    return [sharding.take(torch.arange(sharding.cu_seqlens[-1]), rank, 0) for rank in range(sharding.cp)]


def _check_chunks(chunks, tokens, cu):
    """The chunks tile rows 0..len(tokens) in order and name each row's document and position."""
    document, position = _documents_and_positions(cu)
    assert [c.row for c in chunks] == list(itertools.accumulate([0, *(c.length for c in chunks)]))[:-1]
    assert sum(c.length for c in chunks) == len(tokens)
    for c in chunks:
        rows = tokens[c.row:c.row + c.length]
        assert torch.equal(document[rows], torch.full((c.length,), c.document))
        assert torch.equal(position[rows], torch.arange(c.position, c.position + c.length))


def test_chunk_bounds_cut_as_tensor_split():
    for length, pieces in itertools.product(range(10), range(1, 9)):
        sizes = [len(piece) for piece in torch.arange(length).tensor_split(pieces)]
        bounds = chunk_bounds(length, pieces)
        assert bounds[0] == 0 and [b - a for a, b in itertools.pairwise(bounds)] == sizes


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_document_sharding(cp, layout):
    for seed in range(3):
        cu = _cu(_random_lengths(cp, seed))
        sharding = DocumentSharding(cu, cp, layout)
        document, _ = _documents_and_positions(cu)
        held = _held(sharding)
        assert torch.equal(torch.cat(held).sort().values, torch.arange(cu[-1]))  # each token on exactly one rank
        assert [sharding.local_len(rank) for rank in range(cp)] == [len(tokens) for tokens in held]
        assert sharding.shard_len == max(len(tokens) for tokens in held)
        for rank, tokens in enumerate(held):
            _check_chunks(sharding.chunks(rank), tokens, cu)
            assert (document[tokens].diff() >= 0).all(), "documents in order, a document's chunks adjacent"
            counts = torch.bincount(document[tokens], minlength=len(cu) - 1).tolist()
            assert sharding.local_cu_seqlens(rank) == list(_cu(counts))
        _check_chunks(sharding.whole_chunks(), torch.arange(cu[-1]), cu)
        for dim in (0, 1):
            x = torch.randn(2, cu[-1], 3).movedim(1, dim)
            shards = sharding.split(x, dim)
            for tokens, shard in zip(held, shards):
                assert shard.shape[dim] == sharding.shard_len
                real, padding = shard.split([len(tokens), sharding.shard_len - len(tokens)], dim)
                assert torch.equal(real, x.index_select(dim, tokens)) and not padding.any()
            assert torch.equal(sharding.join(shards, dim), x)
        for rows in (torch.randn(cu[-1], 2, 3), torch.randn(cu[-1], 2, 4).bfloat16()):  # rows of 6 and of 8 bytes
            shards = sharding.scatter_rows(rows)  # token-major, as the Ulysses exchange moves packed documents
            for tokens, shard in zip(held, shards):
                assert torch.equal(shard[:len(tokens)], rows[tokens])
            assert shards.dtype == rows.dtype and torch.equal(sharding.gather_rows(shards), rows)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_contiguous_documents_cut_the_batch_as_it_lies(cp):
    """Rank r holds the r-th of cp pieces of the batch, whatever the documents: a document may
    span ranks, and the ring under a window shorter than a shard needs the rank before only."""
    for seed in range(3):
        cu = _cu(_random_lengths(cp, seed))
        sharding = DocumentSharding(cu, cp, "contiguous")
        assert [t.tolist() for t in _held(sharding)] == [p.tolist() for p in torch.arange(cu[-1]).tensor_split(cp)]
    lengths = [700, 5000, 300, 2000, 1000, 3000, 800, 3200]  # 16,000 tokens: shards of 4000 on 4 ranks
    for window in ((3000, 0), (3999, 0)):
        assert ring_steps(DocumentSharding(_cu(lengths), 4, "contiguous"), True, window) == 2
        assert ring_steps(DocumentSharding(_cu(lengths), 4, "zigzag"), True, window) == 4


@pytest.mark.parametrize("layout", LAYOUTS)
def test_head_shards_fit_the_bound_each_rank_computes_alone(layout):
    """Ulysses and the hybrid keep packed documents' head shards in buffers of head_rows_bound
    rows, which a rank computes from its own token count: every group's whole batch fits, on every
    rank, however uneven the documents."""
    for cp, inner, seed in itertools.product((2, 3, 4, 8), (1, 2, 4), range(6)):
        if cp % inner:
            continue
        lengths = _random_lengths(cp, seed) + [1] * seed
        sharding = DocumentSharding(_cu(lengths), cp, layout)
        for outer_rank in range(cp // inner):
            joined, _ = hybrid_shardings(sharding, inner, outer_rank) if inner < cp else (sharding, None)
            for rank in range(inner):
                bound = head_rows_bound(joined.local_len(rank), len(lengths), inner, layout)
                assert joined.total <= bound, (cp, inner, seed, rank)


def test_host_values_read_once_per_version(monkeypatch):
    """Every layer and both passes read the same cu_seqlens: read once (a device sync on a GPU),
    read again after an in-place change, and never cached for inference tensors."""
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(1) or tolist(self))
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    assert host_values(cu) == [0, 3, 7] and host_values(cu) == [0, 3, 7] and len(reads) == 1
    cu[1:].add_(1)
    assert host_values(cu) == [0, 4, 8] and len(reads) == 2
    assert host_values(torch.tensor([0, 3, 7], dtype=torch.int32)) == [0, 3, 7] and len(reads) == 3
    with torch.inference_mode():
        frozen = torch.tensor([0, 5], dtype=torch.int32)
    assert host_values(frozen) == [0, 5] and host_values(frozen) == [0, 5] and len(reads) == 5


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_zigzag_rank_holds_chunks_r_and_mirror(cp):
    """Documents of a multiple of 2·cp tokens, between others, are cut into equal chunks r and 2cp-1-r."""
    lengths = [2 * cp * 3, 5, 2 * cp, 0, 1, 2 * cp * 2]
    cu = _cu(lengths)
    document, position = _documents_and_positions(cu)
    for rank, tokens in enumerate(_held(DocumentSharding(cu, cp, "zigzag"))):
        for d in (0, 2, 5):
            size = lengths[d] // (2 * cp)
            want = torch.cat([torch.arange(chunk * size, (chunk + 1) * size) for chunk in (rank, 2 * cp - 1 - rank)])
            assert torch.equal(position[tokens][document[tokens] == d], want)


def _packs(world):
    """Token counts of packed batches: tiny documents (some ranks hold no token) and random ones."""
    return [[1, 0, 1, 2], [0, 3, 1], *(_random_lengths(world, seed) for seed in range(3))]


def _check_shard_and_unshard(rank, world):
    groups = [dist.group.WORLD] + ([init_device_mesh("cpu", (2, 2))] if world == 4 else [])
    generator = torch.Generator().manual_seed(0)  # the same batches on every rank
    for group, layout, lengths in itertools.product(groups, LAYOUTS, _packs(world)):
        cu = torch.tensor(_cu(lengths), dtype=torch.int32)
        sharding = DocumentSharding(_cu(lengths), world, layout)
        x = torch.randn(cu[-1], 2, 3, generator=generator, requires_grad=True)
        local, local_cu = shard_varlen(x, cu, group, layout)
        tokens = _held(sharding)[rank]
        assert torch.equal(local, x[tokens])
        assert local_cu.dtype == torch.int32 and local_cu.tolist() == sharding.local_cu_seqlens(rank)
        assert torch.equal(unshard_varlen(local.detach(), cu, group, layout), x)
        weight = torch.randn(local.shape)
        (local * weight).sum().backward()
        assert torch.equal(x.grad, torch.zeros_like(x).index_copy(0, tokens, weight))

        with pytest.raises(ValueError, match="^" + re.escape(
                "x_local requires grad, but unshard_varlen is not differentiable; pass x_local.detach() or call "
                "it under torch.no_grad()") + "$"):
            unshard_varlen(local, cu, group, layout)
        with pytest.raises(ValueError, match="^" + re.escape(
                "x_local.shape[0] must be this rank's token count from cu_seqlens (shard_varlen's output), "
                f"{len(tokens)}; got {len(tokens) + 1}") + "$"):
            unshard_varlen(torch.cat([local.detach(), local.new_zeros(1, 2, 3)]), cu, group, layout)


@pytest.mark.parametrize("world", [2, 4])
def test_shard_and_unshard_varlen(world):
    run_distributed(_check_shard_and_unshard, world)


@pytest.mark.parametrize("ends_aligned", [False, True])
@pytest.mark.parametrize("window", [(-1, -1), (3, 0), (2, 2)])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("cp", [2, 3, 4])
def test_tiles_compute_every_visible_pair_of_a_document_once(cp, is_causal, layout, window, ends_aligned):
    """Planned for kernels that take squares only, or also packed segments that end together."""
    cu = _cu(_random_lengths(cp, seed=cp))
    sharding = DocumentSharding(cu, cp, layout)
    document, position = _documents_and_positions(cu)
    want = ((document[:, None] == document[None, :])
            & visible(position, position, *effective_window(is_causal, window))).long()
    held, total = _held(sharding), cu[-1]
    for q_rank, q_tokens in enumerate(held):
        q_chunks = sharding.chunks(q_rank)
        ring = sum(covered(plan_tiles(q_chunks, sharding.chunks(k_rank), is_causal, window, ends_aligned), q_tokens,
                           k_tokens, total) for k_rank, k_tokens in enumerate(held))
        whole = covered(plan_tiles(q_chunks, sharding.whole_chunks(), is_causal, window, ends_aligned), q_tokens,
                        torch.arange(total), total)
        assert torch.equal(ring[q_tokens], want[q_tokens])
        assert torch.equal(whole[q_tokens], want[q_tokens])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("outer, inner", [(2, 2), (2, 3), (3, 2)])
def test_hybrid_joins_inner_shards_for_a_ring_across_the_outer_dim(outer, inner, layout):
    """The buffer an inner group's exchange joins holds its ranks' tokens, described chunk by chunk
    (each document's chunks that continue one another as one), and the ring over those buffers
    computes every visible pair of a document once."""
    window, is_causal = (3, 0), True
    for lengths in ([1, 0, 1, 2], _random_lengths(outer * inner, seed=outer)):
        cu = _cu(lengths)
        sharding = DocumentSharding(cu, outer * inner, layout)
        document, position = _documents_and_positions(cu)
        held, total = _held(sharding), cu[-1]
        joined = []
        for o in range(outer):
            inner_sharding, ring = hybrid_shardings(sharding, inner, o)
            members = held[o * inner:(o + 1) * inner]
            assert [inner_sharding.local_len(i) for i in range(inner)] == [len(tokens) for tokens in members]
            joined.append(inner_sharding.join(torch.stack([inner_sharding.pad(t, 0) for t in members]), 0))
            assert torch.equal(joined[-1], ring.take(torch.arange(total), o, 0))
            assert torch.equal(inner_sharding.split(joined[-1], 0)[0][:len(members[0])], members[0])
            _check_chunks(ring.chunks(o), joined[-1], cu)
            runs = torch.bincount(torch.tensor([c.document for c in ring.chunks(o)], dtype=torch.long),
                                  minlength=len(lengths))
            assert runs.max() <= {"zigzag": 2, "contiguous": 1}[layout], "continuing chunks are one"
        want = ((document[:, None] == document[None, :])
                & visible(position, position, *effective_window(is_causal, window))).long()
        for o, q_tokens in enumerate(joined):
            ring = hybrid_shardings(sharding, inner, o)[1]
            count = sum(covered(plan_tiles(ring.chunks(o), ring.chunks(k), is_causal, window), q_tokens, k_tokens,
                                total) for k, k_tokens in enumerate(joined))
            assert torch.equal(count[q_tokens], want[q_tokens])
