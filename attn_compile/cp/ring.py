"""Ring attention: K and V travel round the ring while each rank attends its queries to them.

Step i's transfer is posted before step i's compute, so on CUDA it overlaps it. In the
backward pass dK and dV travel one step behind K and V and arrive home after the last step.
K and V keep their own head count and head dims: no repeat for GQA, no padding for MLA.
"""
import torch
from torch import Tensor

from .checks import check_call
from .comm import pass_round, resolve, wait
from .layout import chunk_starts, chunks_per_rank
from .merge import empty_result
from .registration import register_strategy
from .tiles import attend_tiles, attend_tiles_backward, plan_tiles

KV_TAG, GRAD_TAG = 0, 1


def _tiles(q_rank, kv_rank, cp, layout, shard_len, is_causal):
    starts = chunk_starts(q_rank, cp, layout, shard_len), chunk_starts(kv_rank, cp, layout, shard_len)
    return plan_tiles(*starts, shard_len // chunks_per_rank(layout), is_causal)


def ring_forward(q, k, v, group, scale, is_causal, layout):
    rank, size, shard_len = group.rank(), group.size(), q.shape[2]
    out, lse = empty_result(q, v)
    for step in range(size):
        if step + 1 < size:
            next_kv, kv_works = pass_round((k, v), group, KV_TAG)
        tiles = _tiles(rank, (rank - step) % size, size, layout, shard_len, is_causal)
        attend_tiles(q, k, v, tiles, scale, out, lse)
        if step + 1 < size:
            wait(kv_works)
            k, v = next_kv
    return out.to(q.dtype), lse


def ring_backward(dout, q, k, v, out, lse, group, scale, is_causal, layout):
    rank, size, shard_len = group.rank(), group.size(), q.shape[2]
    dq = q.new_zeros(q.shape, dtype=lse.dtype)
    for step in range(size):
        if step + 1 < size:
            next_kv, kv_works = pass_round((k, v), group, KV_TAG)
        dk, dv = k.new_zeros(k.shape, dtype=lse.dtype), v.new_zeros(v.shape, dtype=lse.dtype)
        tiles = _tiles(rank, (rank - step) % size, size, layout, shard_len, is_causal)
        attend_tiles_backward(dout, q, k, v, out, lse, tiles, scale, dq, dk, dv)
        if step > 0:  # add what the ranks before this one found for the same keys
            wait(grad_works)
            dk += next_grads[0]
            dv += next_grads[1]
        next_grads, grad_works = pass_round((dk, dv), group, GRAD_TAG)
        if step + 1 < size:
            wait(kv_works)
            k, v = next_kv
    wait(grad_works)
    return dq.to(q.dtype), next_grads[0].to(k.dtype), next_grads[1].to(v.dtype)


@torch.library.custom_op("attn_cp::ring_attention", mutates_args=())
def ring_attention(q: Tensor, k: Tensor, v: Tensor, group_name: str, scale: float, is_causal: bool,
                   layout: str) -> tuple[Tensor, Tensor]:
    (group,) = groups = resolve([group_name])
    check_call(q, k, v, groups, strategy="ring", scale=scale, is_causal=is_causal, layout=layout)
    return ring_forward(q, k, v, group, scale, is_causal, layout)



@torch.library.custom_op("attn_cp::ring_attention_backward", mutates_args=())
def ring_attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                            group_name: str, scale: float, is_causal: bool, layout: str
                            ) -> tuple[Tensor, Tensor, Tensor]:
    (group,) = resolve([group_name])
    return ring_backward(dout, q, k, v, out, lse, group, scale, is_causal, layout)


register_strategy(ring_attention, ring_attention_backward)
