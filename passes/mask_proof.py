"""The check behind every mask classification: the mask's formula and the claimed structure,
evaluated side by side, must agree at every (b, i, j) checked.

Checked: the traced sizes with all keys and all queries (or, past 64 queries, the ones at the
sequence ends and around the band edges), and again on sizes past every window edge, so that a
window the traced length never reaches is checked too. Data tensors (key padding, document ids)
are read as all True and as two pseudo-random patterns; formula and structure read the same values.
"""
import zlib

import torch

from .index_formula import B, H, I, J, Affine, Gather, evaluate
from .mask_trace import Unsupported

_FULL_ROWS = 64


def _pseudo_random(seed: int):
    """Stand-in data for the proof: a deterministic bit per (tensor, index); all True for seed 0."""
    def gather(element: Gather, index: list) -> torch.Tensor:
        if seed == 0:
            return torch.ones((), dtype=torch.bool)
        h = torch.tensor(seed * 7919 + zlib.crc32(element.source.name.encode()) % 65521)
        for i in index:
            h = (h * 1000003 + i * 2654435761) % 2147483647
        return (h * 48271 % 2147483647) % 3 != 0
    return gather


def _edge_rows(n: int, constants: set) -> torch.Tensor:
    if n <= _FULL_ROWS:
        return torch.arange(n)
    rows = set(range(4)) | set(range(n - 4, n)) | {c + d for c in constants for d in (-1, 0, 1)}
    return torch.tensor(sorted(r for r in rows if 0 <= r < n))


def _claimed(structure, index: dict, gather) -> torch.Tensor:
    diff = index[J] - index[I]
    visible = torch.ones_like(diff, dtype=torch.bool)
    if structure.right is not None:
        visible &= diff <= structure.right
    if structure.left is not None:
        visible &= diff >= -structure.left
    if structure.key_padding is not None:  # the term as the formula reads it, data included
        visible = visible & torch.as_tensor(evaluate(structure.key_padding, index, gather))
    if structure.documents is not None:
        document = [gather(Gather(structure.documents, (Affine.index(B), Affine.index(axis))), [index[B], index[axis]])
                    for axis in (I, J)]
        visible = visible & (document[0] == document[1])
    return visible


def prove(formula, structure, batch: int, s_q: int, s_k: int) -> None:
    """Raise Unsupported unless the formula equals the structure (mask_structure.Structure) at every
    checked (b, i, j)."""
    edges = {abs(x) for x in (structure.left, structure.right) if x is not None}
    beyond = 2 * max(edges, default=0) + 4
    for n_q, n_k in {(s_q, s_k), (max(s_q, beyond), max(s_k, beyond))}:
        rows = _edge_rows(n_q, edges | {n_k - n_q})
        index = {B: torch.arange(batch)[:, None, None], H: torch.zeros((), dtype=torch.long),
                 I: rows[None, :, None], J: torch.arange(n_k)[None, None, :]}
        for seed in (0, 1, 2):
            gather = _pseudo_random(seed)
            got, want = torch.broadcast_tensors(torch.as_tensor(evaluate(formula, index, gather)),
                                               _claimed(structure, index, gather))
            if not torch.equal(got, want):
                b, i, j = (int(x[0]) for x in torch.nonzero(got != want).T)
                raise Unsupported(f"classification as {structure} failed its check at b={b}, i={int(rows[i])}, "
                                  f"j={j}")
