"""``context_parallel_attention``: attention over a sequence sharded across ranks.

Every strategy runs through one composite op, ``attn_cp::context_parallel_attention(q, k, v,
strategy, group_names, scale, is_causal, layout, recompute_kv)``, so a compiled graph names the
chosen strategy as an argument; tracing decomposes it into that strategy's own op.
"""
import torch

from attn_compile import cost_model

from . import allgather, hybrid, ring, ulysses  # noqa: F401  (register the attn_cp ops)
from .comm import process_groups, resolve

STRATEGIES = (*cost_model.STRATEGIES, "auto")

_library = torch.library.Library("attn_cp", "FRAGMENT")
_library.define("context_parallel_attention(Tensor q, Tensor k, Tensor v, str strategy, str[] group_names, "
                "float scale, bool is_causal, str layout, bool recompute_kv=False) -> (Tensor, Tensor)")


def _run_strategy(q, k, v, strategy, group_names, scale, is_causal, layout, recompute_kv=False):
    ops = torch.ops.attn_cp
    if strategy == "ring":
        return ops.ring_attention(q, k, v, group_names[0], scale, is_causal, layout)
    if strategy == "allgather":
        size = resolve(group_names)[0].size()
        out, lse, _, _ = ops.allgather_attention(q, k, v, group_names[0], size, scale, is_causal, layout, recompute_kv)
        return out, lse
    if strategy == "ulysses":
        return ops.ulysses_attention(q, k, v, group_names[0], scale, is_causal, layout)
    if strategy == "hybrid":
        return ops.hybrid_attention(q, k, v, group_names[0], group_names[1], scale, is_causal, layout)
    raise ValueError(f"strategy must be one of {cost_model.STRATEGIES}; got {strategy!r}")


_library.impl("context_parallel_attention", _run_strategy, "CompositeImplicitAutograd")


def choose_strategy(q, k, v, groups, *, is_causal: bool) -> str:
    """The cost model's fastest feasible strategy for these local shards on these groups."""
    problem = cost_model.Problem.of_shards(q, k, v, is_causal=is_causal, mesh_shape=[g.size() for g in groups])
    return cost_model.choose(problem)[0]


def context_parallel_attention(q, k, v, *, group, strategy="auto", is_causal=False, scale=None, layout="zigzag",
                               return_lse=False, recompute_kv=False):
    """Attention of this rank's queries to the whole sequence, each rank holding a shard of it.

    q (B, h_q, S_local, d_qk), k (B, h_kv, S_local, d_qk), v (B, h_kv, S_local, d_v): the local
    shards, in the ``layout`` that ``shard_sequence`` produces ("zigzag" or "contiguous").
    ``group``: a ProcessGroup or 1-D DeviceMesh, or a 2-D DeviceMesh (outer, inner) for
    ``strategy="hybrid"``. ``strategy``: "ring", "allgather", "ulysses", "hybrid" or "auto" (the
    cost model's choice). ``recompute_kv``: allgather gathers K and V again in backward instead of
    keeping them. Returns out (B, h_q, S_local, d_v) in the layout of q, and with ``return_lse``
    also the log-sum-exp (B, h_q, S_local), float32, which carries no gradient.
    """
    groups = process_groups(group)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}; got {strategy!r}")
    if strategy == "auto":
        strategy = choose_strategy(q, k, v, groups, is_causal=is_causal)
    if strategy == "hybrid" and len(groups) != 2:
        raise ValueError("strategy='hybrid' needs group to be a 2-D DeviceMesh (outer ring dim, inner Ulysses dim); "
                         "got a 1-D group")
    if strategy != "hybrid" and len(groups) != 1:
        raise ValueError(f"strategy={strategy!r} needs group to be a ProcessGroup or a 1-D DeviceMesh; "
                         f"got a 2-D DeviceMesh (use strategy='hybrid')")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    out, lse = torch.ops.attn_cp.context_parallel_attention(
        q, k, v, strategy, [g.group_name for g in groups], scale, is_causal, layout, recompute_kv)
    return (out, lse) if return_lse else out
