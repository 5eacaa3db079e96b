"""Context-parallel demo: every strategy, compiled with backend="attn_cp", against one process.

``main(world, device)`` shards a causal GQA + MLA sequence (8/2 heads, d_qk 24, d_v 16) over
``world`` ranks, runs forward and backward with each strategy (hybrid as 2x2 when world is 4),
and prints the largest differences from the single-process kernels. On the CPU it spawns
gloo processes; with device="cuda" it uses NCCL, joining torchrun's processes when started
under torchrun. Returns 0 when every strategy matches, 1 otherwise.
"""
import os
import tempfile
import time
from functools import partial

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from attn_compile.kernels import attention_backward, attention_forward

from .api import context_parallel_attention
from .layout import shard_sequence, unshard_sequence

H_Q, H_KV, D_QK, D_V = 8, 2, 24, 16
TOLERANCE = 1e-4  # max |difference|, float32


def _single_process(q, k, v, dout):
    scale = D_QK ** -0.5
    out, lse = attention_forward(q, k, v, scale=scale, is_causal=True)
    return (out, *attention_backward(dout, q, k, v, out, lse, scale=scale, is_causal=True))


def _run_strategy(strategy, group, q, k, v, dout):
    """(out, dq, dk, dv) gathered to the whole sequence, and the seconds of one warm fwd+bwd."""
    attention = torch.compile(partial(context_parallel_attention, group=group, strategy=strategy, is_causal=True),
                              backend="attn_cp", fullgraph=True)
    local = [shard_sequence(x, group).requires_grad_() for x in (q, k, v)]
    dout_local = shard_sequence(dout, group)
    for _ in range(2):  # the first call compiles
        if q.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = attention(*local)
        grads = torch.autograd.grad(out, local, dout_local)
        if q.is_cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    return [unshard_sequence(x.detach(), group) for x in (out, *grads)], seconds


def _demo(rank: int, world: int, device: str) -> int:
    torch.manual_seed(0)  # the same global sequence on every rank
    seq = 16 * world
    q, k, v = (torch.randn(2, h, seq, d, device=device) for h, d in ((H_Q, D_QK), (H_KV, D_QK), (H_KV, D_V)))
    dout = torch.randn(2, H_Q, seq, D_V, device=device)
    want = _single_process(q, k, v, dout)
    groups = {s: dist.group.WORLD for s in ("ring", "allgather", "ulysses")}
    if world == 4:
        groups["hybrid"] = init_device_mesh(device, (2, 2), mesh_dim_names=("ring", "ulysses"))
    lines = [f"context parallel, world {world} ({device}): causal GQA+MLA {H_Q}/{H_KV} heads, d_qk {D_QK}, "
             f"d_v {D_V}, {seq} tokens, backend='attn_cp'",
             f"{'strategy':10s} {'max|d out|':>11s} {'max|d grad|':>12s} {'fwd+bwd ms':>11s}"]
    mismatches = 0
    for strategy, group in groups.items():
        got, seconds = _run_strategy(strategy, group, q, k, v, dout)
        diffs = [(g - w).abs().max().item() for g, w in zip(got, want)]
        ok = max(diffs) <= TOLERANCE
        mismatches += not ok
        lines.append(f"{strategy:10s} {diffs[0]:11.2e} {max(diffs[1:]):12.2e} {seconds * 1e3:11.1f}"
                     f"{'' if ok else '  MISMATCH'}")
    if rank == 0:
        print("\n".join(lines + [f"tolerance {TOLERANCE:.0e}: {'all match' if not mismatches else 'MISMATCH'}"]))
    return int(mismatches > 0)


def _run_rank(rank: int, world: int, device: str, init_method: str) -> int:
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    else:  # the ranks share the cores; more threads than that only contend
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=init_method, rank=rank,
                            world_size=world)
    try:
        code = _demo(rank, world, device)
        dist.barrier()  # no rank tears its groups down while a peer may still be using them
        return code
    finally:
        dist.destroy_process_group()


def _spawned(rank, world, device, init_method, results):
    code = _run_rank(rank, world, device, init_method)
    if rank == 0:
        results.put(code)


def main(world: int = 2, device: str = "cpu") -> int:
    if world not in (2, 4, 8):
        raise ValueError(f"world must be 2, 4 or 8 (ulysses splits the {H_Q} query heads among the ranks); got {world}")
    if "RANK" in os.environ:  # started by torchrun: join its processes
        if int(os.environ["WORLD_SIZE"]) != world:
            raise ValueError(f"world={world}, but torchrun started WORLD_SIZE={os.environ['WORLD_SIZE']} processes")
        return _run_rank(int(os.environ["RANK"]), world, device, "env://")
    results = mp.get_context("spawn").SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_spawned, args=(world, device, f"file://{os.path.join(tmp, 'store')}", results), nprocs=world)
    return results.get()
