"""All-gather attention (Llama 3 style): gather every rank's K and V (h_kv heads only), then
attend the local queries to their visible prefix; the backward pass reduce-scatters dK and dV.

The forward op also returns the gathered K and V. The backward reuses them, or, with
``recompute_kv``, gathers them again instead of keeping them alive between the passes. Their
shape depends on the group size, so the op takes it as an argument (as torch's functional
collectives do): a compiled graph must not depend on state it cannot see.
"""
from typing import Optional

import torch
from torch import Tensor

from .checks import check_call
from .comm import all_gather_stacked, reduce_scatter_stacked, resolve
from .layout import chunk_starts, chunks_per_rank, join_shards, split_sequence
from .merge import empty_result
from .registration import fake_grads, fake_result
from .tiles import attend_tiles, attend_tiles_backward, plan_tiles


def _gather_sequence(x, group, layout):
    return join_shards(all_gather_stacked(x, (group,)).unbind(0), layout, dim=2)


def _tiles(group, layout, shard_len, is_causal):
    cp, length = group.size(), shard_len // chunks_per_rank(layout)
    every_chunk = [i * length for i in range(cp * chunks_per_rank(layout))]
    return plan_tiles(chunk_starts(group.rank(), cp, layout, shard_len), every_chunk, length, is_causal)


def allgather_forward(q, k, v, group, scale, is_causal, layout):
    k_all, v_all = _gather_sequence(k, group, layout), _gather_sequence(v, group, layout)
    out, lse = empty_result(q, v)
    attend_tiles(q, k_all, v_all, _tiles(group, layout, q.shape[2], is_causal), scale, out, lse)
    return out.to(q.dtype), lse, k_all, v_all


def allgather_backward(dout, q, k, v, out, lse, k_all, v_all, group, scale, is_causal, layout):
    if k_all is None:
        k_all, v_all = _gather_sequence(k, group, layout), _gather_sequence(v, group, layout)
    dq = q.new_zeros(q.shape, dtype=lse.dtype)
    dk_all, dv_all = k_all.new_zeros(k_all.shape, dtype=lse.dtype), v_all.new_zeros(v_all.shape, dtype=lse.dtype)
    tiles = _tiles(group, layout, q.shape[2], is_causal)
    attend_tiles_backward(dout, q, k_all, v_all, out, lse, tiles, scale, dq, dk_all, dv_all)
    dk, dv = (reduce_scatter_stacked(torch.stack(split_sequence(g, group.size(), layout, dim=2)), group)
              for g in (dk_all, dv_all))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@torch.library.custom_op("attn_cp::allgather_attention", mutates_args=())
def allgather_attention(q: Tensor, k: Tensor, v: Tensor, group_name: str, group_size: int, scale: float,
                        is_causal: bool, layout: str, recompute_kv: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Returns (out, lse, k_all, v_all); k_all and v_all are the whole sequence's K and V."""
    (group,) = groups = resolve([group_name])
    if group_size != group.size():
        raise ValueError(f"group_size must be the size of group {group_name!r}, {group.size()}; got {group_size}")
    check_call(q, k, v, groups, strategy="allgather", scale=scale, is_causal=is_causal, layout=layout)
    return allgather_forward(q, k, v, group, scale, is_causal, layout)


@allgather_attention.register_fake
def _(q, k, v, group_name, group_size, scale, is_causal, layout, recompute_kv):
    gathered = [x.new_empty((*x.shape[:2], x.shape[2] * group_size, x.shape[3])) for x in (k, v)]
    return (*fake_result(q, v), *gathered)


@torch.library.custom_op("attn_cp::allgather_attention_backward", mutates_args=())
def allgather_attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                                 k_all: Optional[Tensor], v_all: Optional[Tensor], group_name: str, scale: float,
                                 is_causal: bool, layout: str) -> tuple[Tensor, Tensor, Tensor]:
    """``k_all`` and ``v_all`` are the forward's gathered K and V, or None to gather them again."""
    (group,) = resolve([group_name])
    return allgather_backward(dout, q, k, v, out, lse, k_all, v_all, group, scale, is_causal, layout)


@allgather_attention_backward.register_fake
def _(dout, q, k, v, out, lse, k_all, v_all, group_name, scale, is_causal, layout):
    return fake_grads(q, k, v)


def _setup_context(ctx, inputs, output):
    q, k, v, group_name, group_size, scale, is_causal, layout, recompute_kv = inputs
    out, lse, k_all, v_all = output
    ctx.mark_non_differentiable(lse, k_all, v_all)
    ctx.save_for_backward(q, k, v, out, lse, *(() if recompute_kv else (k_all, v_all)))
    ctx.config = (group_name, scale, is_causal, layout)


def _backward(ctx, dout, _dlse, _dk_all, _dv_all):
    q, k, v, out, lse, *gathered = ctx.saved_tensors
    k_all, v_all = gathered or (None, None)
    dq, dk, dv = allgather_attention_backward(dout, q, k, v, out, lse, k_all, v_all, *ctx.config)
    return dq, dk, dv, None, None, None, None, None, None


allgather_attention.register_autograd(_backward, setup_context=_setup_context)
