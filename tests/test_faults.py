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
STAYS_S = 4.0  # how long a rank that failed inside an op lives on


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


def _kernel_fails_on_rank_1(rank, world, strategy, device="cpu"):
    """After a first call on every rank (which compiles the kernels on a GPU), rank 1's local
    kernel raises at its second call of the op's forward, a step into the ring (for all-gather,
    its first and only call: the others then wait in the backward's reduce-scatter). Each rank
    runs forward and backward, twice: on GPUs the host does not wait for NCCL, and the others
    wait for rank 1 at the second call's agreement. Every other rank raises within STAYS_S / 2."""
    from attn_compile.cp import allgather, ring

    q, k, v = (x.to(device).requires_grad_() for x in _qkv(s=4))

    def attention():
        out = context_parallel_attention(q, k, v, group=dist.group.WORLD, strategy=strategy, is_causal=True)
        out.sum().backward()

    attention()
    module = ring if strategy == "ring" else allgather
    calls = []
    attend = module.attend_tiles

    def failing(*args):
        calls.append(args)
        if rank == 1 and len(calls) == (2 if strategy == "ring" else 1):
            raise RuntimeError("injected kernel failure on rank 1")
        return attend(*args)

    module.attend_tiles = failing
    dist.barrier()
    start = time.monotonic()
    try:
        for _ in range(2):
            attention()
    except RuntimeError:
        if rank == 1:  # alive, its connections open, as a rank that handles its error or is slow to exit
            time.sleep(STAYS_S)
        elif time.monotonic() - start > STAYS_S / 2:
            raise AssertionError(f"rank {rank} raised after {time.monotonic() - start:.1f} s")
        raise


def _assert_every_rank_raised(reports, strategy):
    original = "RuntimeError: injected kernel failure on rank 1"
    assert reports[1]["error"] == original, reports
    op = f"attn_cp::{strategy}_attention"
    for rank, report in enumerate(reports):
        if rank != 1:
            assert report["error"] == (f"PeerFailed: context-parallel attention failed on rank 1 in {op}: {original}; "
                                       f"this rank's collectives with it cannot complete"), (rank, reports)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy, world", [("ring", 2), ("ring", 4), ("allgather", 2)])
def test_an_error_inside_an_op_on_one_rank_raises_on_every_rank_within_seconds(strategy, world):
    """Rank 1 lives on for STAYS_S after its error and the group's timeout is 60 s: every other
    rank raises within moments, naming rank 1 and its error."""
    _assert_every_rank_raised(run_ranks(_kernel_fails_on_rank_1, world, strategy, timeout=60.0), strategy)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.timeout(300)
def test_gpu_an_error_inside_an_op_on_one_gpu_raises_on_every_rank_within_seconds():
    """The same on NCCL groups, one rank per GPU: the others raise at their next call's agreement."""
    reports = run_ranks(_kernel_fails_on_rank_1, torch.cuda.device_count(), "ring", "cuda", timeout=60.0,
                        backend="nccl")
    _assert_every_rank_raised(reports, "ring")


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
