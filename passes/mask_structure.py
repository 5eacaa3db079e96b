"""Mask-structure inference: an attention mask built from index arithmetic becomes the op's
``is_causal``, ``window_left``/``window_right`` and ``key_padding_mask``; the mask is then not built.

Pattern: a mask (bool, or additive ``where(cond, 0, -inf or the dtype's minimum)``) whose element
(b, h, i, j) is a conjunction of
    j - i <= r           (``kv <= q + r``: causal when r == 0, a right window edge when r > 0)
    j - i >= -l          (``kv > q - W``: a left window edge, l = W - 1)
    padding[b, j]        (a (B, S_k) bool tensor read at the batch and key index: key padding)
    ids[b, i] == ids[b, j]  (a (B, S) tensor of document ids: packed documents, run as varlen)
and of conditions true for every index (``q >= 0``). mask_trace.py reads the mask's subgraph as a
formula; position_runs.py turns comparisons of positions within a run of them (Hugging Face's
packed sequences) into comparisons of indices; ``classify`` maps the terms to a Structure, which
mask_proof.py checks against the formula before anything is rewritten.

A formula outside these classes (an OR of conditions, a chunked mask, a mask that depends on the
head, a window that excludes the query's own position, ...) goes to flex_mask.py, which runs it as
flex_attention's mask_mod where that gives eager's answer. Left with their mask (and the reason in
the site's notes): masks that are not a formula (a mask tensor from outside is one data element per
position; that stays a tensor), offsets only known at run time, and what flex_mask.py refuses.

Queries that see no key: the op gives 0, as SDPA does for such rows of a bool mask. An additive
mask of the dtype's minimum instead gives them the mean of all values (eager Hugging Face
models' padding queries under left padding); HF never reads those rows.
"""
import dataclasses
import math
from typing import Optional

import torch
from torch.fx import Node

from .call import AttentionCall, empty_row_note
from .flex_mask import to_flex
from .index_formula import (B, HARD_NEGATIVES, I, J, Affine, Compare, Eq, Gather, Le, Number, Select, all_of,
                            conjuncts, negate, same_document)
from .mask_proof import prove
from .mask_trace import MaskTracer, Unsupported, fixed_unit_axes
from .nodes import is_mutated
from .position_runs import as_index_comparisons
from .shapes import example_tensor, guarded_shape, hinted_shape


@dataclasses.dataclass(frozen=True)
class Structure:
    left: Optional[int] = None  # j >= i - left
    right: Optional[int] = None  # j <= i + right
    key_padding: Optional[Node] = None  # (B, S_k) bool, True = a real key
    documents: Optional[Node] = None  # (B, S) document ids: a key is seen only from its own document

    def __str__(self) -> str:
        parts = []
        if self.right == 0:
            parts.append("causal")
        elif self.right is not None:
            parts.append(f"window_right={self.right}")
        if self.left is not None:
            parts.append(f"window_left={self.left}")
        if self.key_padding is not None:
            parts.append(f"key_padding_mask={self.key_padding.name}")
        if self.documents is not None:
            parts.append(f"document_ids={self.documents.name}")
        return " + ".join(parts) or "every key visible"


def mask_formula(mask: Node, tracer: MaskTracer) -> tuple:
    """The mask's element (b, h, i, j) as a boolean formula (True = the key is visible), and the
    value that hides a key if the mask is additive (None for a bool mask)."""
    sym = tracer.trace(mask)
    if sym.dtype != torch.bool and not sym.dtype.is_floating_point:
        raise Unsupported(f"mask of dtype {sym.dtype}")
    if len(sym.shape) > 4:
        raise Unsupported(f"{len(sym.shape)}-D mask")
    expr = fixed_unit_axes(sym)
    if sym.dtype == torch.bool:
        return expr, None
    if isinstance(expr, Number) and expr.value == 0:
        return Number(True), None
    if isinstance(expr, Select) and expr.if_true == 0 and expr.if_false in HARD_NEGATIVES:
        return expr.cond, expr.if_false
    if isinstance(expr, Select) and expr.if_false == 0 and expr.if_true in HARD_NEGATIVES:
        return negate(expr.cond), expr.if_true
    raise Unsupported(f"additive mask {expr} is not where(cond, 0, -inf or the dtype's minimum)")


def _always_true(value: Affine) -> bool:
    """value <= 0 for every non-negative index: no positive coefficient, constant <= 0."""
    return all(c < 0 for _, c in value.coefficients) and value.constant <= 0


def _bounds(atom: Le, left, right):
    value = atom.value
    if set(dict(value.coefficients)) - {I, J}:
        raise Unsupported(f"'{atom}' depends on the batch or head index")
    step = (value.coefficient(I), value.coefficient(J))
    if step == (-1, 1):  # j - i + c <= 0
        return left, -value.constant if right is None else min(right, -value.constant)
    if step == (1, -1):  # i - j + c <= 0
        return -value.constant if left is None else min(left, -value.constant), right
    if _always_true(value):
        return left, right
    raise Unsupported(f"'{atom}' is not a causal or sliding-window bound")


def _is_key_padding(atom, rows) -> bool:
    return isinstance(atom, Gather) and len(atom.index) == 2 and atom.index[0] in rows and \
        atom.index[1] == Affine.index(J)


def classify(formula, batch_of_one: bool = False) -> Structure:
    """``batch_of_one``: the batch has one row, so a tensor's row 0 is row b (a mask of batch 1
    reads its data at row 0)."""
    rows = (Affine.index(B), Affine()) if batch_of_one else (Affine.index(B),)
    left = right = None
    padding, documents = set(), set()
    for atom in conjuncts(formula):
        if isinstance(atom, Number):
            if not atom.value:
                raise Unsupported("the mask hides every key")
        elif isinstance(atom, Le):
            left, right = _bounds(atom, left, right)
        elif isinstance(atom, Eq):
            left, right = _bounds(Le(-atom.value), *_bounds(Le(atom.value), left, right))
        elif _is_key_padding(atom, rows):
            padding.add(atom.source)
        elif isinstance(atom, Gather):
            raise Unsupported(f"the mask reads data, {atom}: only key padding [b, j] is structured")
        elif same_document(atom, rows) is not None:
            documents.add(atom.left.source)
        elif isinstance(atom, Compare) and Gather in {type(atom.left), type(atom.right)}:
            raise Unsupported(f"the mask compares data, '{atom}': only key padding [b, j] is structured")
        else:
            raise Unsupported(f"'{atom}' is not a causal, sliding-window or key-padding condition")
    if right is not None and right < 0:
        raise Unsupported(f"the mask hides the query's own position and {-right - 1} before it (j <= i - {-right})")
    if left is not None and left < 0:
        raise Unsupported(f"the mask hides the query's own position (j >= i + {-left})")
    for kind, sources in (("key-padding", padding), ("document-id", documents)):
        if len(sources) > 1:
            raise Unsupported(f"two {kind} tensors: {', '.join(sorted(n.name for n in sources))}")
    return Structure(left, right, next(iter(padding), None), next(iter(documents), None))


def _check_key_padding(node: Node, q: Node, k: Node) -> None:
    padding, q, k = (example_tensor(n) for n in (node, q, k))
    if padding.dtype != torch.bool or not guarded_shape(padding, (q.shape[0], k.shape[2])):
        raise Unsupported(f"key padding {node.name} is {padding.dtype} {hinted_shape(padding)}, not bool (B, S_k)")
    if is_mutated(node):
        raise Unsupported(f"key padding {node.name} is modified in place")


def _check_documents(node: Node, q: Node, k: Node) -> None:
    ids, q, k = (example_tensor(n) for n in (node, q, k))
    if ids.dtype.is_floating_point or not guarded_shape(ids, (q.shape[0], q.shape[2])) or \
            not guarded_shape(k, (*k.shape[:2], q.shape[2], k.shape[3])):
        raise Unsupported(f"document ids {node.name} are {ids.dtype} {hinted_shape(ids)}, not integer (B, S) with "
                          f"S_q == S_k")
    if is_mutated(node):
        raise Unsupported(f"document ids {node.name} are modified in place")


def infer_mask_structure(call: AttentionCall) -> AttentionCall:
    if call.attn_mask is None:
        return call
    tracer = MaskTracer()
    try:
        formula, hiding = mask_formula(call.attn_mask, tracer)
    except Unsupported as why:
        return call.noted(f"mask kept: {why}")
    formula = all_of(as_index_comparisons(conjuncts(formula), tracer.trace))
    try:
        structure = structure_of(formula, call.q, call.k)
    except Unsupported as why:
        return to_flex(call, formula, hiding, why)
    note = f"mask -> {structure}"
    if hiding not in (None, -math.inf):
        note += f"; {empty_row_note(hiding)}"
    return with_structure(call, structure, note)


def structure_of(formula, q: Node, k: Node) -> Structure:
    """The structure of a mask formula over the attention of q and k, checked against the formula
    (mask_proof.py); raises Unsupported."""
    q_shape, k_shape = hinted_shape(example_tensor(q)), hinted_shape(example_tensor(k))
    structure = classify(formula, batch_of_one=q_shape[0] == 1)
    if structure.key_padding is not None:
        _check_key_padding(structure.key_padding, q, k)
    if structure.documents is not None:
        _check_documents(structure.documents, q, k)
    prove(formula, structure, q_shape[0], q_shape[2], k_shape[2])
    return structure


def with_structure(call: AttentionCall, structure: Structure, note: str) -> AttentionCall:
    """The call with its mask replaced by the structure's arguments."""
    right = structure.right
    if call.is_causal:
        right = 0 if right is None else min(right, 0)
    window = (-1 if structure.left is None else structure.left, -1 if right in (None, 0) else right)
    return call.noted(note, attn_mask=None, is_causal=right == 0, window=window,
                      key_padding_mask=structure.key_padding, document_ids=structure.documents)
