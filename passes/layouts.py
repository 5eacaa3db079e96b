"""Drop ``.contiguous()`` copies of q, k and v made only for attention.

Pattern: ``x.contiguous()`` as q, k or v, with ``x`` unit-strided in its last axis (e.g. a
(B, S, H, D) projection transposed to (B, H, S, D)). Replacement: ``x``. Every kernel behind the op
takes such strides (the fused ones read them in place), so the copy is not needed. The op's output
lies in q's memory order, so a ``transpose(1, 2).contiguous()`` after attention copies nothing
when q was such a transpose. q's copy goes only where the output is transposed back and copied
like that: elsewhere the output's strides may matter (a ``.view`` of it). A copy that is modified
in place, or whose source is, stays: the op would read the other one.
"""
from torch.fx import Node

from .call import AttentionCall
from .nodes import is_mutated, op_of
from .shapes import example_tensor, known_equal

_COPIES_AFTER_TRANSPOSE = ("reshape", "contiguous", "flatten")


def transposed_away(anchor: Node) -> bool:
    """Every use of the result is ``.transpose(1, 2)`` (or a permute moving the heads) followed by a copy."""
    def moves_heads(user):
        if op_of(user) == "transpose":
            return {a % 4 for a in user.args[1:3] if isinstance(a, int)} == {1, 2}
        return op_of(user) == "permute" and tuple(user.args[1:]) in ((0, 2, 1, 3), ((0, 2, 1, 3),))

    return all(moves_heads(u) and u.users and all(op_of(c) in _COPIES_AFTER_TRANSPOSE for c in u.users)
               for u in anchor.users)


def _copied(node: Node):
    """The source of ``node = source.contiguous()`` when the op can read the source as it is."""
    if op_of(node) != "contiguous" or len(node.args) > 1 or node.kwargs:
        return None
    source = example_tensor(node.args[0])
    if source is None or not known_equal(source.stride(-1), 1) or is_mutated(node.args[0]) or is_mutated(node):
        return None  # a source or a copy edited in place may differ from the other where the op reads it
    return node.args[0]


def drop_contiguous_copies(call: AttentionCall) -> AttentionCall:
    # q's memory order gives the output's, so q's copy goes only where the output's strides
    # cannot matter: it is transposed back and copied (a view of it would fail otherwise)
    names = ("q", "k", "v") if transposed_away(call.anchor) else ("k", "v")
    sources = {name: _copied(getattr(call, name)) for name in names}
    dropped = {name: source for name, source in sources.items() if source is not None}
    if not dropped:
        return call
    return call.noted(f"dropped .contiguous() of {', '.join(dropped)}", **dropped)
