"""The check that the positions of a sequence's shards number one sequence per row.

Hugging Face builds its training mask from ``position_ids``: a document is a run of consecutive
positions (passes/position_runs.py). Each rank of a context-parallel group holds a shard of the
positions, and the runs of a shard say nothing about the sequence: a shard's first position may
start a document or continue one. So the ranks gather the positions (batch x sequence integers,
once per forward) and check that each row rises by one throughout; attention is then causal (or the
window) over the whole sequence, in the sharded layout. Packed documents fail the check: their
shards must be cut by document (``attn_compile.shard_varlen``), which a model's sequence shards are
not.
"""
import torch

from .comm import all_gather_stacked, resolve
from .layout import join_shards

@torch.library.custom_op("attn_cp::check_one_sequence", mutates_args=(),
                         schema="(Tensor positions, str[] group_names, str layout) -> Tensor")
def check_one_sequence(positions, group_names, layout):
    """True (a 0-dim bool tensor) if the positions' shards (B, S_local) make rows that rise by one;
    raises, on every rank alike, otherwise. The graph asserts the result, which keeps the check."""
    whole = join_shards(all_gather_stacked(positions, resolve(group_names)).unbind(0), layout, 1)
    steps = torch.diff(whole, dim=-1)
    if not bool((steps == 1).all()):
        row, at = (int(x[0]) for x in torch.nonzero(steps != 1).T)
        raise ValueError(f"the position_ids the model is given under context parallelism must rise by one along "
                         f"each row of the whole sequence (one sequence per row); row {row} goes from "
                         f"{int(whole[row, at])} to {int(whole[row, at + 1])} at token {at + 1}. Packed documents "
                         f"need their shards cut by document (attn_compile.shard_varlen) and "
                         f"context_parallel_attention(..., cu_seqlens=...)")
    return torch.ones((), dtype=torch.bool, device=positions.device)


@check_one_sequence.register_fake
def _(positions, group_names, layout):
    return positions.new_empty((), dtype=torch.bool)
