"""Ring attention: K and V travel round the ring while each rank attends its queries to them.

Step i's transfer is posted before step i's compute so that the two overlap. The transfers run
on high-priority streams (``comm.transfer_group``): on a stream of normal priority NCCL's
transfer kernel waited for the attention kernel beside it to finish. In the backward pass dK and
dV travel one step behind K and V, and are sent home, in k's dtype, after the last step.
A sliding window may leave the ring's later steps with nothing to see on any rank: the ring
stops after the last step some rank needs, so those blocks are neither computed nor sent. A ring
of two steps (every ring of two ranks, and a window shorter than a shard on contiguous shards)
moves each rank's keys one hop only: it sends just the rows the next rank sees (``halo``), and in
the backward pass their dK and dV come straight home while the rank's own step runs
(``halo_backward``). On a ring of two ranks the op keeps the halo it received for the backward,
which then sends no keys and runs its own step as one call; ``recompute_kv`` sends them again
instead, beside the first part of the own step, split in two for it.
K and V keep their own head count and head dims: no repeat for GQA, no padding for MLA.
"""
import functools
import math
from typing import Optional

import torch
from torch import Tensor

from attn_compile.cost_model import halo_reach
from attn_compile.kernels.result_layout import as_grad

from .checks import check_call, sharding_of
from .comm import pass_round, resolve, sized_group
from .failures import failing_together, wait
from .grad_sum import GradSum, gradient_sum, most_parts
from .layout import Chunk
from .merge import MergedResult, empty_result, running_result
from .registration import nothing_kept, register_kept_kv
from .tiles import Tile, attend_tiles, attend_tiles_backward, k_parts, plan_calls, plan_tiles, q_parts
from .ulysses import head_rows_bound

KV_TAG, GRAD_TAG = 0, 1


def _calls(sharding, q_rank, kv_rank, is_causal, window):
    return plan_calls(sharding.chunks(q_rank), sharding.chunks(kv_rank), is_causal, window)


@functools.lru_cache(maxsize=256)
def ring_steps(sharding, is_causal: bool, window: tuple) -> int:
    """1 + the last step at which some rank's queries see the keys that have come to it."""
    cp = sharding.cp
    needed = [step for step in range(cp) for rank in range(cp)  # the tiles alone: no call need be planned
              if plan_tiles(sharding.chunks(rank), sharding.chunks((rank - step) % cp), is_causal, window)]
    return 1 + max(needed, default=0)


@functools.lru_cache(maxsize=256)
def halo(sharding, is_causal: bool, window: tuple, q_rank: int, kv_rank: int) -> tuple[slice, tuple]:
    """(the rows of kv_rank's shard that q_rank's queries see, as one span; q_rank's calls against
    those rows alone, renumbered from the span's start)."""
    chunks = sharding.chunks(kv_rank)
    tiles = plan_tiles(sharding.chunks(q_rank), chunks, is_causal, window)
    rows = slice(min((t.k_rows.start for t in tiles), default=0), max((t.k_rows.stop for t in tiles), default=0))
    cut = tuple(Chunk(a - rows.start, chunk.position + a - chunk.row, b - a, chunk.document) for chunk in chunks
                for a, b in [(max(chunk.row, rows.start), min(chunk.row + chunk.length, rows.stop))] if b > a)
    return rows, plan_calls(sharding.chunks(q_rank), cut, is_causal, window)


def _halo_exchange(tensors, group, tag, send_rows, receive_rows, shift=1, dtype=None, into=None):
    """Sends ``send_rows`` of each (B, H, S, D) tensor ``shift`` ranks on and receives
    ``receive_rows`` of the like tensors (in ``dtype``, where the sender's differs) from as far back,
    into ``into`` where given."""
    received = into or [t.new_empty((*t.shape[:2], receive_rows.stop - receive_rows.start, t.shape[3]), dtype=dtype)
                        for t in tensors]
    return pass_round([t[:, :, send_rows] for t in tensors], group, tag, shift, into=received)


def keeps_halo(group_size: int) -> bool:
    """Whether the ring's op keeps the halo it received for the backward: on two ranks, unless
    ``recompute_kv``; on more, the K and V a rank receives pass on."""
    return group_size == 2


def kept_halo(k, v, group_size: int, recompute_kv: bool, layout: str, cu_seqlens, is_causal: bool, window: tuple):
    """Buffers for the K and V rows a ring of two ranks receives, which the op keeps for its
    backward, or None (with ``recompute_kv``, or where the ring does not ``keeps_halo``). Halos differ
    in length between ranks and an op's output shapes must not, so each buffer is flat, of the
    most rows a halo can have, and the halo fills its start (``halo_views``): one shard
    (``head_rows_bound`` for one rank, on packed documents' uneven shards), or on contiguous
    shards under a window the window's reach, if shorter."""
    if recompute_kv or not keeps_halo(group_size):
        return None
    rows = head_rows_bound(k.shape[2], 0 if cu_seqlens is None else cu_seqlens.shape[0] - 1, 1, layout)
    reach = halo_reach(layout, is_causal, window)
    if reach is not None:
        rows = torch.sym_min(rows, reach)  # no guard on a symbolic shard length
    return tuple(x.new_empty(x.shape[0] * x.shape[1] * rows * x.shape[3]) for x in (k, v))


def halo_views(kept, like, rows: slice) -> list:
    """``rows`` of tensors shaped as ``like``'s, at the start of ``kept_halo``'s buffers."""
    shapes = [(*x.shape[:2], rows.stop - rows.start, x.shape[3]) for x in like]
    return [buffer[:math.prod(shape)].view(shape) for buffer, shape in zip(kept, shapes)]


def _two_steps(group, is_causal, window, sharding):
    """What both passes of a ring of two steps plan: (this rank's calls to its own keys, its calls
    to the halo, the rows of its shard the next rank sees, the rows of the previous rank's it sees)."""
    rank, size = group.rank(), group.size()
    send_rows, _ = halo(sharding, is_causal, window, (rank + 1) % size, rank)
    receive_rows, halo_calls = halo(sharding, is_causal, window, rank, (rank - 1) % size)
    return _calls(sharding, rank, rank, is_causal, window), halo_calls, send_rows, receive_rows


def halo_forward(q, k, v, group, scale, is_causal, window, sharding, kept=None):
    """The ring of two steps: the keys go one hop, so only the rows the next rank sees go (a
    window's halo on contiguous shards); they are received into ``kept`` (``kept_halo``) where given."""
    own, halo_calls, send_rows, receive_rows = _two_steps(group, is_causal, window, sharding)
    into = kept and halo_views(kept, (k, v), receive_rows)
    for buffer, view in zip(kept or (), into or ()):
        buffer[view.numel():].zero_()  # never read, but an op's outputs are deterministic
    (k_halo, v_halo), works = _halo_exchange((k, v), group, KV_TAG, send_rows, receive_rows, into=into)
    result = MergedResult(q, v, q_parts((*own, *halo_calls)))
    attend_tiles(q, k, v, own, scale, result)
    wait(works, group)
    attend_tiles(q, k_halo, v_halo, halo_calls, scale, result)
    return result.out, result.lse


@functools.lru_cache(maxsize=256)
def halo_grads_exact(sharding, is_causal: bool, window: tuple, q_rank: int, kv_rank: int) -> bool:
    """Whether each row of kv_rank's halo gets its dK and dV from one of q_rank's calls: they then go
    home in k's dtype, exactly the kernel's output, else in float32. Sender and receiver both decide
    it from the sender's calls, so the transfer's sizes match."""
    _, calls = halo(sharding, is_causal, window, q_rank, kv_rank)
    return most_parts(k_parts(calls)) <= 1


def _split_own(calls) -> tuple[tuple, tuple]:
    """A rank's calls to its own keys as what runs before the halo's step and what runs after it:
    the halo's keys arrive during the first, its dK and dV go home during the second. One tile is
    cut in two by its query rows (``Tile.split_queries``)."""
    if len(calls) == 1 and isinstance(calls[0], Tile):
        calls = calls[0].split_queries()
    return calls[:1], calls[1:]


def halo_backward(dout, q, k, v, out, lse, group, scale, is_causal, window, sharding, kept=None):
    """``halo_forward``'s gradients. With the halo ``kept``, its step runs first and this rank's own
    step after it, as one call, while the halo's dK and dV go home. Without, the halo's keys come
    again, and its step runs between two parts of this rank's own (``_split_own``), so that both
    transfers run beside a kernel. The halo's dK and dV go home in k's dtype where each of their
    rows is one call's (exactly the kernel's output), else in float32, and every row's parts sum in
    float32, rounded once (``GradSum``)."""
    rank, size = group.rank(), group.size()
    own, halo_calls, send_rows, receive_rows = _two_steps(group, is_causal, window, sharding)
    if kept:
        (k_halo, v_halo), works = halo_views(kept, (k, v), receive_rows), []
        before, after = (), own
    else:
        (k_halo, v_halo), works = _halo_exchange((k, v), group, KV_TAG, send_rows, receive_rows)
        before, after = _split_own(own)
    dq = GradSum(q, q_parts((*before, *halo_calls, *after)))
    dk, dv = (GradSum(x, [*k_parts((*before, *after)), send_rows]) for x in (k, v))
    sent_exact, received_exact = (halo_grads_exact(sharding, is_causal, window, q_rank, (q_rank - 1) % size)
                                  for q_rank in (rank, (rank + 1) % size))
    dk_halo, dv_halo = (GradSum(x, k_parts(halo_calls), dtype=None if sent_exact else lse.dtype)
                        for x in (k_halo, v_halo))
    attend_tiles_backward(dout, q, k, v, out, lse, before, scale, dq, dk, dv)
    wait(works, group)
    attend_tiles_backward(dout, q, k_halo, v_halo, out, lse, halo_calls, scale, dq, dk_halo, dv_halo)
    back, works = _halo_exchange((dk_halo.result(), dv_halo.result()), group, GRAD_TAG, slice(None), send_rows,
                                 shift=-1, dtype=k.dtype if received_exact else lse.dtype)
    attend_tiles_backward(dout, q, k, v, out, lse, after, scale, dq, dk, dv)
    wait(works, group)
    for total, grad in zip((dk, dv), back):
        total.add(send_rows, grad)
    return dq.result(), dk.result(), dv.result()


def ring_forward(q, k, v, group, scale, is_causal, window, sharding, kept=None):
    """(out, lse); a ring of two steps receives its halo into ``kept`` (``kept_halo``) where given."""
    rank, size = group.rank(), group.size()
    steps = ring_steps(sharding, is_causal, window)
    if steps == 2:
        return halo_forward(q, k, v, group, scale, is_causal, window, sharding, kept)
    for buffer in kept or ():  # a ring of two ranks that takes one step receives no halo
        buffer.zero_()
    k, v = sharding.pad(k, 2), sharding.pad(v, 2)
    calls = [_calls(sharding, rank, (rank - step) % size, is_causal, window) for step in range(steps)]
    result = running_result(q, v, [call for step_calls in calls for call in step_calls])
    for step in range(steps):
        if step + 1 < steps:
            next_kv, kv_works = pass_round((k, v), group, KV_TAG)
        attend_tiles(q, k, v, calls[step], scale, result)
        if step + 1 < steps:
            wait(kv_works, group)
            k, v = next_kv
    return result.out, result.lse


def ring_backward(dout, q, k, v, out, lse, group, scale, is_causal, window, sharding, kept=None):
    """(dq, dk, dv); ``kept``: the halo ``ring_forward`` kept, or None."""
    rank, size, own_k, own_v = group.rank(), group.size(), k, v
    steps = ring_steps(sharding, is_causal, window)
    if steps == 2:
        return halo_backward(dout, q, k, v, out, lse, group, scale, is_causal, window, sharding, kept)
    k, v = sharding.pad(k, 2), sharding.pad(v, 2)
    calls = [_calls(sharding, rank, (rank - step) % size, is_causal, window) for step in range(steps)]
    dq = gradient_sum(q, [call for step_calls in calls for call in step_calls], "q")
    whole = slice(0, k.shape[2])  # every shard travels padded to one length
    for step in range(steps):
        if step + 1 < steps:
            next_kv, kv_works = pass_round((k, v), group, KV_TAG)
        # what the ranks before this one found for the same keys is a part too; the last step's
        # sums are the whole gradients of the keys of rank - (steps - 1), and go home in k's dtype
        dk, dv = (gradient_sum(x, calls[step], "k", dtype=None if step + 1 == steps else lse.dtype,
                               more_parts=[whole] * (step > 0)) for x in (k, v))
        attend_tiles_backward(dout, q, k, v, out, lse, calls[step], scale, dq, dk, dv)
        if step > 0:
            wait(grad_works, group)
            dk.add(whole, next_grads[0])
            dv.add(whole, next_grads[1])
        if step + 1 < steps:
            next_grads, grad_works = pass_round((dk.result(), dv.result()), group, GRAD_TAG)
            wait(kv_works, group)
            k, v = next_kv
    (dk, dv), works = pass_round((dk.result(), dv.result()), group, GRAD_TAG, shift=1 - steps)
    wait(works, group)
    return dq.result(), *(as_grad(g[:, :, :x.shape[2]], x) for g, x in ((dk, own_k), (dv, own_v)))


@torch.library.custom_op("attn_cp::ring_attention", mutates_args=())
def ring_attention(q: Tensor, k: Tensor, v: Tensor, group_name: str, group_size: int, scale: float, is_causal: bool,
                   layout: str, recompute_kv: bool, window_left: int = -1, window_right: int = -1,
                   cu_seqlens: Optional[Tensor] = None, max_seqlen: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Returns (out, lse, k_halo, v_halo): ``kept_halo``'s buffers, holding the K and V rows a ring
    of two ranks received, or empty tensors (``recompute_kv``, or more ranks)."""
    (group,) = groups = (sized_group(group_name, group_size),)
    window = (window_left, window_right)
    sharding = check_call(q, k, v, groups, strategy="ring", scale=scale, is_causal=is_causal, layout=layout,
                          window=window, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, recompute_kv=recompute_kv)
    kept = kept_halo(k, v, group_size, recompute_kv, layout, cu_seqlens, is_causal, window)
    with failing_together("attn_cp::ring_attention"):
        out, lse = ring_forward(q, k, v, group, scale, is_causal, window, sharding, kept)
    return out, lse, *(kept or nothing_kept(k, v))


@ring_attention.register_fake
def _(q, k, v, group_name, group_size, scale, is_causal, layout, recompute_kv, window_left=-1, window_right=-1,
      cu_seqlens=None, max_seqlen=0):
    return *empty_result(q, v), *(kept_halo(k, v, group_size, recompute_kv, layout, cu_seqlens, is_causal,
                                           (window_left, window_right)) or nothing_kept(k, v))


@torch.library.custom_op("attn_cp::ring_attention_backward", mutates_args=())
def ring_attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                            k_halo: Optional[Tensor], v_halo: Optional[Tensor], group_name: str, scale: float,
                            is_causal: bool, layout: str, window_left: int = -1, window_right: int = -1,
                            cu_seqlens: Optional[Tensor] = None, max_seqlen: int = 0
                            ) -> tuple[Tensor, Tensor, Tensor]:
    """``k_halo`` and ``v_halo``: what the forward op kept, or None to receive the halo again."""
    (group,) = groups = resolve([group_name])
    kept = (k_halo, v_halo) if k_halo is not None and keeps_halo(group.size()) else None
    with failing_together("attn_cp::ring_attention_backward"):
        sharding = sharding_of(q, groups, layout, cu_seqlens)
        return ring_backward(dout, q, k, v, out, lse, group, scale, is_causal, (window_left, window_right), sharding,
                             kept)


register_kept_kv(ring_attention, ring_attention_backward)
