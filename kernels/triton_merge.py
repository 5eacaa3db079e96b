"""Fused merge of two partial attention results over disjoint key sets, in float32:
lse = log(e^lse_a + e^lse_b), out = e^(lse_a - lse) out_a + e^(lse_b - lse) out_b.
A side with LSE -inf saw no key and contributes nothing, whatever its output holds.
"""
import triton
import triton.language as tl

from .launch_math import cdiv, next_power_of_2

BLOCK_ROWS = 32


@triton.jit
def _row_offsets(rows, dim1, dim2, stride0, stride1, stride2):
    """Offsets of the rows of an (n0, dim1, dim2, D) tensor, counted in (n0, dim1, dim2) order."""
    rows = tl.cast(rows, tl.int64)
    return (rows // (dim1 * dim2)) * stride0 + (rows // dim2 % dim1) * stride1 + (rows % dim2) * stride2


@triton.jit
def _weighted(out_ptrs, mask, weight):
    part = weight[:, None] * tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    return tl.where(weight[:, None] > 0, part, 0.0)


@triton.jit
def _merge_kernel(OutA, LseA, OutB, LseB, Out, Lse, n_rows, dim1, dim2,
                  stride_a0, stride_a1, stride_a2, stride_b0, stride_b1, stride_b2, stride_o0, stride_o1, stride_o2,
                  stride_la0, stride_la1, stride_la2, stride_lb0, stride_lb1, stride_lb2,
                  stride_l0, stride_l1, stride_l2,
                  D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rows_ok = rows < n_rows
    lse_a = tl.load(LseA + _row_offsets(rows, dim1, dim2, stride_la0, stride_la1, stride_la2), mask=rows_ok,
                    other=float("-inf")).to(tl.float32)
    lse_b = tl.load(LseB + _row_offsets(rows, dim1, dim2, stride_lb0, stride_lb1, stride_lb2), mask=rows_ok,
                    other=float("-inf")).to(tl.float32)
    top = tl.maximum(lse_a, lse_b)
    seen = top > float("-inf")
    top = tl.where(seen, top, 0.0)
    exp_a = tl.exp(lse_a - top)
    exp_b = tl.exp(lse_b - top)
    total = tl.where(seen, exp_a + exp_b, 1.0)
    lse = tl.where(seen, top + tl.log(total), float("-inf"))

    cols = tl.arange(0, BLOCK_D)
    mask = rows_ok[:, None] & (cols < D)[None, :]
    a_ptrs = OutA + _row_offsets(rows, dim1, dim2, stride_a0, stride_a1, stride_a2)[:, None] + cols[None, :]
    b_ptrs = OutB + _row_offsets(rows, dim1, dim2, stride_b0, stride_b1, stride_b2)[:, None] + cols[None, :]
    out = _weighted(a_ptrs, mask, exp_a / total) + _weighted(b_ptrs, mask, exp_b / total)
    o_ptrs = Out + _row_offsets(rows, dim1, dim2, stride_o0, stride_o1, stride_o2)[:, None] + cols[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=mask)
    tl.store(Lse + _row_offsets(rows, dim1, dim2, stride_l0, stride_l1, stride_l2), lse, mask=rows_ok)


def merge(out_a, lse_a, out_b, lse_b, out, lse):
    """Fills ``out`` and ``lse``, which may be ``out_a`` and ``lse_a`` (each row is read before it
    is written, by the same program). Outputs are (n0, n1, n2, D) with a unit last stride; the LSEs
    (n0, n1, n2), any strides."""
    n_rows = lse.numel()
    d = out.shape[-1]
    grid = (cdiv(n_rows, BLOCK_ROWS),)
    _merge_kernel[grid](
        out_a, lse_a, out_b, lse_b, out, lse, n_rows, out.shape[1], out.shape[2],
        *out_a.stride()[:3], *out_b.stride()[:3], *out.stride()[:3], *lse_a.stride(), *lse_b.stride(), *lse.stride(),
        D=d, BLOCK_D=next_power_of_2(d), BLOCK_R=BLOCK_ROWS,
    )
