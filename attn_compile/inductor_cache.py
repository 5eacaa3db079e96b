"""What Inductor's caches key on, beyond the graph it is handed.

Inductor (its FX graph cache, and AOTAutograd's cache in front of it) keys compiled code on the
graph, its config and torch's version. Two things the code depends on are not in the graph:
- this package's ops: code cached with one version of attn_compile may assert other strides than
  another version's fake functions give;
- the process groups the graph names: a context-parallel op names its group (the world group is
  '0' at every size), and its decomposition, traced inside Inductor's compile, bakes in the
  group's size (and ``strategy="auto"`` chooses by it).
The inner Inductor compile therefore runs with a post-grad pass whose ``uuid`` (which Inductor
puts in its cache keys) hashes both: the package's source, and the name and ranks of every
process group an ``attn_cp`` op of the graph names.
"""
import functools
import hashlib
import re
from pathlib import Path

import torch
import torch.distributed as dist
from torch._inductor import custom_graph_pass
from torch._inductor.custom_graph_pass import CustomGraphPass

from .passes.nodes import schema_arguments

# the arguments of the attn_cp ops that name process groups (str or str[])
GROUP_ARGUMENT = re.compile(r"(^|_)group_names?$")


@functools.cache
def source_hash() -> str:
    """sha256 of every .py file of attn_compile, attn_compile.passes and attn_compile.kernels."""
    from . import kernels, passes

    digest = hashlib.sha256()
    for package in (Path(__file__).parent, Path(passes.__file__).parent, Path(kernels.__file__).parent):
        for path in sorted(package.rglob("*.py")):
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _attn_cp_overload(target):
    if isinstance(target, torch._ops.OpOverloadPacket) and target._qualified_op_name.startswith("attn_cp::"):
        return target.default
    if isinstance(target, torch._ops.OpOverload) and target.namespace == "attn_cp":
        return target
    return None


def group_names(gm: torch.fx.GraphModule) -> set[str]:
    """The process groups named by the attn_cp ops of gm and of its subgraphs (checkpoint bodies)."""
    names = set()
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            op = _attn_cp_overload(node.target) if node.op == "call_function" else None
            if op is None:
                continue
            for name, value in schema_arguments(node, op._schema).items():
                if GROUP_ARGUMENT.search(name):
                    names.update([value] if isinstance(value, str) else value or ())
    return names


def groups_described(names) -> list[str]:
    """Each named group's name and ranks (so its size), in name order."""
    from .cp.comm import resolve

    return [f"{name}: ranks {dist.get_process_group_ranks(group)}"
            for name, group in zip(sorted(names), resolve(sorted(names)))]


def cache_key(gm: torch.fx.GraphModule) -> str:
    digest = hashlib.sha256(source_hash().encode())
    for line in groups_described(group_names(gm)):
        digest.update(f"\n{line}".encode())
    return digest.hexdigest()


class CacheStamp(CustomGraphPass):
    """Runs the user's own post-grad pass, if any, and adds ``key`` to its uuid."""

    def __init__(self, key: str, own=None):
        self.key, self.own = key, own

    def __call__(self, graph) -> None:
        if self.own is not None:
            self.own(graph)

    def uuid(self):
        if self.own is None:
            return self.key
        own = self.own.uuid() if isinstance(self.own, CustomGraphPass) else None
        return None if own is None else f"{self.key}:{own}"  # None: Inductor does not cache, as for the pass alone


# Inductor hands ``is_inference`` to passes of this kind (newer torch), which a user's pass may be.
_INFERENCE_AWARE = getattr(custom_graph_pass, "CustomInferenceAwareGraphPass", None)
if _INFERENCE_AWARE is not None:
    class InferenceAwareCacheStamp(CacheStamp, _INFERENCE_AWARE):
        def __call__(self, graph, is_inference: bool) -> None:
            self.own(graph, is_inference=is_inference)


def config_patches(gm: torch.fx.GraphModule) -> dict:
    """Inductor's config for compiling ``gm``: the stamp, in place of the user's post-grad pass,
    which it runs."""
    import torch._inductor.config as inductor_config

    own = inductor_config.post_grad_custom_post_pass
    inference_aware = _INFERENCE_AWARE is not None and isinstance(own, _INFERENCE_AWARE)
    stamp = (InferenceAwareCacheStamp if inference_aware else CacheStamp)(cache_key(gm), own)
    return {"post_grad_custom_post_pass": stamp}
