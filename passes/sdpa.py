"""Find ``F.scaled_dot_product_attention`` calls in a dynamo graph.

Pattern: ``scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)``
in any mix of positional and keyword arguments. It becomes an AttentionCall with the same q, k, v,
attn_mask, is_causal and scale. A call the op would compute differently (dropout, values known only
at run time) is left as it was. Calls SDPA itself rejects never get here: dynamo's fake-tensor
trace fails on them first.
"""
import inspect
from typing import Optional, Union

import torch
from torch.fx import Node

from .call import AttentionCall, Left
from .shapes import example_tensor

SDPA = torch._C._nn.scaled_dot_product_attention


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
    q, k, v = (example_tensor(a[n]) for n in ("query", "key", "value"))
    if q is None or k is None or v is None:
        return "q, k or v has no traced tensor value"
    if not (q.dim() == k.dim() == v.dim() == 4):
        return f"q, k, v are {q.dim()}-D, {k.dim()}-D, {v.dim()}-D; the op takes 4-D (B, H, S, D)"
    if a["attn_mask"] is not None and example_tensor(a["attn_mask"]) is None:
        return "attn_mask is not a traced tensor"
    return None


def find(node: Node) -> Union[AttentionCall, Left, None]:
    if node.op != "call_function" or node.target is not SDPA:
        return None
    a = _BIND.bind(*node.args, **node.kwargs)
    a.apply_defaults()
    a = a.arguments
    reason = _why_not(a)
    if reason is not None:
        names = {"q": "query", "k": "key", "v": "value", "attn_mask": "attn_mask"}
        return Left(node, reason, {name: a[key] for name, key in names.items()})
    return AttentionCall(node, a["query"], a["key"], a["value"], a["attn_mask"], a["is_causal"], a["scale"])
