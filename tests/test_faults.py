"""Faults on one rank of a context-parallel group, on real gloo processes: a shape that differs
on one rank makes every rank raise at once, and a rank that dies or stalls makes the others fail
with an error within the collectives' timeout instead of hanging."""
import os
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from attn_compile import varlen_attention
from attn_compile.cp import comm
from attn_compile.cp.api import context_parallel_attention
from attn_compile.kernels import attention_forward
from dist_harness import run_distributed, run_ranks

TIMEOUT = 6.0  # the collectives' timeout in the tests where a rank is gone


def _qkv(h_q=4, h_kv=2, s=8, d=16):
    return torch.randn(1, h_q, s, d), torch.randn(1, h_kv, s, d), torch.randn(1, h_kv, s, d)


def _mismatch_on_last_rank(rank, world):
    """The last rank alone has more query heads, a shorter shard or more KV heads (all fine on their
    own), under every strategy, "auto" included (which may choose differently there): every rank
    raises within seconds, and the group still works afterwards."""
    mesh = init_device_mesh("cpu", (2, 2))
    for strategy in ("ring", "allgather", "ulysses", "hybrid", "auto"):
        group = mesh if strategy == "hybrid" else dist.group.WORLD
        for differs in ({"h_q": 8}, {"s": 4}, {"h_kv": 4}):
            dist.barrier()  # time the call alone, not how far apart the ranks arrive at it
            start = time.monotonic()
            with pytest.raises(ValueError, match=r"^q, k, v and the options must be the same on every rank of the "
                                                 r"group; got rank 0: q \(1, 4, 8, 16\)"):
                context_parallel_attention(*_qkv(**(differs if rank == world - 1 else {})), group=group,
                                           strategy=strategy, is_causal=True)
            elapsed = time.monotonic() - start
            assert elapsed < 5.0, (strategy, differs, elapsed)
        assert context_parallel_attention(*_qkv(), group=group, strategy=strategy).isfinite().all()


@pytest.mark.timeout(120)
def test_a_shape_that_differs_on_one_rank_raises_on_every_rank():
    run_distributed(_mismatch_on_last_rank, 4, timeout=30.0)


def _one_rank_fails(rank, world, strategy, how):
    """Rank 1 fails ``how`` after a first call that all ranks make; rank 0 calls again, and its
    signature is agreed by then, so it goes straight into the strategy's collectives."""
    group = dist.group.WORLD
    q, k, v = _qkv()
    context_parallel_attention(q, k, v, group=group, strategy=strategy, is_causal=True)
    if rank == 1:
        if how == "exits":
            os._exit(3)
        if how == "stalls":  # alive but never joins: only the collectives' timeout can end rank 0's wait
            time.sleep(TIMEOUT + 2.0)
        raise RuntimeError(f"rank 1 {how}")
    context_parallel_attention(q, k, v, group=group, strategy=strategy, is_causal=True)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("strategy, how", [("ring", "exits"), ("allgather", "raises"), ("ulysses", "stalls")])
def test_the_others_fail_when_one_rank_is_gone(strategy, how):
    start = time.monotonic()
    survivor, failed = run_ranks(_one_rank_fails, 2, strategy, how, timeout=TIMEOUT)
    elapsed = time.monotonic() - start
    expected = {"exitcode": 3} if how == "exits" else {"error": f"RuntimeError: rank 1 {how}"}
    assert expected.items() <= failed.items(), failed
    assert survivor.get("error") and survivor["seconds"] < TIMEOUT + 5.0, survivor
    assert elapsed < 60.0, (elapsed, survivor)


def _shape_changes_on_one_rank_later(rank, world):
    """Rank 1's sequence shrinks after a first call with agreed shapes (a short last batch)."""
    q, k, v = _qkv()
    context_parallel_attention(q, k, v, group=dist.group.WORLD, strategy="ring", is_causal=True)
    context_parallel_attention(*_qkv(s=4 if rank == 1 else 8), group=dist.group.WORLD, strategy="ring",
                               is_causal=True)


@pytest.mark.timeout(120)
def test_a_shape_that_changes_on_one_rank_later_raises_on_every_rank():
    reports = run_ranks(_shape_changes_on_one_rank_later, 2, timeout=TIMEOUT)
    expected = "ValueError: q, k, v and the options must be the same on every rank"
    assert all(report.get("error", "").startswith(expected) for report in reports), reports


def _one_rank_group(rank, world):
    """Every strategy and packed documents on a group of one rank: the local op's result, and no
    collective is posted (each would raise here)."""
    torch.manual_seed(0)
    q, k, v = _qkv()
    want, _ = attention_forward(q, k, v, scale=16 ** -0.5, is_causal=True, window=(3, 0))
    tokens = [x[0].transpose(0, 1) for x in (q, k, v)]
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    collectives = [(comm, "_all_gather"), (comm, "_reduce_scatter"), (dist, "all_to_all_single"),
                   (dist, "batch_isend_irecv")]  # every collective the runtime posts goes through these
    saved = [(owner, name, getattr(owner, name)) for owner, name in collectives]

    def refuse(*args, **kwargs):
        raise AssertionError("a group of one rank posted a collective")

    try:
        for owner, name in collectives:
            setattr(owner, name, refuse)
        for strategy in ("ring", "allgather", "ulysses", "auto"):
            got = context_parallel_attention(q, k, v, group=dist.group.WORLD, strategy=strategy, is_causal=True,
                                             window=(3, 0))
            assert torch.equal(got, want), strategy
        packed = varlen_attention(*tokens, cu, cu, 5, 5, is_causal=True, group=dist.group.WORLD, strategy="ring")
        assert torch.equal(packed, varlen_attention(*tokens, cu, cu, 5, 5, is_causal=True))
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def test_a_group_of_one_rank_runs_locally_without_collectives():
    run_distributed(_one_rank_group, 1)
