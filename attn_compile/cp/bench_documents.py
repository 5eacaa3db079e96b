"""Packed documents and sliding windows under context parallelism: the ``--documents`` part of
``torchrun --nproc-per-node N -m attn_compile.bench cp``.

``check``: bf16 ``varlen_attention`` under every strategy (the hybrid on a (N/2, 2) mesh from 4
GPUs on) and both layouts against the float32 reference on one GPU, document by document, for
windows (1024, 0), (1024, 1024) and (-1, -1), causal and full, GQA + MLA heads, on mixed document
lengths including 1 and ones shorter than 2·cp; then the all-gather on GQA d128 heads, whose
backward FA4 runs too, so that the all-gather runs its prefix segments there.

``benchmark``: 128K tokens of mixed document lengths, causal GQA 32/8 d128, per-GPU TFLOP/s of
every strategy (the hybrid as in ``check``) and of ``strategy="auto"`` (named by what it chose;
its ``no grad`` rows time the forward under ``torch.no_grad()``, where it chooses for the forward
alone) with a window of 4096 (flash-attn's left window), beside the same without a window, the same
with every document padded to a multiple of 2·cp (what TransformerEngine requires), both on the
contiguous layout (the batch cut into N pieces as it lies), and the single-GPU op on the
whole batch; each window's rows timed in interleaved rounds, as bench.py times a shape's. FLOPs
count only the visible (query, key) pairs.
"""
import itertools
import random

import torch
import torch.distributed as dist

from attn_compile.kernels import reference
from attn_compile.varlen import varlen_attention

from .api import choose_strategy
from . import bench
from .bench import CHECK_TOLERANCE, DEVICE, _fwd_and_bwd, _runnable, checked, say
from .comm import process_groups
from .documents import shard_varlen, unshard_varlen
from .layout import LAYOUTS

HEADS = (32, 8, 128, 128)  # GQA 32/8 d128
# (heads, the one strategy checked or None for all): GQA + MLA under every strategy, and GQA d128,
# whose varlen backward FA4 runs too, so that its all-gather runs the prefix segments
CHECK_CASES = (((16, 2, 192, 128), None), ((8, 2, 128, 128), "allgather"))


def mixed_lengths(total: int, seed: int, shortest: int = 512, longest: int = 32768, tiny=()) -> list[int]:
    """Document lengths log-uniform in [shortest, longest], plus ``tiny`` ones, summing to ``total``."""
    rng = random.Random(seed)
    lengths = list(tiny)
    while sum(lengths) < total:
        lengths.append(min(int(shortest * (longest / shortest) ** rng.random()), total - sum(lengths)))
    rng.shuffle(lengths)
    return lengths


def _cu(lengths):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=DEVICE)


def visible_pairs(length: int, is_causal: bool, window) -> int:
    left, right = window
    left = length if left < 0 else left
    right = 0 if is_causal else (length if right < 0 else right)
    return sum(min(i, left) + 1 + min(length - 1 - i, right) for i in range(length))


def _inputs(total, heads, dtype, requires_grad=False):
    h_q, h_kv, d_qk, d_v = heads
    return [torch.randn(total, h, d, device=DEVICE, dtype=dtype, requires_grad=requires_grad)
            for h, d in ((h_q, d_qk), (h_kv, d_qk), (h_kv, d_v))]


def check(groups, total: int = 16384) -> int:
    """Every strategy of ``groups`` (``bench._groups``) on ``total`` tokens, for each of
    ``CHECK_CASES``; returns the number of failed cases."""
    world = dist.get_world_size()
    lengths = mixed_lengths(total, seed=0, shortest=64, longest=4096, tiny=(1, 2 * world - 1, 1))
    cu, longest = _cu(lengths), max(lengths)
    say(f"check: bf16 varlen_attention under CP vs the float32 reference, {len(lengths)} documents, "
        f"{sum(lengths)} tokens; relative error (tolerance {CHECK_TOLERANCE})",
        f"  {'heads':13s} {'strategy':10s} {'layout':10s} {'window':>12s} {'causal':>6s} {'out':>9s} {'dq':>9s} "
        f"{'dk':>9s} {'dv':>9s}")
    failures = 0
    masks = itertools.product(((1024, 0), (1024, 1024), (-1, -1)), (True, False))
    for (heads, only), (window, is_causal) in itertools.product(CHECK_CASES, list(masks)):
        h_q, h_kv, d_qk, d_v = heads
        torch.manual_seed(0)  # the same global inputs on every rank
        q, k, v = _inputs(sum(lengths), heads, torch.float32)
        masking = dict(is_causal=is_causal, window=window)
        documents = (cu, cu, longest, longest)
        out, lse = reference.varlen_forward(q, k, v, *documents, scale=d_qk ** -0.5, **masking)
        dout = torch.randn_like(out)
        want = (out, *reference.varlen_backward(dout, q, k, v, out, lse, *documents, scale=d_qk ** -0.5, **masking))
        strategies = [(s, g) for s, g in _runnable(groups, h_q, world) if only in (None, s)]
        for (strategy, group), layout in itertools.product(strategies, LAYOUTS):
            local = [shard_varlen(x.detach().bfloat16(), cu, group, layout)[0].requires_grad_() for x in (q, k, v)]
            out_local = varlen_attention(*local, cu, cu, longest, longest, group=group, strategy=strategy,
                                         layout=layout, **masking)
            heads_name = f"{h_q}/{h_kv} {d_qk}/{d_v}"
            label = f"{heads_name:13s} {strategy:10s} {layout:10s} {str(window):>12s} {str(is_causal):>6s}"
            failures += not checked(label, local, out_local, shard_varlen(dout.bfloat16(), cu, group, layout)[0],
                                    lambda x: unshard_varlen(x, cu, group, layout), want)
    return failures


def _tflops_per_gpu(lengths, window, ms_pair, gpus):
    h_q, _, d_qk, d_v = HEADS
    pairs = sum(visible_pairs(n, True, window) for n in lengths)
    flops = [2 * h_q * pairs * (d_qk + d_v) * factor for factor in (1.0, 3.5)]
    return [f / gpus / 1e9 / ms for f, ms in zip(flops, ms_pair)]


def _local_calls(lengths, window):
    """The forward and the forward+backward of the single-GPU op on the whole batch."""
    cu, longest = _cu(lengths), max(lengths)
    q, k, v = _inputs(sum(lengths), HEADS, torch.bfloat16, requires_grad=True)
    return list(_fwd_and_bwd(lambda q, k, v: varlen_attention(q, k, v, cu, cu, longest, longest, is_causal=True,
                                                              window=window), q, k, v))


def _cp_calls(lengths, window, strategy, group, layout):
    """The forward and the forward+backward of ``strategy`` on this rank's share of the batch."""
    cu, longest = _cu(lengths), max(lengths)
    local = [shard_varlen(x, cu, group, layout)[0].detach().requires_grad_()
             for x in _inputs(sum(lengths), HEADS, torch.bfloat16)]
    return list(_fwd_and_bwd(lambda q, k, v: varlen_attention(
        q, k, v, cu, cu, longest, longest, is_causal=True, window=window, group=group, strategy=strategy,
        layout=layout), *local))


def _no_grad_forward(lengths, window, layout):
    """The forward of ``strategy="auto"`` under ``torch.no_grad()``, where it chooses for the forward alone."""
    forward, _ = _cp_calls(lengths, window, "auto", dist.group.WORLD, layout)

    def no_grad():
        with torch.no_grad():
            return forward()
    return [no_grad]


def _auto_name(lengths, window, layout, backward=True) -> str:
    """The row name of ``strategy="auto"`` on these documents over the world: what it chose, with
    a backward to follow or (``backward=False``) for the forward alone."""
    h_q, h_kv, d_qk, d_v = HEADS
    q, k, v = (torch.empty(1, h, 1, d, device=DEVICE, dtype=torch.bfloat16, requires_grad=backward)
               for h, d in ((h_q, d_qk), (h_kv, d_qk), (h_kv, d_v)))
    groups = process_groups(dist.group.WORLD)
    return "auto -> " + choose_strategy(q, k, v, groups, is_causal=True, window=window, layout=layout,
                                        cu_seqlens=_cu(lengths), max_seqlen=max(lengths))


def benchmark(groups, rounds: int, total: int = 131072, window=(4096, 0)) -> None:
    """Every strategy of ``groups`` (``bench._groups``), each window's rows timed in ``rounds``
    interleaved rounds (``bench.interleaved_ms``)."""
    world = dist.get_world_size()
    lengths = mixed_lengths(total, seed=0)
    padded = [-(-n // (2 * world)) * 2 * world for n in lengths]
    say(f"packed documents under CP, {world}x {torch.cuda.get_device_name()}, bf16, causal GQA 32/8 d128, "
        f"{len(lengths)} documents of {min(lengths)}..{max(lengths)} tokens, {total} in all "
        f"({sum(padded) - total} more when padded to multiples of 2·cp). TFLOP/s per GPU of visible pairs, "
        f"the median of {rounds} interleaved rounds, fwd / fwd+bwd, and ratio to the single-GPU op on the whole "
        "batch",
        f"  {'strategy':33s} {'window':>10s} {'fwd':>7s} {'fwd+bwd':>8s}   {'vs local':>13s}   {'ms fwd+bwd':>10s}")
    for case_window in (window, (-1, -1)):
        rows = {"local": _local_calls(lengths, case_window)}
        strategies = [*_runnable(groups, HEADS[0], world), ("auto", dist.group.WORLD)]
        # contiguous shards need no window for a short halo: a rank sees the rows before it of the
        # one document that crosses into it, while its load follows how the documents fall
        variants = ("", "padded", "contiguous") if case_window == window else ("", "contiguous")
        for (strategy, group), variant in itertools.product(strategies, variants):
            if variant == "padded" and strategy == "auto":
                continue
            layout = "contiguous" if variant == "contiguous" else "zigzag"
            name = strategy if strategy != "auto" else _auto_name(lengths, case_window, layout)
            rows[f"{name} {variant}".strip()] = _cp_calls(padded if variant == "padded" else lengths, case_window,
                                                          strategy, group, layout)
        for variant in ("", "contiguous"):
            layout = variant or "zigzag"
            name = f"{_auto_name(lengths, case_window, layout, backward=False)} {variant}".strip()
            rows[f"{name}, no grad"] = _no_grad_forward(lengths, case_window, layout)
        ms = bench.interleaved_ms(rows, rounds)
        local = _tflops_per_gpu(lengths, case_window, ms.pop("local"), 1)
        say(f"  {'local':33s} {str(case_window):>10s} {local[0]:7.0f} {local[1]:8.0f}")
        for name, times in ms.items():
            tflops = _tflops_per_gpu(lengths, case_window, times, world)  # padding is overhead, not work
            if len(times) == 1:  # a forward alone
                say(f"  {name:33s} {str(case_window):>10s} {tflops[0]:7.0f} {'':8s}   {tflops[0] / local[0]:5.3f} /")
                continue
            say(f"  {name:33s} {str(case_window):>10s} {tflops[0]:7.0f} {tflops[1]:8.0f}   "
                f"{tflops[0] / local[0]:5.3f} / {tflops[1] / local[1]:5.3f}   {times[1]:10.2f}")
