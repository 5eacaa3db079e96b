"""Compile with backend="attn_cp" and check the result and its gradients against eager."""
import pytest
import torch
import torch.nn.functional as F

from graphs import normalized, rewritten_graphs
from oracle import rel_err


def _sdpa_takes_a_mask_with_is_causal() -> bool:
    x = torch.randn(1, 1, 2, 2)
    try:
        F.scaled_dot_product_attention(x, x, x, attn_mask=torch.ones(2, 2, dtype=torch.bool), is_causal=True)
    except RuntimeError:  # torch 2.14: "Explicit attn_mask should not be set when is_causal=True"
        return False
    return True


# For programs that give SDPA a mask and is_causal=True: torch up to 2.13 ANDs them, 2.14 refuses
# them in eager and in tracing alike, so there is no such site to rewrite.
mask_with_is_causal = pytest.mark.skipif(not _sdpa_takes_a_mask_with_is_causal(),
                                         reason="this torch's SDPA refuses attn_mask with is_causal=True")


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
