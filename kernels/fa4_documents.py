"""(B, S) document ids on FlashAttention-4, with no host sync: the same-document mask, ANDed with
the causal mask or window, as FA4's ``mask_mod``, which reads the ids on the device, and the
block tables that let FA4 skip the blocks no document (or no band) reaches and run unmasked the
blocks wholly inside one document and the band (``triton_document_blocks.py``, one launch per
call).

FA4's packed varlen path would need the documents' cumulative lengths on the host: a sync per
call, and no CUDA graph (``dispatch.py`` keeps it for calls that bring lengths). This path takes
the ids as they are, so it also runs ids that come back after another document.

The block sizes follow FA4's sm90 tiles (``flash_attn.cute.interface``: ``_tile_size_fwd_sm90``,
``_tile_size_bwd_sm90``), which a block table must be a multiple of; FA4 checks them and raises
where they do not fit. Refusals kept out by ``supports``, beyond those of the dense kernel
(``fa4.supports``): anything but sm90, softcap, key padding, position offsets and head dims
other than d_qk == d_v <= 128 or 192/128 without GQA (the ones measured and tested on the GPU).
Windows are taken, but the dispatch gives windowed document ids to Triton, which measured faster
(``dispatch._first``).
"""
import dataclasses
import functools

import torch

from . import fa4
from .problem import Problem
from .result_layout import empty_out
from .visibility import effective_window

QUERY_BLOCK = 128


@functools.cache
def _mask_mod(left, right):
    """The FA4 ``mask_mod`` (CuTe DSL) of the same-document mask ANDed with the band
    ``i - left <= j <= i + right`` (-1 unbounded), made once per band. FA4's compile cache keys on
    the function's source and the reprs of what it captures, so it captures only modules and ints
    (a function's repr holds its address, which changes from process to process)."""
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute import utils

    @cute.jit
    def same_document(batch, head, m_idx, n_idx, seqlen_info, aux_tensors):
        ids = aux_tensors[0]
        # A block's rows and keys past S are masked by FA4; clamped here so the reads stay inside.
        q = cutlass.min(m_idx[0], seqlen_info.seqlen_q - 1)
        k = cutlass.min(n_idx[0], seqlen_info.seqlen_k - 1)
        visible = (utils.scalar_to_ssa(ids[batch[0], q], ids.element_type)
                   == utils.scalar_to_ssa(ids[batch[0], k], ids.element_type))
        if cutlass.const_expr(right >= 0):
            visible = visible & (n_idx <= m_idx + utils.scalar_to_ssa(right, cutlass.Int32))
        if cutlass.const_expr(left >= 0):
            visible = visible & (n_idx + utils.scalar_to_ssa(left, cutlass.Int32) >= m_idx)
        return visible

    return same_document


def key_block(d_qk, backward):
    """The key block of the tables: FA4's sm90 key tile for this head dim (d_v is 128 or d_qk)."""
    return 96 if backward and d_qk > 128 else 128


def supports(p: Problem) -> bool:
    if not (p.has_documents and p.sm[0] == 9 and not p.softcapped and not p.has_key_padding
            and not p.offset and p.s_q == p.s_k
            and (p.d_qk == p.d_v <= 128 or ((p.d_qk, p.d_v) == (192, 128) and p.h_q == p.h_kv))):
        return False
    return fa4.supports(dataclasses.replace(p, has_documents=False))


def _tables(document_ids, d_qk, band, backward):
    from .triton_document_blocks import document_blocks
    keys = key_block(d_qk, backward)
    tables = document_blocks(document_ids, QUERY_BLOCK, keys, band, rows_are_queries=not backward)
    return fa4.interface().BlockSparseTensorsTorch(*tables, block_size=(QUERY_BLOCK, keys))


def _mask_args(document_ids, d_qk, is_causal, window, backward):
    ids = (document_ids.int() if document_ids.dtype == torch.bool else document_ids).contiguous()
    band = effective_window(is_causal, tuple(window))
    return dict(mask_mod=_mask_mod(*band), aux_tensors=[ids], block_sparse_tensors=_tables(ids, d_qk, band, backward))


def attention_forward(q, k, v, *, scale, document_ids, is_causal=False, window=(-1, -1), **_unused_masking):
    """(out (B, h_q, S, d_v) in q's dtype and q's memory order, lse (B, h_q, S) float32)."""
    out = empty_out(q, v.shape[-1])
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    fa4.interface()._flash_attn_fwd(fa4.bshd(q), fa4.bshd(k), fa4.bshd(v), softmax_scale=scale, out=fa4.bshd(out),
                                    lse=lse, return_lse=True,
                                    **_mask_args(document_ids, q.shape[-1], is_causal, window, False))
    return out, lse


def attention_backward(dout, q, k, v, out, lse, *, scale, document_ids, is_causal=False, window=(-1, -1),
                       **_unused_masking):
    """(dq, dk, dv), each in its input's strides."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    fa4.interface()._flash_attn_bwd(*map(fa4.bshd, (q, k, v, out.to(q.dtype), dout)), lse.contiguous(), scale, False,
                                    0.0, dq=fa4.bshd(dq), dk=fa4.bshd(dk), dv=fa4.bshd(dv),
                                    **_mask_args(document_ids, q.shape[-1], is_causal, window, True))
    return dq, dk, dv


class FA4Documents:
    """The kernel as dispatch.py sees it."""
    name = "fa4 mask_mod"
    supports = staticmethod(supports)
    forward = staticmethod(attention_forward)
    backward = staticmethod(attention_backward)
