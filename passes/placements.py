"""Distribute the ``attn_cp.attention`` ops the other passes emitted, where q, k, v are sharded.

Two sources of sharding:
- DTensor q, k, v (their traced values): ``attn_compile.planner`` reads the placements, and the op
  becomes ``to_local`` -> local or context-parallel attention -> ``DTensor.from_local`` with q's
  placements (the output is ``(*q.shape[:-1], v.shape[-1])``, so q's placements describe it).
- ``mesh`` given: q, k, v are plain sequence shards on it, and every op becomes context-parallel
  attention. An attention site left as it was is then an error: run locally, it would see only
  this rank's keys. A packed-document op (``attn_cp.varlen_attention``) becomes the
  context-parallel op with its cu_seqlens, which must then describe the whole batch, with q, k, v
  this rank's tokens from ``shard_varlen``: one cu_seqlens tensor for q and k, no seqused_k, or a
  compile-time error. The op checks on every rank, at run time, that its token count is the one
  cu_seqlens gives it, so cu_seqlens of one rank's tokens raise instead of running as the batch.
Every plan depends only on global shapes, placements and options, so all ranks make the same one;
the context-parallel ops check at their first call that the ranks agree.
"""
import dataclasses
import functools
import operator

import torch
from torch.distributed.tensor import Partial
from torch.fx import GraphModule, Node
from torch.fx.operator_schemas import normalize_function

from .. import cost_model, ops
from ..cp import api as _api, sequence_checks as _checks  # noqa: F401  (register the attn_cp ops)
from ..cp.comm import process_groups
from ..planner import HEADS, SEQ, kv_head_slice, plan
from .shapes import example_tensor, hinted_meta, hinted_shape
from . import FINDERS
from .checkpoint import drop_unused_inputs, linked, passed_in, recompile, with_bodies
from .nodes import erase_unused, runs_of
from .site import Site, location_of

ATTENTION = ops.attention._opoverload
VARLEN = torch.ops.attn_cp.varlen_attention.default
CONTEXT_PARALLEL = torch.ops.attn_cp.context_parallel_attention.default
CHECK_ONE_SEQUENCE = torch.ops.attn_cp.check_one_sequence.default
CHECK_NO_PADDING = torch.ops.attn_cp.check_no_padding.default


@dataclasses.dataclass
class Distributed:
    """One op's plan, for explain: where it is, the placements read, the choice and the estimates."""

    node: str
    placements: str
    plan: str
    estimates: dict

    def __str__(self) -> str:
        lines = [f"{self.node}: {self.placements} -> {self.plan}"]
        lines += [f"      {estimate if isinstance(estimate, cost_model.Estimate) else f'{strategy}: {estimate}'}"
                  for strategy, estimate in self.estimates.items()]
        return "\n".join(lines)


def _is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor"


class MaskNotDistributed(ValueError):
    """An attention on sharded q, k, v with a mask the distributed ops do not take. Where q, k, v are
    DTensors, DTensor's own attention runs it in the graph as dynamo gave it."""


def _check_positional_masking(node: Node, a: dict, inputs: str) -> None:
    masking = [name for name in ("attn_mask", "key_padding_mask", "document_ids") if a[name] is not None]
    if a["q_offset"]:
        masking.append(f"q_offset={a['q_offset']}")
    if a["softcap"]:
        masking.append(f"softcap={a['softcap']:g}")
    if masking:
        raise MaskNotDistributed(f"attention {node.name} with {inputs} uses {', '.join(masking)}; with sharded q, "
                                 f"k, v only causal, sliding-window or full attention is supported")


def _window(a: dict) -> tuple[int, int]:
    return a["window_left"], a["window_right"]


def _window_kwargs(a: dict) -> dict:
    """The window as the ops' keyword arguments, left out when unbounded."""
    return {} if _window(a) == (-1, -1) else {"window_left": a["window_left"], "window_right": a["window_right"]}


def _output_of(node: Node) -> Node:
    (out,) = [user for user in node.users if user.target is operator.getitem and user.args[1] == 0]
    return out


def _to_local_summing_grads(placements):
    """to_local for a K or V that every rank reads only in part (k, v Replicate against a sharded q):
    each rank's gradient is a partial sum over the mesh dims where q is sharded and k, v are not."""
    convert = functools.partial(torch.distributed.tensor.DTensor.to_local, grad_placements=tuple(placements))
    convert.__name__ = "to_local_summing_grads"
    return convert


def _from_local(mesh, placements):
    convert = functools.partial(torch.distributed.tensor.DTensor.from_local, device_mesh=mesh,
                                placements=tuple(placements), run_check=False)
    convert.__name__ = "from_local"
    return convert


def _scale(a: dict, q) -> float:
    return a["scale"] if a["scale"] is not None else hinted_shape(q)[-1] ** -0.5


def _replace(graph, node: Node, make) -> None:
    """Insert ``make()`` before node; its result replaces the op's output; the op goes."""
    out = _output_of(node)
    with graph.inserting_before(node):
        result = make()
    result.meta.update(out.meta)
    out.replace_all_uses_with(result)
    graph.erase_node(out)
    graph.erase_node(node)


def _recompute_kwargs(recompute_kv: bool) -> dict:
    return {"recompute_kv": True} if recompute_kv else {}


def _context_parallel(graph, a, q, k, v, strategy, group_names, scale, layout, recompute_kv) -> Node:
    """The context-parallel op on q, k, v with the site's mask."""
    fused = graph.call_function(CONTEXT_PARALLEL, (q, k, v, strategy, list(group_names), scale, a["is_causal"], layout),
                                {**_window_kwargs(a), **_recompute_kwargs(recompute_kv)})
    return graph.call_function(operator.getitem, (fused, 0))


def _distribute_dtensor(graph, node, a, strategy, recompute_kv, hardware) -> Distributed:
    q, k, v = (example_tensor(a[name]) for name in ("q", "k", "v"))
    _check_positional_masking(node, a, "DTensor q, k, v")
    p = plan(q, k, v, is_causal=a["is_causal"], window=_window(a), strategy=strategy, hardware=hardware)
    mesh = q.device_mesh

    def make():
        local = {"q": graph.call_method("to_local", (a["q"],))}
        summed = (p.q_seq_dim, p.kv_head_dim)
        if summed != (None, None):
            grads = [Partial() if d in summed else pl for d, pl in enumerate(k.placements)]
            local.update({name: graph.call_function(_to_local_summing_grads(grads), (a[name],)) for name in "kv"})
        else:
            local.update({name: graph.call_method("to_local", (a[name],)) for name in "kv"})
        if p.kv_head_dim is not None:
            ranks = mesh.size(p.kv_head_dim)
            first, count = kv_head_slice(q.shape[HEADS], k.shape[HEADS], ranks, mesh.get_local_rank(p.kv_head_dim))
            for name in ("k", "v"):
                local[name] = graph.call_method("narrow", (local[name], HEADS, first, count))
        scale = _scale(a, q)
        if p.cp_dims:
            names = [mesh.get_group(d).group_name for d in p.cp_dims]
            out = _context_parallel(graph, a, local["q"], local["k"], local["v"], p.strategy, names, scale,
                                    "contiguous", recompute_kv)
        else:
            q_offset = 0
            if p.q_seq_dim is not None:
                q_offset = mesh.get_local_rank(p.q_seq_dim) * (hinted_shape(q)[SEQ] // mesh.size(p.q_seq_dim))
            fused = graph.call_function(ATTENTION, (local["q"], local["k"], local["v"], None, a["is_causal"], scale),
                                        {**_window_kwargs(a), **({"q_offset": q_offset} if q_offset else {})})
            out = graph.call_function(operator.getitem, (fused, 0))
        return graph.call_function(_from_local(mesh, q.placements), (out,))

    _replace(graph, node, make)
    placements = ", ".join(f"{name}={tuple(t.placements)}" for name, t in (("q", q), ("k", k), ("v", v)))
    return Distributed(node.name, placements, p.describe(), p.table)


def _assert_in_graph(after: Node, check, shards: Node, group_names: list, layout: str, checked: set) -> None:
    """``check(shards, ...)`` (cp/sequence_checks.py) once per ``shards``, right after ``after`` in
    its graph, its result asserted so that the graph keeps it."""
    if shards in checked:
        return
    checked.add(shards)
    graph = after.graph
    if after.op == "placeholder":
        after = list(graph.find_nodes(op="placeholder"))[-1]
    with graph.inserting_after(after):
        ok = graph.call_function(check, (shards, list(group_names), layout))
    with graph.inserting_after(ok):
        graph.call_function(torch.ops.aten._assert_async.msg, (ok, f"{check.__name__} failed on {shards.name}"))


def _checked_at_run_time(a: dict, names: list, layout: str, checked: set) -> tuple[dict, list]:
    """The call without the masks that a check in the graph shows to ask for nothing (document ids
    that are runs of position_ids, one sequence; key padding, none), and what each check is."""
    a, notes = dict(a), []
    documents = a["document_ids"]
    positions = None if documents is None else runs_of(passed_in(documents))
    if positions is not None:
        _assert_in_graph(passed_in(documents), CHECK_ONE_SEQUENCE, positions, names, layout, checked)
        a["document_ids"] = None
        notes.append(f"document ids are runs of {positions.name}, checked to be one sequence per row")
    if a["key_padding_mask"] is not None:
        padding = passed_in(a["key_padding_mask"])
        _assert_in_graph(padding, CHECK_NO_PADDING, padding, names, layout, checked)
        a["key_padding_mask"] = None
        notes.append(f"key padding {padding.name}, checked to pad nothing")
    return a, notes


def _distribute_shards(graph, node, a, groups, layout, strategy, recompute_kv, hardware, checked: set) -> Distributed:
    """``checked``: the tensors whose check is in the graph already."""
    names = [g.group_name for g in groups]
    dropped = [a["document_ids"], a["key_padding_mask"]]
    a, notes = _checked_at_run_time(a, names, layout, checked)
    _check_positional_masking(node, a, "sequence shards on options['mesh']")
    examples = [example_tensor(a[name]) for name in ("q", "k", "v")]
    q, k, v = map(hinted_meta, examples)
    problem = cost_model.Problem.of_shards(q, k, v, is_causal=a["is_causal"], window=_window(a), layout=layout,
                                           mesh_shape=[g.size() for g in groups],
                                           backward=any(x.requires_grad for x in examples))
    best, table = cost_model.choose(problem, hardware, strategy)
    if cost_model.chooses_forward_alone(problem, strategy):
        notes.append(cost_model.FORWARD_ALONE)
    _replace(graph, node, lambda: _context_parallel(graph, a, a["q"], a["k"], a["v"], best, names,
                                                    _scale(a, q), layout, recompute_kv))
    erase_unused(dropped)
    return Distributed(node.name, f"sequence shards ({layout}) on a mesh of {problem.mesh_shape}",
                       "; ".join([f"context parallel: {best}", *notes]), table)


def _distribute_varlen(graph, node, groups, layout, strategy, recompute_kv) -> Distributed:
    """The packed-document op on this rank's tokens as the context-parallel op over (1, H, T_local, D)."""
    a = normalize_function(VARLEN, node.args, node.kwargs, normalize_to_only_use_kwargs=True).kwargs
    problems = []
    if a["cu_seqlens_q"] is not a["cu_seqlens_k"]:
        problems.append("cu_seqlens_q and cu_seqlens_k are different tensors")
    if a["max_seqlen_q"] is not a["max_seqlen_k"] and a["max_seqlen_q"] != a["max_seqlen_k"]:
        problems.append(f"max_seqlen_q {a['max_seqlen_q']} is not max_seqlen_k {a['max_seqlen_k']}")
    if a.get("seqused_k") is not None:
        problems.append("seqused_k is given")
    if problems:
        raise ValueError(f"packed-document attention {location_of(node) or node.name} on sequence shards "
                         f"(options['mesh']): {'; '.join(problems)}; context parallelism takes one cu_seqlens "
                         f"tensor that describes the whole batch, with q, k, v this rank's tokens from shard_varlen")
    names = [g.group_name for g in groups]
    window = {} if (a["window_left"], a["window_right"]) == (-1, -1) else {
        "window_left": a["window_left"], "window_right": a["window_right"]}
    outputs = {user.args[1]: user for user in node.users}
    with graph.inserting_before(node):
        batched = [graph.call_method("transpose", (graph.call_method("unsqueeze", (a[name], 0)), 1, 2))
                   for name in ("q", "k", "v")]
        fused = graph.call_function(CONTEXT_PARALLEL, (*batched, strategy, names, a["scale"], a["is_causal"], layout),
                                    {**window, **_recompute_kwargs(recompute_kv), "cu_seqlens": a["cu_seqlens_q"],
                                     "max_seqlen": a["max_seqlen_q"]})
        for index, user in outputs.items():  # (1, H, T_local, ...) back to (T_local, H, ...)
            result = graph.call_function(operator.getitem, (fused, index))
            result = graph.call_method("transpose", (graph.call_function(operator.getitem, (result, 0)), 0, 1))
            result.meta.update(user.meta)
            user.replace_all_uses_with(result)
            graph.erase_node(user)
    graph.erase_node(node)
    return Distributed(node.name, f"packed documents, sequence shards ({layout}) on a mesh of "
                                  f"{[g.size() for g in groups]}", f"context parallel: {strategy}", {})


# ops that run a whole attention inside them, out of the passes' sight
OPAQUE_ATTENTION = (torch.nn.functional.multi_head_attention_forward, torch._transformer_encoder_layer_fwd,
                    torch._native_multi_head_attention)


def _is_opaque(node: Node) -> bool:
    return node.op == "call_function" and node.target in OPAQUE_ATTENTION


def _not_distributed(gm: GraphModule, sites: list[Site]):
    """Attention that would run locally, described, or None: a site left as it was or routed to
    flex_attention, an op that runs one inside it (``nn.MultiheadAttention``,
    ``TransformerEncoderLayer``'s fast path), or a site inside the subgraph of a higher-order op
    other than activation checkpointing, which the passes do not see."""
    left = [site for site in sites if site.op not in ("attn_cp.attention", "attn_cp.varlen_attention")]
    if left:
        return f"{left[0]} " + ("runs as flex_attention, which is not distributed" if left[0].rewritten
                                else "could not be rewritten")
    unseen = "where the passes cannot rewrite it"
    rewritten = with_bodies(gm)
    for module in rewritten:
        for node in module.graph.nodes:
            if _is_opaque(node):
                return f"{location_of(node) or node.name} runs inside {node.target.__name__}, {unseen}"
    for name, sub in gm.named_modules():
        if isinstance(sub, GraphModule) and not any(sub is module for module in rewritten):
            for node in sub.graph.nodes:
                if _is_opaque(node) or any(find(node) is not None for find in FINDERS):
                    return f"{location_of(node) or node.name} is inside the subgraph {name}, {unseen}"
    return None


def distribute_attention(gm: GraphModule, sites: list[Site], *, mesh=None, layout="zigzag", strategy="auto",
                         recompute_kv=False, hardware=cost_model.Hardware()) -> list[Distributed]:
    """Rewrite in place every attention op of ``gm`` (and of its checkpoints' bodies) whose inputs
    are sharded; ``sites`` are the attention passes' reports, checked for sites left as they were
    when ``mesh`` is given. ``recompute_kv`` goes to every context-parallel op."""
    if mesh is not None:
        local = _not_distributed(gm, sites)
        if local:
            raise ValueError(f"options['mesh'] makes q, k, v sequence shards, but attention at {local}, and run "
                             f"locally it would see only this rank's keys")
    groups = process_groups(mesh) if mesh is not None else None
    done, checked = [], set()
    with linked(gm) as checkpoints:
        for module in with_bodies(gm):
            for node in list(module.graph.find_nodes(op="call_function", target=ATTENTION)):
                a = normalize_function(ATTENTION, node.args, node.kwargs, normalize_to_only_use_kwargs=True).kwargs
                if _is_dtensor(example_tensor(a["q"])):
                    done.append(_distribute_dtensor(module.graph, node, a, strategy, recompute_kv, hardware))
                elif groups is not None:
                    done.append(_distribute_shards(module.graph, node, a, groups, layout, strategy, recompute_kv,
                                                   hardware, checked))
            if groups is not None:
                for node in list(module.graph.find_nodes(op="call_function", target=VARLEN)):
                    done.append(_distribute_varlen(module.graph, node, groups, layout, strategy, recompute_kv))
        drop_unused_inputs(checkpoints)
    recompile(gm)
    return done


__all__ = ["distribute_attention", "Distributed", "MaskNotDistributed"]
