"""Reading dynamo graph nodes by what they compute, whatever the spelling (``torch.f(x)``,
``x.f()`` or an operator), and removing the nodes a rewrite leaves unused."""
import operator
from typing import Optional

import torch
import torch.nn.functional as F
from torch.fx import Node
from torch.multiprocessing.reductions import StorageWeakRef

from .shapes import example_tensor

# Function targets by the name of the tensor method that computes the same thing.
_FUNCTIONS = {
    torch.matmul: "matmul", operator.matmul: "matmul", torch.bmm: "matmul",
    F.softmax: "softmax", torch.softmax: "softmax",
    F.dropout: "dropout",
    operator.mul: "mul", torch.mul: "mul", operator.truediv: "div", torch.div: "div",
    operator.add: "add", torch.add: "add", operator.sub: "sub", torch.sub: "sub",
    operator.neg: "neg", torch.neg: "neg",
    operator.floordiv: "floordiv", torch.floor_divide: "floordiv",
    operator.mod: "remainder", torch.remainder: "remainder",
    operator.le: "le", operator.lt: "lt", operator.ge: "ge", operator.gt: "gt", operator.eq: "eq", operator.ne: "ne",
    torch.le: "le", torch.lt: "lt", torch.ge: "ge", torch.gt: "gt", torch.eq: "eq", torch.ne: "ne",
    torch.Tensor.__le__: "le", torch.Tensor.__lt__: "lt", torch.Tensor.__ge__: "ge", torch.Tensor.__gt__: "gt",
    torch.Tensor.__eq__: "eq", torch.Tensor.__ne__: "ne",
    operator.and_: "and", operator.or_: "or", operator.invert: "not",
    torch.logical_and: "and", torch.logical_or: "or", torch.logical_not: "not",
    torch.bitwise_and: "and", torch.bitwise_or: "or", torch.bitwise_not: "not",
    torch.where: "where", torch.masked_fill: "masked_fill",
    torch.tril: "tril", torch.triu: "triu", torch.tanh: "tanh", F.tanh: "tanh",
    torch.transpose: "transpose", torch.permute: "permute",
    torch.ops.aten.mT: "mT", torch.ops.aten.mT.default: "mT",  # dynamo on torch 2.14 records x.mT as aten.mT
    torch.unsqueeze: "unsqueeze", torch.squeeze: "squeeze", torch.reshape: "reshape", torch.flatten: "flatten",
    torch.repeat_interleave: "repeat_interleave", torch.cumsum: "cumsum", torch.diff: "diff",
    abs: "abs", torch.abs: "abs", operator.abs: "abs", torch.Tensor.__abs__: "abs",  # torch 2.11: __abs__
    torch.arange: "arange", torch.zeros: "zeros", torch.ones: "ones", torch.full: "full",
    torch.zeros_like: "zeros_like", torch.ones_like: "ones_like", torch.tensor: "tensor",
    operator.getitem: "getitem",
}
_METHODS = {
    "__and__": "and", "__or__": "or", "__invert__": "not", "logical_and": "and", "logical_or": "or",
    "logical_not": "not", "bitwise_and": "and", "bitwise_or": "or", "bitwise_not": "not",
    "__getitem__": "getitem",
    "floor_divide": "floordiv", "__floordiv__": "floordiv", "__mod__": "remainder",
    # dynamo on torch 2.11 recorded a comparison as "__eq__" (as a method or as Tensor.__eq__)
    "__eq__": "eq", "__ne__": "ne", "__le__": "le", "__lt__": "lt", "__ge__": "ge", "__gt__": "gt", "__abs__": "abs",
}


def op_of(node) -> Optional[str]:
    """The tensor-method name of what ``node`` computes, or None for placeholders and unknown calls."""
    if not isinstance(node, Node):
        return None
    if node.op == "call_method":
        return _METHODS.get(node.target, node.target)
    if node.op == "call_function":
        if node.target is getattr:  # a tensor attribute, e.g. x.mT
            return node.args[1]
        try:
            return _FUNCTIONS.get(node.target)
        except TypeError:  # an unhashable target
            return None
    return None


def argument(node: Node, position: int, name: str, default=None):
    """Argument ``name`` of a call, given by keyword or at ``position`` (the tensor itself is
    position 0 in both the function and the method spelling)."""
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[position] if len(node.args) > position else default


def schema_arguments(node: Node, schema) -> dict:
    """Every argument of a call to an op of ``schema`` by name: given by keyword, by position, or
    left at its default."""
    names = [argument.name for argument in schema.arguments]
    bound = {argument.name: argument.default_value for argument in schema.arguments if argument.has_default_value()}
    bound.update(zip(names, node.args))
    bound.update(node.kwargs)
    return bound


def _is_first_column(node, of: Node) -> bool:
    """``of[:, :1]``."""
    full, first = slice(None, None, None), slice(None, 1, None)
    return op_of(node) == "getitem" and node.args[0] is of and node.args[1] in ((full, first), [full, first])


def runs_of(node: Node) -> Optional[Node]:
    """positions, where ``node`` numbers the runs of consecutive positions along each row of them,
    ``(torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1) != 1).cumsum(-1)`` (Hugging
    Face's document ids of packed sequences), neither of them edited in place, positions int32 or
    int64 (whose values, positions of tokens, stay far from wrapping); else None."""
    if op_of(node) != "cumsum" or argument(node, 1, "dim") not in (-1, 1):
        return None
    step = argument(node, 0, "input")
    if op_of(step) != "ne" or argument(step, 1, "other") != 1:
        return None
    diff = argument(step, 0, "input")
    if op_of(diff) != "diff" or argument(diff, 1, "n", 1) != 1 or argument(diff, 2, "dim", -1) not in (-1, 1) \
            or argument(diff, 4, "append") is not None:
        return None
    positions, before = argument(diff, 0, "input"), argument(diff, 3, "prepend")
    if op_of(before) != "sub" or argument(before, 1, "other") != 1 or \
            not _is_first_column(argument(before, 0, "input"), positions):
        return None
    value = example_tensor(positions)
    # narrower integers wrap: in uint8, 255 then 0 is a step of 1
    if value is None or value.dim() != 2 or value.dtype not in (torch.int32, torch.int64) or is_mutated(node) or \
            is_mutated(positions):
        return None
    return positions


_INPLACE_OPERATORS = (operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
                      operator.ifloordiv, operator.imod, operator.ipow, operator.imatmul, operator.iand, operator.ior,
                      operator.ixor, operator.ilshift, operator.irshift)


def _edits_first_argument(node: Node) -> bool:
    """``x.add_(y)``, ``torch.relu_(x)``, ``x[i] = y``, ``x &= y``, ``F.relu(x, inplace=True)``."""
    if node.kwargs.get("inplace") is True:
        return True
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.startswith("_")
    if node.op == "call_function":
        if any(node.target is op for op in _INPLACE_OPERATORS):
            return True
        name = getattr(node.target, "__name__", "")
        return name.endswith("_") and getattr(node.target, "__module__", "") != "_operator"  # not operator.and_
    return False


def written(node: Node) -> list:
    """The nodes whose memory the call ``node`` writes: its first argument where it works in place,
    and what it is given as ``out=``."""
    if node.op not in ("call_method", "call_function"):
        return []
    out = node.kwargs.get("out")
    targets = list(out) if isinstance(out, (tuple, list)) else [out]
    if _edits_first_argument(node):
        targets.append(argument(node, 0, "input"))
    return [target for target in targets if isinstance(target, Node)]


def mutates(node: Node) -> bool:
    return bool(written(node))


def _memory(node: Node):
    """What identifies the memory of node's value: the traced tensor's storage, which its views and
    the casts that return it as it is share; the node itself where there is none to read."""
    t = example_tensor(node)
    if t is not None:
        try:
            return StorageWeakRef(t.untyped_storage())
        except (NotImplementedError, RuntimeError):  # a tensor subclass without storage of its own
            pass
    return node


def _mutations(node: Node) -> list:
    """The in-place calls, in graph order, on node's memory: on node or on anything that aliases it."""
    memory = _memory(node)
    # a storage and a node are never the same memory (and StorageWeakRef's == cannot compare them)
    return [n for n in node.graph.nodes
            if any(type(m) is type(memory) and m == memory for m in map(_memory, written(n)))]


def is_mutated(node: Node) -> bool:
    return bool(_mutations(node))


def mutated_between(node: Node, first: Node, last: Node) -> bool:
    """node's memory is modified in place by a call after ``first`` and before ``last``."""
    return any(first < m < last for m in _mutations(node))


# calls that return a new tensor of their own
_ALLOCATIONS = {"zeros", "ones", "empty", "full", "new_zeros", "new_ones", "new_empty", "new_full", "zeros_like",
                "ones_like", "empty_like", "full_like"}


def _dead_allocation(node: Node) -> Optional[list]:
    """What is computed from ``node``, in graph order, where node is a tensor it allocated itself and
    all of that only writes into it in place (``flex_attention``'s block-mask builder fills one with
    ``x[rows, cols] = x.new_ones(())``) and is read by nothing else; None otherwise."""
    if op_of(node) not in _ALLOCATIONS:
        return None
    found, stack = {node}, list(node.users)
    while stack:
        user = stack.pop()
        if user in found:
            continue
        if user.op not in ("call_function", "call_method") or not set(written(user)) <= {node} or (
                user.is_impure() and node not in written(user)) or len(found) > 16:
            return None
        found.add(user)
        stack.extend(user.users)
    return sorted(found - {node})


def erase_unused(nodes) -> None:
    """Erase the given nodes, and then their inputs, as far as they have no users left and no effects
    (each from its own graph: a checkpoint body's site also reads nodes of the graph around it). A
    tensor allocated in the graph whose only users write into it goes with them."""
    stack, erased = [n for n in nodes if isinstance(n, Node)], set()
    while stack:
        node = stack.pop()
        if node in erased or node.op not in ("call_function", "call_method"):
            continue
        dead = _dead_allocation(node) if node.users else None
        for user in reversed(dead or ()):
            stack.extend(user.all_input_nodes)
            node.graph.erase_node(user)
            erased.add(user)
        if node.users:
            continue
        if mutates(node) or node.is_impure():
            continue
        stack.extend(node.all_input_nodes)
        node.graph.erase_node(node)
        erased.add(node)
