"""Capture dynamo graphs after the attn_cp passes and print them in a normalized form."""
import torch
from torch.fx import Node

from attn_compile.passes import rewrite_attention


def _target(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return getattr(target, "__name__", str(target))


def _arg(a) -> str:
    if isinstance(a, Node):
        return a.name
    if isinstance(a, (tuple, list)):
        return "(" + ", ".join(_arg(x) for x in a) + ")"
    return repr(a)


def normalized(gm) -> str:
    """One line per node; the inputs first, sorted by name (dynamo's order of them differs between
    torch versions)."""
    lines = sorted(f"{n.name} = input" for n in gm.graph.nodes if n.op == "placeholder")
    for n in gm.graph.nodes:
        args = [_arg(a) for a in n.args] + [f"{k}={_arg(v)}" for k, v in n.kwargs.items()]
        if n.op == "placeholder":
            continue
        if n.op == "output":
            lines.append(f"return {', '.join(args)}")
        else:
            lines.append(f"{n.name} = {_target(n.target)}({', '.join(args)})")
    return "\n".join(lines)


def rewritten_graphs(fn, *args):
    """Run fn compiled with only the attn_cp passes; return (graphs, sites, result)."""
    graphs, sites = [], []

    def backend(gm, example_inputs):
        sites.extend(rewrite_attention(gm))
        graphs.append(gm)
        return gm.forward

    result = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return graphs, sites, result
