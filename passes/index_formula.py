"""The language of mask-structure inference: a mask element as a formula over its indices.

A mask broadcast to (B, H, S_q, S_k) holds one value per index (b, h, i, j). Axes are named by
their position from the right (-1 = j, -2 = i, -3 = h, -4 = b), the way broadcasting aligns them,
so a formula keeps its meaning when its tensor is broadcast or expanded.

- Integer values are affine in the indices (``Affine``): aranges, offsets, sums, constant multiples;
  or an affine value floor-divided by, or taken modulo, a positive constant (``Division``: chunked
  and strided masks).
- Boolean values are formulas: ``Le`` (affine <= 0), ``Eq`` (affine == 0), ``And``, ``Or``, ``Not``,
  constants, ``Gather`` (an element of a tensor whose values are data, e.g. ``attention_mask[b, j]``)
  and ``Compare`` (a comparison involving such elements, e.g. document ids).
- Numeric masks are ``Select(cond, a, b)`` of two constants (``torch.where``).
"""
import dataclasses
import functools
import math
import operator
from typing import Callable, Optional, Union

import torch
from torch.fx import Node

from .shapes import example_tensor

J, I, H, B = -1, -2, -3, -4
AXIS_NAMES = {J: "j", I: "i", H: "h", B: "b"}
# Additive mask values that hide a key: -inf, and each floating dtype's minimum (Hugging Face's choice).
HARD_NEGATIVES = {-math.inf} | {torch.finfo(d).min for d in (torch.float16, torch.bfloat16, torch.float32,
                                                            torch.float64)}


@dataclasses.dataclass(frozen=True)
class Affine:
    """sum(coefficient * index[axis]) + constant, over integers."""

    coefficients: tuple[tuple[int, int], ...] = ()  # (axis, coefficient), by axis, no zero coefficient
    constant: int = 0

    @staticmethod
    def index(axis: int) -> "Affine":
        return Affine(((axis, 1),))

    @staticmethod
    def of(terms: dict, constant: int) -> "Affine":
        return Affine(tuple(sorted((a, c) for a, c in terms.items() if c != 0)), constant)

    def coefficient(self, axis: int) -> int:
        return dict(self.coefficients).get(axis, 0)

    def __add__(self, other: Union["Affine", int]) -> "Affine":
        if isinstance(other, int):
            return Affine(self.coefficients, self.constant + other)
        terms = dict(self.coefficients)
        for axis, c in other.coefficients:
            terms[axis] = terms.get(axis, 0) + c
        return Affine.of(terms, self.constant + other.constant)

    def scaled(self, factor: int) -> "Affine":
        return Affine.of({a: c * factor for a, c in self.coefficients}, self.constant * factor)

    def __neg__(self) -> "Affine":
        return self.scaled(-1)

    def __sub__(self, other: Union["Affine", int]) -> "Affine":
        return self + (-other)

    def __str__(self) -> str:
        terms = [("" if c == 1 else "-" if c == -1 else f"{c}*") + AXIS_NAMES.get(axis, f"x{axis}")
                 for axis, c in reversed(self.coefficients)]
        if self.constant or not terms:
            terms.append(str(self.constant))
        return " + ".join(terms).replace("+ -", "- ")


@dataclasses.dataclass(frozen=True)
class Division:
    """``value // divisor`` or ``value % divisor`` (``op``) by a positive constant, rounding down as
    torch's and Python's integer ``//`` and ``%`` do."""

    value: Affine
    divisor: int
    op: str  # "//" or "%"

    def __str__(self) -> str:
        return f"({self.value}) {self.op} {self.divisor}"


@dataclasses.dataclass(frozen=True)
class Number:
    value: Union[bool, int, float]

    def __str__(self) -> str:
        return str(self.value)


@dataclasses.dataclass(frozen=True)
class Le:
    value: Affine  # value <= 0

    def __str__(self) -> str:
        return f"{self.value} <= 0"


@dataclasses.dataclass(frozen=True)
class Eq:
    value: Affine  # value == 0

    def __str__(self) -> str:
        return f"{self.value} == 0"


@dataclasses.dataclass(frozen=True)
class And:
    terms: tuple

    def __str__(self) -> str:
        return "(" + " & ".join(map(str, self.terms)) + ")"


@dataclasses.dataclass(frozen=True)
class Or:
    terms: tuple

    def __str__(self) -> str:
        return "(" + " | ".join(map(str, self.terms)) + ")"


@dataclasses.dataclass(frozen=True)
class Not:
    term: object

    def __str__(self) -> str:
        return f"~{self.term}"


@dataclasses.dataclass(frozen=True)
class Gather:
    """source[index[0], index[1], ...]: an element of a tensor whose values the formula cannot see."""

    source: Node
    index: tuple[Affine, ...]

    def __str__(self) -> str:
        return f"{self.source.name}[{', '.join(map(str, self.index))}]"


@dataclasses.dataclass(frozen=True)
class Offset:
    """gather + constant: an integer data element shifted, e.g. ``position_ids[b, i] - 4``."""

    gather: Gather
    constant: int

    def __str__(self) -> str:
        return f"{self.gather} {'-' if self.constant < 0 else '+'} {abs(self.constant)}"


COMPARISONS = {"le": operator.le, "lt": operator.lt, "ge": operator.ge, "gt": operator.gt, "eq": operator.eq,
               "ne": operator.ne}
_NEGATED = {"le": "gt", "lt": "ge", "ge": "lt", "gt": "le", "eq": "ne", "ne": "eq"}
_SYMBOLS = {"le": "<=", "lt": "<", "ge": ">=", "gt": ">", "eq": "==", "ne": "!="}


@dataclasses.dataclass(frozen=True)
class Compare:
    """A comparison with data on at least one side: ``ids[b, i] == ids[b, j]``."""

    op: str
    left: object
    right: object

    def __str__(self) -> str:
        return f"{self.left} {_SYMBOLS[self.op]} {self.right}"


@dataclasses.dataclass(frozen=True)
class Select:
    """cond ? if_true : if_false, for two constants."""

    cond: object
    if_true: Union[int, float]
    if_false: Union[int, float]

    def __str__(self) -> str:
        return f"where({self.cond}, {self.if_true}, {self.if_false})"


def same_document(atom, rows) -> Optional[tuple[Node, Affine]]:
    """(ids, row) where atom is ``ids[row, i] == ids[row, j]`` (either side first) with row in
    ``rows``: query and key in the same document; else None."""
    if not (isinstance(atom, Compare) and atom.op == "eq" and isinstance(atom.left, Gather)
            and isinstance(atom.right, Gather) and atom.left.source is atom.right.source
            and len(atom.left.index) == len(atom.right.index) == 2):
        return None
    (row, i), (other_row, j) = atom.left.index, atom.right.index
    if row != other_row or row not in rows or {i, j} != {Affine.index(I), Affine.index(J)}:
        return None
    return atom.left.source, row


def compare_integers(op: str, a: Affine, b: Affine):
    """``a op b`` of two integer values as an atom over a - b."""
    diff = a - b
    return {"le": Le(diff), "lt": Le(diff + 1), "ge": Le(-diff), "gt": Le(-diff + 1), "eq": Eq(diff),
            "ne": negate(Eq(diff))}[op]


def all_of(terms) -> object:
    """The conjunction of terms, without constant True terms (False if any term is False)."""
    kept = [t for t in terms if t != Number(True)]
    if Number(False) in kept:
        return Number(False)
    return kept[0] if len(kept) == 1 else And(tuple(kept)) if kept else Number(True)


def any_of(terms) -> object:
    """The disjunction of terms, without constant False terms (True if any term is True)."""
    kept = [t for t in terms if t != Number(False)]
    if Number(True) in kept:
        return Number(True)
    return kept[0] if len(kept) == 1 else Or(tuple(kept)) if kept else Number(False)


def substitute(expr, mapping: dict):
    """expr with index[axis] replaced by mapping[axis] (an Affine) for the axes in mapping."""
    if isinstance(expr, Affine):
        result = Affine((), expr.constant)
        for axis, c in expr.coefficients:
            result = result + (mapping[axis] if axis in mapping else Affine.index(axis)).scaled(c)
        return result
    if isinstance(expr, (Le, Eq)):
        return type(expr)(substitute(expr.value, mapping))
    if isinstance(expr, Division):
        return Division(substitute(expr.value, mapping), expr.divisor, expr.op)
    if isinstance(expr, (And, Or)):
        return type(expr)(tuple(substitute(t, mapping) for t in expr.terms))
    if isinstance(expr, Not):
        return Not(substitute(expr.term, mapping))
    if isinstance(expr, Gather):
        return Gather(expr.source, tuple(substitute(a, mapping) for a in expr.index))
    if isinstance(expr, Offset):
        return Offset(substitute(expr.gather, mapping), expr.constant)
    if isinstance(expr, Compare):
        return Compare(expr.op, substitute(expr.left, mapping), substitute(expr.right, mapping))
    if isinstance(expr, Select):
        return Select(substitute(expr.cond, mapping), expr.if_true, expr.if_false)
    return expr  # Number


def negate(formula):
    """~formula with the negation pushed down to the atoms (integers: ~(a <= 0) is -a + 1 <= 0)."""
    if isinstance(formula, Number):
        return Number(not formula.value)
    if isinstance(formula, Le):
        return Le(-formula.value + 1)
    if isinstance(formula, And):
        return Or(tuple(negate(t) for t in formula.terms))
    if isinstance(formula, Or):
        return And(tuple(negate(t) for t in formula.terms))
    if isinstance(formula, Not):
        return formula.term
    if isinstance(formula, Compare) and (formula.op in ("eq", "ne")
                                         or not any(map(_may_be_nan, (formula.left, formula.right)))):
        return Compare(_NEGATED[formula.op], formula.left, formula.right)
    return Not(formula)  # Eq, Gather, an ordering of floating-point data: ~(nan < 0) is not nan >= 0


def _may_be_nan(side) -> bool:
    if isinstance(side, Number):
        return isinstance(side.value, float) and math.isnan(side.value)
    return isinstance(side, Gather) and example_tensor(side.source).dtype.is_floating_point


def conjuncts(formula) -> list:
    """The terms of a conjunction, nested Ands flattened and negations pushed to the atoms."""
    if isinstance(formula, Not):
        formula = negate(formula.term)
    if isinstance(formula, And):
        return [atom for term in formula.terms for atom in conjuncts(term)]
    return [formula]


def axes_of(expr) -> set:
    """The index axes expr depends on."""
    if isinstance(expr, Affine):
        return {axis for axis, _ in expr.coefficients}
    if isinstance(expr, (Le, Eq, Division)):
        return axes_of(expr.value)
    if isinstance(expr, (And, Or)):
        return set().union(*map(axes_of, expr.terms))
    if isinstance(expr, Not):
        return axes_of(expr.term)
    if isinstance(expr, Gather):
        return set().union(*map(axes_of, expr.index))
    if isinstance(expr, Offset):
        return axes_of(expr.gather)
    if isinstance(expr, Compare):
        return axes_of(expr.left) | axes_of(expr.right)
    if isinstance(expr, Select):
        return axes_of(expr.cond)
    return set()  # Number


def gathers_of(formula) -> list:
    """The data elements a boolean formula reads, in the order read."""
    if isinstance(formula, Gather):
        return [formula]
    if isinstance(formula, Offset):
        return [formula.gather]
    if isinstance(formula, Compare):
        return gathers_of(formula.left) + gathers_of(formula.right)
    if isinstance(formula, (And, Or)):
        return [g for term in formula.terms for g in gathers_of(term)]
    if isinstance(formula, Not):
        return gathers_of(formula.term)
    return []


def evaluate(expr, index: dict, gather: Callable[[Gather, list], torch.Tensor]):
    """expr on broadcastable integer index tensors (index[axis]); ``gather`` supplies data elements.
    Constants stay Python numbers, so that the formula can run as a flex_attention mask_mod, where
    a tensor made inside would be a constant of the traced mask graph."""
    def ev(e):
        return evaluate(e, index, gather)

    if isinstance(expr, Affine):
        value = expr.constant
        for axis, c in expr.coefficients:
            value = value + c * index[axis]
        return value
    if isinstance(expr, Number):
        return expr.value
    if isinstance(expr, Division):
        value = ev(expr.value)
        return value // expr.divisor if expr.op == "//" else value % expr.divisor
    if isinstance(expr, Le):
        return ev(expr.value) <= 0
    if isinstance(expr, Eq):
        return ev(expr.value) == 0
    if isinstance(expr, And):
        return functools.reduce(operator.and_, map(ev, expr.terms))
    if isinstance(expr, Or):
        return functools.reduce(operator.or_, map(ev, expr.terms))
    if isinstance(expr, Not):
        term = ev(expr.term)
        return not term if isinstance(term, bool) else ~term
    if isinstance(expr, Gather):
        return gather(expr, [ev(a) for a in expr.index])
    if isinstance(expr, Offset):
        return ev(expr.gather) + expr.constant
    if isinstance(expr, Compare):
        return COMPARISONS[expr.op](ev(expr.left), ev(expr.right))
    if isinstance(expr, Select):
        cond = ev(expr.cond)
        if isinstance(cond, bool):
            return expr.if_true if cond else expr.if_false
        return torch.where(cond, expr.if_true, expr.if_false)
    raise TypeError(f"not a formula: {expr!r}")
