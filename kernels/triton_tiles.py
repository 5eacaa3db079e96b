"""What the Triton attention kernels share: the tiles a block of rows visits, the masks inside a
tile, where a sequence and a head start, and the autotuning configurations.

Masks are given as reaches: row r sees column c when ``r - before <= c <= r + after`` and
``c < n_cols``. The op boundary folds the causal/window bounds and the position offsets into
these two numbers; an unbounded side is ``UNBOUNDED``, farther than any two positions can be.
Packed documents in a dense batch (``document_args``) AND a same-document test into the masked
tiles and narrow the tiles a block visits to its rows' documents.

The tile loops read through tensor descriptors (TMA on Hopper, ``walk_rows``): for a dense
(B, H, S, D) tensor in a launch long enough to repay it (``pays_host_walk``), one made on the host
(``walked``); for packed varlen documents, shorter launches and the backward's long walks, one
that each program makes over its rows.
"""
import contextvars
import logging
import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .launch_math import next_power_of_2, scan_block
from .triton_run_chunks import chunk_runs, chunk_summaries, chunks
from .visibility import mask_bytes

UNBOUNDED = 1 << 29
MAX_SPAN = 1 << 28  # lengths and |q_offset - k_offset| stay below this, so no int32 bound overflows
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
INTERPRET_TANH = tl.constexpr(INTERPRET)  # ``capped``'s tanh without PTX


def autotune(small, large, key, walk_block=None):
    """``triton.autotune`` over ``small`` while the two head tiles are at most 256 wide together
    (d 128/128) and ``large`` beyond, each a list of (BLOCK_M, BLOCK_N, num_warps, num_stages)
    picked from H100 sweeps (wider tiles with 4 warps spill there); float32 tiles take twice the
    shared memory, so float32 runs them at half the rows and at most 2 stages. IEEE float32 dots
    (``dot_precision``) run on the CUDA cores and compile slowly: they get the first float32
    configuration alone instead of a tuning run over all of them. One small configuration
    when interpreting, so the CPU tests cross several tiles. The kernel's first argument must be
    Q (a tensor or its ``walked`` descriptor), and it takes the PRECISION, SHORT_WALK and
    OWN_WALK constexprs and the ``seq_bucket`` int, which join the key: a pick is compiled, checked
    and timed for the descriptors it reads through (``pays_host_walk`` gives calls of one length
    either kind). ``walk_block``: the tile rows of its walk; each configuration sets the block
    shapes of the ``walked`` descriptors among its arguments before it runs (``launch`` does it
    for a pick)."""
    key = [*key, "PRECISION", "SHORT_WALK", "OWN_WALK", "seq_bucket"]

    def set_block_shapes(nargs):
        shape_walks(nargs.values(), nargs[walk_block])

    block_shapes = set_block_shapes if walk_block else None

    def tuned(configs, **options):
        def decorate(fn):
            kernel = triton.autotune(configs, key=key, **options)(fn)
            kernel.walk_block = walk_block
            return kernel
        return decorate

    if INTERPRET:
        return tuned([triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, pre_hook=block_shapes)])

    def configs(sizes, float32=False):
        if float32:
            sizes = [(max(16, m // 2), max(16, n // 2), w, min(s, 2)) for m, n, w, s in sizes]
        return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s, pre_hook=block_shapes)
                for m, n, w, s in sizes]

    by_kind = {(wide, float32): configs(large if wide else small, float32)
               for wide in (False, True) for float32 in (False, True)}

    def by_head_dims_and_dtype(_configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        q = args["Q"].base if isinstance(args["Q"], TensorDescriptor) else args["Q"]
        kind = by_kind[args["BLOCK_DQK"] + args["BLOCK_DV"] > 256, q.element_size() == 4]
        return kind[:1] if args["PRECISION"] == "ieee" else kind

    every = [config for kind in by_kind.values() for config in kind]
    return tuned(every, prune_configs_by={"early_config_prune": by_head_dims_and_dtype})


def shape_walks(args, rows):
    """Sets the block shape of every ``walked`` descriptor among ``args`` to tiles of ``rows`` rows."""
    for arg in args:
        if isinstance(arg, TensorDescriptor):
            arg.block_shape = [1, 1, rows, arg.block_shape[-1]]


_PICKS = {}  # (autotuned kernel, its autotuning key) -> the configuration it picked
# Calls no longer than this (``seq_bucket``) run the first candidate that compiles, untimed. Each
# candidate compiles for every new key, and context-parallel tiles of short documents bring many
# keys: the first case of one `bench cp --documents --check` run on 2 H200s timed 153 candidates.
UNTUNED_BUCKET = 1024
# ATTN_COMPILE_AUTOTUNE=0 makes every call run its first candidate that compiles, untimed: a
# correctness run (`bench cp --check` sets it) then compiles one candidate per key, not all of
# them. A `bench cp --documents --check` on 4 H200s, compiling and timing every candidate, printed
# its first case after 172 s; with one candidate per key, the whole check took 84 s on 2 H200s.
AUTOTUNE = "ATTN_COMPILE_AUTOTUNE"
_LOGGED = set()  # (kernel, configuration, error) rejections already logged
log = logging.getLogger("attn_compile")


def launch(kernel, grid, device, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)`` for an ``autotune``d kernel, with the scratch memory its
    tensor descriptors need, from an allocator set in a copy of the current context: a Triton
    allocator the caller set stays in place. Triton's autotuner rebuilds its key on every call
    by scanning the argument names once per argument (tens of µs of host time for these
    kernels); here a key's first call tunes (``tune``) and every call launches its pick
    directly, after setting the block shapes of its ``walked`` descriptors for the pick's tiles."""
    key = (kernel, *(kwargs[name] for name in kernel.keys), *(str(arg.dtype) for arg in args if hasattr(arg, "dtype")))

    def scratch(size, alignment, stream):
        return torch.empty(size, dtype=torch.int8, device=device)

    def run():
        triton.set_allocator(scratch)
        pick = _PICKS.get(key)
        if pick is None:
            pick = _PICKS[key] = tune(kernel, grid, args, kwargs)
        if kernel.walk_block is not None:
            shape_walks(args, pick.kwargs[kernel.walk_block])
        kernel.fn[grid](*args, **kwargs, **pick.all_kwargs())

    contextvars.copy_context().run(run)


def tune(kernel, grid, args, kwargs):
    """The configuration of ``kernel`` for these arguments. Each candidate is compiled and loaded
    first (``compile_config``), and one that fails to is rejected like one that runs out of
    resources: Triton's autotuner rejects only OutOfResources, CompileTimeAssertionFailure and
    PTXASError, and on an H100 an MLIR pass failing on one configuration ("Pipeline failed while
    executing LLVMDIScope") ended the call. The survivors are timed by Triton's autotuner; an
    error while they run is raised as it is. A call of ``UNTUNED_BUCKET`` keys or fewer, or any
    call while ``ATTN_COMPILE_AUTOTUNE=0``, takes the first candidate that compiles, untimed.
    Raises a RuntimeError naming the first failure when every candidate is rejected."""
    meta = {**kwargs, "grid": grid, "warmup": False}
    untuned = not autotuning() or kwargs["seq_bucket"] <= UNTUNED_BUCKET
    kernel.nargs = dict(zip(kernel.arg_names, args))  # what the autotuner's pruning and timing read
    try:
        compiled, failures = [], []
        for config in kernel.prune_configs(meta):
            try:
                compile_config(kernel, config, grid, args, kwargs)
            except Exception as error:  # noqa: BLE001  (any failure to compile rejects the configuration)
                _log_rejected(kernel, config, error)
                failures.append(f"{config}: {type(error).__name__}: {_first_line(error)}")
            else:
                compiled.append(config)
                if untuned:
                    break
        if len(compiled) > 1:
            timings = {config: kernel._bench(*args, config=config, **meta) for config in compiled}
            failures += [f"{config}: rejected by Triton's autotuner (out of resources)" for config in compiled
                         if timings[config][0] == float("inf")]
            compiled = sorted((config for config in compiled if timings[config][0] != float("inf")), key=timings.get)
        if not compiled:
            raise RuntimeError(f"Triton kernel {kernel.fn.__name__}: every autotuning configuration was rejected for "
                               f"{dict(zip(kernel.keys, (meta[name] for name in kernel.keys)))}: "
                               + "; ".join(failures))
        return compiled[0]
    finally:
        kernel.nargs = None


def autotuning() -> bool:
    """Whether ``ATTN_COMPILE_AUTOTUNE`` (read at each tuning, default 1) lets a call time its
    candidates."""
    value = os.environ.get(AUTOTUNE, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{AUTOTUNE} must be 0 (each Triton kernel runs its first candidate that compiles) or 1 "
                         f"(the candidates are timed, the default); got {value!r}")
    return value == "1"


def compile_config(kernel, config, grid, args, kwargs) -> None:
    """Compiles ``kernel`` for ``config`` and loads it on the device without launching it (nothing
    to compile when interpreting). Loading checks the shared memory it needs against the GPU's:
    a configuration that needs more (d 256 tiles on an H200: 262,200 bytes of 232,448) fails
    here, not at its launch."""
    if config.pre_hook:  # the block shapes of the walked descriptors, part of what is compiled
        config.pre_hook({**kernel.nargs, **kwargs, **config.all_kwargs()})
    compiled = kernel.fn.run(*args, grid=grid, warmup=True, **kwargs, **config.all_kwargs())
    if hasattr(compiled, "_init_handles"):
        compiled._init_handles()


def _first_line(error) -> str:
    return (str(error).strip().splitlines() or [""])[0]


def _log_rejected(kernel, config, error) -> None:
    """Logged once per kernel, configuration and error. A configuration that needs more shared
    memory than the GPU has is an expected rejection (the d 256 tiles on sm90; Triton's own
    autotuner drops them silently), so it is logged at debug level; any other failure is a
    warning."""
    seen = (kernel, str(config), type(error), _first_line(error))
    if seen not in _LOGGED:
        _LOGGED.add(seen)
        level = logging.DEBUG if isinstance(error, triton.runtime.errors.OutOfResources) else logging.WARNING
        log.log(level, "Triton kernel %s: configuration %s failed to compile or load and is not used (%s: %s)",
                kernel.fn.__name__, config, type(error).__name__, _first_line(error))


def dot_precision(dtype: torch.dtype) -> str:
    """The kernels' dot precision. float32 follows ``torch.get_float32_matmul_precision()`` as
    torch.matmul does: IEEE float32 at "highest" (PyTorch's default), TF32 otherwise. Other
    dtypes are unaffected."""
    return "ieee" if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest" else "tf32"


def seq_bucket(max_seqlen_q: int, max_seqlen_k: int) -> int:
    """The longer sequence rounded up to a power of two (at least 16), an autotuning key that
    the kernels take as an int and do not read. Without it, tiles tuned on a short first call
    were kept for every length: after S=256, GQA+MLA's forward at 4096 ran 12% slower and the
    backwards 3-4% (BENCHMARKS.md). Powers of two of 16 or more compile to the same kernel, so
    a new bucket re-times the configurations (1.5-2.6 s) without compiling them again."""
    return max(16, next_power_of_2(max(max_seqlen_q, max_seqlen_k)))


def short_walk(before: int, after: int) -> bool:
    """Whether a row sees fewer than 4096 keys (a sliding window). It is part of the autotuning
    key (the SHORT_WALK constexpr, which the kernels do not otherwise read): short walks favour
    other tiles than long ones (BENCHMARKS.md), so a window does not inherit the tiles tuned for
    causal attention with the same head dims."""
    return before + after < 4096


def head_blocks(d: int) -> int:
    """The tile width for a head dim: a power of two, at least 16 for the tensor cores."""
    return max(16, next_power_of_2(d))


@triton.jit
def sequence(cu_seqlens, batch, seqlen, VARLEN: tl.constexpr):
    """(first row, length) of sequence ``batch``: a document of the packed tensor, or a batch entry."""
    if VARLEN:
        start = tl.load(cu_seqlens + batch)
        return start, tl.load(cu_seqlens + batch + 1) - start
    else:
        return 0, seqlen


@triton.jit
def head_start(ptr, batch, head, row, stride_b, stride_h, stride_s):
    """Pointer to ``row`` of one head, in 64 bits: long or packed tensors outgrow int32 offsets,
    so offsets added to it stay within one tile."""
    batch, head, row = tl.cast(batch, tl.int64), tl.cast(head, tl.int64), tl.cast(row, tl.int64)
    return ptr + batch * stride_b + head * stride_h + row * stride_s


@triton.jit
def load_rows(ptr, batch, head, start, first, n_rows, stride_b, stride_h, stride_s, D: tl.constexpr,
              BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows [first, first + BLOCK_ROWS) of one head's sequence of ``n_rows`` from row ``start``,
    zero past the last row and past the head dim. Plain loads, for the tiles a program reads
    once: there a tensor descriptor costs more to set up than it saves (a window's short walks
    ran 8% slower)."""
    offs = tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_D)
    ptrs = head_start(ptr, batch, head, start + first, stride_b, stride_h, stride_s)
    mask = (first + offs < n_rows)[:, None]
    if D != BLOCK_D:
        mask = mask & (cols < D)[None, :]
    return tl.load(ptrs + offs[:, None] * stride_s + cols[None, :], mask=mask, other=0.0)


@triton.jit
def rows_of(ptr, batch, head, row, n_rows, stride_b, stride_h, stride_s, D: tl.constexpr, BLOCK_ROWS: tl.constexpr,
            BLOCK_D: tl.constexpr):
    """A tensor descriptor (TMA on Hopper) over one head's rows [row, row + n_rows), for the tiles
    a loop walks: its loads give (BLOCK_ROWS, BLOCK_D) tiles, zero past the last row and past
    the head dim. The start and strides must be 16-byte aligned (``triton_attention`` makes them
    so). A length of 0 becomes 1, which no tile range reaches."""
    return tl.make_tensor_descriptor(head_start(ptr, batch, head, row, stride_b, stride_h, stride_s),
                                     shape=[tl.maximum(n_rows, 1), D], strides=[stride_s, 1],
                                     block_shape=[BLOCK_ROWS, BLOCK_D])


@triton.jit
def walk_rows(ptr, batch, head, row, n_rows, stride_b, stride_h, stride_s, D: tl.constexpr, BLOCK_ROWS: tl.constexpr,
              BLOCK_D: tl.constexpr, OWN: tl.constexpr):
    """What a tile loop reads one head's rows [row, row + n_rows) through, with ``walk_tile``:
    ``ptr`` itself where it came as a ``walked`` descriptor over a whole dense tensor (its tiles
    then end at the tensor's last row, not at ``n_rows``: the masks hide the rows between); with
    ``OWN``, a descriptor this program makes over its rows (packed documents, whose batch stride
    is 0, and the backward's long walks)."""
    if OWN:
        return rows_of(ptr, batch, head, row, n_rows, stride_b, stride_h, stride_s, D, BLOCK_ROWS, BLOCK_D), 0, 0
    else:
        return ptr, batch, head


@triton.jit
def walk_tile(rows, start, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, OWN: tl.constexpr):
    """The (BLOCK_ROWS, BLOCK_D) tile from row ``start`` of ``walk_rows``' rows, zero past their
    end and past the head dim."""
    desc, batch, head = rows
    if OWN:
        return desc.load([start, 0])
    else:
        return desc.load([batch, head, start, 0]).reshape([BLOCK_ROWS, BLOCK_D])


# Descriptors made on the host (``walked``) cost about 80 µs of host time a launch (Triton encodes
# each at every launch) and saved the kernels 1.5-6% of their time: that repays them on launches of
# about a millisecond or more (5e11 FLOPs by ``pays_host_walk``'s count, which counts a causal
# square whole: 0.6-1.7 ms of these kernels at 300-450 TFLOP/s), while a shorter call is bound by
# its host time and its programs make their own. One H200, the Mistral-shaped packed attention of
# `bench models` at 4096 (1.4e11 a launch): fwd+bwd 2.016 to 1.922 ms, host time 2065 to 1942 µs,
# GPU time 1131 to 1178 µs; at 8192 within 1% (BENCHMARKS.md).
HOST_WALK_FLOPS = 5e11


def pays_host_walk(batch, heads, s_q, s_k, before, after, d_qk, d_v) -> bool:
    """Whether a launch over ``heads`` query heads, each row seeing at most ``before + after + 1``
    of ``s_k`` keys, does at least ``HOST_WALK_FLOPS`` of forward work."""
    reach = min(s_k, before + after + 1)
    return 2.0 * batch * heads * s_q * reach * (d_qk + d_v) >= HOST_WALK_FLOPS


def walked(x, own):
    """A kernel's argument for a tensor its tile loop reads (``walk_rows``): for a dense (B, H, S, D)
    tensor with 16-byte aligned strides and start, one descriptor made here, so that no program
    makes its own; ``autotune`` sets its block shape. With ``own`` (packed documents, a launch
    too short to repay it, or a walk where the programs' own descriptors measured faster), the
    tensor itself.
    One descriptor from the host made the forward 1.5-2.5% faster on causal attention and 5% on a
    1024 window, for about 80 µs more host time per call. In the backward it gained on windows
    but cost the dK/dV kernel up to 9% on long walks (GQA+MLA, document ids), hence
    ``triton_backward``'s choice (BENCHMARKS.md)."""
    if own:
        return x
    if x.numel() == 0:  # a descriptor's dims must be positive; no tile of an empty tensor is read
        x = x.new_zeros(1, 1, 1, head_blocks(x.shape[-1]))[..., :x.shape[-1]]
    return TensorDescriptor(x, list(x.shape), list(x.stride()), [1, 1, 16, head_blocks(x.shape[-1])])


@triton.jit
def store_tile(ptrs, value, rows_ok, cols, D: tl.constexpr, BLOCK_D: tl.constexpr):
    if D == BLOCK_D:
        tl.store(ptrs, value, mask=rows_ok[:, None])
    else:
        tl.store(ptrs, value, mask=rows_ok[:, None] & (cols < D)[None, :])


@triton.jit
def capped(s, cap):
    """(cap * tanh(s / cap), tanh(s / cap)): the scores softcapped, with the tanh whose 1 - tanh²
    is the cap's slope. ``cap`` is in the units of the unscaled scores (softcap / scale). On the
    GPU the tanh is PTX's tanh.approx.f32, as flash-attn's softcap: one instruction, against an
    exp2 and a division, which cost the forward 15-30% of its speed (BENCHMARKS.md); bf16 results
    were as close to float32 either way. The interpreter, which runs no PTX, takes it from exp2."""
    x = s * (1.0 / cap)
    if INTERPRET_TANH:
        t = 1 - 2 / (1 + tl.math.exp2(x * (2 * LOG2E)))
    else:
        t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                      pack=1)
    return cap * t, t


@triton.jit
def visible(rows, cols, n_cols, before, after):
    """(rows, cols) mask of the pairs that see each other."""
    dist = cols[None, :] - rows[:, None]
    return (dist >= -before) & (dist <= after) & (cols[None, :] < n_cols)


@triton.jit
def real_keys(key_padding, keys, n_keys):
    """Which of ``keys`` are real, given one batch row of the (uint8) key padding mask."""
    return tl.load(key_padding + keys, mask=keys < n_keys, other=0) != 0


@triton.jit
def padding_bounds(key_bounds, batch, seqlen_k, HAS_KEY_PADDING: tl.constexpr):
    """(prefix, end) of a sequence's keys: every key before ``prefix`` is real and every key from
    ``end`` on is padding, so tiles before ``prefix`` skip the padding mask and those from ``end`` on
    are never visited. (seqlen_k, seqlen_k) without padding."""
    if HAS_KEY_PADDING:
        return tl.load(key_bounds + 2 * batch), tl.load(key_bounds + 2 * batch + 1)
    else:
        return seqlen_k, seqlen_k


@triton.jit
def query_block(cu_seqlens_q, cu_seqlens_k, key_bounds, batch, seqlen_q, seqlen_k, BLOCK_M: tl.constexpr,
                VARLEN: tl.constexpr, HAS_KEY_PADDING: tl.constexpr, KEYED_ONLY: tl.constexpr):
    """(q_start, seqlen_q, k_start, seqlen_k, real_prefix, first) of a program over a block of
    query rows: where its sequence starts and how long it is in q and in k (k cut after the last
    real key), the sequence's ``padding_bounds`` prefix, and the block's first row, < 0 where the
    sequence has fewer blocks, or, with KEYED_ONLY, no real key (its rows are left as they are).
    The last rows come first: under a causal mask they see the most keys."""
    q_start, seqlen_q = sequence(cu_seqlens_q, batch, seqlen_q, VARLEN)
    k_start, seqlen_k = sequence(cu_seqlens_k, batch, seqlen_k, VARLEN)
    real_prefix, seqlen_k = padding_bounds(key_bounds, batch, seqlen_k, HAS_KEY_PADDING)
    first = (tl.cdiv(seqlen_q, BLOCK_M) - 1 - tl.program_id(0)) * BLOCK_M
    if KEYED_ONLY:
        first = tl.where(seqlen_k > 0, first, -1)
    return q_start, seqlen_q, k_start, seqlen_k, real_prefix, first


@triton.jit
def key_tiles(seqlen_k, real_prefix, first, last, before, after, spans, runs, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, HAS_DOCUMENTS: tl.constexpr):
    """The key tiles query rows [first, last] walk, cut at ``lo <= full_lo <= full_hi <= hi``:
    [lo, full_lo) and [full_hi, hi) take the position (and document) mask, [full_lo, full_hi) none;
    and ``padded_from``, the first tile that holds a key at or after ``real_prefix``
    (``padding_bounds``): the tiles from it on take the key padding mask, masked or not."""
    lo, full_lo, full_hi, hi = tile_ranges(first, last, seqlen_k, before, after, BLOCK_N)
    if HAS_DOCUMENTS:
        lo, full_lo, full_hi, hi = document_tiles(spans, runs, first, last, lo, full_lo, full_hi, hi, BLOCK_M,
                                                  BLOCK_N)
    return lo, full_lo, full_hi, hi, real_prefix // BLOCK_N


@triton.jit
def key_walk(K, V, KeyPadding, stride_kpb, Ids, stride_idb, Spans, Runs, batch, kv_head, k_start, seqlen_k, seqlen_q,
             real_prefix, first, last, rows, before, after, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh,
             stride_vs, D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_KEY_PADDING: tl.constexpr,
             HAS_DOCUMENTS: tl.constexpr, OWN: tl.constexpr):
    """What a block of query rows [first, last] reads on its walk over the key tiles, in the
    forward and dQ kernels: (k_rows, v_rows, key_padding, ids, row_docs, tiles), K's and V's
    ``walk_rows``, the batch row's key padding mask, its document ids and the rows' documents
    (``document_rows``), and ``key_tiles``' four cuts and ``padded_from``."""
    ids, spans, runs, row_docs = document_rows(Ids, stride_idb, Spans, Runs, batch, rows, seqlen_q, HAS_DOCUMENTS)
    k_rows = walk_rows(K, batch, kv_head, k_start, seqlen_k, stride_kb, stride_kh, stride_ks, D_QK, BLOCK_N, BLOCK_DQK,
                       OWN)
    v_rows = walk_rows(V, batch, kv_head, k_start, seqlen_k, stride_vb, stride_vh, stride_vs, D_V, BLOCK_N, BLOCK_DV,
                       OWN)
    tiles = key_tiles(seqlen_k, real_prefix, first, last, before, after, spans, runs, BLOCK_M, BLOCK_N, HAS_DOCUMENTS)
    if HAS_KEY_PADDING:
        key_padding = KeyPadding + batch * stride_kpb
    else:
        key_padding = 0  # not None: a compiled kernel cannot hold None in a tuple
    return k_rows, v_rows, key_padding, ids, row_docs, tiles


@triton.jit
def document_tiles(spans, runs, first, last, lo, full_lo, full_hi, hi, BLOCK_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """``tile_ranges``' cuts narrowed to the documents of rows [first, last] (rows of q, or, in
    the dK/dV kernel, of k: the two share their positions). ``spans`` and ``runs`` are the batch
    row's (``document_args``): tiles outside the rows' spans hold no pair of one document, and, in
    a row of runs, tiles inside every row's span only pairs of one document."""
    rows = first + tl.arange(0, BLOCK_ROWS)
    ok = rows <= last
    span_lo = tl.load(spans + 2 * rows, mask=ok, other=0)  # <= its row
    span_hi = tl.load(spans + 2 * rows + 1, mask=ok, other=0)  # > its row
    widest_hi = tl.max(span_hi, 0)
    lo = tl.maximum(lo, tl.min(tl.where(ok, span_lo, last), 0) // BLOCK)
    hi = tl.maximum(tl.minimum(hi, tl.cdiv(widest_hi, BLOCK)), lo)
    in_runs = tl.load(runs) != 0
    full_lo = tl.where(in_runs, tl.maximum(full_lo, tl.cdiv(tl.max(span_lo, 0), BLOCK)), hi)
    full_hi = tl.minimum(full_hi, tl.min(tl.where(ok, span_hi, widest_hi), 0) // BLOCK)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def document_of(ids, rows, n_rows):
    """The document ids of ``rows``; rows past ``n_rows`` read 0 (the position masks hide them)."""
    return tl.load(ids + rows, mask=rows < n_rows, other=0)


@triton.jit
def document_rows(Ids, stride_idb, Spans, Runs, batch, rows, n_rows, HAS_DOCUMENTS: tl.constexpr):
    """(ids, spans, runs, docs): one batch row's ids, spans (``document_args``, with S_q == S_k ==
    n_rows) and runs flag, and the ids of ``rows``. Without documents, placeholders no code reads
    (0, not None: a compiled kernel cannot hold None in a tuple)."""
    if HAS_DOCUMENTS:
        ids = Ids + batch * stride_idb
        return ids, Spans + batch * 2 * n_rows, Runs + batch, document_of(ids, rows, n_rows)
    else:
        return 0, 0, 0, rows


@triton.jit
def same_document(row_docs, ids, cols, n_cols):
    """(rows, cols) mask of the pairs in one document, given the rows' ``document_of``."""
    return row_docs[:, None] == document_of(ids, cols, n_cols)[None, :]


@triton.jit
def position_mask(s, rows, cols, n_cols, before, after, row_docs, ids, HAS_DOCUMENTS: tl.constexpr):
    """Scores ``s`` of (rows, cols) with -inf where the pair does not see each other: outside
    the reaches (``visible``) or, with documents, in two documents (``same_document``)."""
    s = tl.where(visible(rows, cols, n_cols, before, after), s, float("-inf"))
    if HAS_DOCUMENTS:
        s = tl.where(same_document(row_docs, ids, cols, n_cols), s, float("-inf"))
    return s


@triton.jit
def store_spans(Spans, Runs, n, positions, inside, first, end, falls):
    """Writes the ``document_args`` spans of this program's chunk of a batch row (program ids:
    chunk, batch row; the rest as ``chunk_runs`` gives them) and, from the row's first chunk, its
    runs flag."""
    b = tl.program_id(1)
    rising = falls == 0
    spans = Spans + b * 2 * n + 2 * positions
    tl.store(spans, tl.where(rising, first, 0), mask=inside)
    tl.store(spans + 1, tl.where(rising, end, n), mask=inside)
    if tl.program_id(0) == 0:
        tl.store(Runs + b, rising.to(tl.int32))


@triton.jit
def _document_spans_kernel(Ids, stride_b, n, Summary, Spans, Runs):
    """One program per chunk of a batch row (``triton_run_chunks.py``)."""
    positions, inside, _, _, first, end, _, falls = chunk_runs(Ids, stride_b, n, Summary)
    store_spans(Spans, Runs, n, positions, inside, first, end, falls)


def document_tables(batch, n, device):
    """Uninitialised int32 (B, S, 2) spans and (B,) runs flags of ``document_args``."""
    return (torch.empty(batch, n, 2, dtype=torch.int32, device=device),
            torch.empty(batch, dtype=torch.int32, device=device))


def document_args(document_ids):
    """The kernels' document arguments for (B, S) ids with a unit last stride, or None: the ids
    (bool as uint8), their batch stride, int32 (B, S, 2) spans and int32 (B,) runs flags. A row
    whose ids never fall (Hugging Face's packing: ids that count the documents) is a row of runs:
    token i's span is [first, end) of its run, and tiles inside one run skip the mask. Any other
    row is exact too, with the mask everywhere: its spans are the whole row."""
    if document_ids is None:
        return None, 0, None, None
    ids = mask_bytes(document_ids)
    batch, n = ids.shape
    spans, runs = document_tables(batch, n, ids.device)
    if n:
        _document_spans_kernel[(chunks(n), batch)](ids, ids.stride(0), n, chunk_summaries(ids), spans, runs)
    return ids, ids.stride(0), spans, runs


@triton.jit
def _padding_bounds_kernel(mask, stride_b, n_keys, bounds, BLOCK: tl.constexpr):
    """One program per batch row: its ``padding_bounds`` (prefix, end)."""
    row = mask + tl.program_id(0) * stride_b
    prefix = n_keys
    end = 0
    for start in range(0, n_keys, BLOCK):
        keys = start + tl.arange(0, BLOCK)
        inside = keys < n_keys
        real = tl.load(row + keys, mask=inside, other=0) != 0
        prefix = tl.minimum(prefix, tl.min(tl.where(inside & ~real, keys, n_keys)))
        end = tl.maximum(end, tl.max(tl.where(real, keys + 1, 0)))
    tl.store(bounds + 2 * tl.program_id(0), prefix)
    tl.store(bounds + 2 * tl.program_id(0) + 1, end)


def key_padding_args(key_padding_mask):
    """The kernels' key padding arguments for a (B, S_k) bool mask with a unit last stride, or
    None: the mask as uint8, its batch stride, and int32 (B, 2) ``padding_bounds``."""
    if key_padding_mask is None:
        return None, 0, None
    mask = key_padding_mask.view(torch.uint8)
    bounds = torch.empty(mask.shape[0], 2, dtype=torch.int32, device=mask.device)
    _padding_bounds_kernel[(mask.shape[0],)](mask, mask.stride(0), mask.shape[1], bounds,
                                             BLOCK=scan_block(mask.shape[1]))
    return mask, mask.stride(0), bounds


def mask_args(key_padding_mask, document_ids):
    """``key_padding_args`` then ``document_args``: the mask arguments every kernel takes."""
    return (*key_padding_args(key_padding_mask), *document_args(document_ids))


@triton.jit
def tile_ranges(first, last, n_cols, before, after, BLOCK: tl.constexpr):
    """Column tiles for rows [first, last]: ``lo <= full_lo <= full_hi <= hi``. Tiles outside
    [lo, hi) hold no visible pair and are never touched; those in [full_lo, full_hi) are
    visible to every row and need no mask."""
    col_lo = tl.maximum(first - before, 0)
    col_hi = tl.minimum(last + after + 1, n_cols)
    lo = col_lo // BLOCK
    hi = tl.where(col_hi > col_lo, tl.cdiv(col_hi, BLOCK), lo)
    full_lo = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(last - before, 0), BLOCK), lo), hi)
    full_hi = tl.maximum(tl.minimum(first + after + 1, n_cols), 0) // BLOCK
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi
