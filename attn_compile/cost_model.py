"""Time and memory of each context-parallel strategy for one attention call, fwd + bwd, and its
time where no gradient is needed (the forward alone).

A small analytic model: compute at the kernel's throughput, transfers at the link's bandwidth,
and overlap only where the strategy can overlap (the ring, by ``Hardware.ring_overlap``, behind
each step's compute; all-gather and Ulysses wait for their collectives). The defaults describe
NVLink-connected H100/H200 (see BENCHMARKS.md); pass ``Hardware(...)`` to override.

Past one node, ``Hardware.gpus_per_node`` adds a second, slower link between nodes: a ring or an
all-gather that crosses nodes runs at that link's speed, and an all-to-all sends the share of its
data that leaves the node over it. ``options`` lays a problem out on a number of GPUs every way
the model knows (the hybrid with Ulysses inside a node and the ring across nodes), with the
memory each needs per GPU.
"""
import dataclasses
import math
from typing import Optional

import torch

from .kernels.visibility import UNBOUNDED, effective_window

STRATEGIES = ("ring", "allgather", "ulysses", "hybrid")
FORWARD_ALONE = "the fastest forward: no gradient flows to q, k, v"  # explain's note where it chose so
BACKWARD_COMPUTE = 2.5  # backward FLOPs over forward FLOPs (flash attention recomputes P)


@dataclasses.dataclass(frozen=True)
class Hardware:
    # Fwd+bwd of the single-GPU op with FlashAttention-4 inside, causal bf16, d_qk == d_v: 606-626
    # TFLOP/s on H200s; fitted to its context-parallel runs (bench plan --validate), where the calls
    # are shorter, 600.
    kernel_tflops: float = 600.0
    # `bench cp --links` on 2x H200 NVLink: ring pass 306 GB/s, all-gather 259, all-to-all 287.
    link_gbps: float = 306.0  # each way per GPU, batched isend/irecv
    # All-gather's share of link_gbps in a whole fwd+bwd (bench plan --validate): the collective
    # alone reaches 0.85, but the strategy also zeroes, splits and casts fp32 gradients of the
    # whole sequence's K and V around its reduce-scatter
    allgather_efficiency: float = 0.40
    a2a_efficiency: float = 0.94  # all-to-all's share of link_gbps
    memory_gbps: float = 3000.0  # HBM, for the fp32 merge of partial outputs and Ulysses' copies
    step_overhead_s: float = 30e-6  # launches and synchronisation of one ring step
    # The backward with d_qk != d_v runs at this share of kernel_tflops: the single-GPU op's MLA
    # 192/128 fwd+bwd is 526-531 TFLOP/s on H200, against 613-626 at 128/128
    unequal_dims_backward: float = 0.80
    # Between nodes: ranks fill node after node; 0 GPUs per node means every GPU is in one node.
    gpus_per_node: int = 0
    internode_gbps: float = 50.0  # each way per GPU: one 400 Gb/s network port per GPU
    gpu_memory_gb: float = 80.0  # what one GPU holds, for ``options``' memory check
    # The share of a ring step's transfer that runs beside the step's compute, fwd+bwd, in a ring of
    # more than two steps (two steps hide their transfers, ``_ring``). The ring's transfers run on
    # high-priority streams (cp/comm.py's transfer_group), which hides most of the forward's (MLA
    # 64K on 4 H200s: forward 510 to 636 TFLOP/s), but fwd+bwd rose 0.5-4.9%. bench plan --validate
    # on bench_plan.MEASURED: 0, 0.25 and 0.5 choose alike (mean |error| 2.1%, 1.9%, 2.0%)
    ring_overlap: float = 0.0
    # The forward alone, fitted to bench cp's forward columns on 2 and 4 H200s (bench plan
    # --validate): the single-GPU op's forward runs at 635-693 TFLOP/s (MLA's the faster). A ring of
    # two steps hides its one transfer behind its steps (each step takes the longer of the two); a
    # longer ring hides this share of each step's transfer: at 1.0 the model put the ring's forward
    # first on 4 GPUs, where it measured 0.3-4.9% slower than Ulysses' in all 4 shapes. The
    # all-gather and the all-to-all, waited for before the attention, move at these shares of their
    # fwd+bwd rates, their joins and copies included
    forward_tflops: float = 660.0
    forward_ring_overlap: float = 0.5
    forward_allgather_efficiency: float = 0.30
    forward_a2a_efficiency: float = 1.0

    def spans_nodes(self, ranks: int, stride: int = 1) -> bool:
        """Whether a group of ``ranks`` ranks ``stride`` apart crosses nodes (a group starts at a
        multiple of its span, and spans and nodes divide one another)."""
        return self.gpus_per_node > 0 and ranks * stride > self.gpus_per_node

    def pass_gbps(self, ranks: int, stride: int = 1) -> float:
        """Each way per GPU of a pass round a ring, or an all-gather (NCCL's is a ring): a ring that
        crosses nodes moves at its slowest hop's speed."""
        return self.internode_gbps if self.spans_nodes(ranks, stride) else self.link_gbps


def halo_reach(layout: str, is_causal: bool, window: tuple) -> Optional[int]:
    """How far, in rows, a query sees past its own contiguous shard: a sliding window's farther
    side, or None where the layout is zigzag or the mask unbounded on a side."""
    reach = effective_window(is_causal, tuple(window))
    return None if layout != "contiguous" or UNBOUNDED in reach else max(reach)


def traced_int(size) -> int:
    """A size, or a symbolic one at the value it was traced with: reading that adds no guard."""
    return size if isinstance(size, int) else size.node.hint


@dataclasses.dataclass(frozen=True)
class Problem:
    """One attention call as each rank sees it: ``s_local`` query rows per rank."""

    batch: int
    s_local: int
    h_q: int
    h_kv: int
    d_qk: int
    d_v: int
    dtype: torch.dtype
    is_causal: bool
    window: tuple = (-1, -1)
    mesh_shape: tuple = (2,)  # (cp,) or (outer, inner) for the hybrid
    layout: str = "zigzag"
    documents: bool = False  # packed documents (cu_seqlens), costed as a batch of the longest
    backward: bool = True  # whether a backward follows; without one, the choice is by the forward alone
    # the kernels run a packed query chunk against its visible prefix as one segment (FA4:
    # ``dispatch.runs_ends_aligned``), which the all-gather's calls on packed documents take
    prefix_segments: bool = False

    @classmethod
    def of_shards(cls, q, k, v, *, is_causal: bool, mesh_shape: tuple, s_local=None, window=(-1, -1),
                  layout="zigzag", backward=None):
        """From q, k, v (tensors, or anything with their shape and dtype); ``s_local`` defaults to
        q's sequence length, for q, k, v that are already this rank's shards. ``backward`` defaults
        to whether grad mode is on and one of the tensors requires a gradient."""
        size = traced_int
        if backward is None:
            backward = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
        return cls(batch=size(q.shape[0]), s_local=size(q.shape[2] if s_local is None else s_local),
                   h_q=size(q.shape[1]), h_kv=size(k.shape[1]), d_qk=size(q.shape[-1]), d_v=size(v.shape[-1]),
                   dtype=q.dtype, is_causal=is_causal, window=tuple(window), mesh_shape=tuple(mesh_shape),
                   layout=layout, backward=backward)

    @property
    def cp(self) -> int:
        return math.prod(self.mesh_shape)

    @property
    def element_bytes(self) -> int:
        return self.dtype.itemsize

    def visible_keys(self) -> float:
        """Keys a query row sees, on average over the whole sequence."""
        s = self.s_local * self.cp
        left, right = effective_window(self.is_causal, self.window)
        if left == UNBOUNDED and right == 0:
            return (s + 1) / 2
        return min(s, (s if left == UNBOUNDED else left) + (s if right == UNBOUNDED else right) + 1)

    def halo_reach(self) -> Optional[int]:
        return halo_reach(self.layout, self.is_causal, self.window)

    def ring_transfers(self, ranks: int) -> int:
        """Ring steps that move K and V: all but the first, unless a window on contiguous shards
        lets the ring stop early (cp/ring.py stops after the last step any rank needs)."""
        reach = self.halo_reach()
        return ranks - 1 if reach is None else min(ranks - 1, -(-reach // self.s_local))

    def ring_step_share(self, ranks: int) -> float:
        """The share of a shard's K and V a ring step sends: where they go one hop on contiguous
        shards, only the rows a window reaches (cp/ring.py's halo)."""
        reach = self.halo_reach()
        return 1.0 if reach is None or self.ring_transfers(ranks) != 1 else min(1.0, reach / self.s_local)

    def forward_flops(self) -> float:
        return 2.0 * self.batch * self.h_q * self.s_local * self.visible_keys() * (self.d_qk + self.d_v)

    def kv_bytes(self, heads: int) -> float:
        return self.batch * heads * self.s_local * (self.d_qk + self.d_v) * self.element_bytes

    def call_bytes(self) -> float:
        """One rank's q, k, v and out with their gradients, and the LSE: what the call holds
        whatever the strategy."""
        rows = self.batch * self.s_local
        return 2 * self.kv_bytes(self.h_q + self.h_kv) + rows * self.h_q * 4


@dataclasses.dataclass(frozen=True)
class Estimate:
    strategy: str
    compute_s: float
    transfer_s: float
    time_s: float  # with the strategy's overlap
    memory_bytes: float  # K/V (and gathered or exchanged copies) held per rank, besides ``Problem.call_bytes``
    forward_s: float  # the forward alone, where no gradient is needed

    def __str__(self) -> str:
        return (f"{self.strategy}: {self.time_s * 1e6:.4g} us (compute {self.compute_s * 1e6:.4g} us, "
                f"transfer {self.transfer_s * 1e6:.4g} us, memory {self.memory_bytes / 2**20:.4g} MiB)")


def _backward_compute(p: Problem, hw: Hardware) -> float:
    """Backward time over forward time."""
    return BACKWARD_COMPUTE if p.d_qk == p.d_v else BACKWARD_COMPUTE / hw.unequal_dims_backward


def _ring(p: Problem, hw: Hardware, ranks: int, compute: float, backward: float, forward_alone: float,
          stride: int = 1, keeps_halo: bool = False) -> tuple[float, float, float, float, float]:
    """(transfer, forward time, backward time, time of the forward alone, memory) of a ring over
    ``ranks`` ranks ``stride`` apart: KV forward, KV and dKV backward, the backward taking
    ``backward`` times the forward's ``compute``; the forward alone computes for ``forward_alone``
    and a ring of two steps hides its transfer behind its steps (each step takes the longer of the
    two), a longer ring ``Hardware.forward_ring_overlap`` of each. Each step also
    pays a fixed overhead and the fp32 merge of the partial output; in the backward that pass
    stands for the fp32 dK and dV each step of a longer ring sums and passes on (fitted), which a
    ring of two steps, whose dK and dV go home once (cp/ring.py's halo), does not pay. A ring of two
    steps that ``keeps_halo`` does not send its keys again in the backward."""
    step_bytes = p.kv_bytes(p.h_kv) * p.ring_step_share(ranks)
    step_transfer = step_bytes / (hw.pass_gbps(ranks, stride) * 1e9)
    transfers = p.ring_transfers(ranks)
    merge = 3 * p.batch * p.h_q * p.s_local * (p.d_v + 1) * 4 / (hw.memory_gbps * 1e9)
    forward_step = compute / (transfers + 1) + merge + hw.step_overhead_s
    backward_step = backward * (compute / (transfers + 1) + merge * (transfers > 1) + hw.step_overhead_s)
    alone_step = forward_alone / (transfers + 1) + merge + hw.step_overhead_s
    def step(compute_s, transfer_s, overlap=hw.ring_overlap):  # compute and the transfer it cannot hide
        return max(compute_s + (1 - overlap) * transfer_s, transfer_s)

    fwd = forward_step + transfers * step(forward_step, step_transfer)
    # a ring of two steps hides its backward's transfers beside its own step (cp/ring.py's halo_backward)
    backward_transfers = 1 + (not keeps_halo) if transfers == 1 else 2
    bwd = backward_step + transfers * step(backward_step, backward_transfers * step_transfer,
                                           overlap=1.0 if transfers == 1 else hw.ring_overlap)
    alone = alone_step + transfers * step(alone_step, step_transfer, overlap=1.0 if transfers == 1
                                          else hw.forward_ring_overlap)
    return (1 + backward_transfers) * transfers * step_transfer, fwd, bwd, alone, 3 * step_bytes


def estimate(strategy: str, p: Problem, hw: Hardware = Hardware()) -> Estimate:
    compute = p.forward_flops() / (hw.kernel_tflops * 1e12)
    forward = p.forward_flops() / (hw.forward_tflops * 1e12)  # the forward alone
    backward = _backward_compute(p, hw)
    total_compute = compute * (1 + backward)
    if strategy == "ring":
        transfer, fwd, bwd, forward_time, memory = _ring(p, hw, p.cp, compute, backward, forward,
                                                         keeps_halo=p.cp == 2)  # cp/ring.py's kept_halo
        time = fwd + bwd
    elif strategy == "allgather":
        # all-gather of KV in forward, again in backward (recomputed), reduce-scatter of dKV
        # memory: the gathered K and V, and in backward their fp32 gradients and the fp32 copy the
        # reduce-scatter sends
        gathered = p.kv_bytes(p.h_kv) * p.cp
        one_pass = gathered * (p.cp - 1) / p.cp / (hw.pass_gbps(p.cp) * 1e9)
        transfer = 3 * one_pass / hw.allgather_efficiency
        time, memory = total_compute + transfer, 5 * gathered
        forward_time = forward + one_pass / hw.forward_allgather_efficiency
    elif strategy == "ulysses":
        transfer = _a2a_seconds(p, hw, p.cp)
        time, memory = total_compute + transfer, p.kv_bytes(_kv_heads_sent(p.h_kv, p.cp)) * 2
        forward_time = forward + _forward_a2a_seconds(p, hw, p.cp)
    elif strategy == "hybrid":
        outer, inner = p.mesh_shape
        a2a = _a2a_seconds(p, hw, inner)
        per_group = dataclasses.replace(p, s_local=p.s_local * inner, h_q=p.h_q // inner,
                                        h_kv=_kv_heads_sent(p.h_kv, inner) // inner, mesh_shape=(outer,))
        ring_transfer, fwd, bwd, ring_alone, memory = _ring(per_group, hw, outer, compute, backward, forward,
                                                            stride=inner)
        transfer, time = a2a + ring_transfer, a2a + fwd + bwd
        forward_time = _forward_a2a_seconds(p, hw, inner) + ring_alone
    else:
        raise ValueError(f"strategy must be one of {STRATEGIES}; got {strategy!r}")
    return Estimate(strategy, total_compute, transfer, time, memory, forward_time)


def _kv_heads_sent(h_kv: int, cp: int) -> int:
    """KV heads after Ulysses repeats them up to a multiple of cp (see cp/ulysses.py)."""
    return h_kv * (cp // math.gcd(h_kv, cp))


def _a2a_seconds(p: Problem, hw: Hardware, ranks: int) -> float:
    """Ulysses all-to-alls over ``ranks`` consecutive ranks, fwd + bwd: q, k, v there and out back;
    dout there and dq, dk, dv back (the backward reuses the forward's head shards). Each exchange
    also copies its tensor between the sequence order and the per-rank blocks the all-to-all
    moves: one read+write pass over HBM with a batch of one, two with more, where the per-rank
    blocks are not views (measured on 2x H200, MLA 64K: 9.4 ms of all-to-alls came with about
    5 ms of copies, when every exchange made two or three)."""
    e = p.element_bytes
    per_row = p.batch * p.s_local * e
    q, out = per_row * p.h_q * p.d_qk, per_row * p.h_q * p.d_v
    kv = per_row * _kv_heads_sent(p.h_kv, ranks) * (p.d_qk + p.d_v)
    moved = 2 * (q + kv + out)
    copies = 1 if p.batch == 1 else 2
    return _exchange_seconds(moved, ranks, hw) + 2 * copies * moved / (hw.memory_gbps * 1e9)


def _forward_a2a_seconds(p: Problem, hw: Hardware, ranks: int) -> float:
    """The forward's half of Ulysses' exchanges (q, k, v there and out back), where no backward
    follows."""
    return _a2a_seconds(p, hw, ranks) / 2 / hw.forward_a2a_efficiency


def _exchange_seconds(sent: float, ranks: int, hw: Hardware) -> float:
    """An all-to-all in which each rank sends ``sent`` bytes, 1/ranks of it to itself: across
    nodes the share for other nodes goes over their link while the rest moves inside the node."""
    rate = hw.a2a_efficiency * 1e9
    if not hw.spans_nodes(ranks):
        return sent * (ranks - 1) / ranks / (hw.link_gbps * rate)
    node = hw.gpus_per_node
    return max(sent * (ranks - node) / ranks / (hw.internode_gbps * rate),
               sent * (node - 1) / ranks / (hw.link_gbps * rate))


def feasible(strategy: str, p: Problem) -> tuple[bool, str]:
    """Whether the strategy can run this problem on this mesh, and if not, why."""
    if strategy == "hybrid":
        if len(p.mesh_shape) != 2:
            return False, "hybrid needs a 2-D mesh"
        inner = p.mesh_shape[1]
        if p.h_q % inner:
            return False, f"h_q={p.h_q} is not a multiple of the inner mesh size {inner}"
        return True, ""
    if len(p.mesh_shape) != 1:
        return False, f"{strategy} needs a 1-D mesh"
    if strategy == "ulysses" and p.h_q % p.cp:
        return False, f"h_q={p.h_q} is not a multiple of the context-parallel size {p.cp}"
    return True, ""


def chooses_forward_alone(p: Problem, strategy: str) -> bool:
    """Whether ``choose`` ranks the strategies by the forward alone: for "auto" where no backward
    follows (packed documents keep their own rules)."""
    return strategy == "auto" and not p.backward


def choose(p: Problem, hw: Hardware = Hardware(), strategy: str = "auto") -> tuple[str, dict]:
    """(the strategy to run, {strategy: Estimate or reason it is infeasible}): the fastest feasible
    one, or ``strategy`` when it is forced and feasible.

    Packed documents take Ulysses wherever it can run: it attends the whole batch in one varlen
    call, while the ring and the all-gather attend each step's per-document tiles, whose costs
    (fp32 gradient accumulation, filler rows, more calls) the model leaves out. Measured on 4
    H200s, 131,072 tokens in 17 documents on zigzag shards, with and without a window, Ulysses
    ran 1.14-2.5x faster in fwd+bwd than the other strategies (BENCHMARKS.md); on 2, with the
    all-gather's prefix segments on FA4, 1.08-1.19x faster than the all-gather and 1.07-1.45x
    than the ring. The exception is the contiguous layout where the ring has two
    steps: under a sliding window, or on two ranks. A rank then needs the rows of the rank before
    it that its queries see, the ring sends just those (a window's rows, or the part of the
    document that spans both ranks) and attends the rest locally: on 2 H200s, 0.916 / 0.897 of
    one GPU with a window and 0.878 / 0.879 without, against Ulysses' 0.590 / 0.738 and 0.756 /
    0.817. On more ranks without a window the ring has two steps only where no document spans
    more than two ranks' pieces, which the ranks cannot tell alike from their shards (whose token
    counts differ by one), so Ulysses stays the choice there.

    Where no backward follows (``p.backward`` false), the fastest forward is chosen; for packed
    documents on zigzag shards of two ranks that is the all-gather where its calls take each
    query chunk's prefix as one segment (``p.prefix_segments``): 0.655 of one GPU with a window
    and 0.816 without on 2 H200s, against Ulysses' 0.621 and 0.760 (BENCHMARKS.md)."""
    table = {}
    for name in STRATEGIES:
        ok, reason = feasible(name, p)
        table[name] = estimate(name, p, hw) if ok else reason
    estimates = {s: e for s, e in table.items() if isinstance(e, Estimate)}
    if not estimates:
        reasons = "; ".join(f"{s}: {r}" for s, r in table.items())
        raise ValueError(f"no context-parallel strategy can run this problem on mesh {p.mesh_shape}: {reasons}")
    if strategy == "auto":
        if p.documents and p.layout == "contiguous" and (p.halo_reach() is not None or p.cp == 2) \
                and "ring" in estimates:
            return "ring", table
        if p.documents and not p.backward and p.prefix_segments and p.layout == "zigzag" and p.cp == 2 \
                and "allgather" in estimates:
            return "allgather", table
        if p.documents and "ulysses" in estimates:
            return "ulysses", table
        forward = chooses_forward_alone(p, strategy)
        key = (lambda s: estimates[s].forward_s) if forward else (lambda s: estimates[s].time_s)
        return min(estimates, key=key), table
    reason = table.get(strategy, f"strategy must be 'auto' or one of {STRATEGIES}; got {strategy!r}")
    if isinstance(reason, str):
        raise ValueError(f"strategy={strategy!r} cannot run here: {reason}")
    return strategy, table


@dataclasses.dataclass(frozen=True)
class Option:
    """One way to lay a problem out on the GPUs: a strategy on a mesh, and what the model says of it."""
    strategy: str
    mesh_shape: tuple
    estimate: Optional[Estimate]  # None where the strategy cannot run the problem
    exposed_s: float  # what the transfers add to estimate.time_s (the time on links of no cost subtracted)
    memory_bytes: float  # per GPU: ``Problem.call_bytes`` and the strategy's buffers
    reason: str = ""  # why it cannot run: the strategy does not fit the problem, or its memory the GPU


def hybrid_meshes(gpus: int, hw: Hardware) -> list[tuple[int, int]]:
    """The (outer, inner) meshes of the hybrid on ``gpus`` GPUs whose inner (Ulysses) groups lie
    inside a node, so that only the ring crosses nodes."""
    node = hw.gpus_per_node or gpus
    return [(gpus // inner, inner) for inner in range(2, gpus) if gpus % inner == 0 and node % inner == 0]


def options(p: Problem, hw: Hardware = Hardware()) -> list[Option]:
    """Every strategy on ``p.cp`` GPUs: ring, all-gather and Ulysses over all of them, the hybrid
    on each of ``hybrid_meshes``; an option whose memory per GPU exceeds ``hw.gpu_memory_gb``
    does not run."""
    free_links = dataclasses.replace(hw, link_gbps=math.inf, internode_gbps=math.inf)
    layouts = [(s, (p.cp,)) for s in STRATEGIES if s != "hybrid"]
    layouts += [("hybrid", mesh) for mesh in hybrid_meshes(p.cp, hw)]
    result = []
    for strategy, mesh in layouts:
        problem = dataclasses.replace(p, mesh_shape=mesh)
        ok, reason = feasible(strategy, problem)
        if not ok:
            result.append(Option(strategy, mesh, None, 0.0, 0.0, reason))
            continue
        e = estimate(strategy, problem, hw)
        memory = problem.call_bytes() + e.memory_bytes
        exposed = e.time_s - estimate(strategy, problem, free_links).time_s
        too_big = memory > hw.gpu_memory_gb * 1e9
        reason = f"needs {memory / 1e9:.3g} GB per GPU, more than the {hw.gpu_memory_gb:g} GB one holds" \
            if too_big else ""
        result.append(Option(strategy, mesh, e, exposed, memory, reason))
    return result


def fastest(choices: list[Option]) -> Optional[Option]:
    """The fastest option that runs, or None."""
    running = [o for o in choices if not o.reason]
    return min(running, key=lambda o: o.estimate.time_s) if running else None
