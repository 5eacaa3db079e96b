"""Flash attention forward in Triton: one program per (query block, query head, sequence),
online softmax over the key tiles the mask leaves, output and LSE written once.

Tensors come as (B, H, S, D) views with a unit last stride; K and V, which the key loop reads
through tensor descriptors (``triton_tiles.walk_rows``: the host's where the launch repays them,
``pays_host_walk``, else each program's own), with 16-byte aligned other strides and start. For
packed varlen inputs B counts documents, the batch stride is 0, and ``cu_seqlens`` gives each
document's rows.
A dense call may add a (B, S_k) uint8 key padding mask, nonzero for a real key, with each
sequence's ``padding_bounds``: key tiles after the last real key are skipped, and tiles before the
first padded key run without loading the mask. With KEYED_ONLY a sequence with no real key is not
written at all: its rows keep what another call wrote there. It may also add (B, S) document ids
(``triton_tiles.document_args``), read on the device. A softcap caps the scores before any
mask (``triton_tiles.capped``), with the SOFTCAP constexpr, so calls without one compile as before.
"""
import triton
import triton.language as tl

from .launch_math import cdiv
from .triton_tiles import (LN2, LOG2E, autotune, capped, dot_precision, head_blocks, head_start, key_walk, launch,
                           load_rows, mask_args, pays_host_walk, position_mask, query_block, real_keys, seq_bucket,
                           short_walk, store_tile, walk_tile, walked)


@triton.jit
def _attend(acc, row_sum, row_max, q, k_rows, v_rows, key_padding, row_docs, ids, rows, cols, lo, full_lo, full_hi,
            hi, padded_from, seqlen_k, before, after, qk_scale, cap, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr,
            BLOCK_DV: tl.constexpr, HAS_KEY_PADDING: tl.constexpr, HAS_DOCUMENTS: tl.constexpr,
            SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, OWN_WALK: tl.constexpr):
    """Online softmax of the query block over ``key_tiles``' key tiles [lo, hi), in base 2, as one
    loop in which only the tiles that need a mask compute it: the software pipeline fills once.
    A loop per kind of tile ran 7% slower on a 1024 window, which walks few tiles, and 9-12% on
    packed documents (BENCHMARKS.md). Tiles before ``padded_from`` hold no padding key, so they
    skip the key padding mask even where they take the position mask."""
    for tile in range(lo, hi):
        start = tile * BLOCK_N
        keys = start + cols
        k = walk_tile(k_rows, start, BLOCK_N, BLOCK_DQK, OWN_WALK)
        # scaled inside exp2, where it fuses with the shift (qk_scale > 0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if SOFTCAP:
            s, _ = capped(s, cap)
        edge = (tile < full_lo) | (tile >= full_hi)
        if edge:
            s = position_mask(s, rows, keys, seqlen_k, before, after, row_docs, ids, HAS_DOCUMENTS)
        if HAS_KEY_PADDING:
            if tile >= padded_from:
                s = tl.where(real_keys(key_padding, keys, seqlen_k)[None, :], s, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(s, 1) * qk_scale)
        # a row that has seen no key yet keeps p = 0 instead of exp(-inf + inf)
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        p = tl.math.exp2(s * qk_scale - shift[:, None])
        alpha = tl.math.exp2(row_max - shift)
        row_sum = row_sum * alpha + tl.sum(p, 1)
        v = walk_tile(v_rows, start, BLOCK_N, BLOCK_DV, OWN_WALK)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        row_max = new_max
    return acc, row_sum, row_max


@autotune(
    small=[(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3), (128, 32, 4, 4), (64, 64, 4, 3)],
    large=[(128, 64, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3)],
    key=["BLOCK_DQK", "BLOCK_DV"], walk_block="BLOCK_N",
)
@triton.jit
def _forward_kernel(Q, K, V, Out, Lse, cu_seqlens_q, cu_seqlens_k, KeyPadding, stride_kpb, KeyBounds, Ids, stride_idb,
                    Spans, Runs,
                    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
                    stride_vb, stride_vh, stride_vs, stride_ob, stride_oh, stride_os,
                    stride_lb, stride_lh, stride_ls,
                    seqlen_q, seqlen_k, group, before, after, qk_scale, cap, seq_bucket,
                    D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
                    VARLEN: tl.constexpr, HAS_KEY_PADDING: tl.constexpr, HAS_DOCUMENTS: tl.constexpr,
                    SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, SHORT_WALK: tl.constexpr,
                    KEYED_ONLY: tl.constexpr, OWN_WALK: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    batch, head = tl.program_id(2), tl.program_id(1)
    q_start, seqlen_q, k_start, seqlen_k, real_prefix, first = query_block(cu_seqlens_q, cu_seqlens_k, KeyBounds, batch,
                                                                           seqlen_q, seqlen_k, BLOCK_M, VARLEN,
                                                                           HAS_KEY_PADDING, KEYED_ONLY)
    if first < 0:
        return
    last = tl.minimum(first + BLOCK_M, seqlen_q) - 1
    offs_m = tl.arange(0, BLOCK_M)
    rows = first + offs_m
    cols = tl.arange(0, BLOCK_N)
    d_v = tl.arange(0, BLOCK_DV)

    q = load_rows(Q, batch, head, q_start, first, seqlen_q, stride_qb, stride_qh, stride_qs, D_QK, BLOCK_M, BLOCK_DQK)
    k_rows, v_rows, key_padding, ids, row_docs, tiles = key_walk(
        K, V, KeyPadding, stride_kpb, Ids, stride_idb, Spans, Runs, batch, head // group, k_start, seqlen_k, seqlen_q,
        real_prefix, first, last, rows, before, after, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
        D_QK, D_V, BLOCK_M, BLOCK_N, BLOCK_DQK, BLOCK_DV, HAS_KEY_PADDING, HAS_DOCUMENTS, OWN_WALK)
    lo, full_lo, full_hi, hi, padded_from = tiles

    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    acc, row_sum, row_max = _attend(acc, row_sum, row_max, q, k_rows, v_rows, key_padding, row_docs, ids, rows, cols,
                                    lo, full_lo, full_hi, hi, padded_from, seqlen_k, before, after,
                                    qk_scale, cap, BLOCK_N, BLOCK_DQK, BLOCK_DV, HAS_KEY_PADDING, HAS_DOCUMENTS,
                                    SOFTCAP, PRECISION, OWN_WALK)
    seen = row_sum > 0
    row_sum = tl.where(seen, row_sum, 1.0)
    lse = tl.where(seen, (row_max + tl.math.log2(row_sum)) * LN2, float("-inf"))
    o_ptrs = head_start(Out, batch, head, q_start + first, stride_ob, stride_oh, stride_os)
    o_ptrs += offs_m[:, None] * stride_os + d_v[None, :]
    store_tile(o_ptrs, (acc / row_sum[:, None]).to(Out.dtype.element_ty), rows < seqlen_q, d_v, D_V, BLOCK_DV)
    lse_ptrs = head_start(Lse, batch, head, q_start + first, stride_lb, stride_lh, stride_ls)
    tl.store(lse_ptrs + offs_m * stride_ls, lse, mask=rows < seqlen_q)


def forward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, before, after,
            key_padding_mask=None, document_ids=None, softcap=0.0, keyed_only=False, tables=None):
    """Fills ``out`` (B, H_q, S_q, d_v) and ``lse`` (B, H_q, S_q) float32 in place;
    ``key_padding_mask`` is None or (B, S_k) bool with a unit last stride; ``document_ids`` None
    or (B, S) ids of a dense call with S_q == S_k; ``softcap`` > 0 caps the scaled scores;
    ``keyed_only``: the sequences whose mask has no real key are left as they are; ``tables``:
    ``mask_args`` of the mask and ids, where the caller made them already."""
    batch, h_q = q.shape[:2]
    d_qk, d_v = q.shape[-1], v.shape[-1]
    varlen = cu_seqlens_q is not None
    own = varlen or not pays_host_walk(batch, h_q, max_seqlen_q, max_seqlen_k, before, after, d_qk, d_v)

    def grid(meta):
        return cdiv(max_seqlen_q, meta["BLOCK_M"]), h_q, batch

    launch(
        _forward_kernel, grid, q.device,
        q, walked(k, own), walked(v, own), out, lse, cu_seqlens_q, cu_seqlens_k,
        *(tables or mask_args(key_padding_mask, document_ids)),
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], *lse.stride(),
        max_seqlen_q, max_seqlen_k, h_q // k.shape[1], before, after, scale * LOG2E.value, softcap / scale,
        seq_bucket=seq_bucket(max_seqlen_q, max_seqlen_k),
        D_QK=d_qk, D_V=d_v, BLOCK_DQK=head_blocks(d_qk), BLOCK_DV=head_blocks(d_v), VARLEN=varlen,
        HAS_KEY_PADDING=key_padding_mask is not None, HAS_DOCUMENTS=document_ids is not None, SOFTCAP=softcap > 0,
        PRECISION=dot_precision(q.dtype), SHORT_WALK=short_walk(before, after), KEYED_ONLY=keyed_only,
        OWN_WALK=own,
    )
