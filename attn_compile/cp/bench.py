"""Context-parallel benchmark: ``torchrun --nproc-per-node N -m attn_compile.bench cp [--seq S ...] [--check]``.

Per-GPU TFLOP/s, forward and forward+backward, of every strategy on causal GQA 32/8 d128 and
causal MLA 16 heads 192/128 in bf16, beside the single-GPU local kernels at the same per-GPU
work (a sequence of S/sqrt(N) tokens) and PyTorch's experimental ``context_parallel`` (both
rotate methods). The ``auto`` row runs ``strategy="auto"`` on the world group and names the
strategy the cost model chose for it; the ``auto ..., no grad`` row times its forward under
``torch.no_grad()``, where it chooses for the forward alone. FLOPs = 2·B·H_q·S²·(d_qk+d_v), halved
for causal; fwd+bwd counts 3.5×.

Timing is the median over calls with the L2 cache flushed before each, as
``triton.testing.do_bench`` does, but with fixed counts: do_bench sizes its repeat count from a
per-rank time estimate, and ranks that repeat a different number of times hang in the
collectives. Every rank reports the slowest rank's median. The local kernels are timed the same
way, so every row is measured alike. A shape's rows (local, each strategy, ``auto``) are warmed
first, then timed in ``--rounds`` interleaved rounds, each round starting one row later, and each
row reports its median over the rounds: rows timed one after another drift (one unchanged call's
forward fell 7% over three rounds on 4 H200s), so a fixed order favours whichever row comes first. A shape's table
prints when its rounds end; PyTorch's rows are timed once, before them, inside its
``context_parallel`` context.

``--check``: bf16 context-parallel output and gradients against the float32 reference on one GPU
(``kernels/reference.py``: plain matmuls, so the oracle shares no kernel with what it checks),
relative error (norm of error / norm of reference) at most 2.5e-2, then the packed documents'
check of bench_documents.py (only that one with ``--documents``). It runs with Triton's
autotuning off (``ATTN_COMPILE_AUTOTUNE=0``, kernels/triton_tiles.py).

``--documents``: packed documents (THD) with a sliding window instead; see bench_documents.py.

``--links``: GB/s each way per GPU of a ring pass (batched isend/irecv), an all-gather and an
all-to-all of 256 MiB per rank: the figures behind ``cost_model.Hardware``.
"""
import argparse
import itertools
import math
import os
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from attn_compile.kernels import attention_backward, attention_forward, reference

from .api import choose_strategy, context_parallel_attention
from .comm import all_gather_stacked, all_to_all_stacked, pass_round, process_groups
from .failures import wait
from .layout import shard_sequence, unshard_sequence

CONFIGS = {  # name: (h_q, h_kv, d_qk, d_v)
    "gqa 32/8 d128": (32, 8, 128, 128),
    "mla 16h 192/128": (16, 16, 192, 128),
}
CHECK_TOLERANCE = 2.5e-2
WARMUP, REPEAT = 3, 10
DEVICE = "cuda"


def _flops(h_q, seq, d_qk, d_v, backward=False):
    return 2 * h_q * seq * seq * (d_qk + d_v) / 2 * (3.5 if backward else 1.0)


def _groups(world) -> dict:
    """The group of each strategy; the hybrid runs on a (world/2, 2) mesh, so only from 4 GPUs on."""
    groups = dict.fromkeys(("ring", "allgather", "ulysses"), dist.group.WORLD)
    if world >= 4 and world % 2 == 0:
        groups["hybrid"] = init_device_mesh(DEVICE, (world // 2, 2), mesh_dim_names=("ring", "ulysses"))
    return groups


def _runnable(groups, h_q, world):
    """(strategy, group) pairs that fit h_q query heads: Ulysses splits them among all ranks."""
    return [(s, g) for s, g in groups.items() if s != "ulysses" or h_q % world == 0]


def _collective_median_ms(fn, warmup=WARMUP) -> float:
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device=DEVICE)
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(REPEAT)]
    for start, end in events:
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    median = torch.tensor([s.elapsed_time(e) for s, e in events]).median().to(DEVICE)
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return median.item()


def _fwd_and_bwd(attend, q, k, v):
    """Callables for the forward and for forward+backward of ``attend(q, k, v) -> out``."""
    dout = torch.randn_like(attend(q, k, v))
    return (lambda: attend(q, k, v)), (lambda: torch.autograd.grad(attend(q, k, v), (q, k, v), dout))


def _inputs(h_q, h_kv, d_qk, d_v, seq, dtype=torch.bfloat16, requires_grad=True):
    shapes = ((h_q, d_qk), (h_kv, d_qk), (h_kv, d_v))
    return [torch.randn(1, h, seq, d, device=DEVICE, dtype=dtype, requires_grad=requires_grad) for h, d in shapes]


def interleaved_ms(rows, rounds, time=None) -> dict:
    """{name: [median ms of each callable]} for ``rows`` {name: [callables]}: every callable warmed,
    then ``rounds`` rounds that each time every row, round r starting at row r, and per callable
    the median over the rounds. Every rank runs the same order, so the collectives match."""
    time = time or _collective_median_ms
    for calls in rows.values():
        for call in calls:
            for _ in range(WARMUP):
                call()
    names = list(rows)
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append([time(call, warmup=0) for call in rows[name]])
    return {name: [statistics.median(column) for column in zip(*per_round)] for name, per_round in times.items()}


def _local_calls(h_q, h_kv, d_qk, d_v, seq):
    """The forward and the forward+backward of the single-GPU op on one GPU's inputs."""
    q, k, v = _inputs(h_q, h_kv, d_qk, d_v, seq, requires_grad=False)
    scale = d_qk ** -0.5
    out, lse = attention_forward(q, k, v, scale=scale, is_causal=True)
    dout = torch.randn_like(out)

    def fwd_bwd():
        o, l = attention_forward(q, k, v, scale=scale, is_causal=True)
        return attention_backward(dout, q, k, v, o, l, scale=scale, is_causal=True)

    return [lambda: attention_forward(q, k, v, scale=scale, is_causal=True), fwd_bwd]


def _torch_cp_ms(mesh, h_q, h_kv, d_qk, d_v, seq, rotate):
    """PyTorch's context_parallel on the same global problem; as in ../shared/peers/torch_context_parallel.py."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    set_rotate_method(rotate)
    q, k, v = _inputs(h_q, h_kv, d_qk, d_v, seq, requires_grad=False)
    with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2], no_restore_buffers={q, k, v}):
        for t in (q, k, v):
            t.requires_grad_(True)
        fwd, fwd_bwd = _fwd_and_bwd(
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=h_q != h_kv), q, k, v)
        return _collective_median_ms(fwd), _collective_median_ms(fwd_bwd)


def say(*lines) -> None:
    """Prints ``lines`` on rank 0 at once, so that a long run shows each case as it finishes."""
    if dist.get_rank() == 0:
        print("\n".join(lines), flush=True)


def _row(name, tflops, local=None, peer=None):
    """TFLOP/s fwd and fwd+bwd, and their ratios to ``local`` and ``peer`` to three places (0.946
    is short of a 0.95 target, which two places would hide); a forward-only row has None for
    fwd+bwd."""
    fwd, both = tflops
    text = f"  {name:28s} {fwd:7.0f} {'' if both is None else f'{both:.0f}':>8s}"
    for base in (local, peer):
        if base is None:
            text += f"   {'':>13s}"
        else:
            text += f"   {fwd / base[0]:5.3f} / " + (" " * 5 if both is None else f"{both / base[1]:5.3f}")
    return text


def auto_name(q, k, v, groups) -> str:
    """The row name of causal ``strategy="auto"`` on these shards and groups: what it chose, for
    fwd+bwd where one of them requires a gradient, else for the forward alone."""
    return f"auto -> {choose_strategy(q, k, v, groups, is_causal=True)}"


def _strategy_rows(groups, h_q, h_kv, d_qk, d_v, seq) -> dict:
    """{row name: [forward, forward+backward]} of every strategy and ``auto``, and ``auto``'s forward
    under ``torch.no_grad()``, on shards of fresh global inputs."""
    rows = {}
    for strategy, group in [*_runnable(groups, h_q, dist.get_world_size()), ("auto", dist.group.WORLD)]:
        q, k, v = (shard_sequence(x, group).detach().requires_grad_()
                   for x in _inputs(h_q, h_kv, d_qk, d_v, seq, requires_grad=False))
        name = strategy if strategy != "auto" else auto_name(q, k, v, process_groups(group))
        rows[name] = list(_fwd_and_bwd(lambda q, k, v, group=group, strategy=strategy: context_parallel_attention(
            q, k, v, group=group, strategy=strategy, is_causal=True), q, k, v))
    # inference: no gradient needed, so auto chooses for the forward alone
    world_group = dist.group.WORLD
    q, k, v = (shard_sequence(x, world_group) for x in _inputs(h_q, h_kv, d_qk, d_v, seq, requires_grad=False))

    def no_grad_forward():
        with torch.no_grad():
            return context_parallel_attention(q, k, v, group=world_group, strategy="auto", is_causal=True)

    rows[f"{auto_name(q, k, v, process_groups(world_group))}, no grad"] = [no_grad_forward]
    return rows


def benchmark(seqs, groups, rounds) -> None:
    world = dist.get_world_size()
    torch_cp_mesh = init_device_mesh(DEVICE, (world,))
    say(f"context parallel, {world}x {torch.cuda.get_device_name()}, bf16, causal, batch 1. TFLOP/s per GPU, "
        f"the median of {rounds} interleaved rounds; ratios vs the single-GPU local kernels and vs the best "
        "PyTorch CP, fwd / fwd+bwd")
    for (config, (h_q, h_kv, d_qk, d_v)), seq in ((c, s) for c in CONFIGS.items() for s in seqs):
        per_gpu = [_flops(h_q, seq, d_qk, d_v, bwd) / world / 1e9 for bwd in (False, True)]  # TFLOP per ms
        say(f"{f'{config}, {seq} tokens':30s} {'fwd':>7s} {'fwd+bwd':>8s}   {'vs local':>13s}   {'vs torch CP':>13s}")
        peers = []
        for rotate in ("allgather", "alltoall"):
            try:
                ms = _torch_cp_ms(torch_cp_mesh, h_q, h_kv, d_qk, d_v, seq, rotate)
            except Exception as error:  # the peer has known gaps (e.g. MLA); report them and go on
                say(f"  torch CP {rotate}: failed, {type(error).__name__}: {str(error)[:150]}")
                continue
            peers.append((f"torch CP {rotate}", [f / t for f, t in zip(per_gpu, ms)]))
        best_peer = max((p for _, p in peers), key=lambda p: p[1]) if peers else None
        local_seq = int(seq / math.sqrt(world)) // 128 * 128
        local_name = f"local, {local_seq} tokens"
        rows = {local_name: _local_calls(h_q, h_kv, d_qk, d_v, local_seq),
                **_strategy_rows(groups, h_q, h_kv, d_qk, d_v, seq)}
        ms = interleaved_ms(rows, rounds)
        local = [_flops(h_q, local_seq, d_qk, d_v, bwd) / 1e9 / t for bwd, t in zip((False, True), ms[local_name])]
        say(_row(local_name, local))
        for name, tflops in peers:
            say(_row(name, tflops, local))
        for name, times in ms.items():
            if name != local_name:
                say(_row(name, [f / t for f, t in zip(per_gpu, times)] + [None] * (2 - len(times)), local, best_peer))


def _rel_err(got, want) -> float:
    return ((got.float() - want).norm() / want.norm()).item()


def checked(label: str, local, out_local, dout_local, unshard, want) -> bool:
    """One case of a check: ``out_local``'s gradients for ``local`` given ``dout_local``, the output
    and each gradient unsharded against ``want``; prints the case's row and returns whether it passed."""
    grads = torch.autograd.grad(out_local, local, dout_local)
    errors = [_rel_err(unshard(x.detach()), w) for x, w in zip((out_local, *grads), want)]
    ok = max(errors) <= CHECK_TOLERANCE
    say(f"  {label} " + " ".join(f"{e:9.2e}" for e in errors) + ("" if ok else "  FAIL"))
    return ok


def check(seq: int, groups) -> int:
    """bf16 context parallel against the float32 reference, causal and with a causal window of
    seq/8; returns the number of failed cases."""
    world = dist.get_world_size()
    say(f"check: bf16 context parallel vs the float32 reference, {seq} tokens, causal; relative error "
        f"(tolerance {CHECK_TOLERANCE})",
        f"  {'config':16s} {'strategy':10s} {'window':>12s} {'out':>9s} {'dq':>9s} {'dk':>9s} {'dv':>9s}")
    failures = 0
    for (config, (h_q, h_kv, d_qk, d_v)), window in itertools.product(CONFIGS.items(), ((-1, -1), (seq // 8, 0))):
        torch.manual_seed(0)  # the same global inputs on every rank
        q, k, v = _inputs(h_q, h_kv, d_qk, d_v, seq, dtype=torch.float32, requires_grad=False)
        dout = torch.randn(1, h_q, seq, d_v, device=DEVICE)
        masking = dict(scale=d_qk ** -0.5, is_causal=True, window=window)
        out, lse = reference.attention_forward(q, k, v, **masking)
        want = (out, *reference.attention_backward(dout, q, k, v, out, lse, **masking))
        for strategy, group in _runnable(groups, h_q, world):
            for layout in ("zigzag", "contiguous") if window != (-1, -1) else ("zigzag",):
                local = [shard_sequence(x.bfloat16(), group, layout=layout).requires_grad_() for x in (q, k, v)]
                out_local = context_parallel_attention(*local, group=group, strategy=strategy, is_causal=True,
                                                       window=window, layout=layout)
                failures += not checked(f"{config:16s} {strategy + ' ' + layout[:3]:14s} {str(window):>12s}", local,
                                        out_local, shard_sequence(dout.bfloat16(), group, layout=layout),
                                        lambda x: unshard_sequence(x, group, layout=layout), want)
    return failures


def link_bandwidth() -> None:
    """GB/s each way per GPU: bytes a rank sends (and receives) over the median time."""
    world, group = dist.get_world_size(), dist.group.WORLD
    x = torch.randn(128 * 2**20 // 2 * world, device=DEVICE, dtype=torch.bfloat16)  # 256 MiB per rank
    moves = {
        "ring pass (isend/irecv)": (lambda: wait(pass_round((x,), group, 0)[1], group), x.numel() * 2),
        "all-gather": (lambda: all_gather_stacked(x, (group,)), x.numel() * 2 * (world - 1)),
        "all-to-all": (lambda: all_to_all_stacked(x.view(world, -1), group), x.numel() * 2 * (world - 1) / world),
    }
    say(f"links, {world}x {torch.cuda.get_device_name()}: GB/s each way per GPU, 256 MiB per rank")
    for name, (move, sent_bytes) in moves.items():
        say(f"  {name:26s} {sent_bytes / (_collective_median_ms(move) * 1e6):8.1f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m attn_compile.bench cp")
    parser.add_argument("--seq", type=int, nargs="+", default=None,
                        help="global tokens (default 65536 131072; --check: 8192)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved timing rounds per shape (per window with --documents); each row reports "
                             "its median over them")
    parser.add_argument("--check", action="store_true", help="check bf16 results against float32 instead of timing")
    parser.add_argument("--links", action="store_true", help="measure link bandwidth instead of attention")
    parser.add_argument("--documents", action="store_true",
                        help="packed documents with a sliding window (cp/bench_documents.py), timed or with --check")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if "RANK" not in os.environ:
        parser.error("run under torchrun: the world size and ranks come from its environment")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device per rank (torch.cuda.is_available() is False here)")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    try:
        from . import bench_documents

        groups = _groups(dist.get_world_size())
        if args.check:  # packed documents are checked with or without --documents
            from attn_compile.kernels.triton_tiles import AUTOTUNE
            os.environ[AUTOTUNE] = "0"  # a check times nothing: compile one Triton candidate per key, not all
            dense = 0 if args.documents else sum(check(seq, groups) for seq in (args.seq or [8192]))
            return int(dense + bench_documents.check(groups) > 0)
        if args.documents:
            bench_documents.benchmark(groups, args.rounds)
            return 0
        if args.links:
            link_bandwidth()
            return 0
        benchmark(args.seq or [65536, 131072], groups, args.rounds)
        return 0
    finally:
        dist.destroy_process_group()
