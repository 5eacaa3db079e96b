"""Rewrite ``F.scaled_dot_product_attention`` calls in a dynamo graph into ``attn_cp.attention``.

Pattern: ``scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)``
in any mix of positional and keyword arguments. Replacement: ``attn_cp.attention(q, k, v, attn_mask,
is_causal, scale)[0]``. A call the op would compute differently (dropout, a mask that needs a
gradient, values known only at run time) is left as it was. Calls SDPA itself rejects never get
here: dynamo's fake-tensor trace fails on them first.
"""
import inspect
import operator
from typing import Optional

import torch
from torch.fx import GraphModule, Node

from .. import ops
from ..kernels import select_kernel
from .shapes import example_value, hinted_meta
from .site import Site, location_of

SDPA = torch._C._nn.scaled_dot_product_attention
ATTENTION = ops.attention._opoverload


def _sdpa_signature(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                    enable_gqa=False):
    """SDPA's Python signature, used only to bind a call's arguments."""


_BIND = inspect.signature(_sdpa_signature)


def _why_not(a: dict) -> Optional[str]:
    """The reason this call cannot become attn_cp.attention, or None if it can."""
    for name in ("dropout_p", "is_causal", "scale", "enable_gqa"):
        if isinstance(a[name], Node):
            return f"{name} is only known at run time"
    if a["dropout_p"] != 0:
        return f"dropout_p={a['dropout_p']} > 0: the fused op has no dropout"
    q, k, v = (example_value(a[n]) for n in ("query", "key", "value"))
    if not all(isinstance(x, torch.Tensor) for x in (q, k, v)):
        return "q, k or v has no traced tensor value"
    if any(type(x).__name__ == "DTensor" for x in (q, k, v)):
        return "q, k or v is a DTensor: placement-driven rewriting is not supported yet"
    if not (q.dim() == k.dim() == v.dim() == 4):
        return f"q, k, v are {q.dim()}-D, {k.dim()}-D, {v.dim()}-D; the op takes 4-D (B, H, S, D)"
    mask = a["attn_mask"]
    if mask is not None:
        if not isinstance(mask, Node) or not isinstance(example_value(mask), torch.Tensor):
            return "attn_mask is not a traced tensor"
        if example_value(mask).requires_grad:
            return "attn_mask requires grad; the fused op does not differentiate the mask"
    return None


def _describe(node: Node, a: dict) -> tuple[str, dict]:
    shapes = {}
    for name, key in (("q", "query"), ("k", "key"), ("v", "value"), ("attn_mask", "attn_mask")):
        value = example_value(a[key]) if isinstance(a[key], Node) else None
        if isinstance(value, torch.Tensor):
            shapes[name] = hinted_meta(value).shape
    return location_of(node), shapes


def rewrite_sdpa(gm: GraphModule) -> list[Site]:
    sites = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not SDPA:
            continue
        a = _BIND.bind(*node.args, **node.kwargs)
        a.apply_defaults()
        a = a.arguments
        location, shapes = _describe(node, a)
        reason = _why_not(a)
        if reason is not None:
            sites.append(Site(node.name, location, shapes, rewritten=False, reason=reason))
            continue
        with gm.graph.inserting_before(node):
            fused = gm.graph.call_function(
                ATTENTION, (a["query"], a["key"], a["value"], a["attn_mask"], a["is_causal"], a["scale"])
            )
            out = gm.graph.call_function(operator.getitem, (fused, 0))
        out.meta.update(node.meta)
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
        q, k, v = (hinted_meta(example_value(a[n])) for n in ("query", "key", "value"))
        mask = None if a["attn_mask"] is None else hinted_meta(example_value(a["attn_mask"]))
        kernel = select_kernel(q, k, v, is_causal=a["is_causal"], attn_mask=mask)
        sites.append(Site(node.name, location, shapes, rewritten=True, op="attn_cp.attention", kernel=kernel))
    gm.recompile()
    return sites
