"""Placements to plan, and the errors for placements that do not fit, on stand-in meshes."""
import re
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from attn_compile.planner import kv_head_slice, plan


class Mesh(SimpleNamespace):
    @property
    def ndim(self):
        return len(self.shape)


CP = Mesh(shape=(4,), mesh_dim_names=("cp",))
DP_CP = Mesh(shape=(2, 2), mesh_dim_names=("dp", "cp"))


def _t(shape, placements, mesh=CP, requires_grad=True):
    return SimpleNamespace(shape=torch.Size(shape), dtype=torch.bfloat16, placements=tuple(placements),
                           device_mesh=mesh, requires_grad=requires_grad)


def _qkv(q_pl, k_pl, v_pl=None, mesh=CP, h_q=8, h_kv=2, s=64):
    return (_t((2, h_q, s, 24), q_pl, mesh), _t((2, h_kv, s, 24), k_pl, mesh),
            _t((2, h_kv, s, 16), k_pl if v_pl is None else v_pl, mesh))


@pytest.mark.parametrize("placement", [Replicate(), Shard(0), Shard(1)])
def test_local_without_communication(placement):
    p = plan(*_qkv([placement], [placement], mesh=Mesh(shape=(2,), mesh_dim_names=("dp",))), is_causal=True)
    assert p.describe() == "local: no communication" and not p.cp_dims


def test_sequence_shards_mean_context_parallel():
    p = plan(*_qkv([Shard(2)], [Shard(2)]), is_causal=True, strategy="ring")
    assert p.cp_dims == (0,) and p.strategy == "ring"
    assert set(p.table) == {"ring", "allgather", "ulysses", "hybrid"}


def test_data_parallel_dim_passes_through():
    p = plan(*_qkv([Shard(0), Shard(2)], [Shard(0), Shard(2)], mesh=DP_CP), is_causal=True)
    assert p.cp_dims == (1,)


def test_two_sequence_dims_mean_hybrid():
    p = plan(*_qkv([Shard(2), Shard(2)], [Shard(2), Shard(2)], mesh=DP_CP), is_causal=True)
    assert p.cp_dims == (0, 1) and p.strategy == "hybrid"


def test_query_sequence_shard_against_replicated_kv():
    p = plan(*_qkv([Shard(2)], [Replicate()]), is_causal=True)
    assert p.q_seq_dim == 0 and not p.cp_dims


def test_gqa_tensor_parallel_takes_kv_head_slices():
    p = plan(*_qkv([Shard(1)], [Replicate()], h_q=8, h_kv=2), is_causal=False)
    assert p.kv_head_dim == 0
    assert [kv_head_slice(8, 2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [kv_head_slice(16, 4, 2, r) for r in range(2)] == [(0, 2), (2, 2)]


def test_mismatched_sequence_sharding_names_every_placement():
    message = ("k and v must have the same placements; got q=(Shard(dim=2),), k=(Shard(dim=2),), v=(Replicate(),) "
               "on mesh 'cp' (size 4). Redistribute v to (Shard(dim=2),) on mesh dim 0, or k to (Replicate(),).")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        plan(*_qkv([Shard(2)], [Shard(2)], [Replicate()]), is_causal=True)


def test_k_and_v_split_on_heads_against_replicated_v():
    with pytest.raises(ValueError, match=r"^k and v must have the same placements; got q=\(Shard\(dim=1\),\), "
                                         r"k=\(Shard\(dim=1\),\), v=\(Replicate\(\),\)"):
        plan(*_qkv([Shard(1)], [Shard(1)], [Replicate()]), is_causal=True)


def test_a_partial_placement_is_named_before_any_mismatch():
    with pytest.raises(ValueError, match=r"^q, k, v placements must be Replicate or Shard on the batch \(0\), head "
                                         r"\(1\) or sequence \(2\) dim; got q=\(Replicate\(\),\), "
                                         r"k=\(Partial\(sum\),\), v=\(Replicate\(\),\)"):
        plan(*_qkv([Replicate()], [Partial()], [Replicate()]), is_causal=True)


def test_kv_sharded_but_q_not():
    message = ("q, k, v must be sharded the same way on each mesh dim, except that q alone may split the sequence "
               "or the heads against replicated k and v; got q=(Replicate(),), k=(Shard(dim=2),), v=(Shard(dim=2),) "
               "on mesh 'cp' (size 4). Redistribute q to (Shard(dim=2),) on mesh dim 0, or k and v to (Replicate(),).")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        plan(*_qkv([Replicate()], [Shard(2)]), is_causal=True)


def test_uneven_batch_shards():
    with pytest.raises(ValueError, match=r"^the batch size 2 must be a multiple of 4, the number of batch shards on "
                                         r"mesh 'cp' \(size 4\)$"):
        plan(*_qkv([Shard(0)], [Shard(0)]), is_causal=True)


def test_uneven_head_shards_would_pair_the_wrong_kv_heads():
    # 12/3 heads on 2 ranks: 6 query heads but 2 or 1 KV heads a rank
    with pytest.raises(ValueError, match=r"^q's 12 heads and k's and v's 3 must each be a multiple of 2, the number "
                                         r"of head shards on mesh 'dp, cp' \(size 2x2\)"):
        plan(*_qkv([Shard(1), Shard(2)], [Shard(1), Shard(2)], mesh=DP_CP, h_q=12, h_kv=3), is_causal=True)


def test_the_cost_model_sees_the_heads_of_one_context_parallel_rank():
    # h_q = 4 split over 2 head shards leaves 2 query heads a rank: Ulysses over 4 ranks cannot divide them
    qkv = _qkv([Shard(1), Shard(2)], [Shard(1), Shard(2)], mesh=Mesh(shape=(2, 4), mesh_dim_names=("tp", "cp")),
               h_q=4, h_kv=2)
    p = plan(*qkv, is_causal=True)
    assert p.strategy in ("ring", "allgather") and p.table["ulysses"] == (
        "h_q=2 is not a multiple of the context-parallel size 4")
    with pytest.raises(ValueError, match=r"^strategy='ulysses' cannot run here: h_q=2 is not a multiple"):
        plan(*qkv, is_causal=True, strategy="ulysses")


def test_sequence_not_divisible():
    with pytest.raises(ValueError, match=r"^the sequence length 62 must be a multiple of 4, the number of sequence "
                                         r"shards on mesh 'cp' \(size 4\)$"):
        plan(*_qkv([Shard(2)], [Shard(2)], s=62), is_causal=True)


def test_forced_ulysses_with_indivisible_heads():
    with pytest.raises(ValueError, match=r"^strategy='ulysses' cannot run here: h_q=6 is not a multiple of the "
                                         r"context-parallel size 4$"):
        plan(*_qkv([Shard(2)], [Shard(2)], h_q=6, h_kv=2), is_causal=True, strategy="ulysses")


def test_auto_falls_back_when_ulysses_is_infeasible():
    p = plan(*_qkv([Shard(2)], [Shard(2)], h_q=6, h_kv=2), is_causal=True)
    assert p.strategy in ("ring", "allgather") and isinstance(p.table["ulysses"], str)


def test_gqa_tensor_parallel_with_heads_that_do_not_group():
    with pytest.raises(ValueError, match=r"^q's 12 heads split over 4 ranks must give each rank whole groups of "
                                         r"the 3 KV heads, or a part of one group; got 3 query heads per rank with "
                                         r"4 query heads per KV head$"):
        plan(*_qkv([Shard(1)], [Replicate()], h_q=12, h_kv=3), is_causal=True)
