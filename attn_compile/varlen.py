"""``varlen_attention``: attention over packed documents (THD), locally or context-parallel.

Tensors are (total_tokens, heads, dim); ``cu_seqlens`` (int32, leading 0) gives each document's
rows, and every token attends only within its document, at its position in it. GQA (h_q a
multiple of h_kv) and MLA (d_qk != d_v) are native: the output is (total_q, h_q, d_v).

Locally it is ``attn_cp::varlen_attention``: one Triton call on a GPU, one reference call per
document elsewhere. With ``group``, q, k, v are this rank's tokens from ``shard_varlen`` and
``cu_seqlens`` describes the whole batch; the context-parallel op splits each document into
2·cp chunks. ``max_seqlen`` is a plain int, and the fake functions take every shape from q, k
and v, so a compiled graph neither breaks nor recompiles when document lengths change.
"""
from typing import Optional

import torch
from torch import Tensor

from .cp.api import context_parallel_attention, window_pair
from .cp.checks import raise_on_every_rank
from .cp.comm import cp_size, process_groups
from .cp.documents import check_cu_seqlens, cu_seqlens_error
from .kernels import varlen_backward as _kernel_backward
from .kernels.documents import packed, unpacked
from .kernels import varlen_forward as _kernel_forward
from .kernels.reference import lse_dtype
from .ops import default_scale


def check_varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window, check_values=False,
                      seqused_k=None):
    """Shapes, dtypes and devices; with ``check_values`` also the cumulative lengths' values (and
    ``seqused_k``'s), which costs a device sync on a GPU and cannot be done on fake tensors."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 3:
            raise ValueError(f"{name} must be 3-D (total_tokens, heads, dim); got shape {tuple(x.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        raise ValueError(f"q, k and v must share one floating-point dtype; got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k and v must have the same tokens and heads; got k={tuple(k.shape)}, v={tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"q heads must be a multiple of k/v heads (GQA); got h_q={q.shape[1]}, h_kv={k.shape[1]}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must have the same head dim; got q={q.shape[2]}, k={k.shape[2]}")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        check_cu_seqlens(name, cu)
        if cu.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}; got {cu.device}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must count the same documents; got "
                         f"{cu_seqlens_q.numel() - 1} and {cu_seqlens_k.numel() - 1}")
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if value < 0:
            raise ValueError(f"{name} must be a length >= 0; got {value}")
    if window[0] < -1 or window[1] < -1:
        raise ValueError(f"window must be (left, right) with each >= 0, or -1 for unbounded; got {tuple(window)}")
    if seqused_k is not None and (seqused_k.dim() != 1 or seqused_k.shape[0] != cu_seqlens_k.shape[0] - 1
                                  or seqused_k.dtype != torch.int32 or seqused_k.device != q.device):
        raise ValueError(f"seqused_k must be int32 (documents,) = ({cu_seqlens_k.shape[0] - 1},) on q's device; got "
                         f"{seqused_k.dtype} {tuple(seqused_k.shape)} on {seqused_k.device}")
    if check_values:
        for name, x, cu, longest in (("q", q, cu_seqlens_q, max_seqlen_q), ("k", k, cu_seqlens_k, max_seqlen_k)):
            error = cu_seqlens_error(f"cu_seqlens_{name}", cu.tolist(), x.shape[0], f"{name}.shape[0]", longest,
                                     f"max_seqlen_{name}")
            if error:
                raise ValueError(error)
        if seqused_k is not None:
            lengths = cu_seqlens_k.diff()
            if bool((seqused_k < 0).any() or (seqused_k > lengths).any()):
                raise ValueError(f"seqused_k must be between 0 and each document's key count {lengths.tolist()}; "
                                 f"got {seqused_k.tolist()}")


@torch.library.custom_op("attn_cp::varlen_attention", mutates_args=())
def _varlen_op(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
               max_seqlen_k: int, is_causal: bool, scale: float, window_left: int, window_right: int,
               debug: bool, seqused_k: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    window = (window_left, window_right)
    check_varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window,
                      check_values=q.device.type == "cpu" or debug, seqused_k=seqused_k)
    out, lse = _kernel_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale=scale,
                               is_causal=is_causal, window=window, seqused_k=seqused_k)
    return out.contiguous(), lse.contiguous()


@_varlen_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale, window_left, window_right,
      debug, seqused_k=None):
    check_varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, (window_left, window_right),
                      seqused_k=seqused_k)
    return q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty(q.shape[:-1], dtype=lse_dtype(q.dtype))


@torch.library.custom_op("attn_cp::varlen_attention_backward", mutates_args=())
def _varlen_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens_q: Tensor,
                        cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, is_causal: bool, scale: float,
                        window_left: int, window_right: int,
                        seqused_k: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    grads = _kernel_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             scale=scale, is_causal=is_causal, window=(window_left, window_right), seqused_k=seqused_k)
    return tuple(g.contiguous() for g in grads)


@_varlen_backward_op.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *config, seqused_k=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, *config, _debug, seqused_k = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k)
    ctx.config = config


def _backward(ctx, dout, _dlse):
    *saved, seqused_k = ctx.saved_tensors
    dq, dk, dv = _varlen_backward_op(dout, *saved, *ctx.config, seqused_k=seqused_k)
    return dq, dk, dv, *[None] * 10


_varlen_op.register_autograd(_backward, setup_context=_setup_context)


def _sharded_batch_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 3:
            return f"{name} must be 3-D (total_tokens, heads, dim); got shape {tuple(x.shape)}"
    if cu_seqlens_k is not cu_seqlens_q or max_seqlen_k != max_seqlen_q:
        return ("under context parallelism q, k and v are shards of one packed batch: pass the same cu_seqlens "
                "tensor as cu_seqlens_q and cu_seqlens_k, and max_seqlen_q == max_seqlen_k")
    return None


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
                     is_causal: bool = False, scale: Optional[float] = None, window=None, group=None,
                     strategy: str = "auto", layout: str = "zigzag", recompute_kv: bool = False, return_lse: bool = False,
                     debug: bool = False):
    """Attention within each packed document: out (total_q, h_q, d_v), and with ``return_lse`` the
    log-sum-exp (total_q, h_q), float32, which carries no gradient.

    q (total_q, h_q, d_qk), k (total_k, h_kv, d_qk), v (total_k, h_kv, d_v). ``cu_seqlens_q``,
    ``cu_seqlens_k``: int32 (documents + 1,), starting at 0. Each document's queries and keys start
    at position 0 (causal is top-left aligned, as in SDPA). ``window=(left, right)``: query i sees
    keys i-left..i+right of its document, -1 unbounded. ``debug``: also check cu_seqlens's values
    on a GPU, which costs a device sync (on the CPU they are always checked).

    ``group`` (a ProcessGroup or 1-D DeviceMesh, or a 2-D DeviceMesh for "hybrid") makes it
    context-parallel: q, k, v are this rank's tokens from ``shard_varlen(x, cu_seqlens, group,
    layout)``, ``cu_seqlens_q`` is ``cu_seqlens_k`` and describes the whole batch, and
    ``strategy`` is "ring", "allgather", "ulysses", "hybrid" or "auto". ``recompute_kv``: a ring of
    two ranks receives the other rank's keys again in backward instead of keeping the rows it
    received (all-gather always gathers again for packed documents).
    """
    scale = default_scale(q, scale)
    if group is None and strategy != "auto":
        raise ValueError(f"strategy={strategy!r} needs a group; without one varlen_attention runs locally")
    if group is None or cp_size(process_groups(group)) == 1:
        out, lse = _varlen_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale,
                              *window_pair(window), debug)
        return (out, lse) if return_lse else out
    problem = _sharded_batch_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if problem:
        raise_on_every_rank(process_groups(group), q, k, v, problem)
    out, lse = context_parallel_attention(
        *(unpacked(x, 1) for x in (q, k, v)), group=group, strategy=strategy, is_causal=is_causal,
        scale=scale, layout=layout, return_lse=True, recompute_kv=recompute_kv, window=window, cu_seqlens=cu_seqlens_q,
        max_seqlen=max_seqlen_q)
    out, lse = packed(out), packed(lse)
    return (out, lse) if return_lse else out
