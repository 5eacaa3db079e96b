"""Argument checks for the context-parallel ops, run before any collective is posted.

Ranks first agree that they were called alike, on every call: a 16-byte digest of the call's
signature is all-gathered on a gloo twin of the group (comm.host_groups), so the check never
waits for the GPU. A bad argument, or a shape that changes on one rank only, then makes every
rank raise the same error, and none hangs in a collective that another rank never joins. For
packed documents the signature holds a checksum of the document lengths and any rank-local
problem (a token count that does not match them), so every rank sees it.
"""
import hashlib
import zlib

import torch

from attn_compile.validation import check_attention_args

from .comm import all_gather_stacked, cp_rank, cp_size, host_groups
from .documents import check_cu_seqlens, cu_seqlens_error, document_sharding, host_values
from .layout import SequenceSharding, check_layout

_SIGNATURE_BYTES = 512
_DIGEST_BYTES = 16


def _signature(q, k, v, options: dict, packed: bool) -> str:
    def shape(x):  # packed shards hold different token counts: that part is checked against cu_seqlens
        return tuple("T" if packed and dim == 2 else size for dim, size in enumerate(x.shape))
    shapes = ", ".join(f"{name} {shape(x)} {x.dtype}" for name, x in (("q", q), ("k", k), ("v", v)))
    return shapes + "".join(f", {key}={value!r}" for key, value in options.items())


def _gather_bytes(data: bytes, size: int, groups) -> list[bytes]:
    """Every rank's ``data``, cut or padded to ``size`` bytes, in context-parallel rank order."""
    row = torch.frombuffer(bytearray(data[:size].ljust(size, b"\0")), dtype=torch.uint8)
    return [bytes(r.tolist()) for r in all_gather_stacked(row, host_groups(groups))]


def check_same_on_all_ranks(groups, q, k, v, packed=False, problem=None, **options) -> None:
    """Raises the same ValueError on every rank unless all ranks pass like shapes and options and
    found the same ``problem`` (a rank-local error found before, or None). The error leads with
    the ranks' problems, where there are any: they are the cause, the calls differ through them."""
    signature = _signature(q, k, v, options, packed)
    agreed = f"{signature}, problem={problem!r}".encode()
    if len(set(_gather_bytes(hashlib.blake2b(agreed, digest_size=_DIGEST_BYTES).digest(), _DIGEST_BYTES,
                             groups))) == 1:
        return
    signatures = _gather_text(signature, groups)
    calls = "; ".join(f"rank {rank}: {s}" for rank, s in enumerate(signatures))
    problems = "; ".join(f"rank {rank}: {p}" for rank, p in enumerate(_gather_text(problem or "", groups)) if p)
    if not problems:
        raise ValueError(f"q, k, v and the options must be the same on every rank of the group; got {calls}")
    differ = f"; their calls: {calls}" if len(set(signatures)) > 1 else ""
    raise ValueError(f"{problems} (every rank of the group raises this{differ})")


def _gather_text(text: str, groups) -> list[str]:
    return [s.rstrip(b"\0").decode(errors="replace") for s in _gather_bytes(text.encode(), _SIGNATURE_BYTES, groups)]


def raise_on_every_rank(groups, q, k, v, problem: str, packed: bool = False):
    """Raises ValueError(problem) here, for a call that found it before reaching ``check_call``, and
    on every other rank of the group too: they meet this call in check_call's agreement, which fails.
    ``packed``: q, k, v are shards of packed documents, whose token counts differ from rank to rank."""
    check_same_on_all_ranks(groups, q, k, v, packed, problem=problem)
    raise ValueError(problem)


def sharding_of(q, groups, layout: str, cu_seqlens=None):
    """Where the rows of q, k, v sit in the sequence: their ``SequenceSharding`` or ``DocumentSharding``."""
    if cu_seqlens is None:
        return SequenceSharding(cp_size(groups), layout, q.shape[2])
    return document_sharding(tuple(host_values(cu_seqlens)), cp_size(groups), layout)


def _packed_sharding(q, k, v, groups, layout, cu_seqlens, values, max_seqlen):
    """(the DocumentSharding of the documents ``cu_seqlens`` (with these ``values``) describes, why
    the packed shards q, k, v cannot be its shards or None): the sharding is None where the values are bad."""
    try:
        check_layout(layout)
        check_cu_seqlens("cu_seqlens", cu_seqlens)
    except ValueError as error:
        return None, str(error)
    if any(x.dim() != 4 for x in (q, k, v)):
        return None, None  # check_inputs names it, after the ranks agree
    if q.shape[0] != 1:
        return None, f"packed documents come as one batch entry: q.shape[0] must be 1; got {q.shape[0]}"
    error = cu_seqlens_error("cu_seqlens", values, values[-1], "", max_seqlen, "max_seqlen")
    if error:
        return None, error
    sharding = document_sharding(tuple(values), cp_size(groups), layout)
    expected = sharding.local_len(cp_rank(groups))
    held = {name: x.shape[2] for name, x in (("q", q), ("k", k), ("v", v))}
    if set(held.values()) != {expected}:
        holding = ("q, k, v hold {q}" if len(set(held.values())) == 1 else "q holds {q}, k {k}, v {v}").format(**held)
        return sharding, (f"{holding} tokens, but cu_seqlens gives this rank {expected} "
                          f"(shard the batch with shard_varlen)")
    return sharding, None


def check_inputs(q, k, v, groups, *, layout: str, window, head_split: int = 1, strategy: str, packed: bool) -> None:
    """Local checks; ``head_split`` is the number of ranks the query heads are divided among."""
    check_layout(layout)
    check_attention_args(q, k, v, None, window)
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must have the same local sequence length (context parallelism is self-attention "
                         f"over one sharded sequence); got q.shape[2]={q.shape[2]}, k.shape[2]={k.shape[2]}")
    if layout == "zigzag" and q.shape[2] % 2 and not packed:
        cp = cp_size(groups)
        raise ValueError(f"q.shape[2] (the local sequence length) must be even for layout='zigzag': the global "
                         f"sequence must be a multiple of 2·cp = {2 * cp}; got {q.shape[2]} per rank")
    if q.shape[1] % head_split:
        raise ValueError(f"strategy={strategy!r} divides the query heads among {head_split} ranks: q.shape[1] "
                         f"must be a multiple of {head_split}; got {q.shape[1]}")


def check_call(q, k, v, groups, *, strategy: str, scale: float, is_causal: bool, layout: str, window=(-1, -1),
               cu_seqlens=None, max_seqlen: int = 0, head_split: int = 1, recompute_kv: bool = False):
    """Everything a context-parallel op checks before its first collective; returns ``sharding_of``.
    The ranks agree first, so a check that fails fails on every rank."""
    options = dict(strategy=strategy, scale=scale, is_causal=is_causal, layout=layout, window=tuple(window),
                   recompute_kv=recompute_kv)  # recompute_kv decides the backward's collectives
    packed = cu_seqlens is not None
    problem = None
    if packed:
        values = host_values(cu_seqlens)
        options["cu_seqlens"] = f"{len(values) - 1} documents, crc {zlib.crc32(str(values).encode()):08x}"
        sharding, problem = _packed_sharding(q, k, v, groups, layout, cu_seqlens, values, max_seqlen)
    check_same_on_all_ranks(groups, q, k, v, packed, problem=problem, **options)
    if problem:
        raise ValueError(problem)
    check_inputs(q, k, v, groups, layout=layout, window=tuple(window), head_split=head_split, strategy=strategy,
                 packed=packed)
    return sharding if packed else sharding_of(q, groups, layout)
