"""Packed sequences told apart by their positions, as Hugging Face builds the mask for training
(``position_ids`` given, no attention mask): a document starts wherever a position does not
follow the one before it,

    documents = (torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1) != 1).cumsum(-1)

and the mask compares positions, ``positions[b, j] <= positions[b, i]`` (a window adds
``positions[b, j] > positions[b, i] - W``), ANDed with ``documents[b, i] == documents[b, j]``.
Within one document the positions rise by one a token, so there positions[b, x] - positions[b, y]
= x - y, and each comparison of two positions is the same comparison of their indices: the mask is
causal (or the window) within documents, which the op runs as packed documents. (Positions that
rise by one along the whole row by their formula, an arange, are one document: mask_trace.py.)
"""
from typing import Optional

from .index_formula import B, I, J, Affine, Compare, Offset, compare_integers, same_document, substitute
from .nodes import runs_of


def _document_rows(atom) -> Optional[tuple]:
    """(positions, row) where atom is documents[row, i] == documents[row, j] for documents numbering
    the runs of positions; else None."""
    found = same_document(atom, (Affine.index(B), Affine()))
    positions = None if found is None else runs_of(found[0])
    return None if positions is None else (positions, found[1])


def _position(side, reads: dict) -> Optional[tuple]:
    """(positions, index + constant) where side reads positions in a document, shifted or not."""
    gather, constant = (side.gather, side.constant) if isinstance(side, Offset) else (side, 0)
    read = reads.get(gather)
    return None if read is None else (read[0], Affine.index(read[1]) + constant)


def as_index_comparisons(atoms: list, trace) -> list:
    """The atoms of a conjunction, with each comparison of two positions of one document (the
    conjunction holds a documents atom for them) as the comparison of their indices; ``trace``:
    a node's formula (mask_trace.MaskTracer.trace)."""
    reads = {}  # the positions element read at (row, i) or (row, j) -> (positions, axis)
    for atom in atoms:
        found = _document_rows(atom)
        if found is not None:
            positions, row = found
            formula = trace(positions).expr
            for axis in (I, J):
                reads[substitute(formula, {-2: row, -1: Affine.index(axis)})] = (positions, axis)
    converted = []
    for atom in atoms:
        sides = [_position(side, reads) for side in (atom.left, atom.right)] if isinstance(atom, Compare) else [None]
        if None in sides or sides[0][0] is not sides[1][0]:
            converted.append(atom)
        else:
            converted.append(compare_integers(atom.op, sides[0][1], sides[1][1]))
    return converted
