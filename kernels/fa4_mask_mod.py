"""Masks read on the device, on FlashAttention-4, with no host sync: (B, S) document ids (the
same-document mask) or a (B, S) key padding mask (the real keys), ANDed with the causal mask or
window, as FA4's ``mask_mod``, and the block tables that let FA4 skip the blocks no pair reaches
and run unmasked the blocks wholly inside one document, or wholly real, and the band
(``triton_mask_blocks.py``, one launch per call).

FA4's packed varlen path would need the documents' cumulative lengths on the host: a sync per
call, and no CUDA graph (``dispatch.py`` keeps it for calls that bring lengths). This path takes
the ids as they are, so it also runs ids that come back after another document. For key padding
it is exact for any mask (holes, rows without a real key: out 0, LSE -inf, zero gradients, as
FA4 writes rows and keys no pair reaches), in one FA4 launch where FA4's key padding path
(``fa4.py``) makes two packed ones and up to five Triton launches beside them; the dispatch
chooses between the two by measured speed (``ranking.py``).

The block sizes follow FA4's sm90 tiles (``flash_attn.cute.interface``: ``_tile_size_fwd_sm90``,
``_tile_size_bwd_sm90``), which a block table must be a multiple of; FA4 checks them and raises
where they do not fit. Refusals kept out by ``supports``, beyond those of the dense kernel
(``fa4.supports``): anything but sm90, no Triton (the tables' kernel), softcap, document ids
with key padding, position offsets, queries and keys of different lengths, and head dims other
than d_qk == d_v <= 128 or 192/128 without GQA (the ones measured and tested on the GPU).
"""
import dataclasses
import functools

import torch

from . import fa4
from .kernel import Kernel
from .problem import Problem
from .result_layout import empty_out
from .visibility import effective_window, mask_bytes

try:  # the block tables' kernel; as in dispatch.py, triton is a Linux-only dependency
    from .triton_mask_blocks import mask_blocks
except ImportError:
    mask_blocks = None

QUERY_BLOCK = 128


@functools.cache
def _mask_mod(left, right, keys_only):
    """The FA4 ``mask_mod`` (CuTe DSL) of the same-document mask ANDed with the band
    ``i - left <= j <= i + right`` (-1 unbounded), made once per band; ``keys_only``: the ids are
    a key padding mask's (1 on a real key), and every query's id is 1. FA4's compile cache keys
    on the function's source and the reprs of what it captures, so it captures only modules, ints
    and a bool (a function's repr holds its address, which changes from process to process)."""
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute import utils

    @cute.jit
    def same_document(batch, head, m_idx, n_idx, seqlen_info, aux_tensors):
        ids = aux_tensors[0]
        # A block's rows and keys past S are masked by FA4; clamped here so the reads stay inside.
        k = cutlass.min(n_idx[0], seqlen_info.seqlen_k - 1)
        key = utils.scalar_to_ssa(ids[batch[0], k], ids.element_type)
        if cutlass.const_expr(keys_only):
            visible = key == utils.scalar_to_ssa(ids.element_type(1), ids.element_type)  # typed: uint8 ids
        else:
            q = cutlass.min(m_idx[0], seqlen_info.seqlen_q - 1)
            visible = utils.scalar_to_ssa(ids[batch[0], q], ids.element_type) == key
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
    """Document ids or a key padding mask (not both), on queries and keys at the same positions."""
    if not (p.has_documents != p.has_key_padding and p.sm[0] == 9 and not p.softcapped and not p.offset
            and p.s_q == p.s_k
            and (p.d_qk == p.d_v <= 128 or ((p.d_qk, p.d_v) == (192, 128) and p.h_q == p.h_kv))):
        return False
    return mask_blocks is not None and fa4.supports(dataclasses.replace(p, has_documents=False,
                                                                        has_key_padding=False))


def _mask_args(ids, keys_only, d_qk, is_causal, window, backward):
    """FA4's mask_mod, aux_tensors and block tables for document ids, or a key padding mask
    (``keys_only``)."""
    ids = mask_bytes(ids).contiguous()
    band = effective_window(is_causal, tuple(window))
    keys = key_block(d_qk, backward)
    tables = mask_blocks(ids, QUERY_BLOCK, keys, band, rows_are_queries=not backward, keys_only=keys_only)
    return dict(mask_mod=_mask_mod(*band, keys_only), aux_tensors=[ids],
                block_sparse_tensors=fa4.interface().BlockSparseTensorsTorch(*tables, block_size=(QUERY_BLOCK, keys)))


def _mask(document_ids, key_padding_mask):
    """(ids, keys_only) of the call's mask."""
    return (document_ids, False) if key_padding_mask is None else (key_padding_mask, True)


def attention_forward(q, k, v, *, scale, document_ids=None, key_padding_mask=None, is_causal=False, window=(-1, -1),
                      **_unused_masking):
    """(out (B, h_q, S, d_v) in q's dtype and q's memory order, lse (B, h_q, S) float32). Rows that
    see no key get out 0 and LSE -inf, FA4's way."""
    out = empty_out(q, v.shape[-1])
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    fa4.interface()._flash_attn_fwd(fa4.bshd(q), fa4.bshd(k), fa4.bshd(v), softmax_scale=scale, out=fa4.bshd(out),
                                    lse=lse, return_lse=True,
                                    **_mask_args(*_mask(document_ids, key_padding_mask), q.shape[-1], is_causal,
                                                 window, False))
    return out, lse


def attention_backward(dout, q, k, v, out, lse, *, scale, document_ids=None, key_padding_mask=None, is_causal=False,
                       window=(-1, -1), **_unused_masking):
    """(dq, dk, dv), each in its input's strides; zero for the rows and keys no pair reaches."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    fa4.interface()._flash_attn_bwd(*map(fa4.bshd, (q, k, v, out.to(q.dtype), dout)), lse.contiguous(), scale, False,
                                    0.0, dq=fa4.bshd(dq), dk=fa4.bshd(dk), dv=fa4.bshd(dv),
                                    **_mask_args(*_mask(document_ids, key_padding_mask), q.shape[-1], is_causal,
                                                 window, True))
    return dq, dk, dv


FA4MaskMod = Kernel("fa4 mask_mod", supports, attention_forward, attention_backward)
