"""Hybrid attention on a 2-D mesh (outer, inner): Ulysses inside the inner dim, ring across the outer.

With the context-parallel rank ``outer_rank * inner_size + inner_rank``, the inner group's
shards, joined by the Ulysses exchange, are exactly the outer rank's shard of the same layout
over ``outer_size`` ranks: the ring runs on them unchanged. Packed documents are not taken:
their uneven chunks do not join that way.
"""
import torch
from torch import Tensor

from .checks import check_call
from .comm import resolve, sized_group
from .layout import SequenceSharding
from .registration import fake_result, register_head_exchange
from .ring import ring_backward, ring_forward
from .ulysses import exchange_backward, exchange_forward, fake_head_shards


def _shardings(shard_len, outer, inner, layout):
    """(inner group's, outer ring's) shardings of the sequence, from the local shard length."""
    return (SequenceSharding(inner.size(), layout, shard_len),
            SequenceSharding(outer.size(), layout, shard_len * inner.size()))


@torch.library.custom_op("attn_cp::hybrid_attention", mutates_args=())
def hybrid_attention(q: Tensor, k: Tensor, v: Tensor, outer_group_name: str, inner_group_name: str,
                     inner_group_size: int, scale: float, is_causal: bool, layout: str, window_left: int = -1,
                     window_right: int = -1) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(out, lse, q_h, k_h, v_h, out_h, lse_h): the inner group's head shards, for the backward."""
    outer, inner = groups = (*resolve([outer_group_name]), sized_group(inner_group_name, inner_group_size))
    window = (window_left, window_right)
    check_call(q, k, v, groups, strategy="hybrid", scale=scale, is_causal=is_causal, layout=layout, window=window,
               head_split=inner.size())
    inner_sharding, ring_sharding = _shardings(q.shape[2], outer, inner, layout)
    return exchange_forward(q, k, v, inner, inner_sharding,
                            lambda *qkv: ring_forward(*qkv, outer, scale, is_causal, window, ring_sharding))


@hybrid_attention.register_fake
def _(q, k, v, outer_group_name, inner_group_name, inner_group_size, *config):
    return (*fake_result(q, v), *fake_head_shards(q, k, v, inner_group_size))


@torch.library.custom_op("attn_cp::hybrid_attention_backward", mutates_args=())
def hybrid_attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, kv_heads: int,
                              outer_group_name: str, inner_group_name: str, inner_group_size: int, scale: float,
                              is_causal: bool, layout: str, window_left: int = -1, window_right: int = -1
                              ) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v, out and lse are the forward's head shards."""
    outer, inner = (*resolve([outer_group_name]), sized_group(inner_group_name, inner_group_size))
    window = (window_left, window_right)
    inner_sharding, ring_sharding = _shardings(dout.shape[2], outer, inner, layout)
    return exchange_backward(dout, (q, k, v, out, lse), kv_heads, inner, inner_sharding,
                             lambda *args: ring_backward(*args, outer, scale, is_causal, window, ring_sharding))


register_head_exchange(hybrid_attention, hybrid_attention_backward)
