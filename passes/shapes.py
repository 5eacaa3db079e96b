"""Traced tensor values of graph nodes, read without adding shape guards, except where
``guarded_shape`` says so."""
import math
from typing import NamedTuple, Optional

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true


class TensorMeta(NamedTuple):
    """What kernel selection reads of a tensor, with sizes as plain ints."""

    shape: tuple
    dtype: torch.dtype
    device: torch.device

    def dim(self) -> int:
        return len(self.shape)


def example_value(node: Node):
    return node.meta.get("example_value", node.meta.get("val"))


def example_tensor(arg) -> Optional[torch.Tensor]:
    """The traced tensor of a node argument, or None if it is not a node with one."""
    value = example_value(arg) if isinstance(arg, Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _hint(size) -> int:
    return size if isinstance(size, int) else size.node.hint


def hinted_int(value) -> int:
    """An int argument as traced: a plain int, or the hint of a node's SymInt (installs no guard)."""
    return _hint(example_value(value) if isinstance(value, Node) else value)


def hinted_meta(t: torch.Tensor) -> TensorMeta:
    """Sizes are the values traced with (their hints), so reading them installs no guard."""
    return TensorMeta(tuple(_hint(s) for s in t.shape), t.dtype, t.device)


def hinted_shape(t: torch.Tensor) -> tuple:
    return hinted_meta(t).shape


def known_equal(a, b) -> bool:
    """True only if sizes a and b are equal for every value of their symbols; installs no guard."""
    return statically_known_true(a == b)


def known_shape(t: torch.Tensor, shape) -> bool:
    return t.dim() == len(shape) and all(known_equal(s, e) for s, e in zip(t.shape, shape))


def guarded_shape(t: torch.Tensor, shape) -> bool:
    """Whether t has ``shape``. Sizes that are equal as traced but not for every value of their
    symbols (the lengths of two inputs that dynamo made dynamic apart, say) are made equal by a
    guard: a later call where they differ compiles again instead of running this graph."""
    if t.dim() != len(shape) or any(_hint(s) != _hint(e) for s, e in zip(t.shape, shape)):
        return False
    return all(known_equal(s, e) or bool(s == e) for s, e in zip(t.shape, shape))  # bool() installs the guard


def constant_int(value) -> Optional[int]:
    """value as an int when it is one whatever the symbols are (an int, or a SymInt that
    simplifies to a number), else None."""
    if isinstance(value, Node):
        value = example_value(value)
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, torch.SymInt) and value.node.expr.is_number:
        return int(value.node.expr)
    return None


def held(value, dtype: torch.dtype):
    """What a tensor of ``dtype`` holds when given the Python number ``value``: a float rounded to
    the dtype, truncated toward zero for an integer dtype; an int wrapped; nonzero-ness for bool.
    None where the conversion is not defined (a float out of an integer dtype's range)."""
    source = torch.bool if isinstance(value, bool) else torch.int64 if isinstance(value, int) else torch.float64
    try:
        number = torch.tensor(value, dtype=source)
    except (OverflowError, RuntimeError, ValueError):
        return None
    if source == torch.float64 and not dtype.is_floating_point and dtype != torch.bool and not (
            math.isfinite(value) and torch.iinfo(dtype).min <= value <= torch.iinfo(dtype).max):
        return None
    return number.to(dtype).item()
