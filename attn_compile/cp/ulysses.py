"""Ulysses attention: all-to-all from sequence shards to head shards, attention over the whole
sequence on h/cp heads, and the inverse all-to-all of the output.

q, k and v are exchanged separately, each with its own head count and head dim. Rank j gets
query heads [j·h_q/cp, (j+1)·h_q/cp), so h_q must be a multiple of cp. KV heads rule: when
h_kv is not a multiple of cp, every KV head is repeated r = cp / gcd(h_kv, cp) times
(repeat_interleave, so query head i still maps to KV head i // (h_q / h_kv)); h_kv·r is then
the least multiple of both, and each rank gets the h_kv·r/cp KV heads its query heads use.
The gradients of the r copies of a head are summed back. The backward pass exchanges its
inputs again rather than keeping head-sharded copies alive between the passes.

``exchange_forward`` and ``exchange_backward`` take the attention run on the head shards, so
the hybrid strategy reuses them around a ring.
"""
import math

import torch
from torch import Tensor

from attn_compile.kernels import attention_backward, attention_forward

from .checks import check_call
from .comm import all_to_all_stacked, resolve
from .layout import join_shards, split_sequence
from .registration import register_strategy


def kv_head_repeats(h_kv: int, cp: int) -> int:
    return cp // math.gcd(h_kv, cp)


def to_head_shards(x, group, layout):
    """(B, H, S_local, ...) sequence shard -> (B, H/cp, S, ...): this rank's heads, whole sequence
    in position order (for the hybrid, the inner group's part of it)."""
    cp = group.size()
    received = all_to_all_stacked(x.unflatten(1, (cp, -1)).movedim(1, 0), group)
    return join_shards(received.unbind(0), layout, dim=2)


def to_sequence_shards(x, group, layout):
    """to_head_shards undone."""
    received = all_to_all_stacked(torch.stack(split_sequence(x, group.size(), layout, dim=2)), group)
    return torch.cat(received.unbind(0), dim=1)


def exchange_forward(q, k, v, group, layout, attend):
    """(out, lse) sequence-sharded, from ``attend(q, k, v) -> (out, lse)`` run on head shards."""
    repeats = kv_head_repeats(k.shape[1], group.size())
    q, k, v = (to_head_shards(x, group, layout) for x in (q, k.repeat_interleave(repeats, 1),
                                                          v.repeat_interleave(repeats, 1)))
    return tuple(to_sequence_shards(x, group, layout) for x in attend(q, k, v))


def exchange_backward(dout, q, k, v, out, lse, group, layout, attend_backward):
    """(dq, dk, dv) sequence-sharded, from ``attend_backward(dout, q, k, v, out, lse)`` run on head shards."""
    repeats = kv_head_repeats(k.shape[1], group.size())
    inputs = (dout, q, k.repeat_interleave(repeats, 1), v.repeat_interleave(repeats, 1), out, lse)
    dq, dk, dv = (to_sequence_shards(g, group, layout)
                  for g in attend_backward(*(to_head_shards(x, group, layout) for x in inputs)))
    return dq, dk.unflatten(1, (-1, repeats)).sum(2), dv.unflatten(1, (-1, repeats)).sum(2)


@torch.library.custom_op("attn_cp::ulysses_attention", mutates_args=())
def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, group_name: str, scale: float, is_causal: bool,
                      layout: str) -> tuple[Tensor, Tensor]:
    (group,) = groups = resolve([group_name])
    check_call(q, k, v, groups, strategy="ulysses", scale=scale, is_causal=is_causal, layout=layout,
               head_split=group.size())
    return exchange_forward(q, k, v, group, layout,
                            lambda *qkv: attention_forward(*qkv, scale=scale, is_causal=is_causal))



@torch.library.custom_op("attn_cp::ulysses_attention_backward", mutates_args=())
def ulysses_attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                               group_name: str, scale: float, is_causal: bool, layout: str
                               ) -> tuple[Tensor, Tensor, Tensor]:
    (group,) = resolve([group_name])
    return exchange_backward(dout, q, k, v, out, lse, group, layout,
                             lambda *args: attention_backward(*args, scale=scale, is_causal=is_causal))


register_strategy(ulysses_attention, ulysses_attention_backward)
