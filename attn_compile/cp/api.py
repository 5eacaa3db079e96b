"""``context_parallel_attention``: attention over a sequence sharded across ranks.

Every strategy runs through one composite op, ``attn_cp::context_parallel_attention(q, k, v,
strategy, group_names, scale, is_causal, layout, recompute_kv, window_left, window_right,
cu_seqlens, max_seqlen)``, so a compiled graph names the strategy as an argument; tracing
decomposes it into that strategy's own op. "auto" is resolved there, by the cost model, outside
dynamo's trace (where the model's Python would break the graph).
"""
import dataclasses

import torch
from torch.distributed.tensor import DTensor

from attn_compile import cost_model
from attn_compile.kernels.dispatch import runs_ends_aligned

from . import allgather, hybrid, ring, ulysses  # noqa: F401  (register the attn_cp ops)
from .checks import raise_on_every_rank
from .comm import cp_size, process_groups, resolve

STRATEGIES = (*cost_model.STRATEGIES, "auto")

_library = torch.library.Library("attn_cp", "FRAGMENT")
_library.define("context_parallel_attention(Tensor q, Tensor k, Tensor v, str strategy, str[] group_names, "
                "float scale, bool is_causal, str layout, bool recompute_kv=False, int window_left=-1, "
                "int window_right=-1, Tensor? cu_seqlens=None, int max_seqlen=0) -> (Tensor, Tensor)")


def _run_strategy(q, k, v, strategy, group_names, scale, is_causal, layout, recompute_kv=False, window_left=-1,
                  window_right=-1, cu_seqlens=None, max_seqlen=0):
    ops = torch.ops.attn_cp
    masking = (window_left, window_right)
    documents = (cu_seqlens, max_seqlen)
    groups = resolve(group_names)
    sizes = [group.size() for group in groups]
    if strategy == "auto":
        strategy = choose_strategy(q, k, v, groups, is_causal=is_causal, window=masking, layout=layout,
                                   cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
    if strategy == "ring":
        out, lse, _, _ = ops.ring_attention(q, k, v, group_names[0], sizes[0], scale, is_causal, layout, recompute_kv,
                                            *masking, *documents)
        return out, lse
    if strategy == "allgather":
        recompute_kv = recompute_kv or cu_seqlens is not None
        out, lse, _, _ = ops.allgather_attention(q, k, v, group_names[0], sizes[0], scale, is_causal, layout,
                                                 recompute_kv, *masking, *documents)
        return out, lse
    if strategy == "ulysses":
        out, lse, *_ = ops.ulysses_attention(q, k, v, group_names[0], sizes[0], scale, is_causal, layout, *masking,
                                             *documents)
        return out, lse
    if strategy == "hybrid":
        out, lse, *_ = ops.hybrid_attention(q, k, v, *group_names, sizes[1], scale, is_causal, layout, *masking,
                                            *documents)
        return out, lse
    raise ValueError(f"strategy must be one of {cost_model.STRATEGIES}; got {strategy!r}")


_library.impl("context_parallel_attention", _run_strategy, "CompositeImplicitAutograd")


def window_problem(window):
    """Why ``window`` is not None or a (left, right) pair of ints, or None."""
    if window is None or isinstance(window, (tuple, list)) and len(window) == 2 and all(
            isinstance(w, int) for w in window):
        return None
    return f"window must be None or (left, right), each an int >= 0 or -1 for unbounded; got {window!r}"


def window_pair(window) -> tuple[int, int]:
    """``window`` as the ops take it: None means unbounded on both sides."""
    problem = window_problem(window)
    if problem:
        raise ValueError(problem)
    return (-1, -1) if window is None else tuple(window)


def _call_problem(q, k, v, groups, strategy, window):
    """What is wrong with a call before its op is reached, or None."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if isinstance(x, DTensor):
            return (f"{name} must be this rank's shard as a plain tensor; got a DTensor. Pass {name}.to_local(), or "
                    f"call attention on the DTensors in a model compiled with backend='attn_cp', which reads their "
                    f"placements")
        if x.dim() != 4:
            return f"{name} must be 4-D (batch, heads, seq, dim); got shape {tuple(x.shape)}"
    problem = window_problem(window)
    if problem:
        return problem
    if strategy not in STRATEGIES:
        return f"strategy must be one of {STRATEGIES}; got {strategy!r}"
    if strategy == "hybrid" and len(groups) != 2:
        return ("strategy='hybrid' needs group to be a 2-D DeviceMesh (outer ring dim, inner Ulysses dim); got a 1-D "
                "group")
    if strategy not in ("hybrid", "auto") and len(groups) != 1:
        return (f"strategy={strategy!r} needs group to be a ProcessGroup or a 1-D DeviceMesh; got a 2-D DeviceMesh "
                f"(use strategy='hybrid')")
    return None


def context_parallel_attention(q, k, v, *, group, strategy="auto", is_causal=False, scale=None, layout="zigzag",
                               return_lse=False, recompute_kv=False, window=None, cu_seqlens=None, max_seqlen=0):
    """Attention of this rank's queries to the whole sequence, each rank holding a shard of it.

    q (B, h_q, S_local, d_qk), k (B, h_kv, S_local, d_qk), v (B, h_kv, S_local, d_v): the local
    shards, in the ``layout`` that ``shard_sequence`` produces ("zigzag" or "contiguous").
    ``group``: a ProcessGroup or 1-D DeviceMesh, or a 2-D DeviceMesh (outer, inner) for
    ``strategy="hybrid"``. ``strategy``: "ring", "allgather", "ulysses", "hybrid" or "auto" (the
    cost model's choice). ``window=(left, right)``: query i sees keys i-left..i+right (global
    positions; -1 unbounded), ANDed with ``is_causal``. ``recompute_kv``: allgather gathers K and V
    again in backward instead of keeping them, and a ring of two ranks receives the other rank's
    again instead of keeping the rows it received. Returns out (B, h_q, S_local, d_v) in the layout of
    q, and with ``return_lse`` also the log-sum-exp (B, h_q, S_local), float32, which carries no
    gradient. A group of one rank runs the local op, with no collective.

    ``cu_seqlens``/``max_seqlen`` are for ``attn_compile.varlen_attention``, which passes packed
    documents as (1, H, T_local, D).
    """
    groups = process_groups(group)
    problem = _call_problem(q, k, v, groups, strategy, window)
    if problem:
        raise_on_every_rank(groups, q, k, v, problem, packed=cu_seqlens is not None)
    window = window_pair(window)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if cp_size(groups) == 1 and cu_seqlens is None:
        out, lse = torch.ops.attn_cp.attention(q, k, v, None, is_causal, scale, *window)
    else:
        out, lse = torch.ops.attn_cp.context_parallel_attention(
            q, k, v, strategy, [g.group_name for g in groups], scale, is_causal, layout, recompute_kv, *window,
            cu_seqlens, max_seqlen)
    return (out, lse) if return_lse else out


def choose_strategy(q, k, v, groups, *, is_causal: bool, window=(-1, -1), layout="zigzag", cu_seqlens=None,
                    max_seqlen=0) -> str:
    """The cost model's fastest feasible strategy for these local shards on these groups, from
    what every rank sees alike: packed documents, whose shards differ in length, are costed as
    one batch entry per document of ``max_seqlen`` tokens. Symbolic sizes count at their traced
    values, so the choice made when a graph is compiled stays with the graph. Where no gradient is
    needed (grad mode off, or none of q, k, v requires one), the fastest forward is chosen; for
    packed documents that depends on whether the kernels take a query chunk's prefix as one
    segment (``dispatch.runs_ends_aligned``), which every rank's kernels answer alike."""
    problem = cost_model.Problem.of_shards(q, k, v, is_causal=is_causal, window=window, layout=layout,
                                           mesh_shape=[g.size() for g in groups])
    if cu_seqlens is not None:
        problem = dataclasses.replace(problem, batch=cost_model.traced_int(cu_seqlens.shape[0]) - 1,
                                      s_local=max(1, -(-max_seqlen // problem.cp)), documents=True,
                                      prefix_segments=runs_ends_aligned(q, k, v, is_causal=is_causal, window=window))
    return cost_model.choose(problem)[0]
