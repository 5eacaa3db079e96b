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

Key padding, without a window: a row whose real keys are one run ``[start, end)`` (Hugging Face's
left or right padding) is exact with FA4's packed path, the run's queries against the run's keys
(the two lengths agree, so the alignments agree) and, under a causal mask, the queries after the
run against the whole run, unmasked; queries before the run see no key. The runs are found on the
device, with no sync. A row whose real keys have holes is recomputed by the Triton kernels: they
are handed a padding mask that is empty in every other row, which they skip at no cost, and the
rows are selected on the device.

Document ids (B, S): each row's runs of equal ids are FA4 segments of one packed call, so a run's
queries see its keys under causal and window masks unchanged (the two lengths agree). The number
of runs is not known on the host, so the call has a fixed budget of ``segment_budget`` segments:
``torch.nonzero_static`` finds the first budget + 1 run starts on the device, and segments the
batch does not fill are empty (they start at the end). A row whose runs are not all distinct
documents (an id that comes back, found by comparing the row's changes of id with those of its
sorted ids) or that has runs past the budget is recomputed by the Triton kernels, selected on the
device like the rows with holes above. Each segment costs FA4's grid about one CTA per head
whether it is filled or not (``SingleTileVarlenScheduler``: (tokens + segments * (tile - 1)) /
tile blocks per head, in the forward, in the backward's main kernel (over key tiles) and in its
pre- and post-processing), so the budget grows with the tokens: one segment per row plus one
per ``TOKENS_PER_SEGMENT`` tokens.

Refusals found and kept out by ``supports``: float32, head dims over 256 or not a multiple of 8
(sm100: up to 128, or 192/128, or 256/256), tensor masks, a window with key padding (each row
would need its own alignment), document ids with key padding or with queries and keys at other
positions (a context-parallel tile: the op takes document ids only where S_q == S_k and the
offsets agree), and the backward of GQA with ``d_qk != d_v`` ("GQA backward requires head_dim ==
head_dim_v"), which goes to cuDNN.
"""
import functools

import torch

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
            and not p.has_mask and interface() is not None):
        return False
    if p.backward and p.h_q != p.h_kv and p.d_qk != p.d_v:
        return False
    if p.has_documents:
        return not p.has_key_padding and p.s_q == p.s_k and p.k_shift == 0
    if p.has_key_padding:
        return not p.windowed and not p.offset and p.s_q == p.s_k
    return window_sides(p.is_causal, p.window, p.s_q, p.s_k, p.k_shift) is not None


def _bshd(x):
    """(B, H, S, D) -> FA4's (B, S, H, D), a view."""
    return x.transpose(1, 2)


def attention_forward(q, k, v, *, scale, is_causal=False, window=(-1, -1), key_padding_mask=None, q_offset=0,
                      k_offset=0, document_ids=None, softcap=0.0, **_unused_masking):
    """(out (B, h_q, S_q, d_v) in q's dtype and q's memory order, lse (B, h_q, S_q) float32)."""
    segments = _segments(key_padding_mask, document_ids)
    if segments is not None:
        return _packed_forward(q, k, v, segments, scale=scale, is_causal=is_causal, window=window, softcap=softcap)
    out = empty_out(q, v.shape[-1])
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    sides = window_sides(is_causal, window, q.shape[2], k.shape[2], k_offset - q_offset)
    interface()._flash_attn_fwd(_bshd(q), _bshd(k), _bshd(v), softmax_scale=scale, window_size_left=sides[0],
                                window_size_right=sides[1], softcap=softcap, out=_bshd(out), lse=lse,
                                return_lse=True)
    return out, lse


def attention_backward(dout, q, k, v, out, lse, *, scale, is_causal=False, window=(-1, -1), key_padding_mask=None,
                       q_offset=0, k_offset=0, document_ids=None, softcap=0.0, **_unused_masking):
    """(dq, dk, dv), each in its input's strides, given the final (possibly merged) out and lse."""
    out = out.to(q.dtype)
    segments = _segments(key_padding_mask, document_ids)
    if segments is not None:
        return _packed_backward(dout, q, k, v, out, lse, segments, scale=scale, is_causal=is_causal, window=window,
                                softcap=softcap)
    sides = window_sides(is_causal, window, q.shape[2], k.shape[2], k_offset - q_offset)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    interface()._flash_attn_bwd(_bshd(q), _bshd(k), _bshd(v), _bshd(out), _bshd(dout), lse.contiguous(), scale,
                                False, softcap, window_size_left=sides[0], window_size_right=sides[1],
                                dq=_bshd(dq), dk=_bshd(dk), dv=_bshd(dv))
    return dq, dk, dv


# A batch as FA4 segments ----------------------------------------------------------------------------------------
#
# Key padding and document ids both run as packed FA4 calls over the batch's B * S tokens (row b's
# token i at b * S + i), with the rows FA4 cannot run recomputed by the Triton kernels. A segments
# object gives ``calls(is_causal, window)``, the keyword arguments of each FA4 call;
# ``triton_rows``, the (B,) bool rows to recompute, and ``triton_masking``, the masks that make
# the Triton kernels compute those rows only; and ``zeroed``: whether some tokens lie in no
# segment, so results start as what a query that sees no key gets.


def _segments(key_padding_mask, document_ids):
    if document_ids is not None:
        return _Documents(document_ids)
    return None if key_padding_mask is None else _Runs(key_padding_mask)


class _Runs:
    """Key padding: each batch row's real keys as a run [start, start + length), and the rows with
    holes in it, all found on the device. No window (``supports`` refuses it)."""
    zeroed = True  # queries before a run see no key, and padding keys get no gradient

    def __init__(self, key_padding_mask):
        batch, s = key_padding_mask.shape
        positions = torch.arange(s, device=key_padding_mask.device, dtype=torch.int32)
        start = torch.where(key_padding_mask, positions, s).amin(1)
        end = torch.where(key_padding_mask, positions + 1, 0).amax(1)
        self.length = (end - start).clamp_min(0).to(torch.int32)
        self.triton_rows = key_padding_mask.sum(1, dtype=torch.int32) != self.length  # holes
        self.triton_masking = dict(key_padding_mask=key_padding_mask & self.triton_rows[:, None])
        self.rows = torch.arange(batch + 1, device=key_padding_mask.device, dtype=torch.int32) * s
        self.starts = torch.cat([self.rows[:-1] + start.clamp_max(s).to(torch.int32), self.rows[-1:]])
        self.after = torch.cat([self.rows[:-1] + end.to(torch.int32), self.rows[-1:]])
        self.after_length = (s - end).to(torch.int32).clamp_min(0)
        self.s = s

    def calls(self, is_causal, window):
        """The run's queries against the run (causal) and the queries after it against the whole
        run; without a causal mask every query sees the whole run. The keys are the runs."""
        calls = [(self.starts, self.length, True), (self.after, self.after_length, False)] if is_causal else \
            [(self.rows, None, False)]
        return [dict(cu_seqlens_q=segments, seqused_q=lengths, cu_seqlens_k=self.starts, seqused_k=self.length,
                     max_seqlen_q=self.s, max_seqlen_k=self.s, causal=causal) for segments, lengths, causal in calls]


TOKENS_PER_SEGMENT = 256


def segment_budget(batch: int, s: int) -> int:
    """How many FA4 segments a (B, S) batch of document ids gets: one per row (every row starts a
    run) and one per ``TOKENS_PER_SEGMENT`` tokens, so documents that average that length or more
    fit. The budget's unfilled segments cost most where documents are a little longer: with
    documents of D tokens and 128-row tiles, B * S * (1/256 - 1/D) CTAs per head that find no tile
    and exit, beside B * S / 128 * (D/128 + 1) / 2 tiles of causal work (query tile x key tile),
    at most a tenth as many (D = 512) and 3% by D = 4096; one segment per 128 tokens would reach a
    third, one per 512 tokens 3%, but send rows of documents under 512 tokens to Triton."""
    return batch + batch * s // TOKENS_PER_SEGMENT


class _Documents:
    """Document ids: each batch row's runs of equal ids as the segments of one FA4 call, up to
    ``segment_budget``, found on the device. Rows whose runs are not distinct documents or that
    run past the budget go to the Triton kernels."""
    zeroed = False  # every token of a row FA4 runs lies in a segment

    def __init__(self, document_ids):
        batch, s = document_ids.shape
        ids = document_ids.view(torch.uint8) if document_ids.dtype == torch.bool else document_ids
        starts = torch.ones_like(ids, dtype=torch.bool)
        starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
        ordered = ids.sort(1).values
        returns = (ordered[:, 1:] != ordered[:, :-1]).sum(1) != (starts[:, 1:]).sum(1)  # fewer ids than runs
        # Segment t is the run [cu[t], cu[t + 1]); past the last run start, cu holds the end.
        self.cu = torch.nonzero_static(starts.flatten(), size=segment_budget(batch, s) + 1,
                                       fill_value=batch * s)[:, 0].to(torch.int32)
        ends = torch.arange(1, batch + 1, device=ids.device) * s
        self.triton_rows = returns | (ends > self.cu[-1])  # the row's last run reaches past the segments
        self.triton_masking = dict(document_ids=document_ids, key_padding_mask=self.triton_rows[:, None].expand(-1, s))
        self.s = s

    def calls(self, is_causal, window):
        sides = window_sides(is_causal, window, 0, 0, 0)
        return [dict(cu_seqlens_q=self.cu, cu_seqlens_k=self.cu, max_seqlen_q=self.s, max_seqlen_k=self.s,
                     window_size_left=sides[0], window_size_right=sides[1])]


def _packed(x):
    """(B, H, S, D) -> (B * S, H, D): a view where the batch and sequence dims merge, else a copy."""
    return _bshd(x).flatten(0, 1)


def _unpacked(x, like):
    """A packed (B * S, H, D) result as ``like``'s (B, H, S, D), a view."""
    return x.unflatten(0, (like.shape[0], like.shape[2])).transpose(1, 2)


def _triton():
    from . import triton_attention
    return triton_attention


def _rows_replaced(results, rows, replacements):
    """Each of ``results`` (batch first) with the batch rows flagged in ``rows`` taken from
    ``replacements``, in place and on the device."""
    return tuple(torch.where(rows.view(-1, *(1,) * (result.dim() - 1)), new, result, out=result)
                 for result, new in zip(results, replacements))


def _packed_forward(q, k, v, segments, *, scale, is_causal, window, softcap):
    b, h, s, _ = q.shape
    inputs = [_packed(x) for x in (q, k, v)]
    if segments.zeroed:
        out = q.new_zeros(b * s, h, v.shape[-1])
        lse = torch.full((h, b * s), float("-inf"), dtype=torch.float32, device=q.device)
    else:
        out = q.new_empty(b * s, h, v.shape[-1])
        lse = torch.empty((h, b * s), dtype=torch.float32, device=q.device)
    for call in segments.calls(is_causal, window):
        interface()._flash_attn_fwd(*inputs, softmax_scale=scale, softcap=softcap, out=out, lse=lse, return_lse=True,
                                    **call)
    out, lse = as_out(_unpacked(out, q), q), lse.unflatten(1, (b, s)).transpose(0, 1).contiguous()
    recomputed = _triton().attention_forward(q, k, v, scale=scale, is_causal=is_causal, window=window,
                                             softcap=softcap, **segments.triton_masking)
    return _rows_replaced((out, lse), segments.triton_rows, recomputed)


def _packed_backward(dout, q, k, v, out, lse, segments, *, scale, is_causal, window, softcap):
    inputs = [_packed(x) for x in (q, k, v, out, dout)]
    lse_packed = lse.transpose(0, 1).flatten(1).contiguous()
    grads = [(torch.zeros_like if segments.zeroed else torch.empty_like)(x) for x in inputs[:3]]
    for n, call in enumerate(segments.calls(is_causal, window)):
        # The queries of the calls differ, their keys (the runs) do not: dK and dV add up.
        into = grads if n == 0 else [grads[0], *map(torch.zeros_like, grads[1:])]
        interface()._flash_attn_bwd(*inputs, lse_packed, scale, softcap=softcap, dq=into[0], dk=into[1], dv=into[2],
                                    **call)
        if n:
            grads[1] += into[1]
            grads[2] += into[2]
    grads = [as_grad(_unpacked(grad, x), x) for grad, x in zip(grads, (q, k, v))]
    recomputed = _triton().attention_backward(dout, q, k, v, out, lse, scale=scale, is_causal=is_causal,
                                              window=window, softcap=softcap, **segments.triton_masking)
    return _rows_replaced(grads, segments.triton_rows, recomputed)


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
    """Packed documents: their query and key positions must line up (one cu_seqlens tensor) for
    any mask, FA4 aligning its masks bottom-right."""
    return supports(p) and not p.offset


class FA4:
    """The dense kernels as dispatch.py sees a kernel."""
    name = "fa4"
    supports = staticmethod(supports)
    forward = staticmethod(attention_forward)
    backward = staticmethod(attention_backward)


class FA4Varlen:
    """The packed-document kernels as dispatch.py sees a varlen kernel."""
    name = "fa4"
    supports = staticmethod(supports_varlen)
    forward = staticmethod(varlen_forward)
    backward = staticmethod(varlen_backward)
