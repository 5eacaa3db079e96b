"""Hybrid attention on a 2-D mesh (outer, inner): Ulysses inside the inner dim, ring across the outer.

With the context-parallel rank ``outer_rank * inner_size + inner_rank``, the inner group's
shards, joined by the Ulysses exchange, are exactly the outer rank's shard of the same layout
over ``outer_size`` ranks: the ring runs on them unchanged. Packed documents are not taken:
their uneven chunks do not join that way.
"""
import torch
from torch import Tensor

from .checks import check_call
from .comm import resolve
from .layout import SequenceSharding
from .registration import register_strategy
from .ring import ring_backward, ring_forward
from .ulysses import exchange_backward, exchange_forward


def _shardings(q, outer, inner, layout):
    """(inner group's, outer ring's) shardings of the sequence."""
    return (SequenceSharding(inner.size(), layout, q.shape[2]),
            SequenceSharding(outer.size(), layout, q.shape[2] * inner.size()))


@torch.library.custom_op("attn_cp::hybrid_attention", mutates_args=())
def hybrid_attention(q: Tensor, k: Tensor, v: Tensor, outer_group_name: str, inner_group_name: str, scale: float,
                     is_causal: bool, layout: str, window_left: int = -1, window_right: int = -1
                     ) -> tuple[Tensor, Tensor]:
    outer, inner = groups = resolve([outer_group_name, inner_group_name])
    window = (window_left, window_right)
    check_call(q, k, v, groups, strategy="hybrid", scale=scale, is_causal=is_causal, layout=layout, window=window,
               head_split=inner.size())
    inner_sharding, ring_sharding = _shardings(q, outer, inner, layout)
    return exchange_forward(q, k, v, inner, inner_sharding,
                            lambda *qkv: ring_forward(*qkv, outer, scale, is_causal, window, ring_sharding))


@torch.library.custom_op("attn_cp::hybrid_attention_backward", mutates_args=())
def hybrid_attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                              outer_group_name: str, inner_group_name: str, scale: float, is_causal: bool,
                              layout: str, window_left: int = -1, window_right: int = -1
                              ) -> tuple[Tensor, Tensor, Tensor]:
    outer, inner = resolve([outer_group_name, inner_group_name])
    window = (window_left, window_right)
    inner_sharding, ring_sharding = _shardings(q, outer, inner, layout)
    return exchange_backward(dout, q, k, v, out, lse, inner, inner_sharding,
                             lambda *args: ring_backward(*args, outer, scale, is_causal, window, ring_sharding))


register_strategy(hybrid_attention, hybrid_attention_backward)
