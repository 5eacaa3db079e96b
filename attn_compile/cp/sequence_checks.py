"""Checks that a model's per-token inputs, sharded for context parallelism, ask for nothing the
context-parallel ops leave out.

Hugging Face builds its masks from per-token tensors: documents from ``position_ids`` (a run of
consecutive positions is a document, passes/position_runs.py) and key padding from
``attention_mask``. Each rank of a context-parallel group holds a shard of them, and a shard says
nothing about the sequence: its first position may start a document or continue one, and its keys
are not the whole sequence's. The ops attend causally (or in a window) over the whole sequence, so
the passes drop those masks and the compiled forward checks, once, on the gathered tensor
(batch × sequence), that they ask for nothing more: positions that rise by one along each row, and
no padded key. Packed documents or padding fail the check, with the same error on every rank.
"""
import torch

from .comm import all_gather_stacked, resolve
from .layout import join_shards

_SCHEMA = "(Tensor shards, str[] group_names, str layout) -> Tensor"


def _whole(shards, group_names, layout):
    """(B, S): every rank's (B, S_local) shard, joined."""
    return join_shards(all_gather_stacked(shards, resolve(group_names)).unbind(0), layout, 1)


def _passed(shards):
    return torch.ones((), dtype=torch.bool, device=shards.device)


@torch.library.custom_op("attn_cp::check_one_sequence", mutates_args=(), schema=_SCHEMA)
def check_one_sequence(shards, group_names, layout):
    """True (0-dim) if the positions' shards make rows that rise by one; raises otherwise."""
    whole = _whole(shards, group_names, layout)
    steps = torch.diff(whole, dim=-1)
    if not bool((steps == 1).all()):
        row, at = (int(x[0]) for x in torch.nonzero(steps != 1).T)
        raise ValueError(f"the position_ids the model is given under context parallelism must rise by one along "
                         f"each row of the whole sequence (one sequence per row); row {row} goes from "
                         f"{int(whole[row, at])} to {int(whole[row, at + 1])} at token {at + 1}. Packed documents "
                         f"need their shards cut by document (attn_compile.shard_varlen) and "
                         f"context_parallel_attention(..., cu_seqlens=...)")
    return _passed(shards)


@torch.library.custom_op("attn_cp::check_no_padding", mutates_args=(), schema=_SCHEMA)
def check_no_padding(shards, group_names, layout):
    """True (0-dim) if the key padding mask's shards hold no padded key; raises otherwise."""
    whole = _whole(shards, group_names, layout)
    if not bool(whole.all()):
        row, at = (int(x[0]) for x in torch.nonzero(~whole.bool()).T)
        raise ValueError(f"the attention_mask the model is given under context parallelism must pad no token: key "
                         f"padding is not distributed; row {row} pads token {at} of the whole sequence. Pass no "
                         f"attention_mask, or sequences without padding")
    return _passed(shards)


for _op in (check_one_sequence, check_no_padding):
    _op.register_fake(lambda shards, group_names, layout: shards.new_empty((), dtype=torch.bool))
