"""Bad context-parallel calls raise a ValueError that names the argument, on every rank, before
any collective: no rank hangs, and the group stays usable for the next call."""
import re
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from attn_compile.cp.api import choose_strategy, context_parallel_attention as cpa
from attn_compile import shard_varlen, varlen_attention
from attn_compile.cp.documents import document_sharding
from attn_compile.cp.layout import shard_sequence, unshard_sequence
from dist_harness import run_distributed


def _raises(message, fn, *args, **kwargs):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        fn(*args, **kwargs)


def _qkv(h_q=4, h_kv=2, s=8, s_k=None, d=16):
    s_k = s if s_k is None else s_k
    return torch.randn(1, h_q, s, d), torch.randn(1, h_kv, s_k, d), torch.randn(1, h_kv, s_k, d)


def _signature(rank, s, strategy):
    return (f"rank {rank}: q (1, 4, {s}, 16) torch.float32, k (1, 2, {s}, 16) torch.float32, v (1, 2, {s}, 16) "
            f"torch.float32, strategy={strategy!r}, scale=0.25, is_causal=True, layout='zigzag', window=(-1, -1), "
            "recompute_kv=False")


def _check_errors(rank, world):
    group = dist.group.WORLD
    mesh_2d = init_device_mesh("cpu", (1, 2))
    _raises("x.shape[2] (the sequence length) must be a multiple of 4 (2·cp with cp=2) for layout='zigzag'; got 30",
            shard_sequence, torch.randn(1, 2, 30, 4), group)
    _raises("x.shape[1] (the sequence length) must be a multiple of 2 (cp with cp=2) for layout='contiguous'; got 31",
            shard_sequence, torch.randn(1, 31, 4), group, seq_dim=1, layout="contiguous")
    _raises("x_local requires grad, but unshard_sequence is not differentiable; pass x_local.detach() or call it "
            "under torch.no_grad()", unshard_sequence, torch.randn(1, 2, 4, 4, requires_grad=True), group)
    _raises("x_local.shape[2] (the local sequence length) must be even for layout='zigzag'; got 5",
            unshard_sequence, torch.randn(1, 2, 5, 4), group)
    _raises("group must be a ProcessGroup or a DeviceMesh; got str", cpa, *_qkv(), group="world")
    _raises("group must be a ProcessGroup or a 1-D or 2-D DeviceMesh; got a 3-D DeviceMesh",
            cpa, *_qkv(), group=init_device_mesh("cpu", (1, 1, 2)))
    _raises("strategy must be one of ('ring', 'allgather', 'ulysses', 'hybrid', 'auto'); got 'p2p'",
            cpa, *_qkv(), group=group, strategy="p2p")
    _raises("strategy='hybrid' needs group to be a 2-D DeviceMesh (outer ring dim, inner Ulysses dim); got a 1-D "
            "group", cpa, *_qkv(), group=group, strategy="hybrid")
    _raises("strategy='ring' needs group to be a ProcessGroup or a 1-D DeviceMesh; got a 2-D DeviceMesh (use "
            "strategy='hybrid')", cpa, *_qkv(), group=mesh_2d, strategy="ring")
    mesh_1d = init_device_mesh("cpu", (world,))
    _raises("q must be this rank's shard as a plain tensor; got a DTensor. Pass q.to_local(), or call attention on "
            "the DTensors in a model compiled with backend='attn_cp', which reads their placements",
            cpa, *(distribute_tensor(x, mesh_1d, [Shard(2)]) for x in _qkv()), group=mesh_1d)

    name = group.group_name
    _raises(f"group_size must be the size of group {name!r}, 2; got 4",
            torch.ops.attn_cp.allgather_attention, *_qkv(), name, 4, 0.25, False, "zigzag", False)

    compiled_cpa = torch.compile(cpa, backend="attn_cp")
    for strategy in ("ring", "allgather", "ulysses", "hybrid"):
        group = mesh_2d if strategy == "hybrid" else dist.group.WORLD
        for attention in (cpa, compiled_cpa):
            s = 8 if rank == 0 else 6  # every rank raises, the one with the right shape too
            _raises("q, k, v and the options must be the same on every rank of the group; got "
                    f"{_signature(0, 8, strategy)}; {_signature(1, 6, strategy)}",
                    attention, *_qkv(s=s), group=group, strategy=strategy, is_causal=True)
        _raises("layout must be one of ('zigzag', 'contiguous'); got 'striped'",
                cpa, *_qkv(), group=group, strategy=strategy, layout="striped")
        _raises("q.shape[2] (the local sequence length) must be even for layout='zigzag': the global sequence must be "
                "a multiple of 2·cp = 4; got 5 per rank", cpa, *_qkv(s=5), group=group, strategy=strategy)
        _raises("q and k must have the same local sequence length (context parallelism is self-attention over one "
                "sharded sequence); got q.shape[2]=8, k.shape[2]=4",
                cpa, *_qkv(s_k=4), group=group, strategy=strategy)
        _raises("q heads must be a multiple of k/v heads (GQA); got h_q=4, h_kv=3",
                cpa, *_qkv(h_kv=3), group=group, strategy=strategy)
        out = cpa(*_qkv(), group=group, strategy=strategy)  # the group still works after the errors
        assert out.shape == (1, 4, 8, 16) and out.isfinite().all()
    for strategy, group in (("ulysses", dist.group.WORLD), ("hybrid", mesh_2d)):
        _raises(f"strategy={strategy!r} divides the query heads among 2 ranks: q.shape[1] must be a multiple of 2; "
                "got 3", cpa, *_qkv(h_q=3, h_kv=1), group=group, strategy=strategy)


def test_bad_calls_raise_on_every_rank():
    run_distributed(_check_errors, 2)


def _disagree(rank, message):
    """Every rank raises the same error, which leads with rank 1's problem and then lists the ranks' calls."""
    return pytest.raises(ValueError, match=f"^rank 1: {re.escape(message)} \\(every rank of the group raises this; "
                                           f"their calls: rank 0: .*\\)$")


def _check_calls_bad_on_one_rank(rank, world):
    group = dist.group.WORLD
    flat = "q must be 4-D (batch, heads, seq, dim); got shape (8, 16)"
    for strategy in ("ring", "allgather", "ulysses", "auto"):
        _raises(flat, cpa, torch.randn(8, 16), *_qkv()[1:], group=group, strategy=strategy)
        with _disagree(rank, flat):
            cpa(torch.randn(8, 16) if rank else _qkv()[0], *_qkv()[1:], group=group, strategy=strategy)
    with _disagree(rank, "window must be None or (left, right), each an int >= 0 or -1 for unbounded; got (4,)"):
        cpa(*_qkv(), group=group, window=(4,) if rank else (4, 0))
    with _disagree(rank, "strategy must be one of ('ring', 'allgather', 'ulysses', 'hybrid', 'auto'); got 'p2p'"):
        cpa(*_qkv(), group=group, strategy="p2p" if rank else "ring")
    cu = torch.tensor([0, 5, 16], dtype=torch.int32)
    q, _ = shard_varlen(torch.randn(16, 4, 8), cu, group)
    k, _ = shard_varlen(torch.randn(16, 2, 8), cu, group)
    with _disagree(rank, f"q must be 3-D (total_tokens, heads, dim); got shape (1, {q.shape[0]}, 4, 8)"):
        varlen_attention(q[None] if rank else q, k, k, cu, cu, 11, 11, group=group, is_causal=True)
    with pytest.raises(ValueError, match="^q, k, v and the options must be the same on every rank of the group; "
                                         "got rank 0: .*recompute_kv=False; rank 1: .*recompute_kv=True$"):
        cpa(*_qkv(), group=group, strategy="allgather", recompute_kv=rank == 1)  # it decides the backward's collectives
    out = cpa(*_qkv(), group=group, strategy="allgather")  # the group still works after the errors
    assert out.shape == (1, 4, 8, 16) and out.isfinite().all()


def test_a_call_bad_on_one_rank_raises_on_every_rank():
    run_distributed(_check_calls_bad_on_one_rank, 2)


def _check_packed_calls_bad_on_every_rank(rank, world):
    group = dist.group.WORLD
    cu = torch.tensor([0, 5, 16], dtype=torch.int32)
    for layout in ("zigzag", "contiguous"):
        q, k, v = (shard_varlen(torch.randn(16, h, 8), cu, group, layout)[0] for h in (4, 2, 2))
        # shards that differ in length from rank to rank (contiguous: 9 and 7 tokens) agree on this call
        _raises("strategy='hybrid' needs group to be a 2-D DeviceMesh (outer ring dim, inner Ulysses dim); got a 1-D "
                "group", varlen_attention, q, k, v, cu, cu, 11, 11, group=group, strategy="hybrid", layout=layout)
        # every rank's token count disagrees with cu_seqlens: the error leads with that, for each rank
        # (zigzag: 8 tokens on either rank, the same error; contiguous: 9 and 7, each rank's own)
        counts = [document_sharding((0, 5, 16), world, layout).local_len(r) for r in range(world)]
        causes = [f"q, k, v hold {n + 1} tokens, but cu_seqlens gives this rank {n} (shard the batch with "
                  f"shard_varlen)" for n in counts]
        expected = (re.escape(causes[0]) if len(set(causes)) == 1 else
                    re.escape("; ".join(f"rank {r}: {cause}" for r, cause in enumerate(causes)))
                    + " \\(every rank of the group raises this\\)")
        with pytest.raises(ValueError, match=f"^{expected}$"):
            varlen_attention(*(torch.cat([x, x[:1]]) for x in (q, k, v)), cu, cu, 11, 11, group=group,
                             strategy="ring", layout=layout)


def test_packed_calls_bad_on_every_rank_lead_with_the_cause():
    run_distributed(_check_packed_calls_bad_on_every_rank, 2)


def _groups(*sizes):
    return tuple(SimpleNamespace(size=lambda size=size: size) for size in sizes)


@pytest.mark.parametrize("heads, cp, seq, expected", [
    ((32, 8, 128, 128), 2, 32768, "ring"),  # GQA on 2 ranks at 64K: two ring steps, their transfers hidden
    ((16, 16, 192, 128), 2, 32768, "ring"),  # MLA likewise, its larger K and V's transfers hidden too
    ((16, 16, 192, 128), 4, 16384, "ulysses"),  # MLA on 4 ranks at 64K: one all-to-all beats three ring steps
    ((12, 2, 128, 128), 8, 4096, "allgather"),  # Ulysses cannot split 12 heads 8 ways; the KV is small to gather
    ((32, 32, 128, 128), 8, 2048, "ulysses"),  # heads divide, short shards: one all-to-all is cheapest
    ((12, 12, 128, 128), 8, 32768, "ring"),  # Ulysses cannot split 12 heads 8 ways; the ring hides large KV
])
def test_auto_follows_the_cost_model(heads, cp, seq, expected):
    """For training inputs (a backward follows; test_cost_model covers the forward alone)."""
    h_q, h_kv, d_qk, d_v = heads
    q, k, v = (torch.empty(1, h, seq, d, dtype=torch.bfloat16, requires_grad=True)
               for h, d in ((h_q, d_qk), (h_kv, d_qk), (h_kv, d_v)))
    assert choose_strategy(q, k, v, _groups(cp), is_causal=True) == expected
    assert choose_strategy(q, k, v, _groups(2, 2), is_causal=True) == "hybrid"


def test_auto_chooses_alike_for_packed_shards_of_any_length():
    """Packed shards differ in length from rank to rank, and may be empty: the choice is made from
    the documents (cu_seqlens, max_seqlen), which every rank sees alike."""
    cu_seqlens = torch.tensor([0, 2264, 2265, 2266], dtype=torch.int32)
    choices = set()
    for tokens in (1134, 1132, 0):  # two ranks' shards of these documents (they once chose apart), an empty one
        q, k, v = (torch.empty(1, h, tokens, d, dtype=torch.bfloat16) for h, d in ((4, 16), (2, 16), (2, 8)))
        choices.add(choose_strategy(q, k, v, _groups(2), is_causal=True, window=(2, 0), cu_seqlens=cu_seqlens,
                                    max_seqlen=2264))
    assert len(choices) == 1


def test_auto_takes_ulysses_for_packed_documents_where_the_heads_divide():
    """For training inputs; where no backward follows on two ranks, the all-gather, whose calls on
    the CPU's reference take each query chunk's prefix as one segment (test_cost_model)."""
    cu_seqlens = torch.tensor([0, 4000, 4001, 9000], dtype=torch.int32)
    for h_q, expected in ((8, "ulysses"), (3, "allgather")):
        q, k, v = (torch.empty(1, h, 4500, 64, dtype=torch.bfloat16, requires_grad=True) for h in (h_q, 1, 1))
        assert choose_strategy(q, k, v, _groups(2), is_causal=True, cu_seqlens=cu_seqlens, max_seqlen=5000) == expected
        assert choose_strategy(*(x.detach() for x in (q, k, v)), _groups(2), is_causal=True, cu_seqlens=cu_seqlens,
                               max_seqlen=5000) == "allgather"
