"""On CUDA with NCCL: causal DTensor attention compiled with backend="attn_cp", forward and backward
against the float64 oracle, one process per visible GPU (world 1 on a single GPU: the same cases
on a mesh of one rank). Run on the device machine:
``cd tests && python -m pytest -q -m gpu test_gpu_placements.py``.

This is what the CPU tests (test_placements.py) cannot cover: dynamo traces SDPA on DTensors with
fake DTensors before any backend runs, and DTensor can trace causal SDPA only where SDPA takes a
fused kernel (flash, efficient or cuDNN: DTensor has sharding strategies for those ops). SDPA's
math fallback builds the causal mask as a plain tensor, which DTensor refuses ("got mixed
torch.Tensor and DTensor"), and the CPU has no fused kernel with a DTensor strategy. So every case
here picks a shape that a fused CUDA kernel takes, on torch 2.11 as on 2.13:
- enable_gqa=True only in bf16 with d_qk == d_v (flash and cuDNN take GQA; efficient attention,
  the only fused kernel for float32 or d_qk != d_v, takes no GQA in torch 2.11);
- otherwise the model repeats the KV heads itself (HF's repeat_kv), so SDPA sees equal head counts
  and picks efficient attention; attn_compile's repeat_kv pass gives the op the un-repeated k, v.
"""
import pytest
import torch
import torch._dynamo.testing
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import attn_compile  # noqa: F401  (registers the attn_cp ops)
from dist_harness import run_on_gpus
from oracle import naive_attention, rel_err

pytestmark = pytest.mark.gpu
TOL = {torch.bfloat16: 2.5e-2, torch.float32: 1e-4}
SEQ = 256  # a multiple of every world size up to 8
HEAD_DIMS = {"gqa": (64, 64), "gqa+mla": (64, 32)}  # (d_qk, d_v)
PLACEMENTS = [  # (q, k and v, strategy)
    (Shard(2), Shard(2), "auto"), (Shard(2), Shard(2), "ring"), (Shard(2), Shard(2), "allgather"),
    (Shard(2), Shard(2), "ulysses"),
    (Shard(2), Replicate(), "auto"),  # local queries against all keys: causal at their global offset
    (Shard(1), Shard(1), "auto"),
    (Shard(1), Replicate(), "auto"),  # GQA tensor parallel: each rank narrows k, v to its KV heads
]


def sdpa_gqa(q, k, v, is_causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)


def _repeat_kv(x, n):
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n, s, d).reshape(b, h * n, s, d)


def sdpa_repeat_kv(q, k, v, is_causal):
    n = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, _repeat_kv(k, n), _repeat_kv(v, n), is_causal=is_causal)


def model_for(dtype, d_qk, d_v):
    """The model form whose SDPA call a fused CUDA kernel takes (see the module docstring)."""
    return sdpa_gqa if dtype == torch.bfloat16 and d_qk == d_v else sdpa_repeat_kv


def heads_for(world: int) -> tuple[int, int]:
    """(h_q, h_kv): GQA 4:1, with as many KV heads as ranks (at least 2) so that every placement splits."""
    h_kv = max(2, world)
    return 4 * h_kv, h_kv


def global_inputs(seed, heads, head_dims, dtype, seq=SEQ):
    """q, k, v, dout on the CPU in ``dtype``, the same on every rank."""
    (h_q, h_kv), (d_qk, d_v) = heads, head_dims
    generator = torch.Generator().manual_seed(seed)
    shapes = ((h_q, d_qk), (h_kv, d_qk), (h_kv, d_v), (h_q, d_v))
    return [torch.randn(2, h, seq, d, generator=generator).to(dtype) for h, d in shapes]


def reference(q, k, v, dout, is_causal):
    """float64 out and gradients of q, k, v, from the inputs as rounded to their dtype."""
    q, k, v = (x.double().requires_grad_() for x in (q, k, v))
    out = naive_attention(q, k, v, is_causal=is_causal)
    return [out, *torch.autograd.grad(out, (q, k, v), dout.double())]


def check_case(mesh, q_pl, kv_pl, strategy, dtype, head_dims, seed, is_causal):
    q, k, v, dout = global_inputs(seed, heads_for(mesh.size()), head_dims, dtype)
    want = reference(q, k, v, dout, is_causal)
    placed = [(q, q_pl), (k, kv_pl), (v, kv_pl)]
    dq, dk, dv = (distribute_tensor(x.to(mesh.device_type), mesh, [pl]).requires_grad_() for x, pl in placed)
    torch._dynamo.reset()
    model = model_for(dtype, *head_dims)
    out = torch.compile(model, backend="attn_cp", fullgraph=True, options={"strategy": strategy})(dq, dk, dv,
                                                                                                 is_causal)
    assert tuple(out.placements) == (q_pl,) and out.shape == dout.shape, (q_pl, kv_pl, out.placements, out.shape)
    grads = torch.autograd.grad(out, (dq, dk, dv), distribute_tensor(dout.to(mesh.device_type), mesh, [q_pl]))
    got = [x.full_tensor().cpu() for x in (out, *grads)]
    errors = [rel_err(g, w) for g, w in zip(got, want)]
    assert max(errors) <= TOL[dtype], (q_pl, kv_pl, strategy, dtype, head_dims, model.__name__, errors)


def _causal_placements(rank, world, dtype, head_dims):
    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("cp",))
    for seed, (q_pl, kv_pl, strategy) in enumerate(PLACEMENTS):
        check_case(mesh, q_pl, kv_pl, strategy, dtype, head_dims, seed, is_causal=True)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("head_dims", list(HEAD_DIMS), ids=list(HEAD_DIMS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_causal_dtensor_placements(dtype, head_dims):
    run_on_gpus(_causal_placements, dtype, HEAD_DIMS[head_dims], timeout=540)


def _frames_per_length(rank, world, lengths):
    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("cp",))
    counter = torch._dynamo.testing.CompileCounterWithBackend("attn_cp")
    compiled = torch.compile(sdpa_gqa, backend=counter, fullgraph=True)
    torch._dynamo.reset()
    frames = []
    for seq in lengths:
        q, k, v, _ = global_inputs(0, heads_for(world), HEAD_DIMS["gqa"], torch.bfloat16, seq)
        out = compiled(*(distribute_tensor(x.cuda(), mesh, [Shard(2)]) for x in (q, k, v)), True)
        error = rel_err(out.full_tensor().cpu(), naive_attention(q, k, v, is_causal=True))
        assert error <= TOL[torch.bfloat16], (seq, error)
        frames.append(counter.frame_count)
    assert frames == [1, 2, 2], f"compiled frames after each of the lengths {lengths}: {frames}"


def test_sequence_length_change_compiles_once_more_as_dynamic_then_no_more():
    run_on_gpus(_frames_per_length, (SEQ, SEQ + 128, SEQ + 256))
