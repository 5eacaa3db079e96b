"""Find hand-written softmax attention (HF "eager" attention, nanoGPT, timm ViT; the forms of
Inductor's fuse_attention.py patterns, at the level of dynamo's graphs).

Pattern, from the value matmul back (brackets: optional; any spelling: ``@``, torch.matmul, bmm,
.matmul; F.softmax, torch.softmax, .softmax; * or .mul, / or .div):

    scores = [q * c_q] @ k.transpose(-2, -1)               # or k.mT, k.permute(0, 1, 3, 2)
    scores = [scores * c | scores / c]...                   # c a constant, or torch.full((), c)
    scores = [torch.tanh(scores) * cap]                     # softcapping (Gemma 2), cap > 0
    scores = [scores + mask | scores.masked_fill(cond, NEG) | torch.where(cond, scores, NEG)]
    scores = [scores.float() | scores.to(dtype)]            # an upcast, to float32 or float64
    probs  = softmax(scores, dim=-1 [, dtype=float32])
    probs  = [probs.to(dtype) | probs.type(dtype) | probs.type_as(x)]
    probs  = [dropout(probs, p, training)]                  # with p == 0 or training False
    out    = probs @ v

Replacement: ``attn_cp.attention(q, k, v, attn_mask, scale=c_q * c)`` (scale 1 when none is
written; with softcapping ``scale=c_q * c * cap, softcap=cap``: Gemma 2's ``tanh(s / cap) * cap``
caps the scaled scores s at cap), where attn_mask is ``mask`` (additive), ``~cond``
(masked_fill) or ``cond`` (where), and NEG is -inf or a dtype's minimum. Not matched, so left to compile as written: a softmax over
another axis, anything else between the softmax and the value matmul (a scale after the
softmax), k not transposed in its last two axes. Matched but left, with the reason: dropout that is
active, intermediate results used elsewhere (e.g. returned attention weights), masked_fill with
another value, a scale known only at run time, q, k or the mask modified in place before the value
matmul (the op reads them there), and scores that reach the softmax through other steps (a mask
before the scale, a tanh without a positive constant cap, an in-place scale, a second bias, a
downcast).
"""
import dataclasses
import math
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch.fx import Node

from .call import AttentionCall, Left, eager_empty_row, empty_row_note
from .index_formula import HARD_NEGATIVES
from .nodes import argument, mutated_between, op_of
from .shapes import example_tensor, example_value, held

_CASTS = ("to", "type", "type_as", "float", "double", "half", "bfloat16")
_UPCASTS = (None, torch.float32, torch.float64)


RUNTIME = "the scale is only known at run time"


@dataclasses.dataclass
class _Match:
    q: Node
    k: Node
    v: Optional[Node] = None
    scale: float = 1.0
    mask: Optional[Node] = None
    mask_hides: bool = False  # a bool mask that is True at the hidden keys (masked_fill's)
    fill: Optional[float] = None  # what masked_fill or where writes at the hidden keys
    softcap: float = 0.0  # the cap of softcapped scores (0: none)
    chain: list = dataclasses.field(default_factory=list)  # the nodes between the two matmuls
    first: Optional[Node] = None  # where the pattern first reads q and k (the op reads them at the value matmul)
    reasons: list = dataclasses.field(default_factory=list)  # why the site stays as it is


def _constant(arg):
    """A finite non-zero number, from Python or a 0-d ``torch.full((), c)`` (as its dtype holds c);
    RUNTIME for a symbolic one."""
    full = example_tensor(arg) if op_of(arg) == "full" and argument(arg, 0, "size") in ((), []) else None
    if full is not None:
        fill = argument(arg, 1, "fill_value")
        arg = held(fill, full.dtype) if isinstance(fill, (int, float)) else fill
    if isinstance(arg, Node) and isinstance(example_value(arg), (torch.SymFloat, torch.SymInt)):
        return RUNTIME
    number = isinstance(arg, (int, float)) and not isinstance(arg, bool)
    return float(arg) if number and arg != 0 and math.isfinite(arg) else None


def _scaled(node) -> tuple:
    """``x * c``, ``c * x`` or ``x / c``: (x, factor), or (node, 1.0) when it is no scaling."""
    if op_of(node) == "mul" and len(node.args) == 2:
        for x, c in (node.args[:2], node.args[1::-1]):
            factor = _constant(c)
            if isinstance(x, Node) and factor is not None:
                return x, factor
    if op_of(node) == "div" and isinstance(node.args[0], Node) and len(node.args) == 2 and not node.kwargs:
        factor = _constant(node.args[1])
        if factor is not None:
            return node.args[0], factor if factor == RUNTIME else 1.0 / factor
    return node, 1.0


def _transposed(kt) -> Optional[Node]:
    """k from ``k.transpose(-2, -1)`` (any spelling of the last two axes), ``k.mT`` or ``k.permute(0, 1, 3, 2)``."""
    t = example_tensor(kt)
    if t is None or t.dim() < 3 or not isinstance(kt, Node):
        return None
    source = argument(kt, 0, "input")
    if op_of(kt) == "mT":
        return source
    last_two = {t.dim() - 2, t.dim() - 1}
    if op_of(kt) == "transpose":
        dims = (argument(kt, 1, "dim0"), argument(kt, 2, "dim1"))
        return source if all(isinstance(d, int) for d in dims) and {d % t.dim() for d in dims} == last_two else None
    if op_of(kt) == "permute":
        dims = kt.args[1] if len(kt.args) == 2 and isinstance(kt.args[1], (tuple, list)) else kt.args[1:]
        swapped = list(range(t.dim() - 2)) + [t.dim() - 1, t.dim() - 2]
        return source if [d % t.dim() for d in dims] == swapped else None
    return None


def _times(a, b):
    return RUNTIME if RUNTIME in (a, b) else a * b


def _scores(node) -> Optional[_Match]:
    """``[q * c_q] @ k.transpose(-2, -1)``, scaled by constants any number of times (``* c``, ``/ c``)."""
    product, scale, chain = node, 1.0, [node]
    while True:
        inner, factor = _scaled(product)
        if inner is product:
            break
        product, scale = inner, _times(scale, factor)
        chain.insert(0, product)
    if op_of(product) != "matmul":
        return None
    k = _transposed(argument(product, 1, "other"))
    q_scaled = argument(product, 0, "input")
    if k is None or not isinstance(q_scaled, Node):
        return None
    q, q_scale = _scaled(q_scaled)
    first = q_scaled if q is not q_scaled else product
    scale = _times(scale, q_scale)
    if scale == RUNTIME:
        return _Match(q, k, chain=chain, first=first, reasons=[RUNTIME])
    return _Match(q, k, scale=scale, chain=chain, first=first)


def _capped(node) -> Optional[_Match]:
    """``torch.tanh(scores) * cap``: softcapped scores (Gemma 2 writes ``tanh(s / cap) * cap``). The
    op caps the scaled scores at ``cap``, so its scale is the factor inside the tanh times cap."""
    outer, cap = _scaled(node)
    scores = argument(outer, 0, "input") if op_of(outer) == "tanh" else None
    match = _scores(scores) if isinstance(scores, Node) else None
    if match is None:
        return None
    match.chain = match.chain + [outer, node]
    if cap == RUNTIME or match.reasons:
        match.reasons = match.reasons or [RUNTIME]
    elif cap < 0:
        match.reasons.append(f"the tanh of the scores is scaled by {cap} < 0, which is no softcap")
    else:
        match.scale, match.softcap = match.scale * cap, cap
    return match


def _scores_or_capped(node) -> Optional[_Match]:
    return _capped(node) or _scores(node)


def _masked(node) -> Optional[_Match]:
    """``scores [+ mask | .masked_fill(cond, NEG) | where(cond, scores, NEG)]``."""
    op = op_of(node)
    if op == "add" and len(node.args) == 2 and not node.kwargs:
        for scores, mask in (node.args, node.args[::-1]):
            match = _scores_or_capped(scores) if isinstance(scores, Node) else None
            if match is not None and example_tensor(mask) is not None:
                if not example_tensor(mask).dtype.is_floating_point:
                    match.reasons.append(f"the scores are added to {mask.name}, which is not a floating-point mask")
                match.mask, match.chain = mask, match.chain + [node]
                return match
    if op in ("masked_fill", "where"):
        scores, cond, fill = (
            (argument(node, 0, "input"), argument(node, 1, "mask"), argument(node, 2, "value")) if op == "masked_fill"
            else (argument(node, 1, "input"), argument(node, 0, "condition"), argument(node, 2, "other")))
        match = _scores_or_capped(scores) if isinstance(scores, Node) else None
        if match is not None and example_tensor(cond) is not None:
            if fill not in HARD_NEGATIVES:
                match.reasons.append(f"{op} with {fill}, not -inf or a dtype's minimum: not a mask")
            match.mask, match.mask_hides, match.fill = cond, op == "masked_fill", fill
            match.chain = match.chain + [node]
            return match
    return _scores_or_capped(node)


def _unmatched_scores(probs: Node) -> Optional[_Match]:
    """A match left with its reason where the softmax input comes from ``q @ k.transpose(-2, -1)``
    through steps the pattern does not take (a tanh without a constant cap, an in-place scale, a
    second bias, a mask before the scale), each step's first argument being the scores; else None."""
    node, steps = probs, []
    while isinstance(node, Node) and node.op in ("call_function", "call_method") and len(steps) < 8:
        if op_of(node) == "matmul":
            k, q = _transposed(argument(node, 1, "other")), argument(node, 0, "input")
            if k is None or not isinstance(q, Node) or not steps:
                return None
            names = ", ".join(op_of(n) or getattr(n.target, "__name__", str(n.target)) for n in reversed(steps))
            return _Match(q, k, chain=[node, *steps], first=node,
                          reasons=[f"the scores pass through {names} between the score matmul and the softmax, a form "
                                   f"the pattern does not take (the fused op caps scores only as tanh(s / cap) * cap, "
                                   f"and takes no second bias)"])
        steps.append(node)
        node = node.args[0] if node.args else None
    return None


def _cast(node) -> Node:
    return argument(node, 0, "input") if op_of(node) in _CASTS else node


def _upcast(node) -> Node:
    """A cast of the scores that loses nothing (to float32 or float64, or to their own dtype): the op
    computes them in fp32 or better anyway. A downcast (``scores.half()``) stays, and so does the site."""
    if op_of(node) not in _CASTS:
        return node
    cast_from = argument(node, 0, "input")
    source, out = example_tensor(cast_from), example_tensor(node)
    if source is None or out is None:
        return node
    widens = out.dtype in _UPCASTS and out.dtype.itemsize >= source.dtype.itemsize
    return cast_from if out.dtype == source.dtype or widens else node


def _softmax_dtype(node: Node):
    return argument(node, 3 if node.target is F.softmax else 2, "dtype")  # F.softmax(input, dim, _stacklevel, dtype)


def _softmax(node) -> Optional[Node]:
    if op_of(node) != "softmax":
        return None
    t = example_tensor(node)
    dim = argument(node, 1, "dim")
    if not isinstance(dim, int) or dim % t.dim() != t.dim() - 1 or _softmax_dtype(node) not in _UPCASTS:
        return None
    return argument(node, 0, "input")


def _active_dropout(node) -> Optional[str]:
    p, training = argument(node, 1, "p", 0.5), argument(node, 2, "training", True)
    if isinstance(p, Node) or isinstance(training, Node):
        return "dropout p or training is only known at run time"
    return f"dropout p={p} while training: the fused op has no dropout" if p and training else None


def _match(anchor: Node) -> Optional[_Match]:
    """The whole pattern, from ``probs @ v`` back."""
    probs = argument(anchor, 0, "input")
    if op_of(anchor) != "matmul" or not isinstance(probs, Node):
        return None
    chain, reasons = [], []
    if op_of(probs) == "dropout":
        chain.append(probs)
        reasons += [r for r in [_active_dropout(probs)] if r]
        probs = argument(probs, 0, "input")
    for step in (_cast, _softmax, _upcast):
        if not isinstance(probs, Node):
            return None
        chain.append(probs)
        probs = step(probs)
        if probs is None:
            return None
    match = (_masked(probs) or _unmatched_scores(probs)) if isinstance(probs, Node) else None
    if match is None:
        return None
    match.v = argument(anchor, 1, "other")
    match.chain = list(dict.fromkeys(chain + match.chain))
    match.reasons = reasons + match.reasons
    return match


def _negated(anchor: Node, cond: Node) -> Node:
    with anchor.graph.inserting_before(anchor):
        negated = anchor.graph.call_function(torch.logical_not, (cond,))
    negated.meta["example_value"] = example_value(cond)  # same shape and dtype
    return negated


def find(node: Node) -> Union[AttentionCall, Left, None]:
    match = _match(node)
    if match is None or not all(example_tensor(t) is not None and example_tensor(t).dim() >= 3
                                for t in (match.q, match.k, match.v)):
        return None
    tensors = {"q": match.q, "k": match.k, "v": match.v, "attn_mask": match.mask}
    shared = next((n for n in match.chain if len(n.users) > 1), None)
    if shared is not None:
        match.reasons.append(f"{shared.name} is also used by {', '.join(u.name for u in shared.users)}")
    softmax_dtype = next(_softmax_dtype(n) for n in match.chain if op_of(n) == "softmax")
    q_dtype = example_tensor(match.q).dtype
    if softmax_dtype is not None and softmax_dtype.itemsize < q_dtype.itemsize:
        match.reasons.append(f"the softmax runs in {softmax_dtype}, narrower than q's {q_dtype}")
    edited = [name for name in ("q", "k", "attn_mask")
              if tensors[name] is not None and mutated_between(tensors[name], match.first, node)]
    if edited:
        match.reasons.append(f"modified in place between the score and the value matmul: {', '.join(edited)}")
    if match.reasons:
        return Left(node, match.reasons[0], tensors)
    mask = _negated(node, match.mask) if match.mask_hides else match.mask
    notes = ("hand-written softmax attention",)
    if match.softcap:
        notes += (f"scores softcapped at {match.softcap:g}",)
    if match.fill is not None:  # the op takes the fill as a bool mask, and a bool mask gives such rows 0
        notes += (empty_row_note(match.fill, how="filling with"),)
    elif match.mask is not None:  # an additive mask: the op gives a row of -inf scores 0, as SDPA does
        notes += (f"a query whose every score is -inf gets 0, where the code as written gives {eager_empty_row(None)}",)
    return AttentionCall(node, match.q, match.k, match.v, attn_mask=mask, scale=match.scale, softcap=match.softcap,
                         notes=notes)
