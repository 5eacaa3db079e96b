"""One attention call on its way to ``attn_cp.attention`` (or, with a flex_mask, to flex_attention):
the op's arguments as graph nodes and constants. Finders create it, refinements replace its fields,
and it is checked against the op's own argument rules before it is emitted, so a call the op would
reject is left as it was."""
import dataclasses
import math
import operator
from typing import Optional

from torch.fx import Graph, Node

from .. import ops
from ..kernels import select_kernel
from ..validation import check_attention_args
from .shapes import example_tensor, hinted_meta, known_shape

ATTENTION = ops.attention._opoverload
UNBOUNDED = (-1, -1)


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    anchor: Node  # the node whose value the op's output replaces: the SDPA call, the final matmul
    q: Node
    k: Node
    v: Node
    attn_mask: Optional[Node] = None
    is_causal: bool = False
    scale: Optional[float] = None
    window: tuple[int, int] = UNBOUNDED
    key_padding_mask: Optional[Node] = None
    document_ids: Optional[Node] = None
    softcap: float = 0.0  # scores capped as softcap * tanh(scores / softcap), 0: not capped
    flex_mask: Optional[object] = None  # a flex_mask.FlexMask: the call goes to flex_attention, not the op
    notes: tuple[str, ...] = ()  # what the passes did to the call, or why they did not

    def tensors(self) -> dict:
        named = {"q": self.q, "k": self.k, "v": self.v, "attn_mask": self.attn_mask,
                 "key_padding_mask": self.key_padding_mask, "document_ids": self.document_ids}
        named.update({node.name: node for node in (self.flex_mask.data if self.flex_mask is not None else ())})
        return {name: node for name, node in named.items() if node is not None}

    def noted(self, note: str, **changes) -> "AttentionCall":
        return dataclasses.replace(self, notes=self.notes + (note,), **changes)


@dataclasses.dataclass(frozen=True)
class Left:
    """An attention site that stays as it is."""

    anchor: Node
    reason: str
    tensors: dict  # name -> node, for the site's shapes


def eager_empty_row(hiding: Optional[float], how: str = "adding") -> str:
    """What the code as written gives a query that sees no key, where it hides keys by ``how``
    ``hiding``: softmax over -inf alone (or a bool mask, ``hiding`` None) is NaN; over one finite
    value alone it weighs every key alike, the mean of v. The op gives such a query 0."""
    return "NaN" if hiding in (None, -math.inf) else f"the mean of v ({how} {hiding:.4g})"


def empty_row_note(hiding: Optional[float], how: str = "adding") -> str:
    return f"a query that sees no key gets 0, where the code as written gives {eager_empty_row(hiding, how)}"


def why_invalid(call: AttentionCall) -> Optional[str]:
    """The op's argument check on the traced metadata (hinted sizes: no guards), and that the op's
    output has the shape and dtype of the value it replaces; None if the call is fine."""
    traced = {}
    for name, node in call.tensors().items():
        t = example_tensor(node)
        if t is None:
            return f"{name} has no traced tensor value"
        traced[name] = t
    mask, padding, documents = (traced.get(name) for name in ("attn_mask", "key_padding_mask", "document_ids"))
    if mask is not None and mask.requires_grad:
        return "attn_mask requires grad; the fused op does not differentiate the mask"
    q, v = traced["q"], traced["v"]
    try:
        check_attention_args(*(hinted_meta(traced[n]) for n in ("q", "k", "v")),
                             None if mask is None else hinted_meta(mask), call.window,
                             None if padding is None else hinted_meta(padding),
                             None if documents is None else hinted_meta(documents), softcap=call.softcap)
    except ValueError as error:
        return str(error)
    replaced = example_tensor(call.anchor)
    if replaced is None or replaced.dtype != q.dtype or not known_shape(replaced, (*q.shape[:-1], v.shape[-1])):
        return "the attention result is not (B, h_q, S_q, d_v) in q's dtype"
    return None


def kernel_of(call: AttentionCall) -> str:
    if call.flex_mask is not None:
        return "block mask"
    metas = {name: hinted_meta(example_tensor(node)) for name, node in call.tensors().items()}
    return select_kernel(metas["q"], metas["k"], metas["v"], is_causal=call.is_causal, window=call.window,
                         attn_mask=metas.get("attn_mask"), key_padding_mask=metas.get("key_padding_mask"),
                         document_ids=metas.get("document_ids"), softcap=call.softcap)


def emit(graph: Graph, call: AttentionCall) -> None:
    """Insert the op before the anchor and make the anchor's users read its output instead."""
    options = {"window_left": call.window[0], "window_right": call.window[1],
               "key_padding_mask": call.key_padding_mask, "document_ids": call.document_ids, "softcap": call.softcap}
    defaults = {"window_left": -1, "window_right": -1, "key_padding_mask": None, "document_ids": None, "softcap": 0.0}
    kwargs = {name: value for name, value in options.items() if value != defaults[name]}
    with graph.inserting_before(call.anchor):
        fused = graph.call_function(
            ATTENTION, (call.q, call.k, call.v, call.attn_mask, call.is_causal, call.scale), kwargs)
        out = graph.call_function(operator.getitem, (fused, 0))
    out.meta.update(call.anchor.meta)
    call.anchor.replace_all_uses_with(out)
    graph.erase_node(call.anchor)
