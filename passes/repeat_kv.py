"""Remove repeat_kv: attention takes the un-repeated k and v and runs GQA natively.

Patterns (``x`` is (B, H, S, D); each is a copy with head ``h * n + r`` = head ``h`` of ``x``):

    x[:, :, None].expand(B, H, n, S, D).reshape(B, H * n, S, D)    # HF repeat_kv; also unsqueeze(2),
                                                                   # view, flatten(1, 2)
    x.repeat_interleave(n, dim=1)
    x.expand(B, n, S, D)                                           # H == 1

Replacement: ``x``. The op maps query head ``i`` to KV head ``i // (h_q / H)``, which is the head
these copies put at position ``i``. ``x.repeat(1, n, 1, 1)`` (head ``i`` = head ``i % H``) is not
one of them. k and v are replaced only together and only when both lose
their copy to the same head count. Each step is one of a few view ops, and what it does is read
from the traced shapes: any view from (B, H, S, D) to (B, H, 1, S, D) inserts that axis, and any
reshape from (B, H, n, S, D) to (B, H * n, S, D) merges those two, whatever its arguments say.
"""
from typing import Optional

from torch.fx import Node

from .call import AttentionCall
from .nodes import argument, is_mutated, op_of
from .shapes import example_tensor, known_equal, known_shape


def _shape(node) -> Optional[tuple]:
    t = example_tensor(node)
    return tuple(t.shape) if t is not None else None


def _merged_heads(node: Node) -> Optional[Node]:
    """reshape(e, (B, H * n, S, D)) of a 5-D e = (B, H, n, S, D): returns e."""
    if op_of(node) not in ("reshape", "view", "flatten"):
        return None
    expanded = node.args[0]
    src = _shape(expanded)
    if src is None or len(src) != 5:
        return None
    b, h, n, s, d = src
    return expanded if known_shape(example_tensor(node), (b, h * n, s, d)) else None


def _expanded_group(node: Node) -> Optional[Node]:
    """expand(u, (B, H, n, S, D)) of u = (B, H, 1, S, D): returns u."""
    if op_of(node) != "expand":
        return None
    out, src = _shape(node), _shape(node.args[0])
    if src is None or len(src) != 5 or not known_equal(src[2], 1):
        return None
    return node.args[0] if all(known_equal(out[i], src[i]) for i in (0, 1, 3, 4)) else None


def _unsqueezed_group(node: Node) -> Optional[Node]:
    """(B, H, 1, S, D) made from x = (B, H, S, D) by inserting the size-1 axis: returns x."""
    if op_of(node) not in ("getitem", "unsqueeze", "view", "reshape"):
        return None
    if op_of(node) == "getitem":
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        if not all(i is None or i is Ellipsis or i == slice(None) for i in index):
            return None
    src = _shape(node.args[0])
    if src is None or len(src) != 4:
        return None
    b, h, s, d = src
    return node.args[0] if known_shape(example_tensor(node), (b, h, 1, s, d)) else None


def _expand_reshape(node: Node) -> Optional[Node]:
    expanded = _merged_heads(node)
    grouped = _expanded_group(expanded) if expanded is not None else None
    return _unsqueezed_group(grouped) if grouped is not None else None


def _repeat_interleave(node: Node) -> Optional[Node]:
    if op_of(node) != "repeat_interleave" or argument(node, 2, "dim") not in (1, -3):
        return None
    repeats = argument(node, 1, "repeats")
    src = _shape(node.args[0])
    if not isinstance(repeats, int) or src is None or len(src) != 4:
        return None
    b, h, s, d = src
    return node.args[0] if known_shape(example_tensor(node), (b, h * repeats, s, d)) else None


def _expand_single_head(node: Node) -> Optional[Node]:
    """expand(x, (B, n, S, D)) of x = (B, 1, S, D): returns x."""
    if op_of(node) != "expand":
        return None
    out, src = _shape(node), _shape(node.args[0])
    if src is None or len(src) != 4 or not known_equal(src[1], 1):
        return None
    return node.args[0] if all(known_equal(out[i], src[i]) for i in (0, 2, 3)) else None


PATTERNS = (_expand_reshape, _repeat_interleave, _expand_single_head)


def unrepeated(node: Node) -> Optional[Node]:
    """The tensor that ``node`` repeats along the head axis, or None if it is no such copy."""
    for pattern in PATTERNS:
        source = pattern(node)
        if source is not None and not is_mutated(source) and not is_mutated(node):
            return source  # else the op would miss an edit of the copy, or see one of the source
    return None


def strip_repeat_kv(call: AttentionCall) -> AttentionCall:
    k, v = unrepeated(call.k), unrepeated(call.v)
    if k is None and v is None:
        return call
    if k is None or v is None or not known_equal(example_tensor(k).shape[1], example_tensor(v).shape[1]):
        return call.noted("repeat_kv kept: k and v are not repeated alike")
    return call.noted(f"repeat_kv removed: k, v have {example_tensor(k).shape[1]} heads", k=k, v=v)
