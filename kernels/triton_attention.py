"""Flash attention in Triton, behind one op boundary: this module checks the arguments, folds
the masks and position offsets into the kernels' reaches, and lays tensors out for the kernels
of triton_forward.py, triton_backward.py and triton_merge.py.

- ``attention_forward`` / ``attention_backward``: (B, H, S, D) tensors and the signature of
  reference.py. GQA is native, d_qk and d_v are independent (each up to 256), and causal and
  window masks are decided on global positions (``q_offset + i``, ``k_offset + j``), so a ring
  step or a zigzag chunk is one call. A (B, S_k) bool ``key_padding_mask`` (True = a real key)
  and (B, S) ``document_ids`` (S_q == S_k, no offsets; read on the device, so the call neither
  syncs nor stops a CUDA graph) are ANDed with them; a tensor ``attn_mask`` is not taken. ``softcap`` > 0
  caps the scaled scores as ``softcap * tanh(scores / softcap)`` before the masks. The backward
  takes the final, possibly merged, out and LSE and returns this call's share of the gradients.
  ``into`` (results of another call, with a key padding mask) writes them in place, leaving the
  sequences whose mask has no real key as that call wrote them.
- ``varlen_forward`` / ``varlen_backward``: packed (total, H, D) documents with int32
  cumulative lengths starting at 0. Each document starts at position 0 in q and in k (causal
  is top-left aligned, as in SDPA). The LSE is (total_q, H), lined up with out.
- ``merge_forward``: one (out, lse) pair from two over disjoint key sets, or a running pair updated in place.
- ``merge_rows_into``: rows of a running float32 (out, lse), given by index, merged with a part's in place.
- ``add_rows_into``: a part's rows added into a float32 gradient sum at rows given by index.
- ``Triton``: the kernels as dispatch.py sees a kernel.

The tiles the kernels' loops walk are read through tensor descriptors (TMA on Hopper): the
forward's K and V through one made on the host for a dense call, and, on a window whose head
tiles are at most 256 wide together (d 128/128), the backward's walked tiles too; the others
through one each program makes. A q, k, v or dout whose rows or start are not 16-byte aligned
(say a bf16 head dim that is not a multiple of 8) is copied into aligned rows first. Key padding
skips the mask on tiles before a sequence's first padded key and skips the tiles after its last
real key. Where both head dims are over 128 (Gemma 2's d 256), the backward computes dK and dV in
two launches with one accumulator each (1.23x faster on Gemma 2's shape on an H100).

Rows that see no key give output 0, LSE -inf and zero gradients. float32 inputs take IEEE
float32 dots, or TF32 ones (relative error near 1e-3) when ``torch.set_float32_matmul_precision``
allows them, as torch.matmul does (``triton_tiles.dot_precision``).
"""
import math

import torch

from .kernel import Kernel
from .problem import Problem
from .result_layout import empty_out
from .triton_backward import backward
from .triton_forward import forward
from .triton_merge import add_rows, merge, merge_rows
from .triton_tiles import MAX_SPAN, UNBOUNDED
from .visibility import effective_window

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


def supports(p: Problem) -> bool:
    """CUDA on Ampere or newer (bf16 dots), no tensor mask, head dims up to 256."""
    return (
        p.device_type == "cuda" and not p.has_mask and p.dtype in DTYPES
        and p.d_qk <= MAX_HEAD_DIM and p.d_v <= MAX_HEAD_DIM
        and p.sm >= (8, 0)
    )


def _unit_last(*tensors):
    """The kernels take any strides but a unit one in the last dim."""
    return tuple(x if x.stride(-1) == 1 else x.contiguous() for x in tensors)


def _descriptor_ready(*tensors):
    """The kernels' loops read k and v (and q and dout in the backward) through tensor
    descriptors (TMA on Hopper), which need a unit last stride and 16-byte aligned other strides
    and start. A tensor without them, say a bf16 head dim that is not a multiple of 8, is copied
    into rows padded to 16 bytes."""
    def aligned(x):
        strides = (stride * x.element_size() for stride, size in zip(x.stride()[:-1], x.shape) if size > 1)
        return x.stride(-1) == 1 and x.data_ptr() % 16 == 0 and all(stride % 16 == 0 for stride in strides)

    def padded_copy(x):
        per_row = 16 // x.element_size()
        width = -(-x.shape[-1] // per_row) * per_row
        return x.new_empty(*x.shape[:-1], width)[..., :x.shape[-1]].copy_(x)

    return tuple(x if aligned(x) else padded_copy(x) for x in tensors)


def _check_inputs(q, k, v, packed=False):
    """q, k, v as (B, H, S, D), or (total, H, D) when ``packed``, with a unit last stride."""
    layout = "(total, H, D)" if packed else "(B, H, S, D)"
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != (3 if packed else 4):
            raise ValueError(f"{name}: expected {layout}, got shape {tuple(x.shape)}")
        if x.dtype != q.dtype or x.dtype not in DTYPES:
            raise ValueError(f"{name}: dtype {x.dtype}; q, k and v share one of float16, bfloat16, float32")
        if x.device != q.device:
            raise ValueError(f"{name}: on {x.device}, q on {q.device}")
        if not 0 < x.shape[-1] <= MAX_HEAD_DIM:
            raise ValueError(f"{name}: head dim {x.shape[-1]} outside 1..{MAX_HEAD_DIM}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k: head dim {k.shape[-1]} differs from q's {q.shape[-1]}")
    if v.shape[:-1] != k.shape[:-1]:
        raise ValueError(f"v: shape {tuple(v.shape)} does not match k's {tuple(k.shape)} but in the last dim")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"k: {k.shape[1]} heads do not divide q's {q.shape[1]}")
    if not packed and k.shape[0] != q.shape[0]:
        raise ValueError(f"k: batch {k.shape[0]} differs from q's {q.shape[0]}")
    return _unit_last(q, k, v)


def _check_result(dout, out, lse, q, v):
    """out and dout shaped like q but with v's head dim, dout in q's dtype; lse shaped like q
    without the head dim. out (merged, say) and lse may come in any float dtype."""
    want = (*q.shape[:-1], v.shape[-1])
    for name, x in (("dout", dout), ("out", out)):
        if tuple(x.shape) != want:
            raise ValueError(f"{name}: expected shape {want}, got {tuple(x.shape)}")
    if dout.dtype != q.dtype:
        raise ValueError(f"dout: dtype {dout.dtype} differs from q's {q.dtype}")
    if tuple(lse.shape) != tuple(q.shape[:-1]):
        raise ValueError(f"lse: expected shape {tuple(q.shape[:-1])}, got {tuple(lse.shape)}")
    return _descriptor_ready(dout)[0], _unit_last(out)[0]


def _reaches(is_causal, window, q_offset, k_offset, longest, lengths="q, k"):
    """(before, after) of triton_tiles: query i sees key j when i - before <= j <= i + after.
    ``longest``: the longest sequence, named by ``lengths``."""
    if len(window) != 2 or any(not isinstance(w, int) or w < -1 for w in window):
        raise ValueError(f"window: expected (left, right), each -1 or a distance >= 0, got {window}")
    if longest >= MAX_SPAN:
        raise ValueError(f"{lengths}: a sequence of {longest} is too long; the kernels take fewer than {MAX_SPAN}")
    shift = k_offset - q_offset
    if abs(shift) + longest >= MAX_SPAN:
        raise ValueError(f"q_offset, k_offset: positions {q_offset} and {k_offset} lie too far apart")
    left, right = (UNBOUNDED if w == -1 else min(w, UNBOUNDED) for w in effective_window(is_causal, tuple(window)))
    return left + shift, right - shift


def _check_scale_and_mask(scale, attn_mask=None, softcap=0.0):
    if not scale > 0:
        raise ValueError(f"scale: {scale}; the kernels take the row maximum before scaling, so it must be positive")
    if not 0 <= softcap < math.inf:
        raise ValueError(f"softcap: {softcap}; expected 0 (no cap) or a finite cap > 0")
    if attn_mask is not None:
        raise ValueError("attn_mask: the Triton kernels take causal, window and key padding masks only (see supports)")


def _document_ids(document_ids, q, k, q_offset, k_offset):
    """The (B, S) ids with a unit last stride, for queries and keys at the same positions."""
    if document_ids is None:
        return None
    want = (q.shape[0], q.shape[2])
    if document_ids.dtype.is_floating_point or document_ids.dtype.is_complex or tuple(document_ids.shape) != want:
        raise ValueError(f"document_ids: expected integer or bool {want}, got {document_ids.dtype} "
                         f"{tuple(document_ids.shape)}")
    if document_ids.device != q.device:
        raise ValueError(f"document_ids: on {document_ids.device}, q on {q.device}")
    if k.shape[2] != q.shape[2] or q_offset != k_offset:
        raise ValueError(f"document_ids: queries and keys must share their positions; got S_q={q.shape[2]}, "
                         f"S_k={k.shape[2]}, q_offset={q_offset}, k_offset={k_offset}")
    return _unit_last(document_ids)[0]


def _key_padding(key_padding_mask, k):
    """The (B, S_k) bool mask with a unit last stride, as the kernels read it."""
    if key_padding_mask is None:
        return None
    want = (k.shape[0], k.shape[2])
    if key_padding_mask.dtype != torch.bool or tuple(key_padding_mask.shape) != want:
        raise ValueError(f"key_padding_mask: expected bool {want}, got {key_padding_mask.dtype} "
                         f"{tuple(key_padding_mask.shape)}")
    if key_padding_mask.device != k.device:
        raise ValueError(f"key_padding_mask: on {key_padding_mask.device}, k on {k.device}")
    return _unit_last(key_padding_mask)[0]


def attention_forward(q, k, v, *, scale, is_causal=False, window=(-1, -1), attn_mask=None, key_padding_mask=None,
                      q_offset=0, k_offset=0, document_ids=None, softcap=0.0, into=None, tables=None):
    """Returns (out (B, h_q, S_q, d_v) in q's dtype, lse (B, h_q, S_q) float32): new ones, or
    ``into``'s (out, lse), written in place but for the sequences with no real key. ``tables``:
    the kernels' arguments for ``key_padding_mask`` and ``document_ids`` (``triton_tiles.mask_args``),
    where the caller made them already."""
    _check_scale_and_mask(scale, attn_mask, softcap)
    q, k, v = _check_inputs(q, k, v)
    k, v = _descriptor_ready(k, v)
    key_padding = _key_padding(key_padding_mask, k)
    documents = _document_ids(document_ids, q, k, q_offset, k_offset)
    before, after = _reaches(is_causal, window, q_offset, k_offset, max(q.shape[2], k.shape[2]))
    if into is None:
        out = empty_out(q, v.shape[-1])
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    else:
        out, lse = _check_into(into, ("out", "lse"), key_padding, (*q.shape[:-1], v.shape[-1]), q.shape[:-1])
    forward(q, k, v, out, lse, None, None, q.shape[2], k.shape[2], scale, before, after, key_padding, documents,
            softcap, keyed_only=into is not None, tables=tables)
    return out, lse


def attention_backward(dout, q, k, v, out, lse, *, scale, is_causal=False, window=(-1, -1), attn_mask=None,
                       key_padding_mask=None, q_offset=0, k_offset=0, document_ids=None, softcap=0.0, into=None,
                       tables=None):
    """(dq, dk, dv) given the final out and lse, which may merge this call with others: new ones,
    or ``into``'s, written in place but for the sequences with no real key; ``tables`` as in the forward."""
    _check_scale_and_mask(scale, attn_mask, softcap)
    q, k, v = _descriptor_ready(*_check_inputs(q, k, v))
    key_padding = _key_padding(key_padding_mask, k)
    documents = _document_ids(document_ids, q, k, q_offset, k_offset)
    dout, out = _check_result(dout, out, lse, q, v)
    before, after = _reaches(is_causal, window, q_offset, k_offset, max(q.shape[2], k.shape[2]))
    if into is None:
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    else:
        dq, dk, dv = _check_into(into, ("dq", "dk", "dv"), key_padding, q.shape, k.shape, v.shape)
    backward(dout, q, k, v, out, lse, dq, dk, dv, None, None, q.shape[2], k.shape[2], scale, before, after,
             key_padding, documents, softcap, keyed_only=into is not None, tables=tables)
    return dq, dk, dv


def _check_into(into, names, key_padding, *shapes):
    """``into``'s tensors, checked to be ``names`` of ``shapes`` with a unit last stride, for a call
    with a key padding mask (whose sequences with no real key they keep)."""
    if key_padding is None:
        raise ValueError("into: writes in place but for the sequences with no real key, so it needs a "
                         "key_padding_mask; got none")
    if len(into) != len(names):
        raise ValueError(f"into: expected ({', '.join(names)}), got {len(into)} tensors")
    for name, x, shape in zip(names, into, shapes):
        if tuple(x.shape) != tuple(shape) or x.stride(-1) != 1:
            raise ValueError(f"into: {name} must have shape {tuple(shape)} and a unit last stride; got shape "
                             f"{tuple(x.shape)}, strides {x.stride()}")
    return into


def _check_documents(cu_seqlens_q, cu_seqlens_k):
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 2:
            raise ValueError(f"{name}: expected int32 (documents + 1,) starting at 0, got {cu.dtype} {tuple(cu.shape)}")
    if cu_seqlens_k.numel() != cu_seqlens_q.numel():
        raise ValueError(f"cu_seqlens_k: {cu_seqlens_k.numel() - 1} documents, cu_seqlens_q {cu_seqlens_q.numel() - 1}")
    return cu_seqlens_q.numel() - 1


def _documents(x, n):
    """(total, H, ...) -> (n, H, total, ...) with batch stride 0: each document finds its rows
    through cu_seqlens."""
    x = x.transpose(0, 1)
    return x.unsqueeze(0).expand(n, *x.shape)


def varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, scale, is_causal=False,
                   window=(-1, -1), softcap=0.0):
    """Returns (out (total_q, h_q, d_v) in q's dtype, lse (total_q, h_q) float32)."""
    _check_scale_and_mask(scale, softcap=softcap)
    q, k, v = _check_inputs(q, k, v, packed=True)
    k, v = _descriptor_ready(k, v)
    n = _check_documents(cu_seqlens_q, cu_seqlens_k)
    before, after = _reaches(is_causal, window, 0, 0, max(max_seqlen_q, max_seqlen_k), "max_seqlen_q, max_seqlen_k")
    out = q.new_empty(*q.shape[:-1], v.shape[-1])
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    forward(*(_documents(x, n) for x in (q, k, v, out, lse)), cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            scale, before, after, softcap=softcap)
    return out, lse


def varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, scale,
                    is_causal=False, window=(-1, -1), softcap=0.0):
    """(dq, dk, dv) of ``varlen_forward``, given its (possibly merged) out and lse."""
    _check_scale_and_mask(scale, softcap=softcap)
    q, k, v = _descriptor_ready(*_check_inputs(q, k, v, packed=True))
    dout, out = _check_result(dout, out, lse, q, v)
    n = _check_documents(cu_seqlens_q, cu_seqlens_k)
    before, after = _reaches(is_causal, window, 0, 0, max(max_seqlen_q, max_seqlen_k), "max_seqlen_q, max_seqlen_k")
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    backward(*(_documents(x, n) for x in (dout, q, k, v, out, lse, dq, dk, dv)), cu_seqlens_q, cu_seqlens_k,
             max_seqlen_q, max_seqlen_k, scale, before, after, softcap=softcap)
    return dq, dk, dv


def merge_forward(out_a, lse_a, out_b, lse_b, *, out=None, lse=None):
    """(out, lse) of attention over the union of two disjoint key sets, from each set's result.
    Each lse is shaped like its out without the last dim ((B, H, S) or, varlen, (total, H)).
    Written into ``out`` and ``lse`` when given (they may be out_a and lse_a: a running result);
    else out comes in the promoted dtype of the two, lse in float32."""
    if out_b.shape != out_a.shape or not 2 <= out_a.dim() <= 4:
        raise ValueError(f"out_b: shape {tuple(out_b.shape)}; expected out_a's {tuple(out_a.shape)}, 2 to 4 dims")
    for name, x in (("lse_a", lse_a), ("lse_b", lse_b), ("lse", lse)):
        if x is not None and x.shape != out_a.shape[:-1]:
            raise ValueError(f"{name}: shape {tuple(x.shape)}; expected {tuple(out_a.shape[:-1])}")
    if out is not None and (out.shape != out_a.shape or out.stride(-1) != 1):
        raise ValueError(f"out: shape {tuple(out.shape)} with last stride {out.stride(-1)}; expected "
                         f"{tuple(out_a.shape)} with last stride 1")
    out_a, out_b = _unit_last(out_a, out_b)
    if out is None:
        out = torch.empty_like(out_a, dtype=torch.promote_types(out_a.dtype, out_b.dtype))
    if lse is None:
        lse = torch.empty(lse_a.shape, dtype=torch.float32, device=lse_a.device)
    leading = (None,) * (4 - out.dim())
    merge(out_a[leading], lse_a[leading], out_b[leading], lse_b[leading], out[leading], lse[leading])
    return out, lse


def merge_rows_into(acc, acc_lse, part_out, part_lse, rows, part_start) -> None:
    """Rows ``rows`` (1-D int32 or int64, each row once) of the running float32 result acc (1, H, S, D),
    acc_lse (1, H, S) merged in place with rows ``rows - part_start`` of part_out (1, H, S_part, D)
    and part_lse (1, H, S_part)."""
    _check_indexed(acc, "part_out", part_out, rows)
    if acc_lse.shape != acc.shape[:-1] or acc_lse.dtype != torch.float32:
        raise ValueError(f"acc_lse: shape {tuple(acc_lse.shape)}, {acc_lse.dtype}; expected "
                         f"{tuple(acc.shape[:-1])} float32")
    if part_lse.shape != part_out.shape[:-1]:
        raise ValueError(f"part_lse: shape {tuple(part_lse.shape)}; expected {tuple(part_out.shape[:-1])}")
    if rows.numel():
        merge_rows(acc, acc_lse, *_unit_last(part_out), part_lse, rows, part_start)


def add_rows_into(acc, part, rows, part_start) -> None:
    """Rows ``rows - part_start`` of part (1, H, S_part, D) added into rows ``rows`` (1-D int32 or
    int64, each row once) of the float32 sum acc (1, H, S, D), in place."""
    _check_indexed(acc, "part", part, rows)
    if rows.numel():
        add_rows(acc, *_unit_last(part), rows, part_start)


def _check_indexed(acc, part_name: str, part, rows) -> None:
    """What the updates of rows given by index ask of their running float32 tensor, their part and
    their index."""
    if acc.dim() != 4 or acc.shape[0] != 1 or acc.dtype != torch.float32 or acc.stride(-1) != 1:
        raise ValueError(f"acc: shape {tuple(acc.shape)}, {acc.dtype}, last stride {acc.stride(-1)}; expected "
                         "(1, H, S, D) float32 with last stride 1")
    if part.dim() != 4 or part.shape[:2] != acc.shape[:2] or part.shape[-1] != acc.shape[-1]:
        raise ValueError(f"{part_name}: shape {tuple(part.shape)}; expected "
                         f"(1, {acc.shape[1]}, S_part, {acc.shape[-1]})")
    if rows.dim() != 1 or rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rows: {rows.dim()}-D {rows.dtype}; expected a 1-D int32 or int64 index")


Triton = Kernel("triton", supports, attention_forward, attention_backward)  # every mask argument
def supports_varlen(p: Problem) -> bool:
    """Packed documents, whose masks align top-left: not segments that end together under a mask."""
    return supports(p) and not (p.ends_aligned and p.offset)


TritonVarlen = Kernel("triton", supports_varlen, varlen_forward, varlen_backward)  # packed documents
