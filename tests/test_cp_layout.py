"""The pieces under the strategies: sequence layouts, tile plans and the LSE merge."""
import itertools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from attn_compile.cp.layout import (chunk_starts, chunks_per_rank, join_shards, shard_sequence, split_sequence,
                                    unshard_sequence)
from attn_compile.cp.merge import empty_result, merge_
from attn_compile.cp.tiles import plan_tiles
from attn_compile.kernels import attention_forward
from dist_harness import run_distributed
from oracle import naive_attention, rel_err

LAYOUTS = ("zigzag", "contiguous")


def _covered(tiles, q_starts, k_starts, length):
    """How many times each (query, key) pair of global positions is computed by the tiles."""
    q_pos = torch.tensor([s + i for s in q_starts for i in range(length)])
    k_pos = torch.tensor([s + i for s in k_starts for i in range(length)])
    count = torch.zeros(int(q_pos.max()) + 1, int(k_pos.max()) + 1, dtype=torch.long)
    for tile in tiles:
        qp, kp = q_pos[tile.q_rows], k_pos[tile.k_rows]
        seen = torch.ones(len(qp), len(kp), dtype=torch.bool)
        if tile.masking:
            assert tile.masking["q_offset"] == int(qp[0]) and tile.masking["k_offset"] == int(kp[0])
            seen = kp[None, :] <= qp[:, None]
        count[qp[:, None], kp[None, :]] += seen.long()
    return count


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_tiles_compute_every_visible_pair_once(cp, is_causal, layout):
    shard_len = 2 * 3
    length = shard_len // chunks_per_rank(layout)
    seq = cp * shard_len
    visible = torch.ones(seq, seq, dtype=torch.long)
    if is_causal:
        visible = visible.tril()
    for q_rank in range(cp):
        q_starts = chunk_starts(q_rank, cp, layout, shard_len)
        count = torch.zeros(seq, seq, dtype=torch.long)
        for kv_rank in range(cp):
            k_starts = chunk_starts(kv_rank, cp, layout, shard_len)
            tiles = plan_tiles(q_starts, k_starts, length, is_causal)
            part = _covered(tiles, q_starts, k_starts, length)
            count[: part.shape[0], : part.shape[1]] += part
        rows = [s + i for s in q_starts for i in range(length)]
        assert torch.equal(count[rows], visible[rows])


@pytest.mark.parametrize("cp", [2, 4])
def test_zigzag_causal_steps_are_balanced(cp):
    """The diagonal step is three chunk-sized calls, every other step one call of half a square."""
    shard_len, length = 8, 4
    for q_rank, kv_rank in itertools.product(range(cp), repeat=2):
        tiles = plan_tiles(chunk_starts(q_rank, cp, "zigzag", shard_len),
                           chunk_starts(kv_rank, cp, "zigzag", shard_len), length, True)
        areas = [(t.q_rows.stop - t.q_rows.start) * (t.k_rows.stop - t.k_rows.start) for t in tiles]
        assert areas == ([length * length] * 3 if q_rank == kv_rank else [shard_len * shard_len // 2])


def test_merge_of_disjoint_key_sets_is_their_joint_attention():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 12, 8), torch.randn(2, 3, 12, 4)
    out, lse = empty_result(q, v)
    for keys in (slice(0, 7), slice(7, 12)):
        merge_(out, lse, *attention_forward(q, k[:, :, keys], v[:, :, keys], scale=8 ** -0.5))
    assert rel_err(out, naive_attention(q, k, v)) <= 1e-6
    assert torch.allclose(lse, (q @ k.transpose(-1, -2) * 8 ** -0.5).logsumexp(-1))


def test_merge_with_rows_that_saw_no_key():
    inf = float("-inf")
    out, lse = torch.tensor([[0.0, 0.0], [1.0, 2.0], [0.0, 0.0]]), torch.tensor([inf, 0.5, inf])
    merge_(out, lse, torch.tensor([[3.0, 4.0], [0.0, 0.0], [0.0, 0.0]]), torch.tensor([0.25, inf, inf]))
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
