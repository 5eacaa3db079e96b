"""Row runs of packed (rows, H, D) tensors, for the key padding path of ``fa4.py``: each batch row
b owns the rows ``[starts[b], starts[b] + lengths[b])`` of a run. The kernels read and write those
rows only, so a run of length 0 costs nothing and the rest of a buffer may be left uninitialized.

``add_runs``: the key gradients of a second call over other queries, added onto the first's.
``fill_runs``: a constant in the rows no call writes (0 for outputs and gradients, -inf for LSEs).
"""
import triton
import triton.language as tl

BLOCK_ROWS = 32


@triton.jit
def _run_block(Starts, Lengths, n_cols, dim2, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """This program's (rows as int64, heads, dims, mask); the mask is empty past the run's end."""
    block, batch = tl.program_id(0), tl.program_id(1)  # row blocks first: grid dim 0 has no 65535 bound
    length = tl.load(Lengths + batch)
    within = block * BLOCK_R + tl.arange(0, BLOCK_R)
    rows = tl.cast(tl.load(Starts + batch) + within, tl.int64)
    cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    return rows, cols // dim2, cols % dim2, (within < length)[:, None] & (cols < n_cols)[None, :]


@triton.jit
def _add_runs_kernel(Into, Part, Starts, Lengths, n_cols, dim2, stride_i0, stride_i1, stride_i2,
                     stride_p0, stride_p1, stride_p2, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    if tl.program_id(0) * BLOCK_R >= tl.load(Lengths + tl.program_id(1)):
        return
    rows, heads, dims, mask = _run_block(Starts, Lengths, n_cols, dim2, BLOCK_R, BLOCK_C)
    into_ptrs = Into + rows[:, None] * stride_i0 + (heads * stride_i1 + dims * stride_i2)[None, :]
    part_ptrs = Part + rows[:, None] * stride_p0 + (heads * stride_p1 + dims * stride_p2)[None, :]
    total = tl.load(into_ptrs, mask=mask).to(tl.float32) + tl.load(part_ptrs, mask=mask).to(tl.float32)
    tl.store(into_ptrs, total.to(Into.dtype.element_ty), mask=mask)


@triton.jit
def _fill_runs_kernel(Into, Starts, Lengths, value, n_cols, dim2, stride_i0, stride_i1, stride_i2,
                      BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    if tl.program_id(0) * BLOCK_R >= tl.load(Lengths + tl.program_id(1)):
        return
    rows, heads, dims, mask = _run_block(Starts, Lengths, n_cols, dim2, BLOCK_R, BLOCK_C)
    into_ptrs = Into + rows[:, None] * stride_i0 + (heads * stride_i1 + dims * stride_i2)[None, :]
    tl.store(into_ptrs, tl.full((BLOCK_R, BLOCK_C), value, tl.float32).to(Into.dtype.element_ty), mask=mask)


def _grid(into, lengths, longest):
    n_cols = into.shape[1] * into.shape[2]
    block_c = min(triton.next_power_of_2(n_cols), 256)
    return (triton.cdiv(longest, BLOCK_ROWS), len(lengths), triton.cdiv(n_cols, block_c)), n_cols, block_c


def add_runs(into, part, starts, lengths, longest):
    """``into[r] += part[r]`` for the rows r of every run, in place; ``into`` and ``part`` are (rows,
    H, D) with any strides, ``longest`` bounds the lengths (a host int)."""
    grid, n_cols, block_c = _grid(into, lengths, longest)
    _add_runs_kernel[grid](into, part, starts, lengths, n_cols, into.shape[2], *into.stride(), *part.stride(),
                           BLOCK_R=BLOCK_ROWS, BLOCK_C=block_c)


def fill_runs(into, starts, lengths, longest, value):
    """``into[r] = value`` for the rows r of every run, in place; shapes as in ``add_runs``."""
    grid, n_cols, block_c = _grid(into, lengths, longest)
    _fill_runs_kernel[grid](into, starts, lengths, value, n_cols, into.shape[2], *into.stride(),
                            BLOCK_R=BLOCK_ROWS, BLOCK_C=block_c)
