"""All-gather attention (Llama 3 style): gather every rank's K and V (h_kv heads only), then
attend the local queries to their visible prefix; the backward pass reduce-scatters dK and dV.

The forward op also returns the gathered K and V. The backward reuses them, or, with
``recompute_kv``, gathers them again instead of keeping them alive between the passes (the op
then returns empty tensors in their place). Their shape depends on the group size, so the op
takes it as an argument (``comm.sized_group``). Packed documents always gather again: their
gathered size is in cu_seqlens's values. They travel as token-major rows, which one row gather
puts in batch order (and one row scatter takes back for the gradients). Only the key chunks a
query chunk can see are computed, so a sliding window costs its visible band; the whole of K and
V is still gathered. Packed documents on FA4 run each query chunk against its visible prefix as
one segment (``tiles.plan_calls``' ``ends_aligned``): two varlen calls on zigzag shards, one on
contiguous ones, with no merge.
"""
from typing import Optional

import torch
from torch import Tensor

from attn_compile.kernels.dispatch import runs_ends_aligned
from attn_compile.kernels.documents import packed, unpacked
from attn_compile.kernels.result_layout import as_grad

from .checks import check_call, sharding_of
from .comm import all_gather_stacked, reduce_scatter_stacked, resolve, sized_group
from .documents import ChunkSharding
from .failures import failing_together
from .grad_sum import GradSum
from .merge import MergedResult, empty_result
from .registration import nothing_kept, register_kept_kv
from .tiles import attend_tiles, attend_tiles_backward, k_parts, plan_calls, q_parts


def _gather_sequence(x, group, sharding):
    if isinstance(sharding, ChunkSharding):  # packed documents: token-major rows, one row gather
        return unpacked(sharding.gather_rows(all_gather_stacked(sharding.pad(packed(x), 0), (group,))), 1)
    return sharding.join(all_gather_stacked(x, (group,)), dim=2)


def _reduce_scatter_sequence(grad, group, sharding):
    """_gather_sequence's gradient: this rank's rows of the sum over ranks, in grad's dtype."""
    if isinstance(sharding, ChunkSharding):
        summed = reduce_scatter_stacked(sharding.scatter_rows(packed(grad)), group)
        return unpacked(summed[:sharding.local_len(group.rank())], 1)
    return reduce_scatter_stacked(sharding.split(grad, dim=2), group)


def _calls(q, k, v, group, sharding, is_causal, window):
    """Each query chunk against the keys it sees: among packed documents, where the kernels take
    segments that end together, its whole visible prefix in one segment (no merge, larger calls)."""
    ends_aligned = isinstance(sharding, ChunkSharding) and runs_ends_aligned(q, k, v, is_causal=is_causal,
                                                                            window=window)
    return plan_calls(sharding.chunks(group.rank()), sharding.whole_chunks(), is_causal, window, ends_aligned)


def allgather_forward(q, k, v, group, scale, is_causal, window, sharding):
    k_all, v_all = _gather_sequence(k, group, sharding), _gather_sequence(v, group, sharding)
    calls = _calls(q, k, v, group, sharding, is_causal, window)
    result = MergedResult(q, v, q_parts(calls))
    attend_tiles(q, k_all, v_all, calls, scale, result)
    return result.out, result.lse, k_all, v_all


def allgather_backward(dout, q, k, v, out, lse, k_all, v_all, group, scale, is_causal, window, sharding):
    if k_all is None:
        k_all, v_all = _gather_sequence(k, group, sharding), _gather_sequence(v, group, sharding)
    calls = _calls(q, k, v, group, sharding, is_causal, window)
    dq = GradSum(q, q_parts(calls))
    # the whole sequence's dK and dV sum over every rank's: float32 until the reduce-scatter has added them
    dk_all, dv_all = (GradSum(x, k_parts(calls), dtype=lse.dtype) for x in (k_all, v_all))
    attend_tiles_backward(dout, q, k_all, v_all, out, lse, calls, scale, dq, dk_all, dv_all)
    dk, dv = (as_grad(_reduce_scatter_sequence(g.result(), group, sharding).to(x.dtype), x)
              for g, x in ((dk_all, k), (dv_all, v)))
    return dq.result(), dk, dv


@torch.library.custom_op("attn_cp::allgather_attention", mutates_args=())
def allgather_attention(q: Tensor, k: Tensor, v: Tensor, group_name: str, group_size: int, scale: float,
                        is_causal: bool, layout: str, recompute_kv: bool, window_left: int = -1,
                        window_right: int = -1, cu_seqlens: Optional[Tensor] = None, max_seqlen: int = 0
                        ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Returns (out, lse, k_all, v_all); k_all and v_all are the whole sequence's K and V, or
    empty with ``recompute_kv`` (packed documents need it: the whole batch's size is in cu_seqlens)."""
    (group,) = groups = (sized_group(group_name, group_size),)
    if cu_seqlens is not None and not recompute_kv:
        raise ValueError("packed documents (cu_seqlens) need recompute_kv=True: the gathered K and V have a size "
                         "that only cu_seqlens's values give")
    window = (window_left, window_right)
    sharding = check_call(q, k, v, groups, strategy="allgather", scale=scale, is_causal=is_causal, layout=layout,
                          window=window, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, recompute_kv=recompute_kv)
    with failing_together("attn_cp::allgather_attention"):
        out, lse, k_all, v_all = allgather_forward(q, k, v, group, scale, is_causal, window, sharding)
    return (out, lse, *nothing_kept(k, v)) if recompute_kv else (out, lse, k_all, v_all)


@allgather_attention.register_fake
def _(q, k, v, group_name, group_size, scale, is_causal, layout, recompute_kv, window_left=-1, window_right=-1,
      cu_seqlens=None, max_seqlen=0):
    if recompute_kv:
        return (*empty_result(q, v), *nothing_kept(k, v))
    return (*empty_result(q, v), *(x.new_empty((*x.shape[:2], x.shape[2] * group_size, x.shape[3])) for x in (k, v)))


@torch.library.custom_op("attn_cp::allgather_attention_backward", mutates_args=())
def allgather_attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                                 k_all: Optional[Tensor], v_all: Optional[Tensor], group_name: str, scale: float,
                                 is_causal: bool, layout: str, window_left: int = -1, window_right: int = -1,
                                 cu_seqlens: Optional[Tensor] = None, max_seqlen: int = 0
                                 ) -> tuple[Tensor, Tensor, Tensor]:
    """``k_all`` and ``v_all`` are the forward's gathered K and V, or None to gather them again."""
    (group,) = groups = resolve([group_name])
    with failing_together("attn_cp::allgather_attention_backward"):
        sharding = sharding_of(q, groups, layout, cu_seqlens)
        return allgather_backward(dout, q, k, v, out, lse, k_all, v_all, group, scale, is_causal,
                                  (window_left, window_right), sharding)


register_kept_kv(allgather_attention, allgather_attention_backward)
