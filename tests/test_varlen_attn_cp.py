"""varlen_attn sites under options["mesh"]: context-parallel packed documents on 2 gloo processes,
against the whole batch on one, by `auto` and by the ring with and without options["recompute_kv"];
cu_seqlens that do not describe the whole batch raise."""
import itertools

import pytest
import torch

from attn_compile import shard_varlen
from attn_compile.cp import ring
from dist_harness import run_distributed
from oracle import rel_err
from test_cp_strategies import ring_transfers
from test_varlen_attn_pass import GQA

varlen = pytest.importorskip("torch.nn.attention.varlen")

LENGTHS = [1, 9, 30, 3, 21]  # documents shorter than 2·cp included


def _cu(lengths):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def attention(q, k, v, cu, longest, window):
    out, lse = varlen.varlen_attn(q, k, v, cu, cu, longest, longest, window_size=window, **GQA,
                                  return_aux=varlen.AuxRequest(lse=True))
    return out * 2, lse


def _check_ranks(rank, world):
    group = torch.distributed.group.WORLD
    cu, total, longest = _cu(LENGTHS), sum(LENGTHS), max(LENGTHS)
    generator = torch.Generator().manual_seed(0)
    full = [torch.randn(total, heads, 8, dtype=torch.float64, generator=generator) for heads in (4, 2, 2)]
    dout = torch.randn(total, 4, 8, dtype=torch.float64, generator=generator)
    options = {"mesh": group, "inner": "aot_eager"}
    cases = [(window, {}) for window in ((-1, 0), (5, 0), (-1, -1))]
    cases += [((-1, 0), {"strategy": "ring", "recompute_kv": recompute_kv}) for recompute_kv in (False, True)]
    # the ring's transfers: its backward sends the keys again only with recompute_kv
    with ring_transfers() as tags:
        for window, more in cases:
            torch._dynamo.reset()
            compiled = torch.compile(attention, backend="attn_cp", options={**options, **more}, fullgraph=True)
            leaves = [x.clone().requires_grad_() for x in full]
            single_out, single_lse = torch.compile(attention, backend="attn_cp", options={"inner": "aot_eager"})(
                *leaves, cu, longest, window)
            single_grads = torch.autograd.grad(single_out, leaves, dout)
            local = [shard_varlen(x, cu, group)[0].detach().requires_grad_() for x in full]
            out, lse = compiled(*local, cu, longest, window)
            assert rel_err(out, shard_varlen(single_out.detach(), cu, group)[0]) <= 1e-6
            assert lse.shape == (4, out.shape[0])
            want_lse = shard_varlen(single_lse.transpose(0, 1), cu, group)[0].transpose(0, 1)
            assert rel_err(lse, want_lse) <= 1e-6
            tags.clear()
            grads = torch.autograd.grad(out, local, shard_varlen(dout, cu, group)[0])
            for got, want in zip(grads, single_grads):
                assert rel_err(got, shard_varlen(want, cu, group)[0]) <= 1e-6
            if "recompute_kv" in more:
                assert tags == ([ring.KV_TAG] if more["recompute_kv"] else []) + [ring.GRAD_TAG], (more, tags)
    # cu_seqlens of this rank's tokens only: the op's check of its token count raises on every rank
    local = [shard_varlen(x, cu, group) for x in full]
    torch._dynamo.reset()
    compiled = torch.compile(attention, backend="attn_cp", options=options, fullgraph=True)
    with pytest.raises(ValueError, match="cu_seqlens gives this rank"):
        compiled(*(x for x, _ in local), local[0][1], longest, (-1, 0))
    # a q and a k of different cu_seqlens tensors: a compile-time error
    torch._dynamo.reset()
    apart = torch.compile(lambda q, k, v, a, b: varlen.varlen_attn(q, k, v, a, b, longest, longest, **GQA),
                          backend="attn_cp", options=options, fullgraph=True)
    with pytest.raises(Exception, match="one cu_seqlens tensor that describes the whole batch"):
        apart(*(x for x, _ in local), cu, cu.clone())


def test_context_parallel_varlen_sites():
    run_distributed(_check_ranks, 2)
