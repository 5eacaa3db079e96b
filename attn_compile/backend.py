"""The ``attn_cp`` torch.compile backend: rewrite attention, distribute it where q, k, v are
sharded, then hand the graph to an inner compiler.

Registered through the ``torch_dynamo_backends`` entry point (pyproject.toml), so
``torch.compile(model, backend="attn_cp")`` works without importing this package first.
"""
import copy
import warnings

import torch

from . import cost_model, inductor_cache
from .cp.layout import LAYOUTS
from .passes import PassFailure, rewrite_attention
from .passes.placements import MaskNotDistributed, distribute_attention

INNER_COMPILERS = ("inductor", "aot_eager", "eager")
DEFAULT_OPTIONS = {
    "inner": "inductor",
    "mesh": None,  # a ProcessGroup or DeviceMesh: q, k, v of every attention are sequence shards on it
    "seq_dim": 2,  # where the sequence is in SDPA's (B, H, S, D) operands
    "layout": "zigzag",  # of those shards (see attn_compile.shard_sequence)
    "strategy": "auto",  # context-parallel strategy, for DTensor or mesh shards alike
    "recompute_kv": False,  # the ring and all-gather receive K and V again in backward instead of keeping them
    "hardware": cost_model.Hardware(),  # what the cost model assumes
    "strict": False,  # re-raise an unexpected error in the passes instead of compiling the graph unchanged
}


def parse_options(options) -> dict:
    options = dict(options or {})
    unknown = sorted(set(options) - set(DEFAULT_OPTIONS))
    if unknown:
        raise ValueError(f"unknown attn_cp option(s) {unknown}; valid options: {sorted(DEFAULT_OPTIONS)}")
    merged = {**DEFAULT_OPTIONS, **options}
    rules = {
        "inner": (merged["inner"] in INNER_COMPILERS, f"one of {INNER_COMPILERS}"),
        "seq_dim": (merged["seq_dim"] == 2, "2, the sequence dim of SDPA's (batch, heads, seq, dim) operands"),
        "layout": (merged["layout"] in LAYOUTS, f"one of {LAYOUTS}"),
        "strategy": (merged["strategy"] in (*cost_model.STRATEGIES, "auto"),
                     f"one of {(*cost_model.STRATEGIES, 'auto')}"),
        "recompute_kv": (isinstance(merged["recompute_kv"], bool), "True or False"),
        "hardware": (isinstance(merged["hardware"], cost_model.Hardware), "an attn_compile.cost_model.Hardware"),
        "strict": (isinstance(merged["strict"], bool), "True or False"),
    }
    for name, (ok, expected) in rules.items():
        if not ok:
            raise ValueError(f"options[{name!r}] must be {expected}; got {merged[name]!r}")
    return merged


def _check_mode(inner: str, mode) -> None:
    """Before any graph is compiled, so a bad mode is reported as itself, not as a failure of the
    rewritten graph."""
    if mode is None:
        return
    if inner != "inductor":
        raise ValueError(f"mode={mode!r} applies to the inductor inner compiler only; got inner={inner!r}")
    torch._inductor.list_mode_options(mode)  # raises for a mode Inductor does not know, naming the valid ones


def _inner_compile(gm, example_inputs, inner: str, mode):
    if inner == "eager":
        return gm.forward
    if inner == "aot_eager":
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)
    from torch._inductor.compile_fx import compile_fx

    patches = torch._inductor.list_mode_options(mode) if mode is not None else {}
    return compile_fx(gm, example_inputs, config_patches={**patches, **inductor_cache.config_patches(gm)})


def _may_compile_unchanged(opts) -> bool:
    """Whether a failed rewrite may fall back to the graph as dynamo gave it: not when strict, nor
    with a mesh, where the unchanged graph would attend to one rank's keys only."""
    return not opts["strict"] and opts["mesh"] is None


def _compile_unchanged(gm, example_inputs, opts, mode, failed: str):
    warnings.warn(f"attn_compile: {failed}; this graph is compiled unchanged (options={{'strict': True}} re-raises)",
                  stacklevel=3)
    return _inner_compile(gm, example_inputs, opts["inner"], mode)


def _warn_ineffective(given, opts, mode, cuda_graphs: bool, sites, distributed, example_inputs) -> None:
    """Name the options that do nothing for this graph, so a user does not believe them in force."""
    if sites and not distributed:
        for name in ("strategy", "recompute_kv", "hardware"):
            if name in given:
                warnings.warn(f"attn_compile: options[{name!r}] has no effect: it steers distributed attention, and "
                              f"no attention of this graph is distributed (no options['mesh'], no DTensor q, k, v)",
                              stacklevel=3)
    if "layout" in given and opts["mesh"] is None:
        warnings.warn("attn_compile: options['layout'] has no effect without options['mesh']: it is the layout of "
                      "the mesh's sequence shards (DTensor shards are contiguous)", stacklevel=3)
    if cuda_graphs and not any(isinstance(x, torch.Tensor) and x.is_cuda for x in example_inputs):
        warnings.warn(f"attn_compile: mode={mode!r} records CUDA graphs, which has no effect here: no input of this "
                      f"graph is on a CUDA device", stacklevel=3)


def attn_cp(gm, example_inputs, *, mode=None, options=None):
    """torch.compile backend; ``options`` keys and defaults are in ``DEFAULT_OPTIONS``."""
    opts = parse_options(options)
    _check_mode(opts["inner"], mode)
    candidate = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    candidate.meta = gm.meta  # dynamo's bookkeeping, which Inductor reads
    try:
        cuda_graphs = mode is not None and torch._inductor.list_mode_options(mode).get("triton.cudagraphs", False)
        sites = rewrite_attention(candidate, cuda_graphs=cuda_graphs)
        distributed = distribute_attention(candidate, sites, mesh=opts["mesh"], layout=opts["layout"],
                                           strategy=opts["strategy"], recompute_kv=opts["recompute_kv"],
                                           hardware=opts["hardware"])
    except (PassFailure, MaskNotDistributed) as failure:
        if not _may_compile_unchanged(opts):
            raise
        reason = f"the attention passes failed {failure}" if isinstance(failure, PassFailure) else str(failure)
        return _compile_unchanged(gm, example_inputs, opts, mode, reason)
    _warn_ineffective(set(options or {}), opts, mode, cuda_graphs, sites, distributed, example_inputs)
    try:
        return _inner_compile(candidate, example_inputs, opts["inner"], mode)
    except Exception as error:  # e.g. Inductor's flex_attention lowering finding no kernel for a shape
        if not _may_compile_unchanged(opts) or not any(site.rewritten for site in sites):
            raise
        first_line = (str(error).strip().splitlines() or [""])[0]
        return _compile_unchanged(gm, example_inputs, opts, mode, f"{opts['inner']} failed on the rewritten graph "
                                                                  f"({type(error).__name__}: {first_line})")
