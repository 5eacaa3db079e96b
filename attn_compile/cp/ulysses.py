"""Ulysses attention: all-to-all from sequence shards to head shards, attention over the whole
sequence on h/cp heads, and the inverse all-to-all of the output.

q, k and v are exchanged separately, each with its own head count and head dim. Rank j gets
query heads [j·h_q/cp, (j+1)·h_q/cp), so h_q must be a multiple of cp. KV heads rule: when
h_kv is not a multiple of cp, every KV head is repeated r = cp / gcd(h_kv, cp) times
(repeat_interleave, so query head i still maps to KV head i // (h_q / h_kv)); h_kv·r is then
the least multiple of both, and each rank gets the h_kv·r/cp KV heads its query heads use.
The gradients of the r copies of a head are summed back.

The forward op also returns the head shards of q, k, v, out and the LSE, and the backward
reuses them: it exchanges only dout one way and dq, dk, dv back (4 all-to-alls, not 9). That
keeps one head-sharded copy of out alive between the passes besides the caller's out. Packed
documents' head shards hold the whole batch, whose token count is in cu_seqlens's values, which
an output shape cannot name: they come back token-major in buffers of ``head_rows_bound`` rows,
a bound this rank's shape gives, their real rows first.

``exchange_forward`` and ``exchange_backward`` take the attention run on the head shards, so
the hybrid strategy reuses them around a ring. Each direction posts all its all-to-alls before it
waits for any (``comm.all_to_all_posted``), so one tensor's copies run while another travels.
Packed documents (uneven shards) are exchanged as token-major rows padded to the longest shard;
the whole batch is then attended in one varlen call.
"""
import math
from typing import Optional

import torch
from torch import Tensor

from attn_compile.kernels import attention_backward, attention_forward, varlen_backward, varlen_forward
from attn_compile.kernels.documents import packed, unpacked
from attn_compile.kernels.reference import lse_dtype

from .checks import check_call, sharding_of
from .comm import all_to_all_posted, received, sized_group
from .failures import failing_together
from .documents import ChunkSharding, DocumentSharding
from .layout import chunks_per_rank
from .registration import fake_result, register_head_exchange
from .words import contiguous, copy_into


def kv_head_repeats(h_kv: int, cp: int) -> int:
    return cp // math.gcd(h_kv, cp)


def to_head_shards(xs, group, sharding, rows: int = 0) -> list:
    """Each (B, H, S_local, ...) sequence shard of ``xs`` -> (B, H/cp, S, ...): this rank's heads,
    whole sequence in position order (for the hybrid, the inner group's part of it). Packed
    documents' shards come in a buffer of ``rows`` rows where given (``head_rows_bound``), their
    real rows first. One tensor's all-to-all travels while the next is made ready
    (``all_to_all_posted``)."""
    cp = group.size()
    posted = all_to_all_posted((_head_send(x, cp, sharding) for x in xs), group)
    return [_head_receive(x, sharding, rows) for x in received(posted, group)]


def post_sequence_shards(xs, group, sharding) -> list:
    """``to_head_shards`` undone, its all-to-alls posted: ``sequence_shards`` gives the results."""
    return all_to_all_posted((_sequence_send(x, sharding) for x in xs), group)


def sequence_shards(posted, group, sharding) -> list:
    """The (B, H, S_local, ...) contiguous sequence shards ``post_sequence_shards`` sent for."""
    return [_sequence_receive(x, group, sharding) for x in received(posted, group)]


def _head_send(x, cp: int, sharding):
    """(cp, ...): row j for rank j, its heads. Packed documents (one batch entry, uneven shards)
    go token-major, padded to the longest shard."""
    if not isinstance(sharding, ChunkSharding):
        return x.unflatten(1, (cp, -1)).movedim(1, 0)
    tokens = packed(x)  # (S_local, H, ...)
    shards = tokens.new_empty((cp, sharding.shard_len, tokens.shape[1] // cp, *tokens.shape[2:]))
    copy_into(shards[:, :tokens.shape[0]], tokens.unflatten(1, (cp, -1)).movedim(1, 0))  # the padding rows are never read
    return shards


def _head_receive(received, sharding, rows: int):
    """The head shard from what every rank sent: packed documents' rows put in batch order by one
    row gather, into the first rows of a zero-tailed buffer of ``rows`` rows where given, token-major
    (the varlen kernels' layout)."""
    if not isinstance(sharding, ChunkSharding):
        return sharding.join(received, dim=2)
    if not rows:
        return unpacked(sharding.gather_rows(received), 1)
    buffer = _zero_tailed(received, (1, received.shape[2], rows, *received.shape[3:]), received.dtype, sharding.total)
    sharding.gather_rows(received, out=packed(buffer).narrow(0, 0, sharding.total))
    return buffer


def _sequence_send(x, sharding):
    if not isinstance(sharding, ChunkSharding):
        return sharding.split(x, dim=2)
    return sharding.scatter_rows(packed(x))  # (cp, shard_len, H/cp, ...)


def _sequence_receive(received, group, sharding):
    if not isinstance(sharding, ChunkSharding):
        # (cp, B, H/cp, ...) -> (B, H, ...): a view, no copy, for B = 1
        return contiguous(received.movedim(0, 1).flatten(1, 2))
    mine = received.narrow(1, 0, sharding.local_len(group.rank()))
    return contiguous(mine.transpose(1, 2).flatten(0, 1).unsqueeze(0))


def to_head_shards_of(q, k, v, group, sharding, rows: int = 0):
    """The head shards of q, k and v, the KV heads repeated by ``kv_head_repeats``."""
    repeats = kv_head_repeats(k.shape[1], group.size())
    k, v = (x if repeats == 1 else x.repeat_interleave(repeats, 1) for x in (k, v))  # repeats of 1 would copy
    return tuple(to_head_shards((q, k, v), group, sharding, rows))


def head_shard_shapes(q, k, v, cp: int) -> list[tuple]:
    """The shapes of the head shards of q, k, v, out and lse on a group of ``cp`` ranks."""
    batch, h_q, seq = q.shape[:3]
    h_kv = k.shape[1] * kv_head_repeats(k.shape[1], cp)
    return [(batch, h_q // cp, seq * cp, q.shape[3]), (batch, h_kv // cp, seq * cp, k.shape[3]),
            (batch, h_kv // cp, seq * cp, v.shape[3]), (batch, h_q // cp, seq * cp, v.shape[3]),
            (batch, h_q // cp, seq * cp)]


def exchange_forward(q, k, v, group, sharding, attend, rows: int = 0):
    """(out, lse) sequence-sharded, then the head shards (q, k, v, out, lse) for the backward as
    the op returns them (``rows``: ``kept_head_shards``), from ``attend(q, k, v) -> (out, lse)``
    run on head shards."""
    heads = to_head_shards_of(q, k, v, group, sharding, rows)
    out, lse = attend(*attended_rows(heads, sharding))
    posted = post_sequence_shards((out, lse), group, sharding)
    kept = kept_head_shards((out, lse), rows)  # copied while out and the LSE travel
    return (*sequence_shards(posted, group, sharding), *heads, *kept)


def exchange_backward(dout, heads, kv_heads, group, sharding, attend_backward):
    """(dq, dk, dv) sequence-sharded, from the forward's head shards ``heads`` (q, k, v, out, lse)
    and ``attend_backward(dout, q, k, v, out, lse)`` run on head shards; ``kv_heads`` is h_kv."""
    repeats = kv_head_repeats(kv_heads, group.size())
    (dout,) = to_head_shards([dout], group, sharding)
    dq, dk, dv = sequence_shards(post_sequence_shards(attend_backward(dout, *heads), group, sharding), group, sharding)
    if repeats == 1:
        return dq, dk, dv
    return dq, dk.unflatten(1, (-1, repeats)).sum(2), dv.unflatten(1, (-1, repeats)).sum(2)


def head_rows_bound(local_len: int, documents: int, cp: int, layout: str) -> int:
    """The most rows packed documents' head shards can hold on a group of ``cp`` ranks, from this
    rank's ``local_len`` rows alone: on zigzag shards another rank's part of a document is at most
    one row per chunk longer than this rank's (chunks_per_rank); on contiguous ones another rank's
    piece is at most one row longer in all, which the same bound covers."""
    return cp * (local_len + chunks_per_rank(layout) * documents)


def _token_major(like, shape, dtype):
    """An empty (1, H, rows, ...) tensor laid out as (rows, H, ...), packed documents' layout."""
    return unpacked(like.new_empty((shape[2], shape[1], *shape[3:]), dtype=dtype), 1)


def _zero_tailed(like, shape, dtype, used: int):
    """``_token_major`` with its rows from ``used`` on zeroed: never read, but an op's outputs are
    deterministic."""
    buffer = _token_major(like, shape, dtype)
    buffer[:, :, used:].zero_()
    return buffer


def kept_head_shards(heads, rows: int) -> list:
    """What the forward op returns of its head shards: them, or for packed documents (``rows``,
    ``head_rows_bound``) each in the first rows of a token-major buffer of ``rows`` rows. q, k and
    v are gathered there (``to_head_shards``); out and the LSE, which the attention allocates,
    are copied."""
    if not rows:
        return list(heads)
    kept = []
    for x in heads:
        buffer = _zero_tailed(x, (*x.shape[:2], rows, *x.shape[3:]), x.dtype, x.shape[2])
        copy_into(buffer[:, :, :x.shape[2]], x)
        kept.append(buffer)
    return kept


def attended_rows(heads, sharding) -> tuple:
    """The head shards the forward attended, from what the op kept: packed documents' real rows."""
    if not isinstance(sharding, ChunkSharding):
        return tuple(heads)
    return tuple(x.narrow(2, 0, sharding.total) for x in heads)


def whole_sequence_attention(sharding, scale, is_causal, window):
    """(forward, backward) of attention over the whole sequence, or whole batch of documents."""
    masking = dict(scale=scale, is_causal=is_causal, window=window)
    if not isinstance(sharding, DocumentSharding):
        return (lambda *qkv: attention_forward(*qkv, **masking),
                lambda *args: attention_backward(*args, **masking))
    longest = sharding.max_seqlen

    def forward(q, k, v):
        cu = sharding.cu_seqlens_on(q.device)
        out, lse = varlen_forward(*map(packed, (q, k, v)), cu, cu, longest, longest, **masking)
        return unpacked(out, 1), unpacked(lse, 1)

    def backward(dout, q, k, v, out, lse):
        cu = sharding.cu_seqlens_on(q.device)
        grads = varlen_backward(*map(packed, (dout, q, k, v, out, lse)), cu, cu, longest, longest, **masking)
        return tuple(unpacked(g, 1) for g in grads)

    return forward, backward


@torch.library.custom_op("attn_cp::ulysses_attention", mutates_args=())
def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, group_name: str, group_size: int, scale: float,
                      is_causal: bool, layout: str, window_left: int = -1, window_right: int = -1,
                      cu_seqlens: Optional[Tensor] = None, max_seqlen: int = 0
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(out, lse, q_h, k_h, v_h, out_h, lse_h): the output and LSE, then the head shards attended
    (``kept_head_shards``)."""
    (group,) = groups = (sized_group(group_name, group_size),)
    window = (window_left, window_right)
    sharding = check_call(q, k, v, groups, strategy="ulysses", scale=scale, is_causal=is_causal, layout=layout,
                          window=window, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, head_split=group_size)
    forward, _ = whole_sequence_attention(sharding, scale, is_causal, window)
    with failing_together("attn_cp::ulysses_attention"):
        return exchange_forward(q, k, v, group, sharding, forward, packed_rows(q, cu_seqlens, group_size, layout))


@ulysses_attention.register_fake
def _(q, k, v, group_name, group_size, scale, is_causal, layout, window_left=-1, window_right=-1, cu_seqlens=None,
      max_seqlen=0):
    return (*fake_result(q, v), *fake_head_shards(q, k, v, group_size, packed_rows(q, cu_seqlens, group_size, layout)))


def packed_rows(q, cu_seqlens, cp: int, layout: str) -> int:
    """``head_rows_bound`` for packed documents (``cu_seqlens``), else 0."""
    return 0 if cu_seqlens is None else head_rows_bound(q.shape[2], cu_seqlens.shape[0] - 1, cp, layout)


def fake_head_shards(q, k, v, cp: int, rows: int = 0) -> list[Tensor]:
    """What ``exchange_forward`` keeps for the backward, as ``kept_head_shards`` returns it."""
    shapes = head_shard_shapes(q, k, v, cp)
    dtypes = (q.dtype, k.dtype, v.dtype, q.dtype, lse_dtype(q.dtype))
    if not rows:
        return [q.new_empty(shape, dtype=dtype) for shape, dtype in zip(shapes, dtypes)]
    return [_token_major(q, (*shape[:2], rows, *shape[3:]), dtype) for shape, dtype in zip(shapes, dtypes)]


@torch.library.custom_op("attn_cp::ulysses_attention_backward", mutates_args=())
def ulysses_attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                               kv_heads: int, group_name: str, group_size: int, scale: float, is_causal: bool,
                               layout: str, window_left: int = -1, window_right: int = -1,
                               cu_seqlens: Optional[Tensor] = None, max_seqlen: int = 0
                               ) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v, out and lse are the head shards the forward op returned."""
    (group,) = groups = (sized_group(group_name, group_size),)
    with failing_together("attn_cp::ulysses_attention_backward"):
        sharding = sharding_of(dout, groups, layout, cu_seqlens)
        _, backward = whole_sequence_attention(sharding, scale, is_causal, (window_left, window_right))
        heads = attended_rows((q, k, v, out, lse), sharding)
        return exchange_backward(dout, heads, kv_heads, group, sharding, backward)


register_head_exchange(ulysses_attention, ulysses_attention_backward)
