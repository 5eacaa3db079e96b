"""Sliding windows and packed documents (THD) under every context-parallel strategy, on real gloo
processes, against the float64 oracle: output and dq/dk/dv, fp32 within 1e-5 relative.

Windows: (8, 0), (8, 8) and (-1, -1), with causal and full masks, GQA + MLA heads, zigzag and
contiguous layouts, eager and compiled. Packed documents: random lengths including 1, lengths
below 2·cp and one long document, through ``shard_varlen`` and ``varlen_attention``."""
import itertools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from attn_compile import context_parallel_attention, shard_varlen, unshard_varlen, varlen_attention
from attn_compile.cp.documents import document_sharding
from attn_compile.cp.layout import shard_sequence, unshard_sequence
from attn_compile.cp.ring import halo_grads_exact
from dist_harness import run_distributed
from oracle import naive_attention, rel_err

TOL = 1e-5
SEQ = 48  # global: 8 zigzag chunks of 6 at world 4, so a window of 8 reaches into the neighbour chunk only
WINDOWS = ((8, 0), (8, 8), (-1, -1))
HEADS = (8, 2, 24, 16)  # (h_q, h_kv, d_qk, d_v): GQA and MLA at once
# "ring_recompute": recompute_kv=True, with which a ring of two ranks receives its halo again in backward
STRATEGIES = {2: ("ring", "ring_recompute", "allgather", "ulysses"), 4: ("ring", "allgather", "ulysses", "hybrid")}


def _inputs(seed, batch, seq):
    torch.manual_seed(seed)  # the same global inputs on every rank
    h_q, h_kv, d_qk, d_v = HEADS
    q, k, v = (torch.randn(batch, h, seq, d) for h, d in ((h_q, d_qk), (h_kv, d_qk), (h_kv, d_v)))
    return q, k, v, torch.randn(batch, h_q, seq, d_v)


def _oracle(q, k, v, dout, **masking):
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    out = naive_attention(q64, k64, v64, **masking)
    return [out, *torch.autograd.grad(out, (q64, k64, v64), dout.double())]


def _check(got, want, case):
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert not g.isnan().any(), (name, case)
        assert g.shape == w.shape, (name, g.shape, w.shape, case)
        assert rel_err(g, w) <= TOL, (name, rel_err(g, w), case)


def _check_windows(rank, world):
    mesh = init_device_mesh("cpu", (2, 2)) if world == 4 else None
    cases = itertools.product(STRATEGIES[world], WINDOWS[:2], (False, True))
    for seed, (strategy, window, is_causal) in enumerate(cases):
        group = mesh if strategy == "hybrid" else dist.group.WORLD
        layout = ("zigzag", "contiguous")[seed % 2]
        q, k, v, dout = _inputs(seed, 2, SEQ)
        attention = lambda q, k, v: context_parallel_attention(  # noqa: E731
            q, k, v, group=group, strategy=strategy.removesuffix("_recompute"), is_causal=is_causal, layout=layout,
            window=window, recompute_kv=strategy.endswith("_recompute"))
        if seed % 3 == 0:
            torch._dynamo.reset()
            attention = torch.compile(attention, backend="attn_cp", fullgraph=True)
        local = [shard_sequence(x, group, layout=layout).requires_grad_() for x in (q, k, v)]
        out = attention(*local)
        grads = torch.autograd.grad(out, local, shard_sequence(dout, group, layout=layout))
        got = [unshard_sequence(x.detach(), group, layout=layout) for x in (out, *grads)]
        _check(got, _oracle(q, k, v, dout, is_causal=is_causal, window=window),
               dict(strategy=strategy, window=window, is_causal=is_causal, layout=layout))


@pytest.mark.parametrize("world", [2, 4])
def test_windows_under_every_strategy(world):
    run_distributed(_check_windows, world)


def _documents(world, seed):
    """Random document lengths summing to 64: a long one, ones of length 1, ones below 2·cp; for
    every sixth seed a batch of 4 tokens instead, which leaves some ranks (and at world 4 one inner
    group of the 2×2 mesh) no token at all."""
    if seed % 6 == 5:
        return torch.tensor([0, 1, 1, 2, 4], dtype=torch.int32), 2
    generator = torch.Generator().manual_seed(seed)
    lengths = [1, 2 * world - 1, 1]
    while sum(lengths) < 64 - 20:
        lengths.append(int(torch.randint(1, 9, (), generator=generator)))
    lengths.insert(int(torch.randint(0, len(lengths), (), generator=generator)), 64 - sum(lengths))
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32), max(lengths)


def _document_oracle(q, k, v, dout, cu_seqlens, **masking):
    """Per-document float64 attention of packed (T, H, D) tensors, and its gradients."""
    parts = []
    for start, end in itertools.pairwise(cu_seqlens.tolist()):
        dense = [x[start:end].transpose(0, 1).unsqueeze(0) for x in (q, k, v, dout)]
        parts.append([x[0].transpose(0, 1) for x in _oracle(*dense, **masking)])
    return [torch.cat(column) for column in zip(*parts)]


def _check_documents(rank, world, strategies):
    mesh = init_device_mesh("cpu", (2, 2)) if world == 4 else None
    cases = itertools.product(strategies, WINDOWS, (False, True))
    for seed, (strategy, window, is_causal) in enumerate(cases):
        group = mesh if strategy == "hybrid" else dist.group.WORLD
        layout = ("zigzag", "contiguous")[seed % 2]
        cu_seqlens, longest = _documents(world, seed)
        q, k, v, dout = (x[0].transpose(0, 1) for x in _inputs(seed, 1, int(cu_seqlens[-1])))
        attention = lambda q, k, v: varlen_attention(  # noqa: E731
            q, k, v, cu_seqlens, cu_seqlens, longest, longest, is_causal=is_causal, window=window, group=group,
            strategy=strategy.removesuffix("_recompute"), layout=layout, recompute_kv=strategy.endswith("_recompute"))
        if seed % 4 == 0:
            torch._dynamo.reset()
            attention = torch.compile(attention, backend="attn_cp", fullgraph=True)
        local = [shard_varlen(x, cu_seqlens, group, layout)[0].detach().requires_grad_() for x in (q, k, v)]
        out = attention(*local)
        assert out.shape == (local[0].shape[0], HEADS[0], HEADS[3])
        grads = torch.autograd.grad(out, local, shard_varlen(dout, cu_seqlens, group, layout)[0])
        got = [unshard_varlen(x.detach(), cu_seqlens, group, layout) for x in (out, *grads)]
        _check(got, _document_oracle(q, k, v, dout, cu_seqlens, is_causal=is_causal, window=window),
               dict(strategy=strategy, window=window, is_causal=is_causal, layout=layout, cu_seqlens=cu_seqlens))


@pytest.mark.parametrize("world", [2, 4])
def test_packed_documents_under_every_strategy(world):
    run_distributed(_check_documents, world, (*STRATEGIES[world], "auto"))


def _check_auto_forward_alone(rank, world):
    """Under no_grad, on zigzag shards of two ranks, ``auto`` takes the all-gather for packed
    documents where the kernels take each query chunk's prefix as one segment (the reference does),
    eager and compiled, and its output is exact."""
    from attn_compile import cost_model
    chosen, choose = [], cost_model.choose
    cost_model.choose = lambda problem, *args: chosen.append(choose(problem, *args)[0]) or choose(problem, *args)
    try:
        for seed, window in enumerate(((8, 0), (-1, -1))):
            cu_seqlens, longest = _documents(world, seed)
            q, k, v, dout = (x[0].transpose(0, 1) for x in _inputs(seed, 1, int(cu_seqlens[-1])))
            attention = lambda q, k, v: varlen_attention(  # noqa: E731
                q, k, v, cu_seqlens, cu_seqlens, longest, longest, is_causal=True, window=window,
                group=dist.group.WORLD)
            for run in (attention, torch.compile(attention, backend="attn_cp", fullgraph=True)):
                torch._dynamo.reset()
                with torch.no_grad():
                    out = run(*(shard_varlen(x, cu_seqlens, dist.group.WORLD)[0] for x in (q, k, v)))
                got = unshard_varlen(out, cu_seqlens, dist.group.WORLD)
                want = _document_oracle(q, k, v, dout, cu_seqlens, is_causal=True, window=window)[0]
                assert rel_err(got, want) <= TOL, (window, rel_err(got, want))
    finally:
        cost_model.choose = choose
    assert chosen and set(chosen) == {"allgather"}, chosen


def test_auto_takes_the_allgather_for_packed_documents_forward_alone_on_two_ranks():
    run_distributed(_check_auto_forward_alone, 2)


# (seed, layout, window, is_causal): the first two send the halo's dK and dV home in bf16 one way
# and in float32 the other (a halo's rows of two calls sum in float32)
HALF_CASES = ((2, "contiguous", (8, 8), False), (3, "zigzag", (8, 0), True), (3, "zigzag", (-1, -1), True))


def _check_half_precision_ring(rank, world):
    for seed, layout, window, is_causal in HALF_CASES:
        cu_seqlens, longest = _documents(world, seed)
        q, k, v, dout = (x[0].transpose(0, 1) for x in _inputs(seed, 1, int(cu_seqlens[-1])))
        local = [shard_varlen(x.bfloat16(), cu_seqlens, dist.group.WORLD, layout)[0].requires_grad_()
                 for x in (q, k, v)]
        out = varlen_attention(*local, cu_seqlens, cu_seqlens, longest, longest, is_causal=is_causal, window=window,
                               group=dist.group.WORLD, strategy="ring", layout=layout)
        grads = torch.autograd.grad(out, local, shard_varlen(dout.bfloat16(), cu_seqlens, dist.group.WORLD, layout)[0])
        got = [unshard_varlen(x.detach(), cu_seqlens, dist.group.WORLD, layout).double() for x in (out, *grads)]
        want = _document_oracle(*(x.bfloat16().double() for x in (q, k, v, dout)), cu_seqlens, is_causal=is_causal,
                                window=window)
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
            assert rel_err(g, w) <= 1e-2, (name, rel_err(g, w), seed, layout, window, is_causal)


def test_half_precision_ring_sends_halo_grads_in_a_dtype_both_ranks_agree_on():
    """bf16 packed documents on a ring of two ranks, against float64: where one rank's halo sends
    its dK and dV in bf16 and the other's in float32, each receives what the other sends."""
    for seed, layout, window, is_causal in HALF_CASES[:2]:
        sharding = document_sharding(tuple(_documents(2, seed)[0].tolist()), 2, layout)
        exact = [halo_grads_exact(sharding, is_causal, window, rank, 1 - rank) for rank in (0, 1)]
        assert exact[0] != exact[1]
    run_distributed(_check_half_precision_ring, 2)
