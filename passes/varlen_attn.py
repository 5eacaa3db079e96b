"""Find ``torch.nn.attention.varlen.varlen_attn`` calls and rewrite them into ``attn_cp::varlen_attention``.

In a dynamo graph a call is the op ``torch_attn::_varlen_attn(query, key, value, cu_seq_q, cu_seq_k,
max_q, max_k, is_causal, scale, window_size, ...)`` with outputs (out (T_q, H, D), lse (H, T_q),
rng_state). Its arguments after ``window_size`` differ between torch versions, so they are bound
by the op's own schema: paged KV and KV caches (``block_table``, ``k_cache``, ``page_table``, ...)
leave the site as it is, ``enable_gqa`` and ``num_splits`` (the reduction order) change nothing
the op computes, and an argument not known here leaves the site as it is too.

varlen_attn's masks are FA2's: causal and windows align each document's last query with its last
key (bottom-right), where the op aligns the first ones (top-left). The two agree where every
document has as many queries as keys, which the graph shows when cu_seq_q and cu_seq_k are one
tensor and no ``seqused_k`` shortens the keys; a causal or windowed call that does not show it
stays as it is. Causal is the window's right edge at 0: ``is_causal`` or ``window_size=(W, 0)``
become the op's ``is_causal`` with a left window of W (-1 unbounded). The LSE, where read, is
transposed back to varlen_attn's (H, T_q).

MLA: varlen_attn's shape function gives its output q's head dim, so a V with another head dim
cannot be traced through it; code written for FA2 pads V with zeros to q's head dim and trims the
output, ``varlen_attn(q, k, F.pad(v, (0, n)))[..., :d_v]``. The op takes V unpadded, and its
output replaces the trimmed one.
"""
import dataclasses
import operator
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch.fx import Graph, Node

from .. import varlen
from ..kernels import select_varlen_kernel
from ..kernels.reference import lse_dtype
from .call import Left
from .nodes import erase_unused, schema_arguments
from .shapes import example_tensor, hinted_int, hinted_meta
from .site import Site, location_of

try:
    import torch.nn.attention.varlen  # noqa: F401  (registers torch_attn::_varlen_attn where this torch has it)
    VARLEN_ATTN = torch.ops.torch_attn._varlen_attn
except (ImportError, AttributeError):  # a torch without varlen_attn
    VARLEN_ATTN = None
VARLEN_OP = varlen._varlen_op._opoverload

# arguments that make the keys something other than rows of ``key`` (paged KV, KV caches)
_PAGED = ("block_table", "k_cache", "v_cache", "cache_seqlens", "cache_batch_idx", "page_table")
# arguments that change nothing the op computes: GQA is native, and the split only orders the sum
_IGNORED = ("enable_gqa", "num_splits")
_TAKEN = ("query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k", "is_causal", "scale", "window_size",
          "seqused_k")


@dataclasses.dataclass(frozen=True)
class VarlenCall:
    """A varlen_attn site as the op's arguments."""

    anchor: Node
    q: Node
    k: Node
    v: Node
    cu_seqlens_q: Node
    cu_seqlens_k: Node
    max_seqlen_q: object  # int, or a node of a SymInt
    max_seqlen_k: object
    is_causal: bool
    scale: float
    window: tuple[int, int]
    seqused_k: Optional[Node]
    trims: tuple[Node, ...] = ()  # ``out[..., :d_v]`` of a V zero-padded to d_qk: the op's output replaces them

    def tensors(self) -> dict:
        named = {"q": self.q, "k": self.k, "v": self.v, "cu_seqlens": self.cu_seqlens_q, "seqused_k": self.seqused_k}
        return {name: node for name, node in named.items() if node is not None}


def _outputs(node: Node) -> Optional[dict]:
    """index -> the getitem node reading it, or None where the result is used otherwise."""
    outputs = {}
    for user in node.users:
        if user.target is not operator.getitem or not isinstance(user.args[1], int):
            return None
        outputs.setdefault(user.args[1], []).append(user)
    return outputs


def _zero_padded(v: Node) -> Optional[Node]:
    """x where v is ``F.pad(x, (0, n))`` with zeros, the last dim padded at its end; else None."""
    if not isinstance(v, Node) or v.op != "call_function" or v.target not in (torch._C._nn.pad, F.pad):
        return None
    args = dict(zip(("input", "pad", "mode", "value"), v.args), **v.kwargs)
    pad = args.get("pad")
    if args.get("mode", "constant") != "constant" or args.get("value") not in (None, 0, 0.0) or \
            not isinstance(pad, (tuple, list)) or len(pad) != 2 or pad[0] != 0:
        return None
    return args["input"]


def _trims(outputs: dict, d_v: int) -> Optional[list]:
    """The ``out[..., :d_v]`` nodes that are all that reads the output, or None."""
    trims = []
    for out in outputs.get(0, []):
        for user in out.users:
            index = user.args[1] if user.target is operator.getitem and len(user.args) == 2 else None
            if not isinstance(index, tuple) or not index or index[-1] != slice(None, d_v, None) or any(
                    i not in (Ellipsis, slice(None)) for i in index[:-1]) or (Ellipsis not in index and len(index) != 3):
                return None
            trims.append(user)
    return trims


def _masking(a: dict) -> Union[tuple, str]:
    """(is_causal, window) in the op's terms, or why not."""
    window = a["window_size"] if a["window_size"] is not None else (-1, -1)
    if isinstance(a["is_causal"], Node) or isinstance(window, Node) or any(isinstance(w, Node) for w in window):
        return "is_causal or window_size is only known at run time"
    left, right = window
    causal = bool(a["is_causal"]) or right == 0  # FA2 sets the right edge to 0 when causal
    return causal, (left, -1 if causal else right)


def _why_not(a: dict, outputs) -> Optional[str]:
    for name in _PAGED:
        if a.get(name) is not None:
            return f"{name} is given (paged KV or a KV cache), whose keys are not rows of key, which the op takes"
    unknown = [name for name in a if name not in _TAKEN + _IGNORED + _PAGED and a[name] is not None]
    if unknown:
        return f"argument(s) {unknown} of torch_attn._varlen_attn are not ones the pass knows"
    if a["cu_seq_k"] is None:
        return "cu_seq_k is None"
    if isinstance(a["scale"], Node):
        return "scale is only known at run time"
    if outputs is None:
        return "its result is used other than by indexing it"
    if 2 in outputs:
        return "its rng_state output is read"
    tensors = [example_tensor(a[name]) for name in ("query", "key", "value", "cu_seq_q", "cu_seq_k")]
    if any(t is None for t in tensors):
        return "q, k, v or a cu_seq tensor has no traced tensor value"
    q, k, v = tensors[:3]
    if v.shape[-1] != q.shape[-1]:
        return (f"v's head dim {v.shape[-1]} differs from q's {q.shape[-1]}: varlen_attn's output is traced with "
                f"q's shape, which the op's (T_q, H, d_v) cannot replace")
    if isinstance(_masking(a), str):
        return _masking(a)
    causal, window = _masking(a)
    positional = causal or window != (-1, -1)
    if positional and a.get("seqused_k") is not None:
        return ("seqused_k with a causal or windowed mask: varlen_attn aligns the mask to each document's last used "
                "key (bottom-right), the op to its first")
    if positional and a["cu_seq_q"] is not a["cu_seq_k"]:
        return ("cu_seq_q and cu_seq_k are different tensors, and varlen_attn aligns a causal or windowed mask "
                "bottom-right where a document's query and key counts differ, the op top-left")
    return None


def find(node: Node) -> Union[VarlenCall, Left, None]:
    if VARLEN_ATTN is None or node.op != "call_function" or node.target not in (VARLEN_ATTN, VARLEN_ATTN.default):
        return None
    a = schema_arguments(node, VARLEN_ATTN.default._schema)
    outputs = _outputs(node)
    reason = _why_not(a, outputs)
    if reason is not None:
        return Left(node, reason, {"q": a["query"], "k": a["key"], "v": a["value"]})
    causal, window = _masking(a)
    q = hinted_meta(example_tensor(a["query"]))
    scale = a["scale"] if a["scale"] is not None else q.shape[-1] ** -0.5
    v, trims = a["value"], ()
    unpadded = _zero_padded(v)
    if unpadded is not None and example_tensor(unpadded) is not None and 1 not in outputs:
        found = _trims(outputs, example_tensor(unpadded).shape[-1])
        if found:  # MLA written for a kernel that needs d_v == d_qk: the op takes V as it is
            v, trims = unpadded, tuple(found)
    return VarlenCall(node, a["query"], a["key"], v, a["cu_seq_q"], a["cu_seq_k"], a["max_q"], a["max_k"],
                      causal, float(scale), window, a.get("seqused_k"), trims)


def _why_invalid(call: VarlenCall) -> Optional[str]:
    """The op's argument check on the traced metadata."""
    traced = {name: example_tensor(node) for name, node in call.tensors().items()}
    longest = [hinted_int(m) for m in (call.max_seqlen_q, call.max_seqlen_k)]
    try:
        varlen.check_varlen_args(traced["q"], traced["k"], traced["v"], example_tensor(call.cu_seqlens_q),
                                 example_tensor(call.cu_seqlens_k), *longest,
                                 call.window, seqused_k=traced.get("seqused_k"))
    except ValueError as error:
        return str(error)
    return None


def _emit(graph: Graph, call: VarlenCall) -> None:
    outputs = _outputs(call.anchor)
    with graph.inserting_before(call.anchor):
        fused = graph.call_function(
            VARLEN_OP, (call.q, call.k, call.v, call.cu_seqlens_q, call.cu_seqlens_k, call.max_seqlen_q,
                        call.max_seqlen_k, call.is_causal, call.scale, *call.window, False),
            {} if call.seqused_k is None else {"seqused_k": call.seqused_k})
        replacements = {0: graph.call_function(operator.getitem, (fused, 0))}
        if 1 in outputs:
            lse = graph.call_method("transpose", (graph.call_function(operator.getitem, (fused, 1)), 0, 1))
            if lse_dtype(example_tensor(call.q).dtype) != torch.float32:
                lse = graph.call_method("float", (lse,))
            replacements[1] = lse
    for trim in call.trims:
        replacements[0].meta.update(trim.meta)
        trim.replace_all_uses_with(replacements[0])
        graph.erase_node(trim)
    for index, users in outputs.items():
        for user in users:
            if not call.trims:
                replacements[index].meta.update(user.meta)
            user.replace_all_uses_with(replacements[index])
            graph.erase_node(user)
    graph.erase_node(call.anchor)


def rewrite(graph: Graph, call: VarlenCall) -> Site:
    shapes = {name: hinted_meta(example_tensor(node)).shape for name, node in call.tensors().items()}
    location = location_of(call.anchor)
    reason = _why_invalid(call)
    if reason is not None:
        return Site(call.anchor.name, location, shapes, rewritten=False, reason=reason)
    traced = {name: example_tensor(node) for name, node in call.tensors().items()}
    kernel = select_varlen_kernel(traced["q"], traced["k"], traced["v"], seqused_k=traced.get("seqused_k"),
                                  is_causal=call.is_causal, window=call.window)
    inputs = call.anchor.all_input_nodes
    _emit(graph, call)
    erase_unused(inputs)
    return Site(call.anchor.name, location, shapes, rewritten=True, op="attn_cp.varlen_attention", kernel=kernel)
