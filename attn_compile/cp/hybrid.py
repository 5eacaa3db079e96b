"""Hybrid attention on a 2-D mesh (outer, inner): Ulysses inside the inner dim, ring across the outer.

With the context-parallel rank ``outer_rank * inner_size + inner_rank``, the inner group's
shards, joined by the Ulysses exchange, are exactly the outer rank's shard of the same layout
over ``outer_size`` ranks: the ring runs on them unchanged. Packed documents' chunks are uneven,
so there the joined buffers and the ring over them are described chunk by chunk
(``documents.hybrid_shardings``), and the op keeps their head shards as Ulysses does
(``ulysses.kept_head_shards``).
"""
from typing import Optional

import torch
from torch import Tensor

from .checks import check_call, sharding_of
from .comm import resolve, sized_group
from .documents import hybrid_shardings
from .failures import failing_together
from .layout import SequenceSharding
from .registration import fake_result, register_head_exchange
from .ring import ring_backward, ring_forward
from .ulysses import attended_rows, exchange_backward, exchange_forward, fake_head_shards, packed_rows


def _shardings(sharding, outer, inner):
    """(inner group's, outer ring's) shardings, from the whole context-parallel group's."""
    if isinstance(sharding, SequenceSharding):
        return (SequenceSharding(inner.size(), sharding.layout, sharding.shard_len),
                SequenceSharding(outer.size(), sharding.layout, sharding.shard_len * inner.size()))
    return hybrid_shardings(sharding, inner.size(), outer.rank())


def _groups(outer_group_name, inner_group_name, inner_group_size):
    return (*resolve([outer_group_name]), sized_group(inner_group_name, inner_group_size))


@torch.library.custom_op("attn_cp::hybrid_attention", mutates_args=())
def hybrid_attention(q: Tensor, k: Tensor, v: Tensor, outer_group_name: str, inner_group_name: str,
                     inner_group_size: int, scale: float, is_causal: bool, layout: str, window_left: int = -1,
                     window_right: int = -1, cu_seqlens: Optional[Tensor] = None, max_seqlen: int = 0
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(out, lse, q_h, k_h, v_h, out_h, lse_h): the inner group's head shards, for the backward
    (``ulysses.kept_head_shards``)."""
    outer, inner = groups = _groups(outer_group_name, inner_group_name, inner_group_size)
    window = (window_left, window_right)
    sharding = check_call(q, k, v, groups, strategy="hybrid", scale=scale, is_causal=is_causal, layout=layout,
                          window=window, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, head_split=inner.size())
    inner_sharding, ring_sharding = _shardings(sharding, outer, inner)
    with failing_together("attn_cp::hybrid_attention"):
        return exchange_forward(q, k, v, inner, inner_sharding,
                                lambda *qkv: ring_forward(*qkv, outer, scale, is_causal, window, ring_sharding),
                                packed_rows(q, cu_seqlens, inner_group_size, layout))


@hybrid_attention.register_fake
def _(q, k, v, outer_group_name, inner_group_name, inner_group_size, scale, is_causal, layout, window_left=-1,
      window_right=-1, cu_seqlens=None, max_seqlen=0):
    return (*fake_result(q, v), *fake_head_shards(q, k, v, inner_group_size,
                                                  packed_rows(q, cu_seqlens, inner_group_size, layout)))


@torch.library.custom_op("attn_cp::hybrid_attention_backward", mutates_args=())
def hybrid_attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, kv_heads: int,
                              outer_group_name: str, inner_group_name: str, inner_group_size: int, scale: float,
                              is_causal: bool, layout: str, window_left: int = -1, window_right: int = -1,
                              cu_seqlens: Optional[Tensor] = None, max_seqlen: int = 0
                              ) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v, out and lse are the head shards the forward op returned."""
    outer, inner = groups = _groups(outer_group_name, inner_group_name, inner_group_size)
    window = (window_left, window_right)
    with failing_together("attn_cp::hybrid_attention_backward"):
        # for the forward's head shards dout is the one sequence shard at hand
        inner_sharding, ring_sharding = _shardings(sharding_of(dout, groups, layout, cu_seqlens), outer, inner)
        heads = attended_rows((q, k, v, out, lse), inner_sharding)
        return exchange_backward(dout, heads, kv_heads, inner, inner_sharding,
                                 lambda *args: ring_backward(*args, outer, scale, is_causal, window, ring_sharding))


register_head_exchange(hybrid_attention, hybrid_attention_backward)
