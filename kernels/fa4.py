"""FlashAttention-4 (``flash-attn-4``, module ``flash_attn.cute``) behind the kernel interface.

FA4 is written in CuTe DSL: it installs from wheels, compiles each kernel variant on its first
call (2-7 s on an H100) and runs on Hopper (sm90) and Blackwell (sm100). It is imported lazily:
without it every call goes to the other kernels, exactly as before. ``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1``
keeps the compiled variants on disk for later processes.

Layout: FA4 takes (B, S, H, D). The op's (B, H, S, D) operands are usually transposed views of
such projections, so the transposes here are views and FA4 reads the memory as it lies; outputs
are written straight into the layouts ``result_layout.py`` promises.

Masks: FA4 aligns causal and window masks bottom-right where the query and key lengths differ,
while the op decides them on global positions (``q_offset + i``, ``k_offset + j``). A band
``-left <= (k_offset + j) - (q_offset + i) <= right`` is FA4's window ``(left + shift, right -
shift)`` with ``shift = (k_offset - q_offset) + (S_k - S_q)``; FA4 reads a negative side as
unbounded, so a tile whose band needs one is not taken (``window_sides``).

Key padding, without a window (measured faster than FA4's mask_mod path, ``fa4_mask_mod.py``,
beyond 4096 tokens; ``ranking.py``): a row whose real keys are one run ``[start, end)`` (Hugging Face's
left or right padding, or padding on both sides) is exact with FA4's packed path, the run's queries
against the run's keys (the two lengths agree, so the alignments agree) and, under a causal mask,
the queries after the run against the whole run, unmasked, in a second call; the queries before
the run see no key. The runs are found on the device, with no sync. Where a row has no query
after its run (left padding), the second call's segment has no key, and FA4 then does next to no
work. Rows and gradients that no call writes (queries before a run, padding keys) are filled
(``triton_runs.py``), so nothing is zeroed in full. A row whose real keys have holes is recomputed
by the Triton kernels, in place: they are handed a padding mask that is empty in every other row,
and leave those rows as FA4 wrote them (``into``), reading and writing nothing there.

Refusals found and kept out by ``supports``: float32, head dims over 256 or not a multiple of 8
(sm100: up to 128, or 192/128, or 256/256), tensor masks, document ids (``fa4_mask_mod.py`` runs
them), a window with key padding (each row would need its own alignment), and the backward of GQA
with ``d_qk != d_v`` ("GQA backward requires head_dim == head_dim_v"), which goes to cuDNN.
"""
import dataclasses
import functools

import torch

from .documents import packed, unpacked
from .kernel import Kernel
from .problem import Problem
from .result_layout import as_grad, as_out, empty_out
from .visibility import effective_window

_HALF = (torch.float16, torch.bfloat16)


@functools.cache
def interface():
    """``flash_attn.cute.interface``, or None where flash-attn-4 is not installed."""
    try:
        from flash_attn.cute import interface as fa4
    except ImportError:
        return None
    return fa4


def _head_dims_fit(p: Problem) -> bool:
    if p.d_qk % 8 or p.d_v % 8:
        return False
    if p.sm[0] == 9:
        return 8 <= p.d_qk <= 256 and 8 <= p.d_v <= 256
    return (p.d_qk <= 128 and p.d_v <= 128) or (p.d_qk, p.d_v) in ((192, 128), (256, 256))


def window_sides(is_causal, window, s_q, s_k, k_shift):
    """FA4's (window_size_left, window_size_right) for the op's band, None for an unbounded side,
    or None where FA4 cannot express it (a side would be negative)."""
    left, right = effective_window(is_causal, tuple(window))
    shift = k_shift + s_k - s_q
    sides = (None if left == -1 else left + shift, None if right == -1 else right - shift)
    return None if any(side is not None and side < 0 for side in sides) else sides


def supports(p: Problem) -> bool:
    if not (p.device_type == "cuda" and p.sm[0] in (9, 10) and p.dtype in _HALF and _head_dims_fit(p)
            and not p.has_mask and not p.has_documents and interface() is not None):
        return False
    if p.backward and p.h_q != p.h_kv and p.d_qk != p.d_v:
        return False
    if p.has_key_padding:
        return not p.windowed and not p.offset and p.s_q == p.s_k
    return window_sides(p.is_causal, p.window, p.s_q, p.s_k, p.k_shift) is not None


def bshd(x):
    """(B, H, S, D) -> FA4's (B, S, H, D), a view."""
    return x.transpose(1, 2)


def attention_forward(q, k, v, *, scale, is_causal=False, window=(-1, -1), key_padding_mask=None, q_offset=0,
                      k_offset=0, softcap=0.0, **_unused_masking):
    """(out (B, h_q, S_q, d_v) in q's dtype and q's memory order, lse (B, h_q, S_q) float32)."""
    if key_padding_mask is not None:
        return _padded_forward(q, k, v, scale, is_causal, key_padding_mask, softcap)
    out = empty_out(q, v.shape[-1])
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    sides = window_sides(is_causal, window, q.shape[2], k.shape[2], k_offset - q_offset)
    interface()._flash_attn_fwd(bshd(q), bshd(k), bshd(v), softmax_scale=scale, window_size_left=sides[0],
                                window_size_right=sides[1], softcap=softcap, out=bshd(out), lse=lse,
                                return_lse=True)
    return out, lse


def attention_backward(dout, q, k, v, out, lse, *, scale, is_causal=False, window=(-1, -1), key_padding_mask=None,
                       q_offset=0, k_offset=0, softcap=0.0, **_unused_masking):
    """(dq, dk, dv), each in its input's strides, given the final (possibly merged) out and lse."""
    out = out.to(q.dtype)
    if key_padding_mask is not None:
        return _padded_backward(dout, q, k, v, out, lse, scale, is_causal, key_padding_mask, softcap)
    sides = window_sides(is_causal, window, q.shape[2], k.shape[2], k_offset - q_offset)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    interface()._flash_attn_bwd(bshd(q), bshd(k), bshd(v), bshd(out), bshd(dout), lse.contiguous(), scale,
                                False, softcap, window_size_left=sides[0], window_size_right=sides[1],
                                dq=bshd(dq), dk=bshd(dk), dv=bshd(dv))
    return dq, dk, dv


# Dense batches as packed calls ---------------------------------------------------------------------------------


def packed_results(q, d_v):
    """Uninitialised out (B * S, H, d_v) and LSE (H, B * S) float32: FA4's packed layouts, for a
    dense (B, H, S, D) ``q`` run as packed segments."""
    b, h, s, _ = q.shape
    return q.new_empty(b * s, h, d_v), torch.empty((h, b * s), dtype=torch.float32, device=q.device)


def dense_results(out, lse, q):
    """``packed_results`` as the op returns them: out (B, H, S, d_v) in q's memory order, LSE (B, H, S)."""
    b, _, s, _ = q.shape
    return as_out(unpacked(out, b), q), lse.unflatten(1, (b, s)).transpose(0, 1).contiguous()


def packed_lse(lse):
    """The op's (B, H, S) LSE in FA4's packed (H, B * S)."""
    return lse.transpose(0, 1).flatten(1).contiguous()


def dense_grads(grads, inputs):
    """Packed (B * S, H, D) gradients of ``inputs`` (q, k, v), each in its input's strides."""
    return [as_grad(unpacked(grad, x.shape[0]), x) for grad, x in zip(grads, inputs)]


# Key padding ---------------------------------------------------------------------------------------------------


def _calls(runs, is_causal):
    """(query segments, their lengths, their keys' lengths, causal) for each packed call; the key
    segments start where the runs do (``triton_runs.Runs``). Under a causal mask the run's queries
    see the run causally, the queries after it the whole run (a second call), and those before it
    no key; so do all queries of a row with no real key (its run is empty, and all its queries come
    after it). The queries before a run are no call's: they are filled instead."""
    if not is_causal:  # every query sees the whole run
        return [(runs.rows, None, runs.length, False)]
    return [(runs.starts, runs.length, runs.length, True), (runs.after, runs.after_length, runs.after_keys, False)]


def _recomputed(runs, key_padding_mask):
    """The mask the Triton kernels recompute: the rows with holes in their runs, no other."""
    return key_padding_mask & (runs.holes != 0)[:, None]


def _packing(runs, s, segments, lengths, keys):
    return dict(cu_seqlens_q=segments, seqused_q=lengths, cu_seqlens_k=runs.starts, seqused_k=keys,
                max_seqlen_q=s, max_seqlen_k=s)


def _triton():
    from . import triton_attention
    return triton_attention


def _padded_forward(q, k, v, scale, is_causal, key_padding_mask, softcap):
    from .triton_runs import fill_runs, find_runs
    runs = find_runs(key_padding_mask)
    s = q.shape[2]
    inputs = [packed(x) for x in (q, k, v)]
    out, lse = packed_results(q, v.shape[-1])
    for segments, lengths, keys, causal in _calls(runs, is_causal):
        interface()._flash_attn_fwd(*inputs, softmax_scale=scale, causal=causal,
                                    softcap=softcap, out=out, lse=lse, return_lse=True,
                                    **_packing(runs, s, segments, lengths, keys))
    if is_causal:  # the queries before a run see no key
        fill_runs(out, runs.rows, runs.before, s, 0.0)
        fill_runs(lse.t().unsqueeze(-1), runs.rows, runs.before, s, float("-inf"))
    out, lse = dense_results(out, lse, q)
    return _triton().attention_forward(q, k, v, scale=scale, is_causal=is_causal, softcap=softcap,
                                       key_padding_mask=_recomputed(runs, key_padding_mask), into=(out, lse))


def _padded_backward(dout, q, k, v, out, lse, scale, is_causal, key_padding_mask, softcap):
    from .triton_runs import fill_runs, find_runs, finish_key_grads
    runs, s = find_runs(key_padding_mask), q.shape[2]
    inputs = [packed(x) for x in (q, k, v, out, dout)]
    lse_packed = packed_lse(lse)
    grads = [torch.empty_like(x) for x in inputs[:3]]
    calls = _calls(runs, is_causal)
    parts = [torch.empty_like(grad) for grad in grads[1:]] if len(calls) > 1 else [None, None]
    for (segments, lengths, keys, causal), (dk, dv) in zip(calls, (grads[1:], parts)):
        # The queries of the calls differ, their keys (the runs) do not: the second's dK and dV add on.
        interface()._flash_attn_bwd(*inputs, lse_packed, scale, causal, softcap, dq=grads[0], dk=dk, dv=dv,
                                    **_packing(runs, s, segments, lengths, keys))
    if is_causal:
        fill_runs(grads[0], runs.rows, runs.before, s, 0.0)
    for grad, part in zip(grads[1:], parts):
        finish_key_grads(grad, part, runs, s)
    grads = dense_grads(grads, (q, k, v))
    return _triton().attention_backward(dout, q, k, v, out, lse, scale=scale, is_causal=is_causal, softcap=softcap,
                                        key_padding_mask=_recomputed(runs, key_padding_mask), into=grads)


# Packed documents ----------------------------------------------------------------------------------------------


def varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, scale, is_causal=False,
                   window=(-1, -1), softcap=0.0):
    """(out (total_q, h_q, d_v), lse (total_q, h_q) float32) of packed documents, each at position 0."""
    sides = window_sides(is_causal, window, 0, 0, 0)
    out, lse, *_ = interface()._flash_attn_fwd(
        q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, softmax_scale=scale, window_size_left=sides[0], window_size_right=sides[1],
        softcap=softcap, return_lse=True)
    return out, lse.t().contiguous()


def varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, scale,
                    is_causal=False, window=(-1, -1), softcap=0.0):
    sides = window_sides(is_causal, window, 0, 0, 0)
    return interface()._flash_attn_bwd(
        q, k, v, out.to(q.dtype), dout, lse.t().contiguous(), scale, False, softcap, window_size_left=sides[0],
        window_size_right=sides[1], cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)


def supports_varlen(p: Problem) -> bool:
    """Packed documents: under any mask each segment's last query must sit at its last key's
    position, FA4's bottom-right alignment: one cu_seqlens tensor, segments the caller says are
    squares, or segments it says end together (``ends_aligned``). Each segment then aligns on its
    own, so the mask is judged as on a square, whatever the lengths of the buffers (a
    context-parallel step's packed call spans other query rows than key rows)."""
    return (not p.offset or p.ends_aligned) and supports(dataclasses.replace(p, s_k=p.s_q, k_shift=0))


FA4 = Kernel("fa4", supports, attention_forward, attention_backward)
FA4Varlen = Kernel("fa4", supports_varlen, varlen_forward, varlen_backward)  # packed documents
