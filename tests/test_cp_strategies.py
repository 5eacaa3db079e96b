"""Every context-parallel strategy against the float64 oracle and the local kernel, on real gloo
processes: MHA, GQA, MLA and GQA+MLA; causal and full; zigzag and contiguous; eager and compiled.

Each rank builds the same global inputs, runs on its shard, and gathers output and gradients."""
import contextlib
import itertools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from attn_compile.cp import ring
from attn_compile.cp.api import context_parallel_attention
from attn_compile.cp.layout import shard_sequence, unshard_sequence
from attn_compile.kernels import attention_backward, attention_forward
from dist_harness import run_distributed
from oracle import naive_attention, rel_err

TOL = 1e-5
SEQ = 32  # global; 8 zigzag chunks of 4 at world 4
HEADS = {  # (h_q, h_kv, d_qk, d_v)
    "mha": (4, 4, 16, 16),
    "gqa": (8, 2, 16, 16),  # at world 4 Ulysses repeats each KV head twice (h_kv < cp)
    "mla": (4, 4, 24, 16),
    "gqa_mla": (16, 2, 24, 16),
}
# h_kv = 3 is no multiple of 4 (Ulysses) or 2 (hybrid's inner dim): each KV head travels as 4 or 2 copies
UNEVEN_KV = {"gqa_12_3": (12, 3, 16, 16)}
# "<strategy>_recompute": with recompute_kv=True (all-gather gathers K and V again in backward, a ring
# of two ranks receives its halo again)
STRATEGIES = {2: ("ring", "ring_recompute", "allgather", "allgather_recompute", "ulysses", "auto"),
              4: ("ring", "allgather", "allgather_recompute", "ulysses", "hybrid", "auto")}
BACKEND = "attn_cp"


def _attention(strategy, group, is_causal, layout):
    recompute = strategy.endswith("_recompute")
    strategy = strategy.removesuffix("_recompute")
    return lambda q, k, v: context_parallel_attention(q, k, v, group=group, strategy=strategy, is_causal=is_causal,
                                                      layout=layout, recompute_kv=recompute)


def _local_kernel(q, k, v, dout, is_causal):
    scale = q.shape[-1] ** -0.5
    out, lse = attention_forward(q, k, v, scale=scale, is_causal=is_causal)
    return (out, *attention_backward(dout, q, k, v, out, lse, scale=scale, is_causal=is_causal))


def _layout_of_seed(x, seed):
    """Every other case gets (B, S, H, D) memory, as a model's ``.transpose(1, 2)`` hands it over."""
    return x.transpose(1, 2).contiguous().transpose(1, 2) if seed % 2 else x


def _check_all(rank, world, compiled):
    world_group = dist.group.WORLD
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "ulysses")) if world == 4 else None
    masks_and_layouts = list(itertools.product((False, True), ("zigzag", "contiguous")))
    pairs = list(itertools.product(STRATEGIES[world], HEADS))
    if world == 4:
        pairs += itertools.product(("ulysses", "hybrid"), UNEVEN_KV)
    if compiled:
        # Each case compiles anew: every strategy and head shape, the masks and layouts in rotation.
        # Inductor, slow to compile on the CPU, takes one head shape of each strategy (a different
        # one each time); aot_eager the others.
        cases = [(s, h, *masks_and_layouts[(i + i // len(HEADS)) % 4],
                  "inductor" if i % len(HEADS) == i // len(HEADS) % len(HEADS) else "aot_eager")
                 for i, (s, h) in enumerate(pairs)]
    else:
        cases = [(s, h, *m, None) for s, h in pairs for m in masks_and_layouts]
    worst = 0.0
    for seed, (strategy, heads, is_causal, layout, inner) in enumerate(cases):
        group = mesh if strategy == "hybrid" else world_group
        torch.manual_seed(seed)  # the same global inputs on every rank
        h_q, h_kv, d_qk, d_v = {**HEADS, **UNEVEN_KV}[heads]
        q, k, v = (torch.randn(2, h, SEQ, d) for h, d in ((h_q, d_qk), (h_kv, d_qk), (h_kv, d_v)))
        dout = torch.randn(2, h_q, SEQ, d_v)

        attention = _attention(strategy, group, is_causal, layout)
        if compiled:
            torch._dynamo.reset()
            attention = torch.compile(attention, backend=BACKEND, options={"inner": inner}, fullgraph=True)
        q_local, k_local, v_local = (_layout_of_seed(shard_sequence(x, group, layout=layout), seed).requires_grad_()
                                     for x in (q, k, v))
        out_local = attention(q_local, k_local, v_local)
        assert out_local.shape == (*q_local.shape[:-1], d_v), (strategy, heads, out_local.shape)
        grads_local = torch.autograd.grad(out_local, (q_local, k_local, v_local),
                                          shard_sequence(dout, group, layout=layout))
        got = [unshard_sequence(x.detach(), group, layout=layout) for x in (out_local, *grads_local)]

        q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
        want = naive_attention(q64, k64, v64, is_causal=is_causal)
        oracle = [want, *torch.autograd.grad(want, (q64, k64, v64), dout.double())]
        local = _local_kernel(q, k, v, dout, is_causal)
        case = dict(strategy=strategy, heads=heads, is_causal=is_causal, layout=layout, compiled=inner)
        for name, g, o, l in zip(("out", "dq", "dk", "dv"), got, oracle, local):
            errors = rel_err(g, o), rel_err(g, l)
            assert max(errors) <= TOL, (name, errors, case)
            worst = max(worst, *errors)
    if rank == 0:
        print(f"world {world}, compiled={compiled}: max relative error {worst:.2e}")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("world", [2, 4])
def test_strategies_match_oracle(world, compiled):
    run_distributed(_check_all, world, compiled)


def _count_exchanges(rank, world):
    from attn_compile.cp import ulysses
    calls = []
    exchange = ulysses.all_to_all_posted
    ulysses.all_to_all_posted = lambda sends, group: exchange((calls.append(x.shape) or x for x in sends), group)
    try:
        mesh = init_device_mesh("cpu", (2, 2))
        for strategy, group in (("ulysses", dist.group.WORLD), ("hybrid", mesh)):
            torch.manual_seed(0)
            q, k, v = (torch.randn(1, h, 8, 16, requires_grad=True) for h in (8, 2, 2))
            out = context_parallel_attention(q, k, v, group=group, strategy=strategy, is_causal=True)
            forward = len(calls)
            out.backward(torch.randn_like(out))
            # forward: q, k, v there, out and lse back; backward: dout there, dq, dk, dv back
            assert (forward, len(calls) - forward) == (5, 4), (strategy, forward, len(calls) - forward)
            calls.clear()
    finally:
        ulysses.all_to_all_posted = exchange


def test_ulysses_backward_exchanges_only_gradients():
    """The backward reuses the forward's head shards of q, k, v, out and lse."""
    run_distributed(_count_exchanges, 4)


def _ring_attention(recompute_kv, compiled):
    """The ring on sequence shards: called eagerly, or SDPA compiled with the world group as options['mesh']."""
    if not compiled:
        return lambda q, k, v: context_parallel_attention(q, k, v, group=dist.group.WORLD, strategy="ring",
                                                          is_causal=True, recompute_kv=recompute_kv)
    torch._dynamo.reset()
    options = {"mesh": dist.group.WORLD, "strategy": "ring", "recompute_kv": recompute_kv, "inner": "aot_eager"}
    return torch.compile(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                                          enable_gqa=True),
                         backend=BACKEND, options=options, fullgraph=True)


@contextlib.contextmanager
def ring_transfers():
    """The tags of the ring's transfers (``ring.KV_TAG``, ``ring.GRAD_TAG``), in order, while the block runs."""
    tags, pass_round = [], ring.pass_round
    ring.pass_round = lambda tensors, group, tag, *args, **kwargs: (
        tags.append(tag) or pass_round(tensors, group, tag, *args, **kwargs))
    try:
        yield tags
    finally:
        ring.pass_round = pass_round


def _count_ring_transfers(rank, world):
    with ring_transfers() as tags:
        for recompute_kv, compiled in itertools.product((False, True), (False, True)):
            torch.manual_seed(0)
            q, k, v = (torch.randn(1, h, 8, d, requires_grad=True) for h, d in ((4, 24), (2, 24), (2, 16)))
            out = _ring_attention(recompute_kv, compiled)(q, k, v)
            forward = tags.copy()
            out.backward(torch.randn_like(out))
            backward = tags[len(forward):]
            # the forward sends K and V once; the backward sends them again only with recompute_kv
            want = [ring.KV_TAG, ring.GRAD_TAG] if recompute_kv else [ring.GRAD_TAG]
            assert (forward, backward) == ([ring.KV_TAG], want), (recompute_kv, compiled, forward, backward)
            tags.clear()


def test_ring_of_two_ranks_keeps_its_halo_for_the_backward():
    """The forward keeps the keys it received, so the backward sends only their gradients home;
    ``recompute_kv`` (the argument, or the backend's option) sends them again."""
    run_distributed(_count_ring_transfers, 2)


@pytest.mark.parametrize("layout, is_causal, window, cu_seqlens, rows", [
    ("zigzag", True, (-1, -1), None, 16),  # a shard
    ("zigzag", True, (3, 0), None, 16),  # zigzag chunks: the window may reach a whole shard's rows
    ("contiguous", True, (-1, -1), None, 16),
    ("contiguous", True, (3, 0), None, 3),  # the window's reach
    ("contiguous", False, (3, 5), None, 5),  # its farther side
    ("contiguous", True, (3, 5), None, 3),  # causal: nothing to the right
    ("contiguous", True, (30, 0), None, 16),  # never more than a shard
    ("zigzag", True, (-1, -1), torch.tensor([0, 5, 9, 32]), 16 + 2 * 3),  # documents: the other shard may be longer
    ("contiguous", True, (-1, -1), torch.tensor([0, 5, 9, 32]), 16 + 3),
])
def test_kept_halo_holds_the_most_rows_a_halo_can_have(layout, is_causal, window, cu_seqlens, rows):
    k, v = torch.randn(2, 2, 16, 24), torch.randn(2, 2, 16, 8)
    kept = ring.kept_halo(k, v, 2, False, layout, cu_seqlens, is_causal, window)
    assert [x.shape for x in kept] == [(2 * 2 * rows * 24,), (2 * 2 * rows * 8,)]
    assert ring.kept_halo(k, v, 2, True, layout, cu_seqlens, is_causal, window) is None  # recompute_kv
    assert ring.kept_halo(k, v, 4, False, layout, cu_seqlens, is_causal, window) is None  # the keys pass on


def _ring_frames_per_length(rank, world, lengths):
    counter = torch._dynamo.testing.CompileCounterWithBackend(BACKEND)
    torch._dynamo.reset()
    compiled = torch.compile(_attention("ring", dist.group.WORLD, True, "zigzag"), backend=counter, fullgraph=True)
    frames = []
    for seq in lengths:
        torch.manual_seed(seq)  # the same global inputs on every rank
        q, k, v = (torch.randn(1, h, seq, d) for h, d in ((4, 24), (2, 24), (2, 16)))
        local = [shard_sequence(x, dist.group.WORLD).requires_grad_() for x in (q, k, v)]
        out = compiled(*local)
        dout = torch.randn(1, 4, seq, 16)
        grads = torch.autograd.grad(out, local, shard_sequence(dout, dist.group.WORLD))
        got = [unshard_sequence(x.detach(), dist.group.WORLD) for x in (out, *grads)]
        q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
        want = naive_attention(q64, k64, v64, is_causal=True)
        oracle = [want, *torch.autograd.grad(want, (q64, k64, v64), dout.double())]
        assert max(rel_err(g, o) for g, o in zip(got, oracle)) <= TOL, seq
        frames.append(counter.frame_count)
    assert frames == [1, 2, 2], f"compiled frames after each of the lengths {lengths}: {frames}"


def test_kept_halo_takes_a_new_sequence_length_without_recompiling():
    """The kept halo's buffers are shaped from the shards' symbolic sizes: the second length
    compiles once more, as dynamic, and the third reuses that graph."""
    run_distributed(_ring_frames_per_length, 2, (16, 24, 40))


def _exchange_order(rank, world):
    """The order in which Ulysses makes each tensor ready to send (m), posts its all-to-all (p),
    waits for it (w) and copies the head shards it keeps (k)."""
    from attn_compile import shard_varlen, varlen_attention
    from attn_compile.cp import comm, ulysses
    events, patched = [], {}

    def log(module, name, letter):
        patched[module, name] = original = getattr(module, name)
        setattr(module, name, lambda *args, **kwargs: events.append(letter) or original(*args, **kwargs))

    log(ulysses, "_head_send", "m"), log(ulysses, "_sequence_send", "m"), log(comm.dist, "all_to_all_single", "p")
    log(comm, "wait_collective", "w"), log(ulysses, "kept_head_shards", "k")
    try:
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, h, 8, 16, requires_grad=True) for h in (4, 2, 2))
        cu = torch.tensor([0, 5, 16], dtype=torch.int32)
        group = dist.group.WORLD
        packed = [shard_varlen(torch.randn(16, h, 16), cu, group)[0].requires_grad_() for h in (4, 2, 2)]
        for attend, inputs in ((lambda *qkv: context_parallel_attention(*qkv, group=group, strategy="ulysses",
                                                                          is_causal=True), (q, k, v)),
                               (lambda *qkv: varlen_attention(*qkv, cu, cu, 11, 11, is_causal=True, group=group,
                                                              strategy="ulysses"), packed)):
            out = attend(*inputs)
            forward = "".join(events)
            out.backward(torch.randn_like(out))
            backward = "".join(events)[len(forward):]
            # after the ranks' agreement (w), each transfer is posted before the next tensor is made
            # ready, and the waits come after every post
            assert (forward, backward) == ("wmpmpmpwwwmpmpkww", "mpwmpmpmpwww"), (forward, backward)
            events.clear()
    finally:
        for (module, name), original in patched.items():
            setattr(module, name, original)


def test_ulysses_posts_every_exchange_before_it_waits():
    run_distributed(_exchange_order, 2)


class _NcclStandIn:
    """What comm.transfer_group reads of torch's NCCL process group class (CI's torch has none)."""

    class Options:
        is_high_priority_stream = False


class _Group:
    def __init__(self, backend):
        self.backend = backend

    def size(self):
        return 4

    def rank(self):
        return 1


def test_cuda_transfers_get_one_high_priority_twin_per_nccl_group(monkeypatch):
    """Over the same ranks, made with high-priority streams, for CUDA tensors on a group with an
    NCCL backend (alone, or beside gloo as init_process_group() makes it by default). Where new
    NCCL groups would be split from the default group's communicator, a collective of every rank,
    the twin is split from the group's own instead."""
    from attn_compile.cp import comm
    made = []
    monkeypatch.setattr(comm.dist, "get_backend", lambda group: group.backend)
    monkeypatch.setattr(comm.dist, "ProcessGroupNCCL", _NcclStandIn, raising=False)
    monkeypatch.setattr(comm.dist, "get_process_group_ranks", lambda group: [4, 5, 6, 7])
    monkeypatch.setattr(comm.dist, "new_group", lambda ranks, **options: made.append(("new", ranks, options)) or "twin")
    monkeypatch.setattr(comm.dist, "split_group", lambda **options: made.append(("split", options)) or "split twin")
    nccl, mixed, gloo = _Group("nccl"), _Group("cpu:gloo,cuda:nccl"), _Group("gloo")
    cases = ((nccl, "cuda"), (nccl, "cuda"), (mixed, "cuda"), (nccl, "cpu"), (gloo, "cuda"), (gloo, "cpu"))
    twins = {}
    for splits in (False, True):  # True: the default group has a device bound
        monkeypatch.setattr(comm, "_splits_from_world", lambda: splits)
        comm.transfer_group.cache_clear()
        try:
            twins[splits] = [comm.transfer_group(group, device) for group, device in cases]
        finally:
            comm.transfer_group.cache_clear()
    assert twins == {False: ["twin", "twin", "twin", nccl, gloo, gloo],
                     True: ["split twin", "split twin", "split twin", nccl, gloo, gloo]}
    assert [m[0] for m in made] == ["new", "new", "split", "split"]  # one per NCCL group
    for _, ranks, options in made[:2]:
        assert ranks == [4, 5, 6, 7] and options["backend"] == "nccl" and options["use_local_synchronization"]
        assert options["pg_options"].is_high_priority_stream
    for (_, options), parent in zip(made[2:], (nccl, mixed)):
        assert options["parent_pg"] is parent and options["split_ranks"] == [[0, 1, 2, 3]]
        assert options["pg_options"].is_high_priority_stream


def test_ring_transfers_are_posted_on_the_twin_of_their_tensors_device(monkeypatch):
    from attn_compile.cp import comm
    asked, posted = [], []
    group = _Group("nccl")
    monkeypatch.setattr(comm, "transfer_group", lambda g, device: asked.append((g, device)) or "twin")
    monkeypatch.setattr(comm.dist, "get_global_rank", lambda g, rank: 4 + rank)
    monkeypatch.setattr(comm.dist, "P2POp", lambda op, t, peer, g, tag: posted.append((op, peer, g)))
    monkeypatch.setattr(comm.dist, "batch_isend_irecv", lambda ops: ["work"])
    _, works = comm.pass_round((torch.randn(2, 3),), group, 0)
    assert asked == [(group, "cpu")] and works == ["work"]
    assert posted == [(comm.dist.isend, 6, "twin"), (comm.dist.irecv, 4, "twin")]


def _auto_sees_whether_a_backward_follows(rank, world):
    """Each call's choices (a compiled call's come while it is traced) see a backward or none."""
    from attn_compile import cost_model
    seen, choose = [], cost_model.choose
    cost_model.choose = lambda problem, *args: seen[-1].add(problem.backward) or choose(problem, *args)
    try:
        q, k, v = (torch.randn(1, 4, 8, 16) for _ in range(3))
        attend = _attention("auto", dist.group.WORLD, True, "zigzag")
        compiled = torch.compile(attend, backend=BACKEND, dynamic=False)
        for run in (attend, compiled):
            seen.append(set())
            run(*(x.requires_grad_() for x in (q, k, v)))
            seen.append(set())
            with torch.no_grad():
                run(q, k, v)
            seen.append(set())
            run(*(x.detach() for x in (q, k, v)))
    finally:
        cost_model.choose = choose
    assert seen == [{True}, {False}, {False}] * 2, seen


def test_auto_chooses_for_the_forward_alone_where_no_gradient_is_needed():
    """Eager and compiled: with inputs that require a gradient the choice is the fwd+bwd one; under
    no_grad, or with none requiring one, it is the fastest forward (cost_model.choose)."""
    run_distributed(_auto_sees_whether_a_backward_follows, 2)
