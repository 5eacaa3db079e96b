"""Argument checks for the context-parallel ops, run before any collective is posted.

Ranks first agree that they were called alike (one small all-gather, cached per call
signature), so a bad argument makes every rank raise the same error and none hangs in a
collective that a failed rank never joins. The first call with each signature checks it:
ranks are expected to call with the same sequence of signatures.
"""
import torch

from attn_compile.validation import check_attention_args

from .comm import all_gather_stacked, cp_size
from .layout import check_layout

_SIGNATURE_BYTES = 512
_AGREED: set = set()


def _signature(q, k, v, options: dict) -> str:
    shapes = ", ".join(f"{name} {tuple(x.shape)} {x.dtype}" for name, x in (("q", q), ("k", k), ("v", v)))
    return shapes + "".join(f", {key}={value!r}" for key, value in options.items())


def check_same_on_all_ranks(groups, q, k, v, **options) -> None:
    """Raises the same ValueError on every rank unless all ranks pass like shapes and options."""
    signature = _signature(q, k, v, options)
    key = (tuple(group.group_name for group in groups), signature)
    if key in _AGREED:
        return
    encoded = bytearray(signature.encode()[:_SIGNATURE_BYTES].ljust(_SIGNATURE_BYTES, b"\0"))
    gathered = all_gather_stacked(torch.frombuffer(encoded, dtype=torch.uint8).to(q.device), groups).cpu()
    signatures = [bytes(row.tolist()).rstrip(b"\0").decode(errors="replace") for row in gathered]
    if len(set(signatures)) > 1:
        listing = "; ".join(f"rank {rank}: {s}" for rank, s in enumerate(signatures))
        raise ValueError(f"q, k, v and the options must be the same on every rank of the group; got {listing}")
    _AGREED.add(key)


def check_inputs(q, k, v, groups, *, layout: str, head_split: int = 1, strategy: str) -> None:
    """Local checks; ``head_split`` is the number of ranks the query heads are divided among."""
    check_layout(layout)
    check_attention_args(q, k, v, None, (-1, -1))
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must have the same local sequence length (context parallelism is self-attention "
                         f"over one sharded sequence); got q.shape[2]={q.shape[2]}, k.shape[2]={k.shape[2]}")
    if layout == "zigzag" and q.shape[2] % 2:
        cp = cp_size(groups)
        raise ValueError(f"q.shape[2] (the local sequence length) must be even for layout='zigzag': the global "
                         f"sequence must be a multiple of 2·cp = {2 * cp}; got {q.shape[2]} per rank")
    if q.shape[1] % head_split:
        raise ValueError(f"strategy={strategy!r} divides the query heads among {head_split} ranks: q.shape[1] "
                         f"must be a multiple of {head_split}; got {q.shape[1]}")


def check_call(q, k, v, groups, *, strategy: str, scale: float, is_causal: bool, layout: str,
               head_split: int = 1) -> None:
    """Everything a context-parallel op checks before its first collective."""
    check_same_on_all_ranks(groups, q, k, v, strategy=strategy, scale=scale, is_causal=is_causal, layout=layout)
    check_inputs(q, k, v, groups, layout=layout, head_split=head_split, strategy=strategy)
