"""(B, S) document ids on FlashAttention-4's varlen kernel, with no host sync: each batch row's runs
of equal ids are the segments of one packed FA4 call, their cumulative starts and lengths made on
the device (``triton_segments.py``). Causal masks and windows look only at position differences,
so inside a run they mean what they mean on the row.

The rows FA4 is given no segment for are computed by the Triton kernels, in place (``into``), with
the ids: rows whose ids fall (an id may come back after another document) and rows of more runs
than the call's budget. The rest the Triton launch leaves as FA4 wrote them, reading and writing
nothing there. The budget is a mean document length per direction, below which Triton is the
faster kernel (``MEAN_LENGTH``); it also bounds FA4's grid, one program per 128 queries and one
per segment slot.

Refusals kept out by ``supports``, beyond the dense FA4 kernel's (``fa4.supports``): key padding
with the ids, position offsets, queries and keys of different lengths, and what the Triton
kernels do not take (they run the marked rows).
"""
import dataclasses

import torch

from . import fa4
from .documents import packed
from .kernel import Kernel
from .problem import Problem

try:  # the segments' and the marked rows' kernels; as in dispatch.py, triton is a Linux-only dependency
    from . import triton_attention
    from .triton_segments import document_segments
except ImportError:
    triton_attention = None

# The shortest mean document length a row may have for FA4, per direction (False: forward);
# Triton runs rows of shorter documents. Measured on an H200 (BENCHMARKS.md, run L): Triton's
# forward was the faster where documents were 1024 tokens long or shorter (0.916 against this
# path's 0.920 ms at 1024), its backward where they were 256 or shorter (at 512 this path's took
# 1.925 ms, Triton's 1.954).
MEAN_LENGTH = {False: 1024, True: 512}


def supports(p: Problem) -> bool:
    return (p.has_documents and not p.has_key_padding and not p.offset and p.s_q == p.s_k
            and triton_attention is not None and triton_attention.supports(p)
            and fa4.supports(dataclasses.replace(p, has_documents=False)))


def _segments(document_ids, backward):
    s = document_ids.shape[1]
    return document_segments(document_ids.contiguous(), -(-s // MEAN_LENGTH[backward]))


def _packing(segments, s, is_causal, window):
    left, right = fa4.window_sides(is_causal, window, 0, 0, 0)
    return dict(cu_seqlens_q=segments.starts, cu_seqlens_k=segments.starts, seqused_q=segments.used,
                seqused_k=segments.used, max_seqlen_q=s, max_seqlen_k=s, window_size_left=left,
                window_size_right=right)


def attention_forward(q, k, v, *, scale, document_ids, is_causal=False, window=(-1, -1), softcap=0.0,
                      **_unused_masking):
    """(out (B, h_q, S, d_v) in q's dtype and q's memory order, lse (B, h_q, S) float32)."""
    segments = _segments(document_ids, backward=False)
    out, lse = fa4.packed_results(q, v.shape[-1])
    fa4.interface()._flash_attn_fwd(*(packed(x) for x in (q, k, v)), softmax_scale=scale, softcap=softcap,
                                    out=out, lse=lse, return_lse=True,
                                    **_packing(segments, q.shape[2], is_causal, window))
    out, lse = fa4.dense_results(out, lse, q)
    return triton_attention.attention_forward(q, k, v, scale=scale, is_causal=is_causal, window=window,
                                              softcap=softcap, document_ids=document_ids,
                                              key_padding_mask=segments.marked, into=(out, lse),
                                              tables=segments.tables)


def attention_backward(dout, q, k, v, out, lse, *, scale, document_ids, is_causal=False, window=(-1, -1),
                       softcap=0.0, **_unused_masking):
    """(dq, dk, dv), each in its input's strides."""
    segments = _segments(document_ids, backward=True)
    inputs = [packed(x) for x in (q, k, v, out.to(q.dtype), dout)]
    grads = [torch.empty_like(x) for x in inputs[:3]]
    fa4.interface()._flash_attn_bwd(*inputs, fa4.packed_lse(lse), scale, False, softcap,
                                    dq=grads[0], dk=grads[1], dv=grads[2],
                                    **_packing(segments, q.shape[2], is_causal, window))
    grads = fa4.dense_grads(grads, (q, k, v))
    return triton_attention.attention_backward(dout, q, k, v, out, lse, scale=scale, is_causal=is_causal,
                                               window=window, softcap=softcap, document_ids=document_ids,
                                               key_padding_mask=segments.marked, into=grads,
                                               tables=segments.tables)


FA4Segments = Kernel("fa4 segments", supports, attention_forward, attention_backward)
