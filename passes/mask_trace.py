"""Read the subgraph that builds a mask as an index formula (index_formula.py).

Each node becomes a ``Sym``: its formula over its own axes, its traced shape and dtype. Handled
are index arithmetic (arange, +, -, * by a constant, // and % by a positive constant, comparisons),
logic (&, |, ~), constants (zeros, ones, full, new_ones, torch.tensor(c), ...), ``where``/``masked_fill`` of
constants, ``tril``/``triu``,
dtype and device casts (data cast to bool reads as ``data != 0``, so a cast reads the same before
and after indexing, as a comparison with a constant does), and views (indexing with slices, None
and index tensors, unsqueeze, view/reshape that only add or drop size-1 axes, expand). A tensor
that no arange feeds (an input, a buffer, anything computed from data) becomes a ``Gather`` of its
own elements, so that e.g. ``attention_mask[batch_idx, kv_idx]`` reads as ``attention_mask[b, j]``.
Any other operation on
index values raises Unsupported with the operation in its message. Sizes are read from the traced
values, compared only with ``known_equal``, so reading a mask adds no guard.
"""
import dataclasses
from typing import Callable

import torch
from torch.fx import Node

from .checkpoint import passed_in
from .index_formula import (COMPARISONS, Affine, And, Compare, Division, Eq, Gather, Le, Not, Number, Offset, Or,
                            Select, all_of, any_of, compare_integers, negate, substitute)
from .nodes import argument, is_mutated, op_of, runs_of
from .shapes import constant_int, example_tensor, held, known_equal


class Unsupported(Exception):
    """Why a mask cannot be structured; the message ends up in the site's notes."""


@dataclasses.dataclass(frozen=True)
class Sym:
    expr: object
    shape: tuple  # traced sizes (ints, or SymInts under dynamic shapes)
    dtype: torch.dtype


def own_axes(rank: int) -> tuple[Affine, ...]:
    """The index of each axis of a rank-``rank`` tensor, left to right."""
    return tuple(Affine.index(p - rank) for p in range(rank))


def broadcast(sym: Sym, shape: tuple):
    """sym's formula seen through broadcasting to ``shape``: a size-1 axis reads index 0."""
    zeros = {-k: Affine() for k in range(1, len(sym.shape) + 1) if _is_one(sym.shape[-k]) and not _is_one(shape[-k])}
    return substitute(sym.expr, zeros)


def fixed_unit_axes(sym: Sym):
    """sym's formula with each size-1 axis at index 0, the only index it has."""
    return substitute(sym.expr, {-k: Affine() for k in range(1, len(sym.shape) + 1) if _is_one(sym.shape[-k])})


def _is_one(size) -> bool:
    return isinstance(size, int) and size == 1


def _is_formula(expr) -> bool:
    """A boolean value: a formula, a bool constant, or an element of a bool data tensor."""
    if isinstance(expr, Gather):
        return example_tensor(expr.source).dtype == torch.bool
    return isinstance(expr, (Le, Eq, And, Or, Not, Compare)) or (
        isinstance(expr, Number) and isinstance(expr.value, bool))


def _is_int(expr) -> bool:
    return isinstance(expr, Number) and type(expr.value) is int


def _is_integer(expr) -> bool:
    return isinstance(expr, Affine) or _is_int(expr)


def _is_integer_data(expr) -> bool:
    """An element of an integer data tensor, or one shifted by a constant (``position_ids[b, i] - 4``)."""
    if isinstance(expr, Offset):
        return True
    return isinstance(expr, Gather) and not example_tensor(expr.source).dtype.is_floating_point and \
        example_tensor(expr.source).dtype != torch.bool


def _shifted(data, constant: int) -> Offset:
    return Offset(data.gather, data.constant + constant) if isinstance(data, Offset) else Offset(data, constant)


def _as_affine(expr) -> Affine:
    return expr if isinstance(expr, Affine) else Affine((), expr.value)


class MaskTracer:
    def __init__(self):
        self._syms: dict[Node, Sym] = {}
        self._index_fed: dict[Node, bool] = {}

    def bind(self, node: Node, expr, *, index: bool = False) -> None:
        """Take ``node``'s formula as ``expr`` (a subgraph's inputs, such as flex_attention's
        mask_mod arguments); ``index``: it is index arithmetic, as an arange is, so that an
        operation on it that is not raises Unsupported instead of making it data."""
        out = example_tensor(node)
        self._syms[node] = Sym(expr, tuple(out.shape), out.dtype)
        self._index_fed[node] = index

    def trace(self, node: Node) -> Sym:
        node = passed_in(node)
        if node not in self._syms:
            self._syms[node] = self._trace(node)
        return self._syms[node]

    def _trace(self, node: Node) -> Sym:
        out = example_tensor(node)
        if out is None:
            raise Unsupported(f"{node.name} is not a tensor")
        if node.op not in ("call_function", "call_method"):
            return _leaf(node, out)
        positions = runs_of(node)
        if positions is not None:
            return self._document_ids(node, positions, out)
        handler = _HANDLERS.get(op_of(node))
        if handler is None:
            if self._fed_by_arange(node):
                name = op_of(node) or getattr(node.target, "__name__", node.target)
                raise Unsupported(f"{node.name} = {name}(...) is not index arithmetic")
            return _leaf(node, out)
        if is_mutated(node):  # its formula says how it was made, not what it holds after the edit
            raise Unsupported(f"{node.name} is modified in place")
        try:
            expr = handler(self, node, out)
            _check_integer_range(node, expr, out)
            return Sym(expr, tuple(out.shape), out.dtype)
        except Unsupported:
            if self._fed_by_arange(node):
                raise
            return _leaf(node, out)

    def _document_ids(self, node: Node, positions: Node, out: torch.Tensor) -> Sym:
        """The runs of consecutive positions (position_runs.py): data, except that positions rising by
        one along every row by their formula (an arange) are one run, numbered 0."""
        rising = self.trace(positions).expr
        if isinstance(rising, Affine) and rising.coefficient(-1) == 1:
            return Sym(Affine(), tuple(out.shape), out.dtype)
        return _leaf(node, out)

    def _fed_by_arange(self, node: Node) -> bool:
        stack = [node]
        while stack:
            n = stack[-1]
            if n in self._index_fed:
                stack.pop()
                continue
            inputs = [passed_in(i) for i in n.all_input_nodes]
            pending = [i for i in inputs if i not in self._index_fed]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            self._index_fed[n] = op_of(n) == "arange" or any(self._index_fed[i] for i in inputs)
        return self._index_fed[node]

    def operand(self, arg, shape: tuple):
        """A node argument's formula broadcast to ``shape``, or a constant."""
        if isinstance(arg, Node) and example_tensor(arg) is not None:
            return broadcast(self.trace(arg), shape)
        if isinstance(arg, (bool, int, float)):
            return Number(arg)
        value = constant_int(arg)
        if value is None:
            raise Unsupported(f"{arg} is not a constant")
        return Number(value)

    def operands(self, node: Node, out: torch.Tensor, names=("input", "other")) -> list:
        """The formulas of node's arguments ``names``, given by position or keyword."""
        arguments = [argument(node, position, name) for position, name in enumerate(names)]
        if any(a is None for a in arguments):
            raise Unsupported(f"{node.name}: missing argument among {names}")
        return [self.operand(a, tuple(out.shape)) for a in arguments]


def exact(node: Node, value, dtype: torch.dtype):
    """``value`` as a number of ``dtype``'s kind, where a tensor of ``dtype`` holds it exactly: the
    formula holds the number as written, the tensor what the conversion made of it."""
    stored = held(value, dtype)
    if stored is None or stored != value:
        raise Unsupported(f"{node.name}: {value!r} is not exact in {dtype}")
    return stored


# A symbolic size may grow up to the kernels' longest sequence (triton_tiles.MAX_SPAN) without a recompile.
_LONGEST = 1 << 28


def _check_integer_range(node: Node, expr, out: torch.Tensor) -> None:
    """Index arithmetic is exact in the formula but wraps in the tensor: it is taken only in int32
    and int64, and only where no value can leave the dtype's range."""
    value = expr.value if isinstance(expr, Division) else expr
    if not isinstance(value, Affine):
        return
    if out.dtype not in (torch.int32, torch.int64):
        raise Unsupported(f"{node.name}: index arithmetic in {out.dtype}, which may wrap")
    largest = abs(value.constant) + sum(abs(c) * (_size(out, axis) - 1) for axis, c in value.coefficients)
    if largest > torch.iinfo(out.dtype).max:
        raise Unsupported(f"{node.name}: {value} may overflow {out.dtype}")


def _size(out: torch.Tensor, axis: int) -> int:
    """The size of one of out's axes, or at most _LONGEST where it is symbolic."""
    size = out.shape[axis] if -out.dim() <= axis < 0 else None
    return size if isinstance(size, int) else _LONGEST


def _least(value: Affine, out: torch.Tensor) -> int:
    """The least value over out's indices, a symbolic size taken as _LONGEST: a negative
    coefficient of a symbolic axis then gives a negative bound."""
    return value.constant + sum(min(c, 0) * (_size(out, axis) - 1) for axis, c in value.coefficients)


def _leaf(node: Node, out: torch.Tensor) -> Sym:
    return Sym(Gather(node, own_axes(out.dim())), tuple(out.shape), out.dtype)


def _arange(tracer, node, out):
    if out.dtype.is_floating_point:
        raise Unsupported(f"{node.name} is a floating-point arange")
    start = node.kwargs.get("start", node.args[0] if len(node.args) >= 2 else 0)
    start = constant_int(start)
    step = argument(node, 2, "step", 1)
    if start is None or step != 1:
        raise Unsupported(f"{node.name}: arange with a start or step that is not a constant (step 1)")
    return Affine.index(-1) + start


def _constant(fill_position: int = -1, fill=None):
    """zeros/ones (fill given), full/new_full (fill at an argument position)."""
    def handler(tracer, node, out):
        value = fill if fill_position < 0 else argument(node, fill_position, "fill_value")
        if not isinstance(value, (bool, int, float)):
            raise Unsupported(f"{node.name}: fill value {value} is not a constant")
        return Number(exact(node, value, out.dtype))
    return handler


def _scalar(tracer, node, out):
    """``torch.tensor(c)`` of a Python number (transformers 5.17's where(mask, tensor(0.0), min))."""
    value = node.args[0] if node.args else None
    if out.dim() != 0 or not isinstance(value, (bool, int, float)):
        raise Unsupported(f"{node.name}: torch.tensor of {value!r}, not of a number")
    return _constant(fill=value)(tracer, node, out)


def _add(sign: int):
    def handler(tracer, node, out):
        a, b = tracer.operands(node, out)
        alpha = argument(node, 2, "alpha", 1)
        if alpha != 1:
            raise Unsupported(f"{node.name}: add with alpha={alpha}")
        if _is_integer(a) and _is_integer(b) and not out.dtype.is_floating_point and out.dtype != torch.bool:
            return _as_affine(a) + _as_affine(b).scaled(sign)
        if isinstance(a, Number) and isinstance(b, Number):
            return Number(a.value + sign * b.value)
        if _is_integer_data(a) and _is_int(b) and out.dtype in (torch.int32, torch.int64):
            return _shifted(a, sign * b.value)
        if sign == 1 and _is_int(a) and _is_integer_data(b) and out.dtype in (torch.int32, torch.int64):
            return _shifted(b, a.value)
        if isinstance(a, Select) and isinstance(b, Number):
            return Select(a.cond, a.if_true + sign * b.value, a.if_false + sign * b.value)
        if isinstance(a, Number) and isinstance(b, Select):
            return Select(b.cond, a.value + sign * b.if_true, a.value + sign * b.if_false)
        raise Unsupported(f"{node.name}: {op_of(node)} of {a} and {b}")
    return handler


def _mul(tracer, node, out):
    a, b = tracer.operands(node, out)
    if isinstance(a, Number):
        a, b = b, a
    if not isinstance(b, Number):
        raise Unsupported(f"{node.name}: product of two index values")
    if isinstance(a, Affine) and type(b.value) is int:
        return a.scaled(b.value)
    if isinstance(a, Number):
        return Number(a.value * b.value)
    if isinstance(a, Select):
        return Select(a.cond, a.if_true * b.value, a.if_false * b.value)
    raise Unsupported(f"{node.name}: product of {a} and {b}")


def _neg(tracer, node, out):
    (a,) = tracer.operands(node, out, ("input",))
    if isinstance(a, Affine):
        return -a
    raise Unsupported(f"{node.name}: negation of {a}")


def _division(op):
    """``a // c`` or ``a % c`` (``op``) of an index value and a positive constant."""
    def handler(tracer, node, out):
        a, c = tracer.operands(node, out)
        if not (_is_integer(a) and isinstance(c, Number) and type(c.value) is int and c.value > 0) or \
                out.dtype.is_floating_point or out.dtype == torch.bool:
            raise Unsupported(f"{node.name}: {op_of(node)} of {a} by {c}, not of integers by a positive constant")
        return Division(_as_affine(a), c.value, op)
    return handler


def _compare(tracer, node, out):
    op = op_of(node)
    distance = _compare_distance(tracer, node, op, out)
    if distance is not None:
        return distance
    a, b = tracer.operands(node, out)
    _check_compared_constants(tracer, node)
    if _is_integer(a) and _is_integer(b):
        return compare_integers(op, _as_affine(a), _as_affine(b))
    if isinstance(a, Number) and isinstance(b, Number):
        return Number(bool(COMPARISONS[op](a.value, b.value)))
    if isinstance(b, Number) and (isinstance(a, Select) or _is_formula(a)):
        return _compare_two_valued(a, op, b.value)
    if isinstance(a, Number) and (isinstance(b, Select) or _is_formula(b)):
        return _compare_two_valued(b, MIRRORED[op], a.value)
    if isinstance(a, Select) or isinstance(b, Select):
        raise Unsupported(f"{node.name}: comparison of two where() values")
    return Compare(op, a, b)


def _compare_distance(tracer, node, op: str, out):
    """``abs(a) op c`` (on either side) of an index value and an integer constant, as the two
    comparisons of a and -a (``abs(q_idx - kv_idx) <= w``: a two-sided window); else None."""
    left, right = argument(node, 0, "input"), argument(node, 1, "other")
    if op_of(right) == "abs":
        left, right, op = right, left, MIRRORED[op]
    if op_of(left) != "abs" or is_mutated(left):
        return None
    a, c = tracer.operand(argument(left, 0, "input"), tuple(out.shape)), tracer.operand(right, tuple(out.shape))
    if not (isinstance(a, Affine) and _is_int(c)):
        return None
    both = (compare_integers(op, a, Affine((), c.value)), compare_integers(op, -a, Affine((), c.value)))
    return all_of(both) if op in ("le", "lt", "ne") else any_of(both)


def _check_compared_constants(tracer, node):
    """A Python number compared with a tensor is first converted to the tensor's dtype (to the
    default float dtype for a float and an integer tensor): the formula compares the number as
    written, so it must be exact there."""
    sides = [argument(node, 0, "input"), argument(node, 1, "other")]
    tensors = [tracer.trace(side).dtype for side in sides if isinstance(side, Node)]
    for side in sides:
        if isinstance(side, (bool, int, float)) and tensors:
            if isinstance(side, float) and not tensors[0].is_floating_point:
                raise Unsupported(f"{node.name}: a float compared with {tensors[0]} values")
            exact(node, side, tensors[0])


MIRRORED = {"le": "ge", "lt": "gt", "ge": "le", "gt": "lt", "eq": "eq", "ne": "ne"}


def _compare_two_valued(value, op: str, constant):
    """``where(c, x, y) op constant`` (a boolean formula c being where(c, True, False)): a formula in c."""
    cond, if_true, if_false = (value.cond, value.if_true, value.if_false) if isinstance(value, Select) else (
        value, True, False)
    when_true, when_false = (bool(COMPARISONS[op](x, constant)) for x in (if_true, if_false))
    if when_true == when_false:
        return Number(when_true)
    return cond if when_true else negate(cond)


def _logic(tracer, node, out):
    op = op_of(node)
    names = ("input",) if op == "not" else ("input", "other")
    arguments = [argument(node, position, name) for position, name in enumerate(names)]
    if any(isinstance(a, Node) and tracer.trace(a).dtype != torch.bool for a in arguments):
        raise Unsupported(f"{node.name}: bitwise {op} of integers")
    terms = tracer.operands(node, out, names)
    if not all(_is_formula(t) for t in terms):
        raise Unsupported(f"{node.name}: {op} of non-boolean values")
    return negate(terms[0]) if op == "not" else all_of(terms) if op == "and" else any_of(terms)


def _where(tracer, node, out):
    cond, if_true, if_false = tracer.operands(node, out, ("condition", "input", "other"))
    if not (_is_formula(cond) and isinstance(if_true, Number) and isinstance(if_false, Number)):
        raise Unsupported(f"{node.name}: where() whose values are not two constants")
    return Select(cond, exact(node, if_true.value, out.dtype), exact(node, if_false.value, out.dtype))


def _masked_fill(tracer, node, out):
    base, cond, value = tracer.operands(node, out, ("input", "mask", "value"))
    if not (isinstance(base, Number) and _is_formula(cond) and isinstance(value, Number)):
        raise Unsupported(f"{node.name}: masked_fill of a tensor that is not a constant")
    return Select(cond, exact(node, value.value, out.dtype), base.value)


def _triangle(keep: Callable[[int], Affine]):
    """tril/triu: keep where ``keep(diagonal) <= 0``, zero elsewhere."""
    def handler(tracer, node, out):
        (base,) = tracer.operands(node, out, ("input",))
        diagonal = argument(node, 1, "diagonal", 0)
        if not isinstance(diagonal, int):
            raise Unsupported(f"{node.name}: diagonal {diagonal} is not a constant")
        kept = Le(keep(diagonal))
        if _is_formula(base):
            return all_of((base, kept))
        if isinstance(base, Number):
            return Select(kept, base.value, 0)
        raise Unsupported(f"{node.name}: {op_of(node)} of {base}")
    return handler


def _cast(tracer, node, out):
    source = tracer.trace(node.args[0])
    if source.dtype == out.dtype:
        return source.expr
    if isinstance(source.expr, Number):
        return Number(exact(node, source.expr.value, out.dtype))
    if isinstance(source.expr, Gather) and out.dtype == torch.bool:  # data read as bool is data != 0 (NaN is True)
        return Compare("ne", source.expr, Number(0))
    if _is_formula(source.expr) and out.dtype.is_floating_point:
        return Select(source.expr, 1.0, 0.0)
    raise Unsupported(f"{node.name}: cast from {source.dtype} to {out.dtype}")


def _same(tracer, node, out):
    return tracer.trace(node.args[0]).expr


def _expand(tracer, node, out):
    return broadcast(tracer.trace(node.args[0]), tuple(out.shape))


def _unit_axes_changed(tracer, node, out):
    """view/reshape/unsqueeze/squeeze that only insert or remove size-1 axes."""
    source = tracer.trace(node.args[0])
    if source.dtype != out.dtype:
        raise Unsupported(f"{node.name}: a view as {out.dtype} reads the bits of {source.dtype} values")
    kept_in = [p for p, s in enumerate(source.shape) if not _is_one(s)]
    kept_out = [p for p, s in enumerate(out.shape) if not _is_one(s)]
    if len(kept_in) != len(kept_out) or not all(
            known_equal(source.shape[p], out.shape[q]) for p, q in zip(kept_in, kept_out)):
        raise Unsupported(f"{node.name}: a reshape that moves data between axes")
    rank_in, rank_out = len(source.shape), out.dim()
    mapping = {p - rank_in: Affine() for p in range(rank_in)}
    mapping.update({p - rank_in: Affine.index(q - rank_out) for p, q in zip(kept_in, kept_out)})
    return substitute(source.expr, mapping)


def _getitem(tracer, node, out):
    source = tracer.trace(node.args[0])
    index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    if any(isinstance(i, Node) and example_tensor(i) is not None for i in index):
        return _advanced_index(tracer, node, out, source, index)
    return _basic_index(node, out, source, index)


def _basic_index(node, out, source: Sym, index: tuple):
    rank_in = len(source.shape)
    consumed = sum(1 for i in index if i is not None and i is not Ellipsis)
    expanded = []
    for i in index:
        expanded.extend([slice(None)] * (rank_in - consumed) if i is Ellipsis else [i])
    if Ellipsis not in index:
        expanded.extend([slice(None)] * (rank_in - consumed))
    positions, p_in, p_out = {}, 0, 0
    for i in expanded:
        if i is None:
            p_out += 1
            continue
        if isinstance(i, slice):
            start = 0 if i.start is None else constant_int(i.start)
            if start is None or start < 0 or i.step not in (None, 1):
                raise Unsupported(f"{node.name}: slice {i} with a start that is not a non-negative constant")
            positions[p_in] = (p_out, start)
            p_out += 1
        elif isinstance(i, int) and not isinstance(i, bool) and i >= 0:
            positions[p_in] = (None, i)
        else:
            raise Unsupported(f"{node.name}: index {i}")
        p_in += 1
    if p_out != out.dim():
        raise Unsupported(f"{node.name}: indexing with an unexpected result rank")
    mapping = {p - rank_in: (Affine() if q is None else Affine.index(q - p_out)) + offset
               for p, (q, offset) in positions.items()}
    return substitute(source.expr, mapping)


def _advanced_index(tracer, node, out, source: Sym, index: tuple):
    """source[t_0, ..., t_n] with one integer index tensor per axis."""
    if len(index) != len(source.shape):
        raise Unsupported(f"{node.name}: indexing that mixes index tensors with slices")
    rank_in, shape = len(source.shape), tuple(out.shape)
    mapping = {}
    for p, i in enumerate(index):
        value = tracer.operand(i, shape)
        if not _is_integer(value):
            raise Unsupported(f"{node.name}: index {i} is data, not index arithmetic")
        value = _as_affine(value)
        if _least(value, out) < 0:
            raise Unsupported(f"{node.name}: index {value} may be negative, where it would wrap")
        mapping[p - rank_in] = value
    return substitute(source.expr, mapping)


_HANDLERS = {
    "arange": _arange,
    "zeros": _constant(fill=0), "new_zeros": _constant(fill=0), "zeros_like": _constant(fill=0),
    "ones": _constant(fill=1), "new_ones": _constant(fill=1), "ones_like": _constant(fill=1),
    "full": _constant(fill_position=1), "new_full": _constant(fill_position=2), "tensor": _scalar,
    "add": _add(1), "sub": _add(-1), "mul": _mul, "neg": _neg,
    "floordiv": _division("//"), "remainder": _division("%"),
    **{op: _compare for op in COMPARISONS},
    "and": _logic, "or": _logic, "not": _logic,
    "where": _where, "masked_fill": _masked_fill,
    "tril": _triangle(lambda k: Affine.index(-1) - Affine.index(-2) - k),  # keep j - i <= k
    "triu": _triangle(lambda k: Affine.index(-2) - Affine.index(-1) + k),  # keep j - i >= k
    "to": _cast, "type": _cast, "type_as": _cast, "bool": _cast, "float": _cast, "int": _cast, "long": _cast,
    "half": _cast, "bfloat16": _cast, "double": _cast,
    "contiguous": _same, "clone": _same, "detach": _same,
    "expand": _expand, "expand_as": _expand,
    "view": _unit_axes_changed, "reshape": _unit_axes_changed, "unsqueeze": _unit_axes_changed,
    "squeeze": _unit_axes_changed,
    "getitem": _getitem,
}
