"""The pieces under the strategies: sequence layouts, tile plans and the LSE merge."""
import itertools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from attn_compile.cp.layout import (SequenceSharding, chunks_per_rank, join_shards, shard_sequence, split_sequence,
                                    take_shard, unshard_sequence)
from attn_compile.cp.ring import halo, ring_steps
from attn_compile.cp.merge import MergedResult
from attn_compile.cp.tiles import plan_tiles
from attn_compile.cp.words import as_words, contiguous, copy_into, index_rows
from attn_compile.kernels import attention_forward
from attn_compile.kernels.dispatch import merge_into
from attn_compile.kernels.visibility import effective_window, visible
from dist_harness import run_distributed
from oracle import rel_err
from tile_coverage import covered

LAYOUTS = ("zigzag", "contiguous")


def _positions(chunks):
    return torch.tensor([c.position + i for c in chunks for i in range(c.length)])


@pytest.mark.parametrize("window", [(-1, -1), (3, 0), (2, 5)])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_tiles_compute_every_visible_pair_once(cp, is_causal, layout, window):
    sharding = SequenceSharding(cp, layout, 2 * 3)
    seq = cp * sharding.shard_len
    want = visible(torch.arange(seq), torch.arange(seq), *effective_window(is_causal, window)).long()
    for q_rank in range(cp):
        q_chunks = sharding.chunks(q_rank)
        rows = _positions(q_chunks)
        count = sum(covered(plan_tiles(q_chunks, sharding.chunks(kv_rank), is_causal, window), rows,
                            _positions(sharding.chunks(kv_rank)), seq) for kv_rank in range(cp))
        whole = plan_tiles(q_chunks, sharding.whole_chunks(), is_causal, window)
        assert torch.equal(count[rows], want[rows])
        assert torch.equal(covered(whole, rows, _positions(sharding.whole_chunks()), seq)[rows], want[rows])


@pytest.mark.parametrize("cp", [2, 4])
def test_zigzag_causal_steps_are_balanced(cp):
    """The diagonal step is one causal call over the shard, every other step one full call of half
    of it: the same work."""
    sharding = SequenceSharding(cp, "zigzag", 8)
    for q_rank, kv_rank in itertools.product(range(cp), repeat=2):
        tiles = plan_tiles(sharding.chunks(q_rank), sharding.chunks(kv_rank), True)
        areas = [(t.q_rows.stop - t.q_rows.start) * (t.k_rows.stop - t.k_rows.start) for t in tiles]
        assert areas == [8 * 8 if q_rank == kv_rank else 8 * 8 // 2]
        assert [bool(t.masking) for t in tiles] == [q_rank == kv_rank]


@pytest.mark.parametrize("window", [(-1, -1), (6, 0)])
@pytest.mark.parametrize("cp", [2, 4])
def test_allgather_attends_each_query_chunk_in_one_call(cp, window):
    """Under the all-gather a causal zigzag shard's query chunk sees one run of the whole sequence,
    its prefix (or its window's band), and attends it in one masked call: no merge."""
    sharding = SequenceSharding(cp, "zigzag", 8)
    left = window[0] if window[0] >= 0 else 10 ** 9
    for rank in range(cp):
        tiles = plan_tiles(sharding.chunks(rank), sharding.whole_chunks(), True, window)
        want = [(slice(chunk.row, chunk.row + 4), slice(max(0, chunk.position - left), chunk.position + 4))
                for chunk in sharding.chunks(rank)]
        assert [(tile.q_rows, tile.k_rows) for tile in tiles] == want
        assert all(tile.masking["is_causal"] for tile in tiles)


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_stops_after_the_last_step_a_window_needs(cp):
    """Contiguous shards of 8 with a causal window of 8 need the keys of one rank back, so two
    steps; zigzag shards have a neighbour chunk on the rank one step ahead, so all steps."""
    assert ring_steps(SequenceSharding(cp, "contiguous", 8), True, (8, 0)) == 2
    assert ring_steps(SequenceSharding(cp, "contiguous", 8), True, (7, 0)) == 2
    assert ring_steps(SequenceSharding(cp, "contiguous", 8), True, (0, 0)) == 1
    assert ring_steps(SequenceSharding(cp, "zigzag", 8), True, (4, 0)) == cp
    assert ring_steps(SequenceSharding(cp, "contiguous", 8), False, (-1, -1)) == cp


@pytest.mark.parametrize("layout, window", [("contiguous", (3, 0)), ("contiguous", (8, 0)), ("zigzag", (-1, -1))])
def test_two_step_ring_sends_only_the_rows_the_next_rank_sees(layout, window):
    """A ring of two steps sends the rows of the rank before that a rank's queries see, and its
    calls on them cover those pairs: a window's halo on contiguous shards (none for rank 0), and
    under a causal zigzag on 2 ranks rank 0's first chunk to rank 1, rank 1's whole shard to rank 0."""
    cp = 2 if layout == "zigzag" else 4
    sharding = SequenceSharding(cp, layout, 8)
    assert ring_steps(sharding, True, window) == 2
    seq = cp * 8
    want = visible(torch.arange(seq), torch.arange(seq), *effective_window(True, window)).long()
    for rank in range(cp):
        sender = (rank - 1) % cp
        rows, calls = halo(sharding, True, window, rank, sender)
        if layout == "contiguous":
            assert (rows.start, rows.stop) == ((8 - window[0], 8) if rank else (0, 0))
        else:
            assert (rows.start, rows.stop) == ((0, 4) if rank else (0, 8))
        q_positions, k_positions = _positions(sharding.chunks(rank)), _positions(sharding.chunks(sender))[rows]
        count = covered(calls, q_positions, k_positions, seq)
        assert torch.equal(count[q_positions][:, k_positions], want[q_positions][:, k_positions])
        assert count.sum() == want[q_positions][:, _positions(sharding.chunks(sender))].sum()


def _merged(q, k, v, parts, dtype=torch.float32):
    """MergedResult of q's rows against keys, part by part (parts are (query rows, key rows)),
    with float32 parts and a result in ``dtype``."""
    result = MergedResult(q.to(dtype), v.to(dtype), [rows for rows, _ in parts])
    for rows, keys in parts:
        result.add(rows, *attention_forward(q[:, :, rows], k[:, :, keys], v[:, :, keys], scale=8 ** -0.5))
    return result


def test_merge_of_disjoint_key_sets_is_their_joint_attention():
    """Parts over overlapping query rows: rows 0-1 get one part, 2-3 three, 4-5 two, 6 none."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 3, 7, 8), torch.randn(2, 3, 12, 8), torch.randn(2, 3, 12, 4)
    parts = [(slice(0, 6), slice(0, 5)), (slice(2, 6), slice(5, 9)), (slice(2, 4), slice(9, 12))]
    result = _merged(q, k, v, parts)
    seen = torch.zeros(7, 12, dtype=torch.bool)
    for rows, keys in parts:
        seen[rows, keys] = True
    scores = (q.double() @ k.double().mT * 8 ** -0.5).masked_fill(~seen, float("-inf"))
    want = scores.softmax(-1).nan_to_num(0.0) @ v.double()
    assert result.out.dtype == q.dtype and result.out.is_contiguous()
    assert rel_err(result.out[:, :, :6], want[:, :, :6]) <= 1e-6
    assert result.out[:, :, 6].eq(0).all()
    assert torch.allclose(result.lse, scores.logsumexp(-1).float())


def test_rows_of_two_parts_merge_from_the_first_part_uncopied():
    """A row of two parts merges its first part where it lies: no float32 running copy is made
    (the first part of a ring step comes in q's dtype), and the result is the joint attention."""
    torch.manual_seed(2)
    q, k, v = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8)
    parts = [(slice(0, 6), slice(0, 6)), (slice(3, 6), slice(6, 12))]  # a ring step of 2 on zigzag
    result = _merged(q, k, v, parts)
    assert result._running is None
    joint = attention_forward(q[:, :, 3:], k, v, scale=8 ** -0.5)
    assert rel_err(result.out[:, :, 3:], joint[0]) <= 1e-6 and torch.allclose(result.lse[:, :, 3:], joint[1])
    assert torch.equal(result.out[:, :, :3], attention_forward(q[:, :, :3], k[:, :, :6], v[:, :, :6],
                                                               scale=8 ** -0.5)[0])


def test_merge_rounds_once_to_the_output_dtype():
    """bfloat16 queries: the parts merge in float32 and the last merge rounds, so the output is
    the float32 merge rounded once."""
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8)
    parts = [(slice(0, 6), slice(0, 4)), (slice(0, 6), slice(4, 8)), (slice(3, 6), slice(8, 12))]
    exact, rounded = _merged(q, k, v, parts), _merged(q, k, v, parts, torch.bfloat16)
    assert rounded.out.dtype == torch.bfloat16 and rounded.lse.dtype == torch.float32
    assert torch.equal(rounded.out, exact.out.bfloat16())
    assert torch.equal(rounded.lse, exact.lse)


def test_merge_with_rows_that_saw_no_key():
    inf = float("-inf")
    out, lse = torch.tensor([[0.0, 0.0], [1.0, 2.0], [0.0, 0.0]]), torch.tensor([inf, 0.5, inf])
    merge_into(out, lse, torch.tensor([[3.0, 4.0], [0.0, 0.0], [0.0, 0.0]]), torch.tensor([0.25, inf, inf]))
    assert torch.equal(out, torch.tensor([[3.0, 4.0], [1.0, 2.0], [0.0, 0.0]]))
    assert torch.equal(lse, torch.tensor([0.25, 0.5, inf]))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_split_and_join_are_inverse(layout):
    x = torch.randn(2, 3, 24, 5)
    shards = split_sequence(x, 3, layout, dim=2)
    assert torch.equal(join_shards(shards, layout, dim=2), x)
    first = shards[0].tensor_split(chunks_per_rank(layout), 2)
    assert torch.equal(first[0], x[:, :, :4] if layout == "zigzag" else x[:, :, :8])
    if layout == "zigzag":
        assert torch.equal(first[1], x[:, :, 20:])


@pytest.mark.parametrize("dtype, last", [(torch.bfloat16, 8), (torch.bfloat16, 6), (torch.float32, 6),
                                         (torch.float32, 3), (torch.uint8, 16)])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_split_take_and_join_copy_words_where_the_rows_allow(layout, dtype, last):
    """The copies move 8-byte words where a row's bytes are a multiple of 8, with the result of
    the element-wise copies (float64, never viewed, is the oracle)."""
    x = (torch.randn(2, 3, 24, last) * 50).to(dtype)
    assert (as_words([x], 2)[0].dtype == torch.int64) == (last * x.element_size() % 8 == 0)
    oracle = x.double()
    shards = split_sequence(x, 3, layout, 2)
    assert shards.dtype == dtype and torch.equal(shards.double(), split_sequence(oracle, 3, layout, 2))
    for rank in range(3):
        assert torch.equal(take_shard(x, rank, 3, layout, 2), shards[rank])
    assert torch.equal(join_shards(shards.unbind(0), layout, 2), x)


def test_words_only_where_every_tensor_fits():
    x = torch.randn(2, 8, 4).bfloat16()
    assert as_words([x], 2)[0] is x  # the joined dim is the last
    assert all(t.dtype == torch.bfloat16 for t in as_words([x, x[..., :3]], 1))  # one row of 6 bytes
    assert [t.dtype for t in as_words([x, x.half()], 1)] == [torch.bfloat16, torch.float16]  # two dtypes
    assert as_words([x[:, 1:]], 1)[0].dtype == torch.int64  # an offset of whole rows
    grad = x.float().requires_grad_()
    assert as_words([grad], 1)[0] is grad  # autograd records the copy
    shard = take_shard(grad, 1, 2, "zigzag", 1)
    shard.sum().backward()
    assert grad.grad.sum() == shard.numel()


def test_contiguous_copies_strided_rows_as_words():
    x = torch.randn(2, 6, 3, 8).bfloat16().transpose(1, 2)  # a (B, H, S, D) view of (B, S, H, D)
    copy = contiguous(x)
    assert copy.is_contiguous() and copy.dtype == torch.bfloat16 and torch.equal(copy, x)
    assert contiguous(copy) is copy
    odd = torch.randn(4, 3).bfloat16().t()  # rows of 8 bytes are not whole here: copied as they are
    assert torch.equal(contiguous(odd), odd) and contiguous(odd).is_contiguous()


@pytest.mark.parametrize("dtype, last", [(torch.bfloat16, 8), (torch.bfloat16, 6), (torch.float32, 2),
                                         (torch.float32, 3)])
def test_row_gathers_and_copies_move_words_where_the_rows_allow(dtype, last):
    """index_rows and copy_into give the element-wise results (float64 oracle) on rows that fit
    8-byte words and rows that do not, into a given out; a copy between dtypes casts."""
    x = (torch.randn(10, 3, last) * 50).to(dtype)
    index = torch.randperm(10)[:7]
    oracle = x.double().index_select(0, index)
    assert index_rows(x, index).dtype == dtype and torch.equal(index_rows(x, index).double(), oracle)
    buffer = torch.full((9, 3, last), 7.0, dtype=dtype)
    out = buffer.narrow(0, 1, 7)
    assert index_rows(x, index, out) is out  # as index_select with out= returns it
    assert torch.equal(buffer[1:8].double(), oracle) and (buffer[[0, 8]] == 7).all()
    into = torch.full((3, 12, last), 7.0, dtype=dtype)
    copy_into(into[:, 2:12], x.transpose(0, 1))  # a strided source, as the Ulysses send of packed rows
    assert torch.equal(into[:, 2:].double(), x.double().transpose(0, 1)) and (into[:, :2] == 7).all()
    cast = torch.empty(10, 3, last, dtype=torch.float16 if dtype == torch.bfloat16 else torch.float64)
    copy_into(cast, x)
    assert torch.equal(cast.double(), x.double().to(cast.dtype).double())
    for other in (torch.float64, cast.dtype):  # as index_select: no bits of one dtype read as another
        with pytest.raises(RuntimeError, match="same scalar type"):
            index_rows(x, index, torch.empty(7, 3, last, dtype=other))


def _check_shard_roundtrip(rank, world):
    torch.manual_seed(0)
    x = torch.randn(2, 16, 3)
    for group in (dist.group.WORLD, init_device_mesh("cpu", (2, 2))):
        for layout in LAYOUTS:
            local = shard_sequence(x, group, seq_dim=1, layout=layout)
            assert torch.equal(local, split_sequence(x, world, layout, dim=1)[rank])
            assert torch.equal(unshard_sequence(local, group, seq_dim=1, layout=layout), x)


def test_shard_and_unshard_round_trip_on_4_ranks():
    run_distributed(_check_shard_roundtrip, 4)
