"""Compile with backend="attn_cp" and check the result and its gradients against eager."""
import torch

from graphs import normalized, rewritten_graphs
from oracle import rel_err


def assert_matches_eager(fn, *args, tolerance=1e-5):
    """fn compiled (attn_cp, aot_eager inner compiler) equals fn eagerly, forward and backward,
    on the given inputs; gradients for every input that requires them."""
    torch._dynamo.reset()  # tests compile many closures of one code object
    compiled = torch.compile(fn, backend="attn_cp", options={"inner": "aot_eager"}, fullgraph=True)
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    got, want = compiled(*args), fn(*args)
    assert rel_err(got, want) <= tolerance
    dout = torch.randn_like(want)
    for g, w in zip(torch.autograd.grad(got, leaves, dout), torch.autograd.grad(want, leaves, dout)):
        assert rel_err(g, w) <= tolerance


def rewrite(fn, *args):
    """(normalized graph after the passes, the sites) of fn traced on args."""
    torch._dynamo.reset()
    graphs, sites, _ = rewritten_graphs(fn, *args)
    return normalized(graphs[0]), sites
