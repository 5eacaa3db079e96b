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
the hybrid strategy reuses them around a ring. Packed documents (uneven shards) are padded to
the longest shard for the exchange; the whole batch is then attended document by document.
"""
import math
from typing import Optional

import torch
from torch import Tensor

from attn_compile.kernels import attention_backward, attention_forward, varlen_backward, varlen_forward
from attn_compile.kernels.documents import packed, unpacked

from .checks import check_call, sharding_of
from .comm import all_to_all_stacked, resolve
from .documents import DocumentSharding
from .registration import register_strategy


def kv_head_repeats(h_kv: int, cp: int) -> int:
    return cp // math.gcd(h_kv, cp)


def to_head_shards(x, group, sharding):
    """(B, H, S_local, ...) sequence shard -> (B, H/cp, S, ...): this rank's heads, whole sequence
    in position order (for the hybrid, the inner group's part of it)."""
    cp = group.size()
    received = all_to_all_stacked(sharding.pad(x, 2).unflatten(1, (cp, -1)).movedim(1, 0), group)
    return sharding.join(received.unbind(0), dim=2)


def to_sequence_shards(x, group, sharding):
    """to_head_shards undone."""
    received = all_to_all_stacked(torch.stack(sharding.split(x, dim=2)), group)
    return torch.cat(received.unbind(0), dim=1).narrow(2, 0, sharding.local_len(group.rank())).contiguous()


def exchange_forward(q, k, v, group, sharding, attend):
    """(out, lse) sequence-sharded, from ``attend(q, k, v) -> (out, lse)`` run on head shards."""
    repeats = kv_head_repeats(k.shape[1], group.size())
    q, k, v = (to_head_shards(x, group, sharding) for x in (q, k.repeat_interleave(repeats, 1),
                                                            v.repeat_interleave(repeats, 1)))
    return tuple(to_sequence_shards(x, group, sharding) for x in attend(q, k, v))


def exchange_backward(dout, q, k, v, out, lse, group, sharding, attend_backward):
    """(dq, dk, dv) sequence-sharded, from ``attend_backward(dout, q, k, v, out, lse)`` run on head shards."""
    repeats = kv_head_repeats(k.shape[1], group.size())
    inputs = (dout, q, k.repeat_interleave(repeats, 1), v.repeat_interleave(repeats, 1), out, lse)
    dq, dk, dv = (to_sequence_shards(g, group, sharding)
                  for g in attend_backward(*(to_head_shards(x, group, sharding) for x in inputs)))
    return dq, dk.unflatten(1, (-1, repeats)).sum(2), dv.unflatten(1, (-1, repeats)).sum(2)


def whole_sequence_attention(sharding, scale, is_causal, window):
    """(forward, backward) of attention over the whole sequence, or whole batch of documents."""
    masking = dict(scale=scale, is_causal=is_causal, window=window)
    if not isinstance(sharding, DocumentSharding):
        return (lambda *qkv: attention_forward(*qkv, **masking),
                lambda *args: attention_backward(*args, **masking))
    documents = (torch.tensor(sharding.cu_seqlens, dtype=torch.int32), sharding.max_seqlen)

    def forward(q, k, v):
        cu = documents[0].to(q.device)
        out, lse = varlen_forward(*map(packed, (q, k, v)), cu, cu, documents[1], documents[1], **masking)
        return unpacked(out, 1), unpacked(lse, 1)

    def backward(dout, q, k, v, out, lse):
        cu = documents[0].to(q.device)
        grads = varlen_backward(*map(packed, (dout, q, k, v, out, lse)), cu, cu, documents[1], documents[1],
                                **masking)
        return tuple(unpacked(g, 1) for g in grads)

    return forward, backward


@torch.library.custom_op("attn_cp::ulysses_attention", mutates_args=())
def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, group_name: str, scale: float, is_causal: bool, layout: str,
                      window_left: int = -1, window_right: int = -1, cu_seqlens: Optional[Tensor] = None,
                      max_seqlen: int = 0) -> tuple[Tensor, Tensor]:
    (group,) = groups = resolve([group_name])
    window = (window_left, window_right)
    sharding = check_call(q, k, v, groups, strategy="ulysses", scale=scale, is_causal=is_causal, layout=layout,
                          window=window, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, head_split=group.size())
    forward, _ = whole_sequence_attention(sharding, scale, is_causal, window)
    return exchange_forward(q, k, v, group, sharding, forward)


@torch.library.custom_op("attn_cp::ulysses_attention_backward", mutates_args=())
def ulysses_attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                               group_name: str, scale: float, is_causal: bool, layout: str, window_left: int = -1,
                               window_right: int = -1, cu_seqlens: Optional[Tensor] = None, max_seqlen: int = 0
                               ) -> tuple[Tensor, Tensor, Tensor]:
    (group,) = groups = resolve([group_name])
    sharding = sharding_of(q, groups, layout, cu_seqlens)
    _, backward = whole_sequence_attention(sharding, scale, is_causal, (window_left, window_right))
    return exchange_backward(dout, q, k, v, out, lse, group, sharding, backward)


register_strategy(ulysses_attention, ulysses_attention_backward)
