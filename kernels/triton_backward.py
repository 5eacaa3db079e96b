"""Flash attention backward in Triton, in two deterministic kernels that recompute P from the
given LSE (which may merge several calls, so each call gets exactly its share):

- ``_dq_kernel``: one program per (query block, query head, sequence) walks its key tiles for
  dQ; it also writes delta = rowsum(dO * O), which the second kernel reads.
- ``_dkdv_kernel``: one program per (key block, KV head, sequence) walks the query tiles of
  every query head in its group, so dK and dV are summed over the group without atomics.
  When a few KV heads would leave the GPU idle, the group is split over several programs
  whose float32 partial sums are added afterwards. For the widest heads, dK and dV each get
  a launch of their own (``split_grads``).

Layouts, the key padding mask, the document ids and the softcap are those of triton_forward.py;
the tiles a loop walks come through tensor descriptors, its own or the host's (``own_walks``).
Masked pairs and rows with LSE -inf get P = 0.
"""
import torch
import triton
import triton.language as tl

from .launch_math import cdiv
from .triton_tiles import (LOG2E, autotune, capped, document_rows, document_tiles, dot_precision, head_blocks,
                           head_start, key_walk, launch, load_rows, mask_args, padding_bounds, pays_host_walk,
                           position_mask, query_block, real_keys, seq_bucket, sequence, short_walk, store_tile,
                           tile_ranges, walk_rows, walk_tile, walked)


@triton.jit
def _log2_lse(lse_ptrs, ok):
    """The LSE in base 2, +inf where a row saw nothing, so exp2(s - lse) is 0 there."""
    lse = tl.load(lse_ptrs, mask=ok, other=float("-inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)


@triton.jit
def _dq_tiles(dq, q, do, lse, delta, k_rows, v_rows, key_padding, row_docs, ids, rows, cols, tile_lo, tile_hi,
              padded_from, seqlen_k, before, after, qk_scale, cap, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr,
              BLOCK_DV: tl.constexpr, MASKED: tl.constexpr, HAS_KEY_PADDING: tl.constexpr,
              HAS_DOCUMENTS: tl.constexpr, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, OWN_WALK: tl.constexpr):
    """dQ over key tiles [tile_lo, tile_hi). The backward keeps a loop for the position-masked
    tiles apart from the others, unlike the forward's ``_attend``: one loop gained on windows,
    documents and MLA but lost 2-5% on key padding and ring steps (BENCHMARKS.md). Tiles from
    ``padded_from`` on take the key padding mask, as in the forward, through a branch: against a
    loop of their own, the dQ kernel ran 4% faster on 128 documents of 256 (their marks) and on a
    Mistral-shaped padded row, and 1% slower on a right-padded B4 (H200)."""
    for tile in range(tile_lo, tile_hi):
        start = tile * BLOCK_N
        keys = start + cols
        k = walk_tile(k_rows, start, BLOCK_N, BLOCK_DQK, OWN_WALK)
        v = walk_tile(v_rows, start, BLOCK_N, BLOCK_DV, OWN_WALK)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if SOFTCAP:
            s, t = capped(s, cap)
        if MASKED:
            s = position_mask(s, rows, keys, seqlen_k, before, after, row_docs, ids, HAS_DOCUMENTS)
        if HAS_KEY_PADDING:
            if tile >= padded_from:
                s = tl.where(real_keys(key_padding, keys, seqlen_k)[None, :], s, float("-inf"))
        p = tl.math.exp2(s * qk_scale - lse[:, None])
        ds = p * (tl.dot(do, tl.trans(v), input_precision=PRECISION) - delta[:, None])
        if SOFTCAP:
            ds *= 1 - t * t
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
    return dq


@autotune(
    small=[(64, 32, 4, 4), (64, 32, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3)],
    large=[(64, 32, 4, 3), (64, 32, 4, 4), (128, 64, 8, 2), (64, 32, 8, 2), (64, 64, 8, 2), (32, 64, 4, 2),
           (128, 32, 8, 2)],
    key=["BLOCK_DQK", "BLOCK_DV"], walk_block="BLOCK_N",
)
@triton.jit
def _dq_kernel(Q, K, V, DO, O, Lse, Delta, DQ, cu_seqlens_q, cu_seqlens_k, KeyPadding, stride_kpb, KeyBounds, Ids,
               stride_idb, Spans, Runs,
               stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
               stride_vb, stride_vh, stride_vs, stride_dob, stride_doh, stride_dos,
               stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_ls,
               stride_db, stride_dh, stride_ds, stride_dqb, stride_dqh, stride_dqs,
               seqlen_q, seqlen_k, group, before, after, qk_scale, scale, cap, seq_bucket,
               D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
               VARLEN: tl.constexpr, HAS_KEY_PADDING: tl.constexpr, HAS_DOCUMENTS: tl.constexpr,
               SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, SHORT_WALK: tl.constexpr, OWN_WALK: tl.constexpr,
               KEYED_ONLY: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    batch, head = tl.program_id(2), tl.program_id(1)
    q_start, seqlen_q, k_start, seqlen_k, real_prefix, first = query_block(cu_seqlens_q, cu_seqlens_k, KeyBounds, batch,
                                                                           seqlen_q, seqlen_k, BLOCK_M, VARLEN,
                                                                           HAS_KEY_PADDING, KEYED_ONLY)
    if first < 0:
        return
    last = tl.minimum(first + BLOCK_M, seqlen_q) - 1
    offs_m = tl.arange(0, BLOCK_M)
    rows = first + offs_m
    rows_ok = rows < seqlen_q
    cols = tl.arange(0, BLOCK_N)
    d_qk = tl.arange(0, BLOCK_DQK)

    q = load_rows(Q, batch, head, q_start, first, seqlen_q, stride_qb, stride_qh, stride_qs, D_QK, BLOCK_M, BLOCK_DQK)
    do = load_rows(DO, batch, head, q_start, first, seqlen_q, stride_dob, stride_doh, stride_dos, D_V, BLOCK_M,
                   BLOCK_DV)
    o = load_rows(O, batch, head, q_start, first, seqlen_q, stride_ob, stride_oh, stride_os, D_V, BLOCK_M, BLOCK_DV)
    row = q_start + first
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    delta_ptrs = head_start(Delta, batch, head, row, stride_db, stride_dh, stride_ds)
    tl.store(delta_ptrs + offs_m * stride_ds, delta, mask=rows_ok)
    lse = _log2_lse(head_start(Lse, batch, head, row, stride_lb, stride_lh, stride_ls) + offs_m * stride_ls, rows_ok)

    k_rows, v_rows, key_padding, ids, row_docs, tiles = key_walk(
        K, V, KeyPadding, stride_kpb, Ids, stride_idb, Spans, Runs, batch, head // group, k_start, seqlen_k, seqlen_q,
        real_prefix, first, last, rows, before, after, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
        D_QK, D_V, BLOCK_M, BLOCK_N, BLOCK_DQK, BLOCK_DV, HAS_KEY_PADDING, HAS_DOCUMENTS, OWN_WALK)
    lo, full_lo, full_hi, hi, padded_from = tiles
    dq = tl.zeros([BLOCK_M, BLOCK_DQK], dtype=tl.float32)
    dq = _dq_tiles(dq, q, do, lse, delta, k_rows, v_rows, key_padding, row_docs, ids, rows, cols, lo, full_lo,
                   padded_from, seqlen_k, before, after, qk_scale, cap, BLOCK_N, BLOCK_DQK, BLOCK_DV, True,
                   HAS_KEY_PADDING, HAS_DOCUMENTS, SOFTCAP, PRECISION, OWN_WALK)
    dq = _dq_tiles(dq, q, do, lse, delta, k_rows, v_rows, key_padding, row_docs, ids, rows, cols, full_lo,
                   full_hi, padded_from, seqlen_k, before, after, qk_scale, cap, BLOCK_N, BLOCK_DQK, BLOCK_DV, False,
                   HAS_KEY_PADDING, False, SOFTCAP, PRECISION, OWN_WALK)
    dq = _dq_tiles(dq, q, do, lse, delta, k_rows, v_rows, key_padding, row_docs, ids, rows, cols, full_hi, hi,
                   padded_from, seqlen_k, before, after, qk_scale, cap, BLOCK_N, BLOCK_DQK, BLOCK_DV, True,
                   HAS_KEY_PADDING, HAS_DOCUMENTS, SOFTCAP, PRECISION, OWN_WALK)

    dq_ptrs = head_start(DQ, batch, head, row, stride_dqb, stride_dqh, stride_dqs)
    dq_ptrs += offs_m[:, None] * stride_dqs + d_qk[None, :]
    store_tile(dq_ptrs, (dq * scale).to(DQ.dtype.element_ty), rows_ok, d_qk, D_QK, BLOCK_DQK)


@triton.jit
def _dkdv_tiles(dk, dv, k, v, q_rows, do_rows, lse_ptrs, delta_ptrs, real, key_docs, ids, keys, rows, tile_lo,
                tile_hi, seqlen_q, before, after, qk_scale, cap, stride_ls, stride_ds, BLOCK_M: tl.constexpr,
                BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr, MASKED: tl.constexpr, HAS_KEY_PADDING: tl.constexpr,
                HAS_DOCUMENTS: tl.constexpr, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, OWN_WALK: tl.constexpr,
                DK: tl.constexpr, DV: tl.constexpr):
    """Accumulates into dK (if DK) and dV (if DV) over query tiles [tile_lo, tile_hi); scores are
    kept transposed (keys x queries), so ``before`` and ``after`` arrive swapped. ``real``: which
    keys are real."""
    for tile in range(tile_lo, tile_hi):
        start = tile * BLOCK_M
        queries = start + rows
        ok = queries < seqlen_q
        offset = tl.cast(start, tl.int64)
        q = walk_tile(q_rows, start, BLOCK_M, BLOCK_DQK, OWN_WALK)
        do = walk_tile(do_rows, start, BLOCK_M, BLOCK_DV, OWN_WALK)
        lse = _log2_lse(lse_ptrs + offset * stride_ls, ok)
        if DK:
            delta = tl.load(delta_ptrs + offset * stride_ds, mask=ok, other=0.0)
        s = tl.dot(k, tl.trans(q), input_precision=PRECISION)
        if SOFTCAP:
            s, t = capped(s, cap)
        if MASKED:
            s = position_mask(s, keys, queries, seqlen_q, before, after, key_docs, ids, HAS_DOCUMENTS)
        if HAS_KEY_PADDING:
            s = tl.where(real[:, None], s, float("-inf"))
        p = tl.math.exp2(s * qk_scale - lse[None, :])
        if DV:
            dv = tl.dot(p.to(do.dtype), do, dv, input_precision=PRECISION)
        if DK:
            ds = p * (tl.dot(v, tl.trans(do), input_precision=PRECISION) - delta[None, :])
            if SOFTCAP:
                ds *= 1 - t * t
            dk = tl.dot(ds.to(q.dtype), q, dk, input_precision=PRECISION)
    return dk, dv


# 64-key blocks serve one launch of wide tiles (MLA 192/128 picked (32, 64, 4, 2)); d 256/256 launches dK and dV
# apart (split_grads), and each picked 128-key blocks
@autotune(
    small=[(32, 64, 4, 4), (32, 64, 4, 3), (64, 128, 8, 2), (32, 128, 8, 3)],
    large=[(32, 128, 8, 2), (32, 128, 8, 3), (16, 64, 4, 3), (64, 128, 8, 2), (32, 64, 8, 2), (64, 64, 8, 2),
           (32, 64, 4, 2), (16, 64, 8, 2), (64, 64, 8, 3)],
    key=["BLOCK_DQK", "BLOCK_DV", "DK", "DV"], walk_block="BLOCK_M",
)
@triton.jit
def _dkdv_kernel(Q, K, V, DO, Lse, Delta, GradK, GradV, cu_seqlens_q, cu_seqlens_k, KeyPadding, stride_kpb, KeyBounds,
                 Ids, stride_idb, Spans, Runs,
                 stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
                 stride_vb, stride_vh, stride_vs, stride_dob, stride_doh, stride_dos,
                 stride_lb, stride_lh, stride_ls, stride_db, stride_dh, stride_ds,
                 stride_dk_part, stride_dkb, stride_dkh, stride_dks, stride_dv_part, stride_dvb, stride_dvh, stride_dvs,
                 seqlen_q, seqlen_k, group, parts, before, after, qk_scale, scale, cap, seq_bucket,
                 D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
                 VARLEN: tl.constexpr, HAS_KEY_PADDING: tl.constexpr, HAS_DOCUMENTS: tl.constexpr,
                 SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, SHORT_WALK: tl.constexpr, OWN_WALK: tl.constexpr,
                 KEYED_ONLY: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    batch, kv_head, part = tl.program_id(2), tl.program_id(1) // parts, tl.program_id(1) % parts
    q_start, seqlen_q = sequence(cu_seqlens_q, batch, seqlen_q, VARLEN)
    k_start, seqlen_k = sequence(cu_seqlens_k, batch, seqlen_k, VARLEN)
    first = tl.program_id(0) * BLOCK_N  # under a causal mask the first keys are seen most: start them first
    _, end = padding_bounds(KeyBounds, batch, seqlen_k, HAS_KEY_PADDING)
    if KEYED_ONLY:  # a sequence with no real key keeps the gradients another call wrote
        first = tl.where(end > 0, first, seqlen_k)
    if first >= seqlen_k:
        return
    last = tl.minimum(first + BLOCK_N, seqlen_k) - 1
    row = k_start + first
    offs_n = tl.arange(0, BLOCK_N)
    keys = first + offs_n
    keys_ok = keys < seqlen_k
    rows = tl.arange(0, BLOCK_M)
    d_qk = tl.arange(0, BLOCK_DQK)
    d_v = tl.arange(0, BLOCK_DV)

    k = load_rows(K, batch, kv_head, k_start, first, seqlen_k, stride_kb, stride_kh, stride_ks, D_QK, BLOCK_N,
                  BLOCK_DQK)
    v = load_rows(V, batch, kv_head, k_start, first, seqlen_k, stride_vb, stride_vh, stride_vs, D_V, BLOCK_N, BLOCK_DV)
    dk = tl.zeros([BLOCK_N, BLOCK_DQK], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    real = keys_ok
    lo, full_lo, full_hi, hi = tile_ranges(first, last, seqlen_q, after, before, BLOCK_M)
    ids, spans, runs, key_docs = document_rows(Ids, stride_idb, Spans, Runs, batch, keys, seqlen_k, HAS_DOCUMENTS)
    if HAS_DOCUMENTS:
        lo, full_lo, full_hi, hi = document_tiles(spans, runs, first, last, lo, full_lo, full_hi, hi, BLOCK_N, BLOCK_M)
    if HAS_KEY_PADDING:
        real = real_keys(KeyPadding + batch * stride_kpb, keys, seqlen_k)
        if first >= end:  # padding keys only: dK = dV = 0
            lo = hi
            full_lo = hi
            full_hi = hi
    heads = tl.cdiv(group, parts)
    head_lo = kv_head * group + part * heads
    for head in range(head_lo, tl.minimum(head_lo + heads, (kv_head + 1) * group)):
        q_rows = walk_rows(Q, batch, head, q_start, seqlen_q, stride_qb, stride_qh, stride_qs, D_QK, BLOCK_M,
                           BLOCK_DQK, OWN_WALK)
        do_rows = walk_rows(DO, batch, head, q_start, seqlen_q, stride_dob, stride_doh, stride_dos, D_V, BLOCK_M,
                            BLOCK_DV, OWN_WALK)
        lse_ptrs = head_start(Lse, batch, head, q_start, stride_lb, stride_lh, stride_ls) + rows * stride_ls
        delta_ptrs = head_start(Delta, batch, head, q_start, stride_db, stride_dh, stride_ds) + rows * stride_ds
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_rows, do_rows, lse_ptrs, delta_ptrs, real, key_docs, ids, keys, rows,
                             lo, full_lo, seqlen_q, after, before, qk_scale, cap, stride_ls, stride_ds, BLOCK_M,
                             BLOCK_DQK, BLOCK_DV, True, HAS_KEY_PADDING, HAS_DOCUMENTS, SOFTCAP, PRECISION, OWN_WALK,
                             DK, DV)
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_rows, do_rows, lse_ptrs, delta_ptrs, real, key_docs, ids, keys, rows,
                             full_lo, full_hi, seqlen_q, after, before, qk_scale, cap, stride_ls, stride_ds, BLOCK_M,
                             BLOCK_DQK, BLOCK_DV, False, HAS_KEY_PADDING, False, SOFTCAP, PRECISION, OWN_WALK, DK, DV)
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_rows, do_rows, lse_ptrs, delta_ptrs, real, key_docs, ids, keys, rows,
                             full_hi, hi, seqlen_q, after, before, qk_scale, cap, stride_ls, stride_ds, BLOCK_M,
                             BLOCK_DQK, BLOCK_DV, True, HAS_KEY_PADDING, HAS_DOCUMENTS, SOFTCAP, PRECISION, OWN_WALK,
                             DK, DV)

    part = tl.cast(part, tl.int64)
    if DK:
        dk_ptrs = head_start(GradK + part * stride_dk_part, batch, kv_head, row, stride_dkb, stride_dkh, stride_dks)
        store_tile(dk_ptrs + offs_n[:, None] * stride_dks + d_qk[None, :], (dk * scale).to(GradK.dtype.element_ty),
                   keys_ok, d_qk, D_QK, BLOCK_DQK)
    if DV:
        dv_ptrs = head_start(GradV + part * stride_dv_part, batch, kv_head, row, stride_dvb, stride_dvh, stride_dvs)
        store_tile(dv_ptrs + offs_n[:, None] * stride_dvs + d_v[None, :], dv.to(GradV.dtype.element_ty),
                   keys_ok, d_v, D_V, BLOCK_DV)


def own_walks(varlen, short, wide, pays_host):
    """Whether the backward's programs make their own descriptors for the tiles they walk (K and
    V in the dQ kernel, Q and dO in the dK/dV kernel) rather than read ``walked`` ones made on
    the host: always, but for the short walks (windows) of head tiles at most 256 wide together,
    in launches long enough to repay the host's time (``pays_host``, ``pays_host_walk``). There
    the host's were 2-6% faster; on long walks they cost up to 9%, and wide tiles lost on a
    window too (GQA+MLA 192/128: 3%; BENCHMARKS.md)."""
    return varlen or not short or wide or not pays_host


def split_grads(d_qk, d_v):
    """Whether dK and dV come from two launches of ``_dkdv_kernel``, each with one float32
    accumulator, rather than one launch with both: where both head tiles are 256 wide. There the
    two accumulators crowd the registers, and the split's extra score recomputation pays: H100,
    backward 1.23x faster on Gemma 2's d256 window with a softcap, 1.09x on d256 causal; with a
    256 + 128 tile (MLA 192/128) it lost 8-15%, and on d128 17-20% (BENCHMARKS.md)."""
    return head_blocks(d_qk) + head_blocks(d_v) > 384


def _group_parts(device, group, programs):
    """How many programs share one KV head's query heads in ``_dkdv_kernel``: enough for two
    waves of programs. The interpreter has no multiprocessors; its target of 16 makes small
    tests take the split path too."""
    target = 2 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 16
    heads = cdiv(group, min(group, cdiv(target, max(programs, 1))))  # no keys: no programs
    return cdiv(group, heads)


def _packed(grad, varlen):
    """The memory behind a (B, H, S, D) view: for varlen every document aliases the packed rows."""
    return grad[:1] if varlen else grad


def backward(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
             scale, before, after, key_padding_mask=None, document_ids=None, softcap=0.0, keyed_only=False,
             tables=None):
    """Fills ``dq``, ``dk`` and ``dv`` in place; layouts, ``key_padding_mask``, ``document_ids``,
    ``softcap``, ``keyed_only`` and ``tables`` as in ``triton_forward.forward``."""
    batch, h_q, s_q = q.shape[:3]
    h_kv = k.shape[1]
    d_qk, d_v = q.shape[-1], v.shape[-1]
    group = h_q // h_kv
    varlen = cu_seqlens_q is not None
    delta = torch.empty(1 if varlen else batch, h_q, s_q, dtype=torch.float32, device=q.device).expand(batch, h_q, s_q)
    short = short_walk(before, after)
    own = own_walks(varlen, short, head_blocks(d_qk) + head_blocks(d_v) > 256,
                    pays_host_walk(batch, h_q, max_seqlen_q, max_seqlen_k, before, after, d_qk, d_v))
    common = dict(D_QK=d_qk, D_V=d_v, BLOCK_DQK=head_blocks(d_qk), BLOCK_DV=head_blocks(d_v), VARLEN=varlen,
                  HAS_KEY_PADDING=key_padding_mask is not None, HAS_DOCUMENTS=document_ids is not None,
                  SOFTCAP=softcap > 0, PRECISION=dot_precision(q.dtype), SHORT_WALK=short, OWN_WALK=own,
                  KEYED_ONLY=keyed_only, seq_bucket=seq_bucket(max_seqlen_q, max_seqlen_k))
    masks = tables or mask_args(key_padding_mask, document_ids)
    qk_scale = scale * LOG2E.value

    def dq_grid(meta):
        return cdiv(max_seqlen_q, meta["BLOCK_M"]), h_q, batch

    launch(
        _dq_kernel, dq_grid, q.device,
        q, walked(k, own), walked(v, own), dout, out, lse, delta, dq, cu_seqlens_q, cu_seqlens_k, *masks,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3], *out.stride()[:3],
        *lse.stride(), *delta.stride(), *dq.stride()[:3],
        max_seqlen_q, max_seqlen_k, group, before, after, qk_scale, scale, softcap / scale, **common,
    )

    # 128: the widest key block. keyed_only writes dK and dV in place, which partial sums would overwrite.
    parts = 1 if keyed_only else _group_parts(q.device, group, cdiv(max_seqlen_k, 128) * h_kv * batch)
    if parts == 1:
        dk_parts, dv_parts = dk.unsqueeze(0), dv.unsqueeze(0)
    else:  # float32 partial sums, one per part, added up below
        dk_parts, dv_parts = (torch.empty(parts, *_packed(grad, varlen).shape, dtype=torch.float32, device=q.device)
                              .expand(parts, *grad.shape) for grad in (dk, dv))

    def dkdv_grid(meta):
        return cdiv(max_seqlen_k, meta["BLOCK_N"]), h_kv * parts, batch

    launches = ((True, False), (False, True)) if split_grads(d_qk, d_v) else ((True, True),)
    for with_dk, with_dv in launches:
        launch(
            _dkdv_kernel, dkdv_grid, q.device,
            walked(q, own), k, v, walked(dout, own), lse, delta, dk_parts, dv_parts, cu_seqlens_q, cu_seqlens_k,
            *masks, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3], *lse.stride(),
            *delta.stride(), dk_parts.stride(0), *dk_parts.stride()[1:4], dv_parts.stride(0), *dv_parts.stride()[1:4],
            max_seqlen_q, max_seqlen_k, group, parts, before, after, qk_scale, scale, softcap / scale, **common,
            DK=with_dk, DV=with_dv,
        )
    if parts > 1:
        for grad, partial in ((dk, dk_parts), (dv, dv_parts)):
            rows = _packed(grad, varlen)
            rows.copy_(partial[:, :len(rows)].sum(0))
