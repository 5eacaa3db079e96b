"""Inductor's caches and process groups: a graph compiled for one group size is never reused for
another. Runs share one cache directory, as runs of a script on 2 and then 4 GPUs of one machine do.
The world group is named '0' at every size, so only what the caches key on tells the runs apart."""
import os
from functools import partial

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

from attn_compile.cp.api import context_parallel_attention
from attn_compile.cp.layout import shard_sequence, unshard_sequence
from dist_harness import run_distributed
from oracle import naive_attention, rel_err


def _compiled_on_world(rank, world, cache_dir, expect_hit):
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, h, 8 * world, 16, dtype=torch.float64) for h in (4, 2, 2))
    group = dist.group.WORLD
    attention = torch.compile(partial(context_parallel_attention, group=group, strategy="allgather", is_causal=True),
                              backend="attn_cp", fullgraph=True)
    local = [shard_sequence(x, group).requires_grad_() for x in (q, k, v)]
    out = attention(*local)
    out.sum().backward()
    got = [unshard_sequence(x.detach(), group) for x in (out, *(x.grad for x in local))]
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    want = naive_attention(*full, is_causal=True)
    want.sum().backward()
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, (want, *(x.grad for x in full))):
        assert rel_err(g, w) < 1e-10, (world, name, rel_err(g, w))
    hits = counters["aot_autograd"]["autograd_cache_hit"]
    assert (hits > 0) == expect_hit, (world, dict(counters["aot_autograd"]))


@pytest.mark.timeout(300)
def test_a_graph_compiled_for_one_group_size_is_not_reused_for_another(tmp_path):
    """World 2, then 4 (the same graph, a group of another size: compiled anew), then 2 again
    (the first run's code, from the cache)."""
    for world, expect_hit in ((2, False), (4, False), (2, True)):
        run_distributed(_compiled_on_world, world, str(tmp_path), expect_hit, timeout=120.0)


def test_the_groups_a_graph_names_are_read_from_every_attn_cp_op_and_subgraph():
    """Positional or keyword group names, the op or its overload packet, in the graph or in a
    subgraph (a checkpoint's body); other ops' strings are not group names."""
    from attn_compile.inductor_cache import group_names

    def graph(*calls):
        g = torch.fx.Graph()
        x = g.placeholder("x")
        for target, args, kwargs in calls:
            g.call_function(target, (x, *args), kwargs)
        g.output(x)
        return torch.fx.GraphModule(torch.nn.Module(), g)

    ops = torch.ops.attn_cp
    outer = graph((ops.context_parallel_attention, (None, None, "ring", ["0"], 1.0, True, "zigzag"), {}),
                  (ops.hybrid_attention.default, (None, None), {"outer_group_name": "3", "inner_group_name": "4",
                                                               "inner_group_size": 2}),
                  (torch.ops.aten.add.Tensor, (None,), {}))
    outer.add_submodule("wrap_body_0", graph((ops.check_no_padding.default, (["5", "6"], "zigzag"), {})))
    assert group_names(outer) == {"0", "3", "4", "5", "6"}
