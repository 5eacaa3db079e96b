"""Fused merge of two partial attention results over disjoint key sets, in float32:
lse = log(e^lse_a + e^lse_b), out = e^(lse_a - lse) out_a + e^(lse_b - lse) out_b.
A side with LSE -inf saw no key and contributes nothing, whatever its output holds.
``merge`` takes two results row for row; ``merge_rows`` merges one call's rows, given by index,
into a running float32 result, so that a call whose rows lie in many runs (packed documents)
merges in one launch. ``add_rows`` is the backward's counterpart: one call's gradient rows, given
by index, added into a float32 sum.
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
def _merged(lse_a, lse_b, a_ptrs, b_ptrs, mask):
    """(out in float32, lse) of the rows whose sides' LSEs and output pointers are given."""
    top = tl.maximum(lse_a, lse_b)
    seen = top > float("-inf")
    top = tl.where(seen, top, 0.0)
    exp_a = tl.exp(lse_a - top)
    exp_b = tl.exp(lse_b - top)
    total = tl.where(seen, exp_a + exp_b, 1.0)
    lse = tl.where(seen, top + tl.log(total), float("-inf"))
    return _weighted(a_ptrs, mask, exp_a / total) + _weighted(b_ptrs, mask, exp_b / total), lse


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
    cols = tl.arange(0, BLOCK_D)
    mask = rows_ok[:, None] & (cols < D)[None, :]
    a_ptrs = OutA + _row_offsets(rows, dim1, dim2, stride_a0, stride_a1, stride_a2)[:, None] + cols[None, :]
    b_ptrs = OutB + _row_offsets(rows, dim1, dim2, stride_b0, stride_b1, stride_b2)[:, None] + cols[None, :]
    out, lse = _merged(lse_a, lse_b, a_ptrs, b_ptrs, mask)
    o_ptrs = Out + _row_offsets(rows, dim1, dim2, stride_o0, stride_o1, stride_o2)[:, None] + cols[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=mask)
    tl.store(Lse + _row_offsets(rows, dim1, dim2, stride_l0, stride_l1, stride_l2), lse, mask=rows_ok)


@triton.jit
def _indexed_rows(Rows, n_index, BLOCK_R: tl.constexpr):
    """(the rows this program's entries of the index name, as int64; which entries exist)."""
    index = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    index_ok = index < n_index
    return tl.load(Rows + index, mask=index_ok, other=0).to(tl.int64), index_ok


@triton.jit
def _merge_rows_kernel(Acc, AccLse, Part, PartLse, Rows, n_index, part_start,
                       stride_a1, stride_a2, stride_p1, stride_p2, stride_la1, stride_la2, stride_lp1, stride_lp2,
                       D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    """Head program_id(1), index entries of block program_id(0): row Rows[i] of the running result
    merges with row Rows[i] - part_start of the part, in place."""
    head = tl.program_id(1).to(tl.int64)
    rows, index_ok = _indexed_rows(Rows, n_index, BLOCK_R)
    part_rows = rows - part_start
    acc_lse_ptrs = AccLse + head * stride_la1 + rows * stride_la2
    lse_a = tl.load(acc_lse_ptrs, mask=index_ok, other=float("-inf"))
    lse_b = tl.load(PartLse + head * stride_lp1 + part_rows * stride_lp2, mask=index_ok,
                    other=float("-inf")).to(tl.float32)
    cols = tl.arange(0, BLOCK_D)
    mask = index_ok[:, None] & (cols < D)[None, :]
    a_ptrs = Acc + head * stride_a1 + (rows * stride_a2)[:, None] + cols[None, :]
    b_ptrs = Part + head * stride_p1 + (part_rows * stride_p2)[:, None] + cols[None, :]
    out, lse = _merged(lse_a, lse_b, a_ptrs, b_ptrs, mask)
    tl.store(a_ptrs, out, mask=mask)
    tl.store(acc_lse_ptrs, lse, mask=index_ok)


@triton.jit
def _add_rows_kernel(Acc, Part, Rows, n_index, part_start, stride_a1, stride_a2, stride_p1, stride_p2,
                     D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    """Head program_id(1), index entries of block program_id(0): row Rows[i] - part_start of the
    part added into row Rows[i] of the float32 sum, in place."""
    head = tl.program_id(1).to(tl.int64)
    rows, index_ok = _indexed_rows(Rows, n_index, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    mask = index_ok[:, None] & (cols < D)[None, :]
    a_ptrs = Acc + head * stride_a1 + (rows * stride_a2)[:, None] + cols[None, :]
    b_ptrs = Part + head * stride_p1 + ((rows - part_start) * stride_p2)[:, None] + cols[None, :]
    total = tl.load(a_ptrs, mask=mask, other=0.0) + tl.load(b_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(a_ptrs, total, mask=mask)


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


def merge_rows(acc, acc_lse, part, part_lse, rows, part_start):
    """Merges rows ``rows`` (a 1-D int32 or int64 index over dim 2, each row once) of the float32
    running result ``acc`` (1, H, S, D), ``acc_lse`` (1, H, S) with rows ``rows - part_start`` of
    ``part`` (1, H, S_part, D, any dtype) and ``part_lse``, in place. Outputs have a unit last stride."""
    d = acc.shape[-1]
    grid = (cdiv(rows.numel(), BLOCK_ROWS), acc.shape[1])
    _merge_rows_kernel[grid](
        acc, acc_lse, part, part_lse, rows, rows.numel(), part_start,
        *acc.stride()[1:3], *part.stride()[1:3], *acc_lse.stride()[1:], *part_lse.stride()[1:],
        D=d, BLOCK_D=next_power_of_2(d), BLOCK_R=BLOCK_ROWS,
    )


def add_rows(acc, part, rows, part_start):
    """Adds rows ``rows - part_start`` of ``part`` (1, H, S_part, D, any dtype) into rows ``rows`` (a
    1-D int32 or int64 index over dim 2, each row once) of the float32 sum ``acc`` (1, H, S, D), in
    place. Both have a unit last stride."""
    d = acc.shape[-1]
    grid = (cdiv(rows.numel(), BLOCK_ROWS), acc.shape[1])
    _add_rows_kernel[grid](
        acc, part, rows, rows.numel(), part_start, *acc.stride()[1:3], *part.stride()[1:3],
        D=d, BLOCK_D=next_power_of_2(d), BLOCK_R=BLOCK_ROWS,
    )
