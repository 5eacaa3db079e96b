"""Packed documents in a (B, S) batch: ``document_ids[b, i]`` names the document of position i, and
a query sees only keys of its own document (ANDed with the other masks).

The Triton kernels read the ids on the device (``triton_tiles.document_args``). For the other
kernels they are read here, on the host, at the cost of a device sync: where every row's
documents are contiguous runs, the batch is one packed varlen problem: the runs become cumulative
lengths over the B·S tokens, and causal and window masks, which look only at position
differences, mean the same inside a run. Otherwise the documents become a (B, 1, S, S) bool mask.
"""
from typing import Optional

import torch


def run_bounds(document_ids: torch.Tensor) -> Optional[torch.Tensor]:
    """int32 (runs + 1,) cumulative lengths of the runs of equal ids over the flattened batch (every
    row starts a run), or None where a row's id comes back after another."""
    ids = document_ids.cpu()
    starts = torch.ones(ids.shape, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    rising = bool((ids[:, 1:] >= ids[:, :-1]).all())  # runs of ids that never fall are distinct (no sort)
    if not rising and any(len(row.unique()) != int(row_starts.sum()) for row, row_starts in zip(ids, starts)):
        return None
    return torch.cat([starts.flatten().nonzero().flatten(), torch.tensor([ids.numel()])]).int()


def same_document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    return (document_ids[:, :, None] == document_ids[:, None, :]).unsqueeze(1)


def packed(x: torch.Tensor) -> torch.Tensor:
    """(B, H, S, ...) -> (B·S, H, ...): the batch's tokens in order."""
    return x.transpose(1, 2).flatten(0, 1)


def unpacked(x: torch.Tensor, batch: int) -> torch.Tensor:
    """packed undone."""
    return x.unflatten(0, (batch, -1)).transpose(1, 2)
