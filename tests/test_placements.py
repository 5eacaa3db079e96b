"""DTensor placements and options["mesh"] choose the distributed attention at compile time:
each placement combination compiled with backend="attn_cp", forward and backward against the
unsharded float64 oracle, on real gloo processes; the rewritten graph; compile-time errors.

Covered here, on the CPU: non-causal DTensor SDPA on 1-D meshes (world 2 and 4) and on a 2x2
("dp", "cp") mesh: data-parallel Shard(0) or Replicate passing through context parallelism, the
sequence sharded over both dims (hybrid), a q-only sequence split next to a data-parallel dim.
Causal attention and windows run on plain sequence shards through options["mesh"], on a 1-D and
a 2-D (hybrid) mesh. With d_qk == d_v, SDPA's CPU kernel takes DTensors through the sharding rules
of attn_compile/cpu_sdpa_sharding.py: causal DTensor SDPA, 1-D and 2-D meshes, heads split beside
the sequence included. tests/test_gpu_placements.py covers causal DTensor SDPA on CUDA with NCCL.

Not covered, because torch 2.13's DTensor fails on the CPU before any backend runs, where d_qk !=
d_v sends SDPA to its math path (the CPU kernel takes one head dim):
- causal DTensor SDPA: the math path adds its causal mask, a plain tensor ("aten.add.Tensor got
  mixed torch.Tensor and DTensor"), eagerly, and dynamo's fake trace fails alike;
- on a 2-D mesh, heads split (Shard(1)) on either dim: SDPA's math decomposition flattens
  (batch, heads), DTensor describes that as _StridedShard, and while costing redistributions it
  calls _StridedShard.local_shard_size_and_offset (torch/distributed/tensor/placement_types.py),
  whose sharded_indices[rank].tolist() makes unbacked SymInts under dynamo's FakeTensorMode:
  "PendingUnbackedSymbolNotFound: Pending unbacked symbols {u0, ...} not in returned outputs"
  (or, for Shard(1) on both dims, "Cannot unflatten tensor with _StridedShard placement"). Eager
  DTensor runs these; see pytorch/pytorch#184945 for the same .tolist() in view sharding.
On torch 2.11 (the GPU machine's) GQA SDPA with the heads split (Shard(1)) fails the same way, in
DTensor's sharding propagation of enable_gqa's flatten ("Attempted to flatten multiple dimensions,
with dimension 1 being sharded"), so those cases run from torch 2.13 on.
"""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from expecttest import TestCase
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.torch_version import TorchVersion

import attn_compile
import attn_compile.backend as backend
from attn_compile.cp.layout import shard_sequence, unshard_sequence
from attn_compile.planner import plan
from dist_harness import run_distributed
from graphs import normalized
from oracle import naive_attention, rel_err

TOL = 1e-5
SEQ = 16
GQA_HEADS_SPLIT = TorchVersion(torch.__version__) >= (2, 13)


def sdpa(q, k, v, is_causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)


def _inputs(seed, h_q=8, h_kv=2, d_qk=24, d_v=16):
    torch.manual_seed(seed)  # the same global inputs on every rank
    q, k, v = (torch.randn(2, h, SEQ, d) for h, d in ((h_q, d_qk), (h_kv, d_qk), (h_kv, d_v)))
    return q, k, v, torch.randn(2, h_q, SEQ, d_v)


def _check_case(mesh, q_pl, kv_pl, is_causal, seed, heads=(8, 2), strategy="auto", dims=(24, 16)):
    q, k, v, dout = _inputs(seed, *heads, *dims)
    dq, dk, dv = (distribute_tensor(x, mesh, pl).requires_grad_() for x, pl in ((q, q_pl), (k, kv_pl), (v, kv_pl)))
    torch._dynamo.reset()
    fn = torch.compile(sdpa, backend="attn_cp", fullgraph=True, options={"strategy": strategy})
    out = fn(dq, dk, dv, is_causal)
    assert tuple(out.placements) == tuple(q_pl) and out.shape == (*q.shape[:-1], v.shape[-1])
    grads = torch.autograd.grad(out, (dq, dk, dv), distribute_tensor(dout, mesh, q_pl))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    want = naive_attention(q, k, v, is_causal=is_causal)
    want_grads = torch.autograd.grad(want, (q, k, v), dout.double())
    errors = [rel_err(out.full_tensor(), want)] + [rel_err(g.full_tensor(), w) for g, w in zip(grads, want_grads)]
    assert max(errors) <= TOL, (q_pl, kv_pl, is_causal, strategy, errors)


def _placement_cases(rank, world):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    cases = [([Shard(2)], [Shard(2)], "auto"), ([Shard(2)], [Shard(2)], "ring"),
             ([Shard(2)], [Shard(2)], "allgather"), ([Shard(2)], [Shard(2)], "ulysses"),
             ([Shard(0)] if world == 2 else [Replicate()], [Shard(0)] if world == 2 else [Replicate()], "auto"),
             ([Shard(1)], [Shard(1)] if world == 2 else [Replicate()], "auto"),  # world 4: h_kv=2 < 4, GQA TP
             ([Shard(2)], [Replicate()], "auto")]
    for seed, (q_pl, kv_pl, strategy) in enumerate(cases):
        if q_pl == [Shard(1)] and not GQA_HEADS_SPLIT:
            continue
        _check_case(mesh, q_pl, kv_pl, False, seed, strategy=strategy)
    if world == 4 and GQA_HEADS_SPLIT:
        _check_case(mesh, [Shard(1)], [Replicate()], False, 9, heads=(4, 1))  # 1 query head a rank, one KV head


def test_placements_world_2():
    run_distributed(_placement_cases, 2)


def test_placements_world_4():
    run_distributed(_placement_cases, 4)


def _cpu_kernel_cases(rank, world):
    """With d_qk == d_v SDPA on the CPU takes aten._scaled_dot_product_flash_attention_for_cpu, for
    which DTensor has sharding rules only from attn_compile.cpu_sdpa_sharding: without them dynamo's
    trace of the sequence split did not finish, and causal attention failed. Compiled, causal or
    not, it becomes context parallelism; called eagerly, DTensor redistributes to batch, heads or
    replicated, as for SDPA's CUDA kernels."""
    if world == 4:  # a 2x2 mesh: data parallel, heads or the sequence beside context parallelism (hybrid)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
        for seed, outer in enumerate((Shard(0), Shard(1), Shard(2))):
            _check_case(mesh, [outer, Shard(2)], [outer, Shard(2)], True, seed, heads=(4, 4), dims=(16, 16))
        return
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    for seed, (is_causal, heads) in enumerate(((False, (4, 4)), (True, (4, 4)), (True, (8, 2)))):
        _check_case(mesh, [Shard(2)], [Shard(2)], is_causal, seed, heads=heads, dims=(16, 16))
    q, k, v, dout = _inputs(3, 8, 2, 16, 16)
    for placements, results in (((Shard(2),), ((Replicate(),), (Shard(0),), (Shard(1),))),
                                ((Shard(1),), ((Shard(1),),)), ((Shard(0),), ((Shard(0),),))):
        dq, dk, dv = (distribute_tensor(x, mesh, placements).requires_grad_() for x in (q, k, v))
        out = sdpa(dq, dk, dv, True)
        assert out.placements in results, (placements, out.placements)
        grads = torch.autograd.grad(out, (dq, dk, dv), distribute_tensor(dout, mesh, out.placements))
        want_q, want_k, want_v = (x.detach().requires_grad_() for x in (q, k, v))
        want = naive_attention(want_q, want_k, want_v, is_causal=True)
        want_grads = torch.autograd.grad(want, (want_q, want_k, want_v), dout.double())
        errors = [rel_err(g.full_tensor(), w) for g, w in zip((out, *grads), (want, *want_grads))]
        assert max(errors) <= TOL, (placements, errors)
    # A DTensor mask stays replicated (DTensor never redistributes a keyword argument): the batch
    # split stays where the mask broadcasts over the batch, and not where it has one of its own.
    dq, dk, dv = (distribute_tensor(x, mesh, [Shard(0)]) for x in (q, k, v))
    for shape, results in (((SEQ, SEQ), ((Shard(0),),)), ((2, 1, SEQ, SEQ), ((Replicate(),), (Shard(1),)))):
        mask = torch.rand(shape) > 0.3
        mask[..., 0] = True
        out = masked_sdpa(dq, dk, dv, distribute_tensor(mask, mesh, [Replicate()]))
        assert out.placements in results, (shape, out.placements)
        assert rel_err(out.full_tensor(), naive_attention(q, k, v, attn_mask=mask)) <= TOL
    with pytest.raises(RuntimeError, match=r"attn_mask must be replicated for SDPA on DTensors on the CPU; got "
                                           r"placements \(Shard\(dim=0\),\)"):  # DTensor's error wraps the rule's
        masked_sdpa(dq, dk, dv, distribute_tensor(mask, mesh, [Shard(0)]))


@pytest.mark.parametrize("world", [2, 4])
def test_dtensor_sdpa_on_the_cpu_kernel_traces_and_runs_eagerly(world):
    run_distributed(_cpu_kernel_cases, world, timeout=90.0)


def _two_dim_mesh_cases(rank, world):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    dp_cp, seq_both = [Shard(0), Shard(2)], [Shard(2), Shard(2)]
    cases = [(dp_cp, dp_cp, "auto"), (dp_cp, dp_cp, "ulysses"),  # data parallel passes through
             ([Replicate(), Shard(2)], [Replicate(), Shard(2)], "ring"),
             ([Shard(2), Shard(0)], [Shard(2), Shard(0)], "allgather"),
             (seq_both, seq_both, "auto"), (seq_both, seq_both, "hybrid"),
             (dp_cp, [Shard(0), Replicate()], "auto"), ([Replicate(), Shard(2)], [Replicate()] * 2, "auto")]
    for seed, (q_pl, kv_pl, strategy) in enumerate(cases):
        _check_case(mesh, q_pl, kv_pl, False, seed, strategy=strategy)
    q, k, v, _ = _inputs(0)
    replicated = [Replicate()] * 2
    with pytest.raises(ValueError, match=r"^q's sequence may be split against replicated k, v over one mesh dim only"):
        plan(*(distribute_tensor(x, mesh, pl) for x, pl in ((q, seq_both), (k, replicated), (v, replicated))),
             is_causal=True)
    heads_both, heads_then_replicated = [Shard(1)] * 2, [Shard(1), Replicate()]
    with pytest.raises(ValueError, match=r"^q's heads may be split against replicated k, v \(GQA tensor parallel\) "
                                         r"only where no other mesh dim splits the heads of q, k and v"):
        plan(*(distribute_tensor(x, mesh, pl)
               for x, pl in ((q, heads_both), (k, heads_then_replicated), (v, heads_then_replicated))), is_causal=True)


def test_two_dim_mesh_data_parallel_passes_through_and_two_sequence_dims_run_hybrid():
    run_distributed(_two_dim_mesh_cases, 4)


def windowed_sdpa(q, k, v, is_causal):
    """A causal sliding window of 4 keys, as models build it: the window is relative, so a mask
    built on the local shard's positions means the same window on the whole sequence."""
    i = torch.arange(q.shape[2])[:, None]
    j = torch.arange(k.shape[2])[None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(j <= i) & (j > i - 4), enable_gqa=True)


def checkpointed_windowed_sdpa(q, k, v, is_causal):
    """The same window, its mask built outside an activation checkpoint and read inside it."""
    i = torch.arange(q.shape[2])[:, None]
    j = torch.arange(k.shape[2])[None, :]
    return torch.utils.checkpoint.checkpoint(masked_sdpa, q, k, v, (j <= i) & (j > i - 4), use_reentrant=False)


def _plain_shards(rank, world):
    cases = [("auto", "zigzag", sdpa), ("ring", "contiguous", sdpa), ("allgather", "zigzag", sdpa),
             ("ulysses", "contiguous", sdpa), ("ring", "zigzag", windowed_sdpa),
             ("allgather", "contiguous", windowed_sdpa), ("ulysses", "zigzag", windowed_sdpa),
             ("ring", "contiguous", checkpointed_windowed_sdpa)]
    group = dist.group.WORLD
    if world == 4:
        group = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "ulysses"))
        cases = [("auto", "zigzag", sdpa), ("hybrid", "contiguous", windowed_sdpa)]
    for seed, (strategy, layout, attention) in enumerate(cases):
        window = None if attention is sdpa else (3, 0)
        q, k, v, dout = _inputs(seed)
        local = [shard_sequence(x, group, layout=layout).requires_grad_() for x in (q, k, v)]
        torch._dynamo.reset()
        fn = torch.compile(attention, backend="attn_cp", fullgraph=True,
                           options={"mesh": group, "layout": layout, "strategy": strategy})
        out = fn(*local, True)
        grads = torch.autograd.grad(out, local, shard_sequence(dout, group, layout=layout))
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        want = naive_attention(q, k, v, is_causal=True, window=window or (-1, -1))
        want_grads = torch.autograd.grad(want, (q, k, v), dout.double())
        got = [unshard_sequence(x.detach(), group, layout=layout) for x in (out, *grads)]
        errors = [rel_err(g, w) for g, w in zip(got, (want, *want_grads))]
        assert max(errors) <= TOL, (strategy, layout, errors)
    if world == 2:  # the distributed ops take no softcap: an error, not a local attention per rank
        torch._dynamo.reset()
        q, k, v = (shard_sequence(x, group) for x in _inputs(0, h_q=2)[:3])
        with pytest.raises(Exception, match="uses softcap=2; with sharded q, k, v only causal"):
            torch.compile(softcapped, backend="attn_cp", options={"mesh": group})(q, k, v)


def softcapped(q, k, v):
    return (torch.tanh(q @ k.transpose(-2, -1) * 0.25 / 2.0) * 2.0).softmax(-1) @ v


def test_plain_sequence_shards_with_a_mesh_option():
    run_distributed(_plain_shards, 2)


def test_plain_sequence_shards_on_a_2d_mesh_run_hybrid():
    run_distributed(_plain_shards, 4)


def masked_sdpa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def _dtensor_mask(rank, world):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    q, k, v, dout = _inputs(0)
    mask = torch.rand(SEQ, SEQ) > 0.3
    mask[:, 0] = True
    sharded = [distribute_tensor(x, mesh, [Shard(0)]).requires_grad_() for x in (q, k, v)]
    replicated_mask = distribute_tensor(mask, mesh, [Replicate()])
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match=r"attention .* with DTensor q, k, v uses attn_mask; .* this graph is "
                                         r"compiled unchanged"):
        out = torch.compile(masked_sdpa, backend="attn_cp", options={"inner": "aot_eager"})(*sharded, replicated_mask)
    grads = torch.autograd.grad(out, sharded, distribute_tensor(dout, mesh, [Shard(0)]))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    want = naive_attention(q, k, v, attn_mask=mask)
    want_grads = torch.autograd.grad(want, (q, k, v), dout.double())
    errors = [rel_err(g.full_tensor(), w) for g, w in zip((out, *grads), (want, *want_grads))]
    assert max(errors) <= TOL, errors
    torch._dynamo.reset()
    with pytest.raises(Exception, match="uses attn_mask; with sharded q, k, v only causal"):
        torch.compile(masked_sdpa, backend="attn_cp", options={"inner": "aot_eager", "strict": True})(
            *sharded, replicated_mask)


def test_a_dtensor_attention_with_a_mask_is_left_to_dtensor():
    """The distributed ops take no tensor mask: the graph is compiled unchanged, with a warning,
    and DTensor's own attention runs it; strict raises."""
    run_distributed(_dtensor_mask, 2)


def _graph_and_errors(rank, world, out_dir):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    q, k, v, _ = _inputs(0)
    graphs = []
    inner = backend._inner_compile

    def recording(gm, example_inputs, *args):
        graphs.append(normalized(gm))
        return inner(gm, example_inputs, *args)

    backend._inner_compile = recording
    sharded = [distribute_tensor(x, mesh, [Shard(2)]) for x in (q, k, v)]
    torch.compile(sdpa, backend="attn_cp", fullgraph=True, options={"strategy": "ring"})(*sharded, False)
    backend._inner_compile = inner
    messages = []
    for placements in ([Shard(2)], [Shard(2)], [Replicate()]), ([Replicate()], [Shard(2)], [Shard(2)]):
        torch._dynamo.reset()
        try:
            torch.compile(sdpa, backend="attn_cp", fullgraph=True)(
                *(distribute_tensor(x, mesh, pl) for x, pl in zip((q, k, v), placements)), False)
        except Exception as error:  # dynamo wraps the backend's ValueError
            messages.append(str(error).split("\n")[1] if "\n" in str(error) else str(error))
    report = str(attn_compile.explain(sdpa, *(distribute_tensor(x, mesh, [Shard(2)]) for x in (q, k, v)), False))
    if rank == 0:
        with open(os.path.join(out_dir, "explain.txt"), "w") as f:
            f.write(report)
        with open(os.path.join(out_dir, "graph.txt"), "w") as f:
            f.write(graphs[0])
        with open(os.path.join(out_dir, "errors.txt"), "w") as f:
            f.write("\n".join(messages))


class TestRewrittenGraph(TestCase):
    def test_to_local_op_from_local_with_the_strategy_as_argument(self):
        with tempfile.TemporaryDirectory() as out_dir:
            run_distributed(_graph_and_errors, 2, out_dir)
            graph = open(os.path.join(out_dir, "graph.txt")).read()
            errors = open(os.path.join(out_dir, "errors.txt")).read()
            report = open(os.path.join(out_dir, "explain.txt")).read()
        self.assertExpectedInline(graph, """\
l_k_ = input
l_q_ = input
l_v_ = input
to_local = to_local(l_q_)
to_local_1 = to_local(l_k_)
to_local_2 = to_local(l_v_)
context_parallel_attention_default = attn_cp.context_parallel_attention.default(to_local, to_local_1, to_local_2, 'ring', ('0'), 0.2041241452319315, False, 'contiguous')
getitem_1 = getitem(context_parallel_attention_default, 0)
from_local = from_local(getitem_1)
return (from_local)""")
        self.assertExpectedInline(errors, """\
ValueError: k and v must have the same placements; got q=(Shard(dim=2),), k=(Shard(dim=2),), v=(Replicate(),) on mesh 'cp' (size 2). Redistribute v to (Shard(dim=2),) on mesh dim 0, or k to (Replicate(),).
ValueError: q, k, v must be sharded the same way on each mesh dim, except that q alone may split the sequence or the heads against replicated k and v; got q=(Replicate(),), k=(Shard(dim=2),), v=(Shard(dim=2),) on mesh 'cp' (size 2). Redistribute q to (Shard(dim=2),) on mesh dim 0, or k and v to (Replicate(),).""")
        self.assertExpectedInline(report, """\
attn_compile: 1 attention site(s), 1 rewritten, 0 left as is
  [0] test_placements.py:54: q(2, 8, 16, 24) k(2, 2, 16, 24) v(2, 2, 16, 16) -> attn_cp.attention [reference]
distributed by placements (cost-model estimates, fwd + bwd):
  attention_default: q=(Shard(dim=2),), k=(Shard(dim=2),), v=(Shard(dim=2),) -> context parallel over mesh dim(s) [0]: allgather (the fastest forward: no gradient flows to q, k, v)
      ring: 247.5 us (compute 0.001126 us, transfer 0.03346 us, memory 0.01465 MiB)
      allgather: 0.1266 us (compute 0.001126 us, transfer 0.1255 us, memory 0.04883 MiB)
      ulysses: 0.1584 us (compute 0.001126 us, transfer 0.1573 us, memory 0.009766 MiB)
      hybrid: hybrid needs a 2-D mesh""")


class _OwnBackward(torch.autograd.Function):
    """Attention in a function with a backward of its own, which the passes must not replace."""

    @staticmethod
    def forward(ctx, q, k, v):
        return sdpa(q, k, v, True)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def _own_backward(q, k, v):
    return _OwnBackward.apply(q, k, v)


def _multihead(x, mha):
    return mha(x, x, x, need_weights=False)[0]


@pytest.mark.parametrize("fn, where", [(_own_backward, r"is inside the subgraph fwd_body_0"),
                                       (_multihead, r"runs inside multi_head_attention_forward")],
                         ids=["autograd_function", "multihead"])
def test_attention_the_passes_cannot_see_is_an_error_under_a_mesh(fn, where):
    """Left alone it would attend to this rank's keys only: a wrong result, silently."""
    from attn_compile.passes import rewrite_attention
    from attn_compile.passes.placements import distribute_attention

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    args = (torch.randn(1, 8, 8), torch.nn.MultiheadAttention(8, 2, batch_first=True)) if fn is _multihead else \
        [t.requires_grad_() for t in _inputs(0)[:3]]  # without gradients dynamo inlines the forward
    torch.compile(fn, backend=capture)(*args)
    (gm,) = graphs
    with pytest.raises(ValueError, match=f"^options\\['mesh'\\] makes q, k, v sequence shards, but attention at "
                                         f".*{where}, where the passes cannot rewrite it"):
        distribute_attention(gm, rewrite_attention(gm), mesh="a mesh")
