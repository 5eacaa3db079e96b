"""Find ``flex_attention`` calls whose mask_mod the op's structure covers, and make them the op.

In a dynamo graph a call is the higher-order op ``flex_attention(q, k, v, score_mod, block_mask,
scale, kernel_options, score_mod_other_buffers, mask_mod_other_buffers)``: ``score_mod`` and the
block mask's last element (its mask_mod) are subgraphs, called with 0-d index tensors (b, h,
q_idx, kv_idx) and then the tensors they captured (the other buffers, passed in that order).
The mask_mod's subgraph is read as an index formula (mask_trace.py) with its arguments bound to
the indices and the captured tensors, and classified and checked as an attention mask is
(mask_structure.py): causal, a window, key padding ``[b, kv]`` or document ids
``ids[b, q] == ids[b, kv]``. The score_mod must be the identity or a softcap,
``c * tanh(score / c)`` (the op's ``softcap``). The call then becomes an AttentionCall; the block
mask is not passed any more, so where the graph built it (``create_block_mask`` inside the
compiled code) it is not built either.

flex_attention attends where a block is full, or partial and its mask_mod says so: the block
tensors are what ``create_block_mask`` made of the mask_mod they are paired with in the
BlockMask, and the mask_mod alone says which keys a query sees. Left as they are, with the
reason: a mask_mod outside those classes (a data comparison such as torchtitan's
``q_idx <= doc_end[b, kv_idx]``, which the graph cannot show to be the documents' ends), another
score_mod, a call whose LSE or max scores are read, and block sizes that do not match q and k.
"""
import operator
from typing import Optional, Union

import torch
from torch._functorch import predispatch
from torch.fx import Node

from .call import AttentionCall, Left
from .index_formula import B, H, I, J, Affine, Gather, all_of, conjuncts
from .mask_structure import mask_formula, structure_of, with_structure
from .mask_trace import MaskTracer, Unsupported, own_axes
from .nodes import erase_unused, op_of
from .position_runs import as_index_comparisons
from .shapes import example_tensor, example_value, hinted_int, hinted_shape

FLEX = torch.ops.higher_order.flex_attention
# what vmap leaves in a graph around the mask it evaluated, once the mask itself is gone
_VMAP_BRACKETS = {getattr(predispatch, name, None) for name in
                  ("_vmap_increment_nesting", "_vmap_decrement_nesting", "lazy_load_decompositions")} - {None}
_VMAP_DIMS = {getattr(predispatch, name, None) for name in ("_add_batch_dim", "_remove_batch_dim")} - {None}
_NAMES = ("query", "key", "value", "score_mod", "block_mask", "scale", "kernel_options", "score_mod_other_buffers",
          "mask_mod_other_buffers")


def _arguments(node: Node) -> dict:
    a = dict(zip(_NAMES, node.args))
    a.update(node.kwargs)
    a.setdefault("score_mod_other_buffers", ())
    a.setdefault("mask_mod_other_buffers", ())
    return a


def _subgraph(node: Node, get_attr) -> Optional[torch.fx.GraphModule]:
    if not isinstance(get_attr, Node) or get_attr.op != "get_attr":
        return None
    module = node.graph.owning_module.get_submodule(get_attr.target)
    return module if isinstance(module, torch.fx.GraphModule) else None


def _returned(gm) -> Node:
    (value,) = gm.graph.output_node().args
    return value[0] if isinstance(value, (tuple, list)) else value


def _constant(arg) -> Optional[float]:
    """A number, or a node of one whatever the symbols are (flex_attention's default scale,
    1 / sqrt(head dim), is a SymFloat node under dynamic shapes); else None."""
    if isinstance(arg, Node):
        arg = example_value(arg)
        if isinstance(arg, torch.SymFloat) and arg.node.expr.is_number:
            arg = float(arg.node.expr)
    return float(arg) if isinstance(arg, (int, float)) and not isinstance(arg, bool) else None


def _softcap(gm) -> Union[float, str]:
    """0.0 for the identity score_mod, c for ``c * tanh(score / c)``, else why not."""
    score = gm.graph.find_nodes(op="placeholder")[0]
    out = _returned(gm)
    if out is score:
        return 0.0
    if op_of(out) == "mul":
        for tanh, cap in (out.args, reversed(out.args)):
            cap = _constant(cap)
            if cap and cap > 0 and op_of(tanh) == "tanh" and op_of(tanh.args[0]) == "div":
                inner, divisor = tanh.args[0].args
                if inner is score and _constant(divisor) == cap:
                    return cap
    return "its score_mod is not the identity or a softcap (c * tanh(score / c))"


def _mask_formula(gm, buffers) -> object:
    """The mask_mod's formula over (b, h, i, j); the captured tensors read as data of the nodes
    passed for them. Raises Unsupported."""
    tracer = MaskTracer()
    inputs = gm.graph.find_nodes(op="placeholder")
    if len(inputs) != 4 + len(buffers):
        raise Unsupported(f"its mask_mod takes {len(inputs)} inputs for 4 indices and {len(buffers)} tensors")
    for node, axis in zip(inputs, (B, H, I, J)):
        tracer.bind(node, Affine.index(axis), index=True)
    for node, outer in zip(inputs[4:], buffers):
        value = example_tensor(outer)
        if value is None:
            raise Unsupported(f"its mask_mod reads {outer}, which is not a traced tensor")
        tracer.bind(node, Gather(outer, own_axes(value.dim())))
    formula, hiding = mask_formula(_returned(gm), tracer)
    if hiding is not None:
        raise Unsupported("its mask_mod returns a number, not a bool")
    return all_of(as_index_comparisons(conjuncts(formula), tracer.trace))


def _why_not(a: dict, outputs: dict) -> Optional[str]:
    if None in outputs:
        return "its result is used other than by indexing it"
    if set(outputs) - {0}:
        return "its LSE or max scores are read"
    if len(outputs.get(0, ())) != 1:
        return "its output is not read once"
    q, k = example_tensor(a["query"]), example_tensor(a["key"])
    if q is None or k is None or q.dim() != 4:
        return "q, k are not 4-D traced tensors"
    lengths = tuple(hinted_int(n) for n in a["block_mask"][:2])
    if lengths != (hinted_shape(q)[2], hinted_shape(k)[2]):
        return f"its block mask is for {lengths} queries and keys, not q's and k's"
    if _constant(a["scale"]) is None:
        return f"scale {a['scale']} is not a constant"
    return None


def find(node: Node) -> Union[AttentionCall, Left, None]:
    if node.op != "call_function" or node.target is not FLEX:
        return None
    a = _arguments(node)
    outputs = {}
    for user in node.users:
        outputs.setdefault(user.args[1] if user.target is operator.getitem else None, []).append(user)
    tensors = {"q": a["query"], "k": a["key"], "v": a["value"]}
    reason = _why_not(a, outputs)
    score_mod, mask_mod = _subgraph(node, a["score_mod"]), _subgraph(node, a["block_mask"][-1])
    if reason is None and (score_mod is None or mask_mod is None):
        reason = "its score_mod or mask_mod is not a subgraph"
    softcap = _softcap(score_mod) if reason is None else reason
    if isinstance(softcap, str):
        return Left(node, softcap, tensors)
    if a["score_mod_other_buffers"]:
        return Left(node, "its score_mod reads tensors", tensors)
    try:
        formula = _mask_formula(mask_mod, a["mask_mod_other_buffers"])
        structure = structure_of(formula, a["query"], a["key"])
    except Unsupported as why:
        return Left(node, f"its mask_mod is not causal, a window, key padding or document ids: {why}", tensors)
    (out,) = outputs[0]
    call = AttentionCall(out, a["query"], a["key"], a["value"], scale=_constant(a["scale"]), softcap=softcap)
    return with_structure(call, structure, f"flex_attention's mask_mod -> {structure}")


def erase_leftovers(graph) -> None:
    """After flex_attention calls became the op: the subgraphs nothing calls any more, and, where
    no vmap is left in the graph (the block masks it evaluated are gone), vmap's nesting calls."""
    for node in list(graph.find_nodes(op="get_attr")):
        if not node.users and isinstance(getattr(graph.owning_module, node.target, None), torch.fx.GraphModule):
            graph.erase_node(node)
            graph.owning_module.delete_submodule(node.target)
    erase_unused([node for node in graph.nodes if node.op == "call_function" and node.target in _VMAP_DIMS])
    if not any(node.op == "call_function" and node.target in _VMAP_DIMS for node in graph.nodes):
        for node in list(graph.nodes):
            if node.op == "call_function" and node.target in _VMAP_BRACKETS and not node.users:
                graph.erase_node(node)
