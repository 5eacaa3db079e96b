"""Plans for clusters, on a CPU: ``python -m attn_compile.bench plan [--gpus N ...] [--seq S ...] [--validate]``.

For each shape (heads, GPUs, tokens) it prints every strategy's estimated time of one attention
call's forward and backward, the communication exposed in it and the memory per GPU, then the
strategy the cost model chooses, after the assumptions it rests on (``cost_model.Hardware``).
``--gpus-per-node`` puts a second, slower link (``--internode-gbps``) between nodes; the hybrid
is planned with Ulysses inside a node and the ring across nodes.

``--validate`` prints, instead, the model's forward+backward TFLOP/s per GPU against the
measured context-parallel tables (``MEASURED``), the relative error of each point and their mean.
"""
import argparse
import dataclasses
import statistics

import torch

from . import cost_model

HEADS = {  # name: (h_q, h_kv, d_qk, d_v), as bench cp runs them
    "GQA 32/8 d128": (32, 8, 128, 128),
    "MLA 16h 192/128": (16, 16, 192, 128),
}

# Measured TFLOP/s per GPU of `bench cp` (bf16, causal, batch 1, zigzag), forward and fwd+bwd, by
# (GPUs, heads, global tokens): {strategy: (forward, fwd+bwd)}; the forward ran with no backward
# after it. The hybrid ran on a (2, 2) mesh. NVIDIA H200s (NVLink), torch 2.11.0+cu130,
# flash-attn-4 4.0.0b36 inside the single-GPU op, each shape's rows in 3 interleaved rounds (the
# median): 4 GPUs at commit f10b932 (2026-11-29); 2 GPUs (a 2-GPU host) at 617ca33 (2026-11-29),
# whose ring of two ranks keeps its halo for the backward.
MEASURED = {
    (2, "GQA 32/8 d128", 65536): dict(ring=(623, 589), allgather=(610, 583), ulysses=(607, 584)),
    (2, "GQA 32/8 d128", 131072): dict(ring=(636, 609), allgather=(633, 604), ulysses=(631, 604)),
    (2, "MLA 16h 192/128", 65536): dict(ring=(640, 498), allgather=(603, 476), ulysses=(611, 491)),
    (2, "MLA 16h 192/128", 131072): dict(ring=(669, 514), allgather=(639, 499), ulysses=(653, 510)),
    (4, "GQA 32/8 d128", 65536): dict(ring=(582, 550), allgather=(597, 550), ulysses=(603, 576),
                                      hybrid=(590, 563)),
    (4, "GQA 32/8 d128", 131072): dict(ring=(612, 576), allgather=(615, 590), ulysses=(624, 599),
                                       hybrid=(613, 590)),
    (4, "MLA 16h 192/128", 65536): dict(ring=(612, 448), allgather=(552, 433), ulysses=(622, 487),
                                        hybrid=(604, 469)),
    (4, "MLA 16h 192/128", 131072): dict(ring=(642, 477), allgather=(602, 475), ulysses=(643, 503),
                                         hybrid=(642, 494)),
}

# The same runs' single-GPU op on the same per-GPU work and PyTorch's context_parallel (the better
# rotate method), fwd+bwd TFLOP/s per GPU, by (GPUs, heads, global tokens).
LOCAL_AND_PYTORCH = {
    (2, "GQA 32/8 d128", 65536): (608, 518), (2, "GQA 32/8 d128", 131072): (615, 532),
    (2, "MLA 16h 192/128", 65536): (525, 378), (2, "MLA 16h 192/128", 131072): (522, 380),
    (4, "GQA 32/8 d128", 65536): (607, 488), (4, "GQA 32/8 d128", 131072): (613, 507),
    (4, "MLA 16h 192/128", 65536): (517, 325), (4, "MLA 16h 192/128", 131072): (523, 351),
}

ASSUMPTIONS = (
    "one attention call's forward and backward (one layer of a training step), bf16; ranks fill node after node",
    "a ring or all-gather that crosses nodes moves at the slower link; an all-to-all sends its other nodes' "
    "share over it and the rest inside the node",
    "memory per GPU: this rank's q, k, v, out, their gradients and the LSE, and the strategy's buffers; "
    "the rest of the model is not counted",
)


def problem(heads, gpus: int, seq: int, batch: int = 1, window=(-1, -1)) -> cost_model.Problem:
    h_q, h_kv, d_qk, d_v = heads
    return cost_model.Problem(batch=batch, s_local=seq // gpus, h_q=h_q, h_kv=h_kv, d_qk=d_qk, d_v=d_v,
                              dtype=torch.bfloat16, is_causal=True, window=tuple(window), mesh_shape=(gpus,))


def mesh_name(option: cost_model.Option) -> str:
    return "x".join(map(str, option.mesh_shape))


def plan_lines(name: str, p: cost_model.Problem, hw: cost_model.Hardware) -> list[str]:
    """The table of every option for one shape, and the choice."""
    gpus, nodes = p.cp, -(-p.cp // hw.gpus_per_node) if hw.gpus_per_node else 1
    lines = [f"{name}, {p.s_local * gpus} tokens, batch {p.batch}, on {gpus} GPUs ({nodes} node{'s' * (nodes > 1)})",
             f"  {'strategy':10s} {'mesh':>6s} {'ms fwd+bwd':>11s} {'ms exposed':>11s} {'GB per GPU':>11s}"]
    choices = cost_model.options(p, hw)
    for option in choices:
        row = f"  {option.strategy:10s} {mesh_name(option):>6s}"
        if option.estimate is None:
            lines.append(f"{row}   cannot run: {option.reason}")
            continue
        row += (f" {option.estimate.time_s * 1e3:11.2f} {option.exposed_s * 1e3:11.2f} "
                f"{option.memory_bytes / 1e9:11.2f}")
        lines.append(row + (f"   does not fit: {option.reason}" if option.reason else ""))
    best = cost_model.fastest(choices)
    if best is None:
        runnable = [o for o in choices if o.estimate is not None]
        least = min(runnable, key=lambda o: o.memory_bytes) if runnable else None
        lines.append(f"  choice: none fits in {hw.gpu_memory_gb:g} GB per GPU"
                     + (f"; the least memory is {least.strategy} {mesh_name(least)}'s "
                        f"{least.memory_bytes / 1e9:.3g} GB" if least else ""))
    elif best.strategy == "hybrid":
        outer, inner = best.mesh_shape
        groups = "nodes" if inner == hw.gpus_per_node else "such groups"
        lines.append(f"  choice: hybrid {mesh_name(best)}: Ulysses over {inner} GPUs inside a node, the ring across "
                     f"the {outer} {groups}")
    else:
        lines.append(f"  choice: {best.strategy} over {gpus} GPUs")
    return lines


def assumption_lines(hw: cost_model.Hardware) -> list[str]:
    fields = ", ".join(f"{f.name}={getattr(hw, f.name)}" for f in dataclasses.fields(hw))
    return ["assumptions: cost_model.Hardware(" + fields + ")", *(f"  {line}" for line in ASSUMPTIONS)]


def validation(hw: cost_model.Hardware = cost_model.Hardware(), forward: bool = False) -> tuple[list[str], float]:
    """(the lines comparing the model on ``hw`` in one node with ``MEASURED``'s fwd+bwd figures, or
    its forward alone with the forward figures, the mean relative error)."""
    hw = dataclasses.replace(hw, gpus_per_node=0)
    column, what = (0, "forward alone") if forward else (1, "fwd+bwd")
    lines = [f"validation: the cost model's {what} TFLOP/s per GPU against measured bench cp figures "
             "(bf16, causal, batch 1)",
             f"  {'GPUs':>4s} {'heads':16s} {'tokens':>7s} {'strategy':10s} {'mesh':>4s} {'measured':>8s} "
             f"{'model':>6s} {'error':>7s}"]
    errors, agreed, worst_choice = [], 0, 1.0
    for (gpus, name, seq), both in MEASURED.items():
        measured = {strategy: tflops[column] for strategy, tflops in both.items()}
        p = problem(HEADS[name], gpus, seq)
        # bench cp's count: fwd+bwd is 3.5x fwd
        flops = p.forward_flops() * (1 if forward else 1 + cost_model.BACKWARD_COMPUTE)
        predicted = {}
        for option in cost_model.options(p, hw):
            if option.strategy in measured and option.estimate is not None:
                seconds = option.estimate.forward_s if forward else option.estimate.time_s
                predicted[option.strategy] = (mesh_name(option), flops / seconds / 1e12)
        for strategy, tflops in measured.items():
            mesh, model = predicted[strategy]
            errors.append((model - tflops) / tflops)
            lines.append(f"  {gpus:4d} {name:16s} {seq:7d} {strategy:10s} {mesh:>4s} {tflops:8.0f} {model:6.0f} "
                         f"{errors[-1]:+7.1%}")
        choice = max(predicted, key=lambda s: predicted[s][1])
        agreed += choice == max(measured, key=measured.get)
        worst_choice = min(worst_choice, measured[choice] / max(measured.values()))
    mean = statistics.fmean(abs(e) for e in errors)
    lines.append(f"  mean |error| {mean:.1%} over {len(errors)} points; the model's fastest is the measured "
                 f"fastest in {agreed} of {len(MEASURED)} shapes, and measured at {worst_choice:.3f} of it or more")
    return lines, mean


def efficiency() -> dict:
    """{(heads, global tokens): {"attn_cp" | "PyTorch": [(GPUs, fwd+bwd per GPU over one GPU's)]}}: the
    best measured strategy and PyTorch's context_parallel against the single-GPU op, one GPU at 1.0."""
    curves = {}
    for (gpus, name, seq), measured in MEASURED.items():
        local, pytorch = LOCAL_AND_PYTORCH[gpus, name, seq]
        shape = curves.setdefault((name, seq), {"attn_cp": [(1, 1.0)], "PyTorch": [(1, 1.0)]})
        shape["attn_cp"].append((gpus, max(fwd_bwd for _, fwd_bwd in measured.values()) / local))
        shape["PyTorch"].append((gpus, pytorch / local))
    return curves


def plot_efficiency(path: str) -> None:
    """Draws ``efficiency()`` into a PNG (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(8, 5))
    for n, ((name, seq), curves) in enumerate(efficiency().items()):
        color = f"C{n}"
        for peer, style in (("attn_cp", "-o"), ("PyTorch", ":x")):
            gpus, values = zip(*curves[peer])
            axis.plot(gpus, values, style, color=color, label=f"{name}, {seq // 1024}K: {peer}")
    axis.axhline(0.95, color="grey", linewidth=0.8)
    axis.set_xticks([1, 2, 4])
    axis.set_xlabel("GPUs (H200, NVLink)")
    axis.set_ylabel("fwd+bwd per GPU / one GPU")
    axis.set_title("Context parallelism: the best strategy and PyTorch's context_parallel")
    axis.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attn_compile.bench plan")
    parser.add_argument("--gpus", type=int, nargs="+", default=[8, 16, 64], help="GPUs in all (default 8 16 64)")
    parser.add_argument("--gpus-per-node", type=int, default=8,
                        help="GPUs joined by the fast link in one node; 0: all in one node (default 8)")
    parser.add_argument("--seq", type=int, nargs="+", default=[131072, 1048576],
                        help="global tokens (default 131072 1048576)")
    parser.add_argument("--heads", type=int, nargs=4, action="append", metavar=("H_Q", "H_KV", "D_QK", "D_V"),
                        help=f"attention heads and head dims, repeatable (default {' and '.join(HEADS)})")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--window", type=int, default=-1, help="a causal sliding window's left reach (default none)")
    defaults = cost_model.Hardware()
    parser.add_argument("--link-gbps", type=float, default=defaults.link_gbps,
                        help="each way per GPU inside a node (default %(default)s)")
    parser.add_argument("--internode-gbps", type=float, default=defaults.internode_gbps,
                        help="each way per GPU between nodes (default %(default)s)")
    parser.add_argument("--memory-gb", type=float, default=defaults.gpu_memory_gb,
                        help="memory of one GPU (default %(default)s)")
    parser.add_argument("--ring-overlap", type=float, default=defaults.ring_overlap,
                        help="the share of a ring step's transfer hidden behind its compute (default %(default)s)")
    parser.add_argument("--validate", action="store_true",
                        help="print the model against the measured 2- and 4-GPU tables (fwd+bwd, then the "
                             "forward alone) instead")
    parser.add_argument("--plot-efficiency", metavar="FILE.png",
                        help="with --validate, also draw the measured efficiency against GPU count (needs matplotlib)")
    args = parser.parse_args(argv)
    if not 0 <= args.ring_overlap <= 1:
        parser.error(f"--ring-overlap must be a share between 0 and 1; got {args.ring_overlap}")
    hw = dataclasses.replace(defaults, gpus_per_node=args.gpus_per_node, link_gbps=args.link_gbps,
                             internode_gbps=args.internode_gbps, gpu_memory_gb=args.memory_gb,
                             ring_overlap=args.ring_overlap)
    if args.validate:
        print("\n".join([*validation(hw)[0], "", *validation(hw, forward=True)[0]]))
        if args.plot_efficiency:
            plot_efficiency(args.plot_efficiency)
        return 0
    for name, value in (("--gpus", min(args.gpus)), ("--batch", args.batch)):
        if value < 1:
            parser.error(f"{name} must be at least 1; got {value}")
    for h_q, h_kv, *_ in args.heads or ():
        if h_kv < 1 or h_q % h_kv:
            parser.error(f"--heads: H_Q must be a multiple of H_KV >= 1; got {h_q} and {h_kv}")
    if args.gpus_per_node < 0:
        parser.error(f"--gpus-per-node must be 0 (one node) or more; got {args.gpus_per_node}")
    for gpus in args.gpus:
        if args.gpus_per_node and gpus > args.gpus_per_node and gpus % args.gpus_per_node:
            parser.error(f"--gpus must fill whole nodes of --gpus-per-node {args.gpus_per_node}; got {gpus}")
        for seq in args.seq:
            if seq % (2 * gpus):
                parser.error(f"--seq must be a multiple of 2 x GPUs (zigzag shards); got {seq} on {gpus} GPUs")
    heads = {f"heads {h_q}/{h_kv} d {d_qk}/{d_v}": (h_q, h_kv, d_qk, d_v)
             for h_q, h_kv, d_qk, d_v in args.heads} if args.heads else HEADS
    window = (args.window, 0) if args.window >= 0 else (-1, -1)
    lines = assumption_lines(hw)
    for (name, shape), gpus, seq in ((h, g, s) for h in heads.items() for g in args.gpus for s in args.seq):
        lines += ["", *plan_lines(name, problem(shape, gpus, seq, args.batch, window), hw)]
    lines += ["", f"the model against measured tables: mean |error| {validation(hw)[1]:.1%} "
                  "(python -m attn_compile.bench plan --validate)"]
    print("\n".join(lines))
    return 0
