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
import operator
from typing import Optional

import torch
from torch.fx import Node

from .call import AttentionCall, empty_row_note
from .flex_mask import to_flex
from .index_formula import (B, HARD_NEGATIVES, I, J, Affine, Compare, Eq, Gather, Le, Not, Number, Select, all_of,
                            axes_of, conjuncts, negate, same_document)
from .mask_proof import prove
from .mask_trace import MIRRORED, MaskTracer, Unsupported, fixed_unit_axes
from .nodes import is_mutated
from .position_runs import as_index_comparisons
from .shapes import example_tensor, guarded_shape, hinted_shape


@dataclasses.dataclass(frozen=True)
class Structure:
    left: Optional[int] = None  # j >= i - left
    right: Optional[int] = None  # j <= i + right
    key_padding: Optional[object] = None  # the formula's term that says key j of row b is real (key_padding_term)
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
            parts.append(f"key_padding_mask={_padding_name(self.key_padding)}")
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


def _key_read(element, rows) -> bool:
    """element is data[row, c, ..., j]: read at the batch row, constant indices (the size-1 axes of a
    (B, 1, 1, S_k) tensor) and the key index."""
    return isinstance(element, Gather) and len(element.index) >= 2 and element.index[0] in rows and \
        element.index[-1] == Affine.index(J) and not any(axes_of(x) for x in element.index[1:-1])


def key_padding_term(atom, rows):
    """``atom`` as a key-padding term where it says whether key j of row b is real, else None: bool
    data read at [row, c, ..., j], its negation, or such data compared with a constant, the data
    first (``p[b, j] == 1``; ``p[b, j] != 0`` is ``p.bool()``, however the cast and the indexing
    are ordered)."""
    if isinstance(atom, Compare) and isinstance(atom.left, Number):
        atom = Compare(MIRRORED[atom.op], atom.right, atom.left)
    element = _padding_element(atom)
    if not _key_read(element, rows):
        return None
    if isinstance(atom, Compare):
        return atom if isinstance(atom.right, Number) else None
    return atom if example_tensor(element.source).dtype == torch.bool else None


def _padding_element(term):
    """The data element a (would-be) key-padding term reads."""
    return term.term if isinstance(term, Not) else term.left if isinstance(term, Compare) else term


def _padding_name(term) -> str:
    """The tensor's name where the term reads a (B, S_k) bool tensor as it is, else the term."""
    return term.source.name if isinstance(term, Gather) and len(term.index) == 2 else str(term)


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
        elif (term := key_padding_term(atom, rows)) is not None:
            padding.add(term)
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
    if len(padding) > 1:
        raise Unsupported(f"two key-padding terms: {', '.join(sorted(map(str, padding)))}")
    if len(documents) > 1:
        raise Unsupported(f"two document-id tensors: {', '.join(sorted(n.name for n in documents))}")
    return Structure(left, right, next(iter(padding), None), next(iter(documents), None))


def _check_key_padding(term, q: Node, k: Node) -> None:
    node = _padding_element(term).source
    data, q, k = (example_tensor(n) for n in (node, q, k))
    if not guarded_shape(data, (q.shape[0], *data.shape[1:-1], k.shape[2])):
        raise Unsupported(f"key padding {node.name} is {hinted_shape(data)}, not (B, ..., S_k)")
    if is_mutated(node):
        raise Unsupported(f"key padding {node.name} is modified in place")


_COMPARISONS = {"eq": torch.eq, "ne": torch.ne, "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge}
_DERIVED = "attn_cp_key_padding"  # a node's meta: made from its input for key padding


def _derived(source: Node, target, *args) -> Node:
    """``target(source, *args)`` in source's graph, right after source: made once, so the sites of
    every layer share it (and a distributed check of it runs once)."""
    for user in source.users:
        if user.meta.get(_DERIVED) and user.target is target and user.args == (source, *args):
            return user
    graph = source.graph
    after = list(graph.find_nodes(op="placeholder"))[-1] if source.op == "placeholder" else source
    with graph.inserting_after(after):
        node = graph.call_function(target, (source, *args))
    node.meta.update({"example_value": target(example_tensor(source), *args), _DERIVED: True})
    return node


def _key_padding_node(term) -> Node:
    """The (B, S_k) bool tensor of a key-padding term: the data itself where the term reads a
    (B, S_k) bool tensor as it is, else the term computed on the whole tensor."""
    element = _padding_element(term)
    node = element.source
    if len(element.index) > 2:
        node = _derived(node, operator.getitem, (slice(None), *(x.constant for x in element.index[1:-1]), slice(None)))
    if isinstance(term, Compare):
        node = _derived(node, _COMPARISONS[term.op], term.right.value)
    if isinstance(term, Not):
        node = _derived(node, torch.logical_not)
    return node


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
    padding = None if structure.key_padding is None else _key_padding_node(structure.key_padding)
    return call.noted(note, attn_mask=None, is_causal=right == 0, window=window,
                      key_padding_mask=padding, document_ids=structure.documents)
