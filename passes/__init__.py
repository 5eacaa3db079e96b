"""FX passes that find attention in dynamo graphs and rewrite it into ``attn_cp.attention``.

Each node, in graph order, is offered to the finders: an SDPA call (sdpa.py), hand-written
softmax attention (matmul_softmax.py), a ``flex_attention`` call whose mask_mod reads as the op's
masks (flex_attention.py), or a ``varlen_attn`` call (varlen_attn.py), which becomes
``attn_cp.varlen_attention`` directly, with no refinement. A site found is an AttentionCall (call.py), which each
refinement in turn may improve: drop a repeat_kv copy of k and v (repeat_kv.py), turn an index-built
mask into causal/window/key-padding arguments (mask_structure.py) or, outside those classes, into a
flex_attention mask_mod (flex_mask.py), drop ``.contiguous()`` copies of
q, k, v (layouts.py). The refinements are independent, so their order is only the order of the
site's notes. The final call is checked against the op's argument rules and emitted in place of
the site; the nodes it no longer needs (the mask, the copies, the softmax chain) are erased. A site
that fails a check stays exactly as it was, with the reason in its Site. The bodies of activation
checkpoints are rewritten the same way (checkpoint.py).
"""
import logging

from torch.fx import GraphModule

from . import checkpoint, flex_attention, matmul_softmax, sdpa, varlen_attn
from .call import AttentionCall, Left, emit, kernel_of, why_invalid
from .checkpoint import localize
from .flex_mask import emit_flex
from .layouts import drop_contiguous_copies
from .mask_structure import infer_mask_structure
from .nodes import erase_unused
from .repeat_kv import strip_repeat_kv
from .shapes import example_tensor, hinted_meta
from .site import Site, location_of

log = logging.getLogger("attn_compile")

FINDERS = (sdpa.find, matmul_softmax.find, varlen_attn.find, flex_attention.find)
REFINEMENTS = (strip_repeat_kv, infer_mask_structure, drop_contiguous_copies)


def _shapes(tensors: dict) -> dict:
    shapes = {}
    for name, node in tensors.items():
        t = example_tensor(node)
        if t is not None:
            shapes[name] = hinted_meta(t).shape
    return shapes


def _left(found: Left, made=()) -> Site:
    """The site as it stays; ``made``: nodes a finder or refinement added, erased if unused."""
    erase_unused(made)
    return Site(found.anchor.name, location_of(found.anchor), _shapes(found.tensors), rewritten=False,
                reason=found.reason)


def _rewrite(graph, found: AttentionCall, cuda_graphs: bool) -> Site:
    calls = [found]
    for refine in REFINEMENTS:
        calls.append(refine(calls[-1]))
    call = calls[-1]
    made = [node for c in calls for node in c.tensors().values()]
    reason = why_invalid(call) or _slower_than_as_is(call) or _unrecordable(call, cuda_graphs)
    if reason is not None:
        return _left(Left(found.anchor, reason, found.tensors()), made)
    flex = call.flex_mask is not None
    site = Site(found.anchor.name, location_of(found.anchor), _shapes(call.tensors()), rewritten=True,
                op="flex_attention" if flex else "attn_cp.attention", kernel=kernel_of(call), notes=list(call.notes))
    inputs = found.anchor.all_input_nodes
    (emit_flex if flex else emit)(graph, localize(graph, call))
    erase_unused(made + inputs)
    return site


def _slower_than_as_is(call: AttentionCall):
    """On CUDA no fused kernel of the op takes a tensor mask, so the op would run its reference
    kernel, while the site as it is runs fused (SDPA's masked kernels) or as Inductor's code."""
    q = example_tensor(call.q)
    if call.attn_mask is not None and q is not None and q.device.type == "cuda":
        return ("its mask stays a tensor, which on CUDA the op runs only on its reference kernel; as it is, "
                "the site runs on SDPA's or Inductor's fused code")
    return None


def _unrecordable(call: AttentionCall, cuda_graphs: bool):
    """Only the kernels that take document ids on the device (Triton) can be recorded with them."""
    if not cuda_graphs or call.document_ids is None or example_tensor(call.q).device.type != "cuda":
        return None
    if kernel_of(call).startswith("varlen:"):
        return ("its document ids would be read on the host (to cut the batch into runs), which a CUDA graph "
                "cannot record; as it is, the site records")
    return None


def _find(node):
    for find in FINDERS:
        found = find(node)
        if found is not None:
            return found
    return None


class PassFailure(RuntimeError):
    """An unexpected error inside the passes, with the node it happened at."""


def _rewrite_graph(graph, cuda_graphs: bool) -> list[Site]:
    sites = []
    for node in list(graph.nodes):
        try:
            found = _find(node)
            if found is None:
                continue
            if isinstance(found, Left):
                site = _left(found)
            elif isinstance(found, varlen_attn.VarlenCall):
                site = varlen_attn.rewrite(graph, found)
            else:
                site = _rewrite(graph, found, cuda_graphs)
        except Exception as error:
            raise PassFailure(f"at {location_of(node) or node.name} ({node.name}): {type(error).__name__}: "
                              f"{error}") from error
        log.info("%s %s", "rewrote" if site.rewritten else "left", site)
        sites.append(site)
    flex_attention.erase_leftovers(graph)
    return sites


def rewrite_attention(gm: GraphModule, *, cuda_graphs: bool = False) -> list[Site]:
    """Rewrite every attention site of ``gm`` in place, and of the bodies of its activation
    checkpoints (which become gm's own copies); one Site per site found, logged. ``cuda_graphs``:
    the graph will be recorded (mode="reduce-overhead"), so sites the op would run with a host
    read stay as they are. An unexpected error raises PassFailure naming the node, and may leave
    ``gm`` half rewritten: callers that want to go on run this on a copy."""
    checkpoint.own_bodies(gm)
    with checkpoint.linked(gm) as checkpoints:
        sites = [site for module in checkpoint.with_bodies(gm)
                 for site in _rewrite_graph(module.graph, cuda_graphs)]
        checkpoint.drop_unused_inputs(checkpoints)
    checkpoint.recompile(gm)
    return sites


__all__ = ["rewrite_attention", "PassFailure", "Site"]
