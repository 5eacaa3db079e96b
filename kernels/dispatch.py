"""The one place that decides which kernel runs an attention call.

The choice depends only on the call's metadata (see ``Problem``), so every rank and ``explain``
agree on it; forward and backward choose each for their own direction. Kernels are tried in the
order of their measured speed on the call's class of problem (``ranking.py``); kernels without
a figure there follow in the fixed order FlashAttention-4 > FA4's mask_mod path > FA4's segments
path > cuDNN > Triton > flash > efficient, and the reference takes everything else. A backward
may run on another kernel than its forward: all of them take the same natural-log LSE. Windows
and position offsets (ring steps), which none of the aten kernels take, run on FA4 or Triton;
(B, S) document ids and key padding masks on FA4's mask_mod path (``fa4_mask_mod.py``), FA4's
segments path for document ids (``fa4_segments.py``), FA4's key padding path (``fa4.py``) or
Triton, which read them on the device; where none of them runs, document ids are read on the
host and run as packed documents.
Packed documents (``varlen_*``) try FA4, Triton, then FA2's varlen kernel (which pads V for MLA
inside its adapter), then one reference call per document. ``merge_into`` combines partial
results, ``merge_rows_into`` a part's rows given by index into a running result, and
``add_rows_into`` a gradient's: one fused Triton kernel each on CUDA.

Mask arguments, shared by every function here: ``is_causal`` (key j visible to query i when
j <= i), ``window=(left, right)`` (i-left <= j <= i+right, -1 unbounded), ``attn_mask`` (bool,
True = visible, or additive), ``key_padding_mask`` ((B, S_k) bool, True = a real key), and the
global positions ``q_offset + i`` / ``k_offset + j``. All that apply are ANDed. ``softcap`` > 0
caps the scaled scores before the masks (``softcap * tanh(scores / softcap)``); only FA4, Triton
and the reference take it.
"""
import dataclasses
import functools

import torch

from . import reference
from .aten import Cudnn, Efficient, Flash, FlashVarlen
from .documents import packed, run_bounds, same_document_mask, unpacked
from .fa4 import FA4, FA4Varlen
from .fa4_mask_mod import FA4MaskMod
from .fa4_segments import FA4Segments
from .problem import Problem, capability
from .ranking import ranked

try:
    from .triton_attention import Triton, TritonVarlen, merge_forward
    from .triton_attention import add_rows_into as _add_rows_fused, merge_rows_into as _merge_rows_fused
except ImportError:  # triton is a Linux-only dependency
    Triton = TritonVarlen = merge_forward = _merge_rows_fused = _add_rows_fused = None

FUSED = tuple(kernel for kernel in (FA4, FA4MaskMod, FA4Segments, Cudnn, Triton, Flash, Efficient)
              if kernel is not None)
FUSED_VARLEN = tuple(kernel for kernel in (FA4Varlen, TritonVarlen, FlashVarlen) if kernel is not None)
REFERENCE = "reference"


def _fused_kernel(q, k, v, masking, document_ids=None, backward=False):
    return _first(FUSED, Problem.of(q, k, v, **masking, document_ids=document_ids, backward=backward))


def _first(kernels, problem, packed=False):
    """The fastest of ``kernels`` measured on ``problem``'s class that takes ``problem``."""
    return next((kernel for kernel in ranked(kernels, problem, packed) if kernel.supports(problem)), None)


def select_kernel(q, k, v, document_ids=None, **masking) -> str:
    """Name of the kernel that runs this call: 'fa4', 'fa4 mask_mod', 'fa4 segments', 'cudnn',
    'triton', 'flash', 'efficient' or 'reference', followed by ' (backward <name>)' where the
    backward runs on another one. Document ids go to a fused kernel that reads them on the device
    ('fa4 mask_mod', 'fa4 segments', 'triton') where one takes the call, else to
    'varlen:<kernel>', the packed kernel that runs documents in contiguous runs after reading
    them on the host (ids that come back after another run on the reference)."""
    problem = Problem.of(q, k, v, **masking, document_ids=document_ids)
    if _first(FUSED, problem) is not None:
        return describe(problem)
    if document_ids is not None:
        if masking.get("key_padding_mask") is not None:  # see _documents_as_varlen
            return REFERENCE
        kernel = _varlen_kernel_of(Problem.of(q, k, v, **_positional(masking)))
        return f"varlen:{kernel.name if kernel else REFERENCE}"
    return REFERENCE


def kernel_name(problem, packed=False) -> str:
    """The kernel that runs ``problem`` in its direction (``packed``: documents given as
    cumulative lengths), or 'reference'."""
    kernel = _first(FUSED_VARLEN if packed else FUSED, problem, packed)
    return REFERENCE if kernel is None else kernel.name


def describe(problem, packed=False) -> str:
    """'name', or 'name (backward other)' where the backward runs on another kernel."""
    forward, backward = (kernel_name(dataclasses.replace(problem, backward=b), packed) for b in (False, True))
    return forward if backward == forward else f"{forward} (backward {backward})"


def _documents_as_varlen(document_ids, masking):
    """(cu_seqlens, longest) where the documents can run as one packed varlen call, else None."""
    if masking.get("key_padding_mask") is not None or document_ids.numel() == 0:
        return None
    bounds = run_bounds(document_ids)
    return None if bounds is None else (bounds.to(document_ids.device), int(bounds.diff().max()))


def _positional(masking):
    """What a packed varlen call keeps of a dense call's masking."""
    return {name: masking[name] for name in ("is_causal", "window", "softcap") if name in masking}


def attention_forward(q, k, v, *, scale, document_ids=None, **masking):
    """(out, lse): out (B, h_q, S_q, d_v) in q's dtype, lse (B, h_q, S_q) float32 (float64 for float64 q)."""
    kernel = _fused_kernel(q, k, v, masking, document_ids)
    if kernel is not None:
        return kernel.forward(q, k, v, scale=scale, document_ids=document_ids, **masking)
    if document_ids is not None:
        return _documents_forward(q, k, v, document_ids, scale, masking)
    return reference.attention_forward(q, k, v, scale=scale, **masking)


def attention_backward(dout, q, k, v, out, lse, *, scale, document_ids=None, **masking):
    """(dq, dk, dv). ``out`` and ``lse`` may be the merged result of several calls (ring steps):
    the gradients are then this call's share."""
    kernel = _fused_kernel(q, k, v, masking, document_ids, backward=True)
    if kernel is not None:
        return kernel.backward(dout, q, k, v, out, lse, scale=scale, document_ids=document_ids, **masking)
    if document_ids is not None:
        return _documents_backward(dout, q, k, v, out, lse, document_ids, scale, masking)
    return reference.attention_backward(dout, q, k, v, out, lse, scale=scale, **masking)


def _documents_forward(q, k, v, document_ids, scale, masking):
    """Documents read on the host: one packed varlen call, or the reference with their mask."""
    runs = _documents_as_varlen(document_ids, masking)
    if runs is None:
        return reference.attention_forward(q, k, v, scale=scale,
                                           **{**masking, "attn_mask": same_document_mask(document_ids)})
    cu, longest = runs
    out, lse = varlen_forward(*map(packed, (q, k, v)), cu, cu, longest, longest, scale=scale, **_positional(masking))
    return unpacked(out, q.shape[0]), unpacked(lse, q.shape[0])


def _documents_backward(dout, q, k, v, out, lse, document_ids, scale, masking):
    runs = _documents_as_varlen(document_ids, masking)
    if runs is None:
        return reference.attention_backward(dout, q, k, v, out, lse, scale=scale,
                                            **{**masking, "attn_mask": same_document_mask(document_ids)})
    cu, longest = runs
    grads = varlen_backward(*map(packed, (dout, q, k, v, out, lse)), cu, cu, longest, longest, scale=scale,
                            **_positional(masking))
    return tuple(unpacked(g, q.shape[0]) for g in grads)


def _varlen_kernel_of(problem):
    return _first(FUSED_VARLEN, problem, packed=True)


def _varlen_kernel(q, k, v, masking, aligned=True, ends_aligned=False, backward=False):
    return _varlen_kernel_of(Problem.of(*(unpacked(x, 1) for x in (q, k, v)), **masking, aligned=aligned,
                                        ends_aligned=ends_aligned, backward=backward))


def select_varlen_kernel(q, k, v, seqused_k=None, **masking) -> str:
    """Name of the kernel that runs these packed documents, with the same lengths in q and k:
    'fa4', 'triton', 'flash' or 'reference' (the only one that takes ``seqused_k``)."""
    kernel = None if seqused_k is not None else _varlen_kernel(q, k, v, masking)
    return kernel.name if kernel else REFERENCE


def runs_ends_aligned(q, k, v, **masking) -> bool:
    """Whether packed segments that end together (``varlen_forward``'s ``ends_aligned``) run on a
    fused kernel both ways, or need the reference only where segments that are squares would too.
    q, k, v: (1, H, S, D) packed rows, or anything with their shape, dtype and device."""
    def kernel(backward, **alignment):
        return _varlen_kernel_of(Problem.of(q, k, v, **masking, **alignment, backward=backward))
    return all(kernel(backward, aligned=False, ends_aligned=True) is not None or kernel(backward) is None
               for backward in (False, True))


def _varlen_entry(q, k, v, cu_seqlens_q, cu_seqlens_k, masking, seqused_k, aligned, ends_aligned, which: str):
    """The kernel's forward or backward for these packed documents, with ``seqused_k`` bound where
    given (only the reference takes it)."""
    kernel = None if seqused_k is not None else _varlen_kernel(
        q, k, v, masking, aligned=cu_seqlens_q is cu_seqlens_k if aligned is None else aligned,
        ends_aligned=ends_aligned, backward=which == "varlen_backward")
    if kernel is None:
        return functools.partial(getattr(reference, which), seqused_k=seqused_k, ends_aligned=ends_aligned)
    return getattr(kernel, which.removeprefix("varlen_"))


def varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, scale, seqused_k=None,
                   aligned=None, ends_aligned=False, **masking):
    """(out (total_q, h_q, d_v), lse (total_q, h_q)) of packed documents; masking: is_causal, window and
    softcap. ``seqused_k`` (each document's keys are its first seqused_k[i] rows) runs on the reference.
    Distinct cu_seqlens_q and cu_seqlens_k tensors count as documents whose query and key lengths
    differ (FA2 and FA4 align their masks bottom-right, the others top-left), unless ``aligned``
    says the lengths agree wherever a document has both queries and keys (the rows lie elsewhere
    in q and k), or ``ends_aligned`` that each document's last query and last key share a position
    (bottom-right; ``runs_ends_aligned`` says whether a fused kernel takes it)."""
    forward = _varlen_entry(q, k, v, cu_seqlens_q, cu_seqlens_k, masking, seqused_k, aligned, ends_aligned,
                            "varlen_forward")
    return forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale=scale, **masking)


def varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, scale,
                    seqused_k=None, aligned=None, ends_aligned=False, **masking):
    backward = _varlen_entry(q, k, v, cu_seqlens_q, cu_seqlens_k, masking, seqused_k, aligned, ends_aligned,
                             "varlen_backward")
    return backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale=scale,
                    **masking)


def merge_into(out, lse, part_out, part_lse, *, into=None) -> None:
    """The running (out, lse) becomes the attention over its keys and part's: lse in place, out in
    place or, given ``into``, written there (in into's dtype; out, which may then be in q's dtype,
    is left as it was). One fused Triton kernel, computing in float32, for float32 LSEs on CUDA,
    else the reference (float64 results, the CPU)."""
    if _merges_fused(out, lse) and (out.dtype == torch.float32 or into is not None):
        merge_forward(out, lse, part_out, part_lse, out=out if into is None else into, lse=lse)
    else:
        reference.merge_into(out, lse, part_out, part_lse, into=into)


def merge_rows_into(acc, acc_lse, part_out, part_lse, rows, part_start) -> None:
    """Rows ``rows`` (a 1-D index over dim 2) of the running (acc, acc_lse), (1, H, S, D) in the
    LSE's dtype, merged in place with rows ``rows - part_start`` of the part: one fused Triton
    kernel for float32 on CUDA, else the reference."""
    if _merges_fused(acc, acc_lse) and acc.dtype == torch.float32:
        _merge_rows_fused(acc, acc_lse, part_out, part_lse, rows, part_start)
    else:
        reference.merge_rows_into(acc, acc_lse, part_out, part_lse, rows, part_start)


def add_rows_into(acc, part, rows, part_start) -> None:
    """Rows ``rows - part_start`` of a gradient's part added into rows ``rows`` (a 1-D index over
    dim 2) of the running sum acc, (1, H, S, D), in place: one fused Triton kernel for float32 on
    CUDA, else the reference."""
    if _fused_on(acc) and acc.dtype == torch.float32:
        _add_rows_fused(acc, part, rows, part_start)
    else:
        reference.add_rows_into(acc, part, rows, part_start)


def _merges_fused(out, lse) -> bool:
    return _fused_on(out) and lse.dtype == torch.float32


def _fused_on(x) -> bool:
    """Whether the fused Triton merges and sums run on x's device."""
    return merge_forward is not None and x.is_cuda and capability(x.device) >= (8, 0)
