"""Pure-PyTorch blockwise attention: online softmax over key blocks, fp32 (or fp64) accumulation.

It runs on any device and is both the CPU path and the oracle the fused kernels are checked
against. GQA is native: the h_q/h_kv query heads of a group are stacked along the row axis,
so every key block is read once per group and never repeated. d_qk and d_v are independent.
Rows that see no key produce output 0 and LSE -inf, and zero gradients. ``softcap`` > 0 caps
the scaled scores as ``softcap * tanh(scores / softcap)`` before any mask (Gemma 2's logit
softcapping); 0 leaves them as they are.
"""
import itertools

import torch

from .documents import packed, unpacked
from .visibility import Visibility, classify, effective_window, visible

BLOCK = 256


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The LSE is float32, except for float64 inputs, where it keeps the oracle's precision."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _grouped(x: torch.Tensor, h_kv: int, acc: torch.dtype) -> torch.Tensor:
    """(B, h_q, S, D) -> (B, h_kv, g*S, D): the query heads of one KV head stacked as rows."""
    b, h, s, d = x.shape
    return x.to(acc).reshape(b, h_kv, (h // h_kv) * s, d)


class _Blocks:
    """Shared by forward and backward: the key blocks to visit and the scores of each."""

    def __init__(self, q, k, scale, is_causal, window, attn_mask, key_padding_mask, q_offset, k_offset, softcap):
        self.b, self.h_q, self.s_q, _ = q.shape
        self.h_kv, self.s_k = k.shape[1], k.shape[2]
        self.g = self.h_q // self.h_kv
        self.acc = lse_dtype(q.dtype)
        self.scale, self.softcap = scale, softcap
        self.left, self.right = effective_window(is_causal, window)
        self.q_offset, self.k_offset = q_offset, k_offset
        self.q_pos = torch.arange(self.s_q, device=q.device) + q_offset
        self.mask = None
        if attn_mask is not None:
            self.mask = attn_mask.expand(self.b, self.h_q, self.s_q, self.s_k).unflatten(1, (self.h_kv, self.g))
        self.key_padding = None if key_padding_mask is None else key_padding_mask[:, None, None, None, :]

    def __iter__(self):
        for start in range(0, self.s_k, BLOCK):
            end = min(start + BLOCK, self.s_k)
            vis = classify(self.q_offset, self.s_q, self.k_offset + start, end - start, self.left, self.right)
            if vis is not Visibility.NONE:
                yield start, end, vis

    def scores(self, q_rows, k_blk, start, end, vis):
        """(scores, slope): scaled, capped and masked scores (B, h_kv, g, S_q, blk) in the
        accumulation dtype, and the derivative of the cap (1 - tanh²; None without a cap)."""
        s = (q_rows @ k_blk.transpose(-1, -2)).unflatten(2, (self.g, self.s_q)) * self.scale
        slope = None
        if self.softcap:
            capped = torch.tanh(s / self.softcap)
            s, slope = self.softcap * capped, 1 - capped * capped
        if self.mask is not None:
            m = self.mask[..., start:end]
            s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.to(self.acc)
        if self.key_padding is not None:
            s = s.masked_fill(~self.key_padding[..., start:end], float("-inf"))
        if vis is Visibility.PARTIAL:
            k_pos = torch.arange(start, end, device=s.device) + self.k_offset
            s = s.masked_fill(~visible(self.q_pos, k_pos, self.left, self.right), float("-inf"))
        return s, slope


def attention_forward(q, k, v, *, scale, is_causal=False, window=(-1, -1), attn_mask=None, key_padding_mask=None,
                      q_offset=0, k_offset=0, softcap=0.0):
    """Returns (out (B, h_q, S_q, d_v) in q's dtype, lse (B, h_q, S_q) float32)."""
    blocks = _Blocks(q, k, scale, is_causal, window, attn_mask, key_padding_mask, q_offset, k_offset, softcap)
    b, h_kv, g, s_q = blocks.b, blocks.h_kv, blocks.g, blocks.s_q
    acc = blocks.acc
    q_rows = _grouped(q, h_kv, acc)
    row_max = q.new_full((b, h_kv, g, s_q), float("-inf"), dtype=acc)
    row_sum = q.new_zeros((b, h_kv, g, s_q), dtype=acc)
    out = q.new_zeros((b, h_kv, g, s_q, v.shape[-1]), dtype=acc)
    for start, end, vis in blocks:
        s, _ = blocks.scores(q_rows, k[:, :, start:end].to(acc), start, end, vis)
        new_max = torch.maximum(row_max, s.amax(-1))
        shift = torch.where(new_max == float("-inf"), 0.0, new_max)
        p = torch.exp(s - shift[..., None])
        rescale = torch.exp(row_max - shift)
        row_sum = row_sum * rescale + p.sum(-1)
        pv = p.flatten(2, 3) @ v[:, :, start:end].to(acc)
        out = out * rescale[..., None] + pv.unflatten(2, (g, s_q))
        row_max = new_max
    seen = row_sum > 0
    out = torch.where(seen[..., None], out / torch.where(seen, row_sum, 1.0)[..., None], 0.0)
    lse = torch.where(seen, row_max + torch.log(torch.where(seen, row_sum, 1.0)), float("-inf"))
    return out.flatten(1, 2).to(q.dtype), lse.flatten(1, 2).to(lse_dtype(q.dtype))


def attention_backward(dout, q, k, v, out, lse, *, scale, is_causal=False, window=(-1, -1), attn_mask=None,
                       key_padding_mask=None, q_offset=0, k_offset=0, softcap=0.0):
    """Gradients (dq, dk, dv) given the final out and lse; works per key block, so a ring step
    can pass the merged out/lse of all steps and get exactly its share of the gradients."""
    blocks = _Blocks(q, k, scale, is_causal, window, attn_mask, key_padding_mask, q_offset, k_offset, softcap)
    h_kv, g, s_q = blocks.h_kv, blocks.g, blocks.s_q
    acc = blocks.acc
    q_rows = _grouped(q, h_kv, acc)
    do_rows = _grouped(dout, h_kv, acc)
    lse5 = lse.to(acc).unflatten(1, (h_kv, g))
    lse5 = torch.where(lse5 == float("-inf"), float("inf"), lse5)  # rows that saw nothing get p = 0
    delta = (dout.to(acc) * out.to(acc)).sum(-1).unflatten(1, (h_kv, g))
    dq = torch.zeros_like(q_rows)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    for start, end, vis in blocks:
        k_blk, v_blk = k[:, :, start:end].to(acc), v[:, :, start:end].to(acc)
        s, slope = blocks.scores(q_rows, k_blk, start, end, vis)
        p = torch.exp(s - lse5[..., None])
        dp = (do_rows @ v_blk.transpose(-1, -2)).unflatten(2, (g, s_q))
        ds = p * (dp - delta[..., None])
        if slope is not None:
            ds = ds * slope
        ds = ds.flatten(2, 3) * scale
        p = p.flatten(2, 3)
        dv[:, :, start:end] = p.transpose(-1, -2) @ do_rows
        dk[:, :, start:end] = ds.transpose(-1, -2) @ q_rows
        dq += ds @ k_blk
    return dq.reshape(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _document_rows(cu_seqlens_q, cu_seqlens_k, seqused_k=None):
    """(query rows, key rows) of each document; with ``seqused_k`` a document's keys are only the
    first ``seqused_k[i]`` of its rows."""
    bounds = [list(itertools.pairwise(cu.tolist())) for cu in (cu_seqlens_q, cu_seqlens_k)]
    if seqused_k is not None:
        bounds[1] = [(start, start + used) for (start, _), used in zip(bounds[1], seqused_k.tolist())]
    return [(slice(*q), slice(*k)) for q, k in zip(*bounds)]


def _dense(x):
    """A document's (L, H, ...) rows as a batch of one, (1, H, L, ...)."""
    return unpacked(x, 1)


def _positions(q_rows: slice, k_rows: slice, ends_aligned: bool) -> dict:
    """A document's query and key positions: both from 0 (top-left), or, ``ends_aligned``, its
    last query at its last key's position (bottom-right, as FA2 and FA4 align)."""
    if not ends_aligned:
        return {}
    return dict(q_offset=(k_rows.stop - k_rows.start) - (q_rows.stop - q_rows.start))


def varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, scale, is_causal=False,
                   window=(-1, -1), softcap=0.0, seqused_k=None, ends_aligned=False):
    """Packed documents (total, H, D), one call per document: out (total_q, h_q, d_v), lse (total_q, h_q).
    ``seqused_k``: (documents,) int, each document's keys are the first seqused_k[i] of its rows.
    ``ends_aligned``: masks align a document's last query with its last key (else its first ones)."""
    out = q.new_zeros((*q.shape[:-1], v.shape[-1]))
    lse = q.new_full(q.shape[:-1], float("-inf"), dtype=lse_dtype(q.dtype))
    for q_rows, k_rows in _document_rows(cu_seqlens_q, cu_seqlens_k, seqused_k):
        part_out, part_lse = attention_forward(_dense(q[q_rows]), _dense(k[k_rows]), _dense(v[k_rows]), scale=scale,
                                               is_causal=is_causal, window=window, softcap=softcap,
                                               **_positions(q_rows, k_rows, ends_aligned))
        out[q_rows], lse[q_rows] = packed(part_out), packed(part_lse)
    return out, lse


def varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, scale,
                    is_causal=False, window=(-1, -1), softcap=0.0, seqused_k=None, ends_aligned=False):
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for q_rows, k_rows in _document_rows(cu_seqlens_q, cu_seqlens_k, seqused_k):
        grads = attention_backward(_dense(dout[q_rows]), _dense(q[q_rows]), _dense(k[k_rows]), _dense(v[k_rows]),
                                   _dense(out[q_rows]), _dense(lse[q_rows]), scale=scale, is_causal=is_causal,
                                   window=window, softcap=softcap, **_positions(q_rows, k_rows, ends_aligned))
        for acc, rows, grad in zip((dq, dk, dv), (q_rows, k_rows, k_rows), grads):
            acc[rows] = packed(grad)
    return dq, dk, dv


def merge_into(out, lse, part_out, part_lse, *, into=None) -> None:
    """(out, lse) becomes the attention over both key sets: lse in place, out in place or, given
    ``into``, written there.

    out + sigmoid(part_lse - lse) * (part_out - out) is the softmax-weighted mean of the two
    without exp overflow. A side that saw no key has lse -inf and weight 0; when neither saw
    one the difference is NaN, and the row stays (0, -inf).
    """
    weight = torch.sigmoid(part_lse - lse).nan_to_num_(0.0).unsqueeze(-1)
    if into is None:
        out.add_(weight * (part_out - out))
    else:
        into.copy_(out + weight * (part_out - out))
    lse.copy_(torch.logaddexp(lse, part_lse))


def merge_rows_into(acc, acc_lse, part_out, part_lse, rows, part_start) -> None:
    """``merge_into`` of rows ``rows`` (dim 2) of the running (acc, acc_lse) with rows ``rows -
    part_start`` of the part, in place."""
    rows = rows.long()  # index_copy_ takes no other
    out, lse = acc.index_select(2, rows), acc_lse.index_select(2, rows)
    merge_into(out, lse, part_out.index_select(2, rows - part_start), part_lse.index_select(2, rows - part_start))
    acc.index_copy_(2, rows, out)
    acc_lse.index_copy_(2, rows, lse)


def add_rows_into(acc, part, rows, part_start) -> None:
    """Rows ``rows - part_start`` of ``part`` added into rows ``rows`` (dim 2) of ``acc``, in place."""
    rows = rows.long()  # index_add_ takes no other
    acc.index_add_(2, rows, part.index_select(2, rows - part_start).to(acc.dtype))
