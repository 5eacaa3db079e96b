"""Attention inside activation checkpointing. Dynamo traces ``torch.utils.checkpoint`` (Hugging
Face's gradient checkpointing) as a ``tag_activation_checkpoint`` call on a body graph whose inputs
are the region's arguments; AOTAutograd then recomputes the body in the backward.

The passes rewrite a body like any graph. What a site there needs from outside is reached through
the body's inputs: each input is linked to the value passed for it, so a mask built once before the
layers reads as its formula, and a tensor the rewritten call reads from outside (a key-padding
mask) becomes a new input of the body. Inputs the body no longer reads (the mask) are dropped from
the call, so the mask is not built.
"""
import contextlib
import copy
import dataclasses
import itertools

import torch
from torch.fx import GraphModule, Node

from .call import AttentionCall
from .nodes import erase_unused

CHECKPOINT = torch.ops.higher_order.tag_activation_checkpoint
_PASSED = "attn_cp_passed"  # a body input's meta: the node the checkpoint call passes for it
_CALL = "attn_cp_checkpoint_call"  # a body's meta: the call that runs it


def _inputs(graph) -> list[Node]:
    return list(graph.find_nodes(op="placeholder"))


def bodies(gm: GraphModule) -> list[tuple[Node, GraphModule]]:
    """gm's checkpoint calls and their bodies, nested ones after the body they are in."""
    found = []
    for call in gm.graph.find_nodes(op="call_function", target=CHECKPOINT):
        body = getattr(gm, call.args[0].target)
        found += [(call, body)] + bodies(body)
    return found


def with_bodies(gm: GraphModule) -> list[GraphModule]:
    return [gm] + [body for _, body in bodies(gm)]


def recompile(gm: GraphModule) -> None:
    """After a pass: gm's code and its bodies' from their graphs."""
    for module in with_bodies(gm):
        module.recompile()


def own_bodies(gm: GraphModule) -> None:
    """Give each checkpoint call, nested ones included, a copy of its body to rewrite: the body
    module dynamo made is shared with the graph the backend was given, which stays as it was for a
    fallback."""
    taken = set()
    for call in gm.graph.find_nodes(op="call_function", target=CHECKPOINT):
        getter = call.args[0]
        body, name = getattr(gm, getter.target), getter.target
        if name in taken or len(getter.users) > 1:
            name = next(f"{name}_{n}" for n in itertools.count(1) if not hasattr(gm, f"{name}_{n}"))
            with gm.graph.inserting_before(call):
                call.update_arg(0, gm.graph.get_attr(name))
        taken.add(name)
        copied = GraphModule(body, copy.deepcopy(body.graph))
        setattr(gm, name, copied)
        own_bodies(copied)


@contextlib.contextmanager
def linked(gm: GraphModule):
    """Within the block, each body's inputs are linked to the values its call passes for them
    (passed_in, as_input); yields (call, body) for every checkpoint, as ``bodies`` lists them."""
    found = [(call, body) for call, body in bodies(gm) if len(_inputs(body.graph)) == len(call.args) - 1]
    for call, body in found:
        for node, passed in zip(_inputs(body.graph), call.args[1:]):
            node.meta[_PASSED] = passed
        body.meta[_CALL] = call
    try:
        yield found
    finally:
        for _, body in found:
            body.meta.pop(_CALL, None)
            for node in _inputs(body.graph):
                node.meta.pop(_PASSED, None)


def passed_in(node: Node) -> Node:
    """The node whose value ``node`` holds: for a linked body's input, the value passed for it
    (followed out of nested bodies); any other node is itself."""
    while node.op == "placeholder" and _PASSED in node.meta:
        node = node.meta[_PASSED]
    return node


def as_input(graph, node: Node) -> Node:
    """``node``, from a graph enclosing ``graph`` (a linked body's), as a node of ``graph``: the
    body's input that the checkpoint call passes it for, added if the call does not pass it yet."""
    if node.graph is graph:
        return node
    call = graph.owning_module.meta[_CALL]
    passed = as_input(call.graph, node)
    inputs = _inputs(graph)
    for existing in inputs:
        if existing.meta.get(_PASSED) is passed:
            return existing
    with graph.inserting_after(inputs[-1]) if inputs else graph.inserting_before(next(iter(graph.nodes))):
        added = graph.placeholder(passed.name)
    added.meta.update({"example_value": passed.meta.get("example_value"), _PASSED: passed})
    call.args = (*call.args, passed)
    return added


def localize(graph, call: AttentionCall) -> AttentionCall:
    """``call`` reading, in ``graph``, each tensor it took from an enclosing graph."""
    changes = {field: as_input(graph, getattr(call, field))
               for field in ("key_padding_mask", "document_ids") if getattr(call, field) is not None}
    if call.flex_mask is not None:
        data = tuple(as_input(graph, node) for node in call.flex_mask.data)
        changes["flex_mask"] = dataclasses.replace(call.flex_mask, data=data)
    return dataclasses.replace(call, **changes)


def drop_unused_inputs(checkpoints: list) -> None:
    """Stop passing what the bodies no longer read, and erase what only that needed outside;
    ``checkpoints``: (call, body) pairs as ``bodies`` lists them, so that inner bodies go first."""
    for call, body in reversed(checkpoints):
        _drop_unused_inputs(call, body)


def _drop_unused_inputs(call: Node, body: GraphModule) -> None:
    inputs = _inputs(body.graph)
    unused = [i for i, node in enumerate(inputs) if not node.users]
    if not unused:
        return
    dropped = [call.args[1 + i] for i in unused]
    call.args = (call.args[0], *(arg for i, arg in enumerate(call.args[1:]) if i not in unused))
    for i in unused:
        body.graph.erase_node(inputs[i])
    erase_unused(dropped)
