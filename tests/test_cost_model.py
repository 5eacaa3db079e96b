"""The cost model picks the expected strategy in clear-cut regimes."""
import dataclasses

import pytest
import torch

from attn_compile.cost_model import Hardware, Problem, _exchange_seconds, choose, estimate, fastest, options


def _problem(**overrides):
    base = dict(batch=1, s_local=32768, h_q=32, h_kv=8, d_qk=128, d_v=128, dtype=torch.bfloat16, is_causal=True,
                mesh_shape=(2,))
    return Problem(**{**base, **overrides})


def test_gqa_with_small_kv_and_indivisible_heads_prefers_allgather():
    """GQA 12/2 on 8 ranks: Ulysses cannot split the heads, and gathering the small KV once costs
    less than a merge, an overhead and an exposed transfer per ring step."""
    strategy, table = choose(_problem(h_q=12, h_kv=2, s_local=4096, mesh_shape=(8,)))
    assert strategy == "allgather" and table["allgather"].time_s < 0.8 * table["ring"].time_s


def test_large_kv_with_indivisible_heads_prefers_ring():
    """MHA with h_q=12 on 8 ranks: Ulysses cannot split the heads, and the ring hides 7 large transfers."""
    strategy, table = choose(_problem(h_q=12, h_kv=12, mesh_shape=(8,)))
    assert strategy == "ring"
    assert table["ulysses"] == "h_q=12 is not a multiple of the context-parallel size 8"


def test_many_ranks_and_divisible_heads_prefer_ulysses():
    assert choose(_problem(h_q=32, h_kv=32, s_local=2048, mesh_shape=(8,)))[0] == "ulysses"


def test_two_dimensional_mesh_means_hybrid():
    strategy, table = choose(_problem(mesh_shape=(2, 4)))
    assert strategy == "hybrid"
    assert table["ring"] == "ring needs a 1-D mesh"


@pytest.mark.parametrize("cp, window", [(2, (4096, 0)), (2, (-1, -1)), (4, (4096, 0)), (4, (-1, -1))])
def test_packed_documents_take_ulysses_where_it_runs(cp, window):
    """The shapes of `bench cp --documents` (17 documents, the longest 22,360 tokens): the model
    alone picks the ring on 2 GPUs, whose fwd+bwd ran at 0.45 (window) and 0.86 (none) of Ulysses'
    there on zigzag shards (eff116c)."""
    docs = _problem(batch=17, s_local=-(-22360 // cp), window=window, mesh_shape=(cp,))
    assert choose(docs)[0] == ("ring" if cp == 2 else "ulysses")
    assert choose(dataclasses.replace(docs, documents=True))[0] == "ulysses"


@pytest.mark.parametrize("cp", [2, 4])
def test_contiguous_packed_documents_take_the_ring_where_it_has_two_steps(cp):
    """On the contiguous layout a window, or a ring of two ranks, leaves a rank needing the rank
    before it only: the ring sends K and V one step, and attends the rest locally. Without a window
    on more ranks a document may span several ranks' pieces: Ulysses."""
    docs = _problem(batch=17, s_local=-(-22360 // cp), window=(4096, 0), mesh_shape=(cp,), documents=True)
    assert choose(dataclasses.replace(docs, layout="contiguous"))[0] == "ring"
    assert choose(dataclasses.replace(docs, layout="contiguous", window=(-1, -1)))[0] == (
        "ring" if cp == 2 else "ulysses")
    assert choose(dataclasses.replace(docs, layout="contiguous", window=(-1, -1), backward=False))[0] == (
        "ring" if cp == 2 else "ulysses")
    assert choose(docs)[0] == "ulysses"


@pytest.mark.parametrize("window", [(4096, 0), (-1, -1)])
def test_packed_documents_forward_alone_takes_the_allgather_on_two_ranks_where_prefixes_are_one_segment(window):
    """With no backward, on zigzag shards of two ranks, the all-gather whose calls take each query
    chunk's visible prefix as one segment (FA4) has the fastest forward: 0.655 and 0.816 of one GPU
    against Ulysses' 0.621 and 0.760 (2 H200s, d28fe88). With a backward, on more ranks, on the
    contiguous layout or on kernels without such segments, the rules before it stand."""
    docs = _problem(batch=17, s_local=-(-22360 // 2), window=window, mesh_shape=(2,), documents=True,
                    prefix_segments=True)
    assert choose(dataclasses.replace(docs, backward=False))[0] == "allgather"
    assert choose(docs)[0] == "ulysses"
    assert choose(dataclasses.replace(docs, backward=False, prefix_segments=False))[0] == "ulysses"
    assert choose(dataclasses.replace(docs, backward=False, mesh_shape=(4,)))[0] == "ulysses"
    assert choose(dataclasses.replace(docs, backward=False, layout="contiguous"))[0] == "ring"


def test_packed_documents_follow_the_model_where_ulysses_cannot_run():
    docs = _problem(batch=17, h_q=12, h_kv=2, s_local=4096, mesh_shape=(8,), documents=True)
    assert choose(docs)[0] == choose(dataclasses.replace(docs, documents=False))[0] != "ulysses"
    assert choose(dataclasses.replace(docs, mesh_shape=(2, 4), h_q=32))[0] == "hybrid"
    assert choose(dataclasses.replace(docs, h_q=32, mesh_shape=(8,)), strategy="ring")[0] == "ring"


def test_window_reduces_compute_and_favours_gathering():
    """Too little compute is left to hide the ring's transfers behind: gathering K and V (or the
    heads, Ulysses) once costs less."""
    full, windowed = _problem(s_local=8192, mesh_shape=(4,)), _problem(s_local=8192, mesh_shape=(4,), window=(1024, 0))
    assert estimate("ring", windowed).compute_s < estimate("ring", full).compute_s / 10
    assert estimate("allgather", windowed).time_s < estimate("ring", windowed).time_s
    assert choose(windowed)[0] in ("allgather", "ulysses")


def test_window_on_contiguous_shards_shortens_the_ring():
    """A window of 1024 on shards of 8192 needs 1024 keys of one rank back: one transfer of an
    eighth of a shard, not seven whole ones, and then the ring (no all-gather of the whole
    sequence) wins where Ulysses cannot split the heads. Zigzag shards still pass all."""
    windowed = dict(s_local=8192, h_q=12, h_kv=12, mesh_shape=(8,), window=(1024, 0))
    contiguous, zigzag = _problem(**windowed, layout="contiguous"), _problem(**windowed)
    assert (contiguous.ring_transfers(8), zigzag.ring_transfers(8)) == (1, 7)
    assert estimate("ring", contiguous).transfer_s == pytest.approx(estimate("ring", zigzag).transfer_s / 7 / 8)
    assert choose(contiguous)[0] == "ring"


def test_causal_is_half_the_work_of_full():
    causal, full = _problem(), _problem(is_causal=False)
    assert estimate("ring", causal).compute_s == pytest.approx(estimate("ring", full).compute_s / 2, rel=1e-3)


def test_faster_links_shrink_transfer_only():
    p, fast = _problem(), Hardware(link_gbps=612.0)
    slow_est, fast_est = estimate("allgather", p), estimate("allgather", p, fast)
    assert fast_est.transfer_s == pytest.approx(slow_est.transfer_s / 2)
    assert fast_est.compute_s == slow_est.compute_s


def test_nothing_feasible():
    with pytest.raises(ValueError, match=r"^no context-parallel strategy can run this problem on mesh \(2, 8\): "
                                         r"ring: ring needs a 1-D mesh; allgather: allgather needs a 1-D mesh; "
                                         r"ulysses: ulysses needs a 1-D mesh; hybrid: h_q=12 is not a multiple of "
                                         r"the inner mesh size 8$"):
        choose(_problem(h_q=12, h_kv=12, mesh_shape=(2, 8)))


def test_unknown_strategy():
    with pytest.raises(ValueError, match=r"^strategy must be one of \('ring', 'allgather', 'ulysses', 'hybrid'\); "
                                         r"got 'tree'$"):
        estimate("tree", _problem())


def test_estimates_print_readably():
    text = str(estimate("ring", dataclasses.replace(_problem(), s_local=1024)))
    assert text.startswith("ring: ") and "compute" in text and "MiB" in text


def test_the_choice_on_two_and_four_ranks_is_the_measured_fastest_or_level_with_it():
    """GQA 32/8 and MLA 16h 192/128 at 64K and 128K tokens (bench_plan.MEASURED, fwd+bwd, H200s,
    FlashAttention-4). On 4 ranks Ulysses' all-to-alls cost less than the ring's exposed transfers
    and merges or the all-gather's gathered K and V. On 2 the ring has two steps, and its backward
    runs both transfers beside kernels: the ring and Ulysses are within 1% of each other (GQA: the
    ring 579 and 602 TFLOP/s, Ulysses 583 and 601; MLA: the ring 492 and 511, Ulysses 489 and 512),
    and the ring's forward is the faster (MLA: 644 and 673 against 613 and 653)."""
    for cp in (2, 4):
        for seq in (65536, 131072):
            for heads in (dict(), dict(h_q=16, h_kv=16, d_qk=192, d_v=128)):
                want = "ring" if cp == 2 else "ulysses"
                assert choose(_problem(s_local=seq // cp, mesh_shape=(cp,), **heads))[0] == want, (cp, seq, heads)


def test_where_no_backward_follows_the_fastest_forward_is_chosen():
    """The same shapes (bench_plan.MEASURED, forward): a ring of two steps hides its transfer behind
    its steps, while Ulysses' and the all-gather's collectives are waited for, so on 2 ranks the
    forward alone takes the ring; a longer ring hides only part of each step's transfer, so on 4
    ranks it takes Ulysses. Each was measured the fastest forward of its shape. With a backward the
    choice can differ: MLA on 2 ranks at 8192 tokens takes Ulysses for fwd+bwd, the ring for the
    forward alone."""
    for cp in (2, 4):
        for seq in (65536, 131072):
            for heads in (dict(), dict(h_q=16, h_kv=16, d_qk=192, d_v=128)):
                problem = _problem(s_local=seq // cp, mesh_shape=(cp,), **heads)
                want = "ring" if cp == 2 else "ulysses"
                assert choose(dataclasses.replace(problem, backward=False))[0] == want, (cp, seq, heads)
    mla = _problem(s_local=4096, mesh_shape=(2,), h_q=16, h_kv=16, d_qk=192, d_v=128)
    assert choose(mla)[0] == "ulysses" and choose(dataclasses.replace(mla, backward=False))[0] == "ring"


def test_a_backward_follows_where_grad_mode_is_on_and_an_input_requires_a_gradient():
    def backward(*requires_grad, **given):
        q, k, v = (torch.empty(1, 8, 64, 16, device="meta", requires_grad=r) for r in requires_grad)
        return Problem.of_shards(q, k, v, is_causal=True, mesh_shape=(2,), **given).backward

    assert backward(True, False, False) and backward(False, False, True)
    assert not backward(False, False, False)
    with torch.no_grad():
        assert not backward(True, True, True)
        assert backward(True, True, True, backward=True)  # given, as the passes give it from the traced tensors
    assert not backward(True, True, True, backward=False)


def test_unequal_head_dims_slow_the_backward_only():
    """MLA's backward (d_qk 192, d_v 128) runs at ``unequal_dims_backward`` of the kernel's speed,
    whatever the strategy; its forward, like GQA's, at the kernel's speed."""
    mla = _problem(h_q=16, h_kv=16, d_qk=192, d_v=128, mesh_shape=(4,))
    hw = Hardware()
    forward = mla.forward_flops() / (hw.kernel_tflops * 1e12)
    for strategy in ("ring", "allgather", "ulysses"):
        assert estimate(strategy, mla).compute_s == pytest.approx(forward * (1 + 2.5 / hw.unequal_dims_backward))
    assert estimate("ring", _problem()).compute_s == pytest.approx(
        _problem().forward_flops() / (hw.kernel_tflops * 1e12) * 3.5)


def test_a_ring_across_nodes_moves_at_the_slower_link():
    """64 GPUs in nodes of 8 joined at 50 GB/s per GPU: the ring over all of them waits for its
    hops between nodes, and so does the hybrid's ring across nodes, but not its all-to-all inside one."""
    nodes, one_node = Hardware(gpus_per_node=8, internode_gbps=50.0), Hardware()
    ring = _problem(s_local=2048, mesh_shape=(64,))
    assert estimate("ring", ring, nodes).transfer_s == pytest.approx(
        estimate("ring", ring, one_node).transfer_s * one_node.link_gbps / 50.0)
    hybrid = _problem(s_local=2048, mesh_shape=(8, 8))
    inside = estimate("hybrid", dataclasses.replace(hybrid, mesh_shape=(1, 8)), nodes)
    assert inside.transfer_s == estimate("hybrid", dataclasses.replace(hybrid, mesh_shape=(1, 8)), one_node).transfer_s
    assert estimate("hybrid", hybrid, nodes).transfer_s > estimate("hybrid", hybrid, one_node).transfer_s


def test_all_to_all_across_nodes_sends_the_other_nodes_share_over_the_slower_link():
    """Over 16 GPUs in 2 nodes of 8, half of what a rank sends leaves its node, over the slower
    link, while 7/16 moves inside it at the same time; inside one node, 7/8 moves."""
    hw, sent = Hardware(gpus_per_node=8, internode_gbps=50.0), 1e9
    assert _exchange_seconds(sent, 16, hw) == pytest.approx(sent * 8 / 16 / (50.0 * hw.a2a_efficiency * 1e9))
    assert _exchange_seconds(sent, 8, hw) == pytest.approx(sent * 7 / 8 / (hw.link_gbps * hw.a2a_efficiency * 1e9))
    fast_nodes = dataclasses.replace(hw, internode_gbps=1e6)
    assert _exchange_seconds(sent, 16, fast_nodes) == pytest.approx(
        sent * 7 / 16 / (hw.link_gbps * hw.a2a_efficiency * 1e9))


def test_past_one_node_the_plan_is_ulysses_inside_nodes_and_the_ring_across():
    """GQA 32/8 and MLA 16h on 64 GPUs in nodes of 8, at 128K and 1M tokens: Ulysses cannot split the
    heads 64 ways, the ring over 64 ranks crosses nodes at every step, and all-gather moves the whole
    K and V between nodes; the hybrid with the all-to-all inside each node (8) and the ring across the
    nodes (8) is fastest."""
    hw = Hardware(gpus_per_node=8, internode_gbps=50.0)
    for heads in ((32, 8, 128, 128), (16, 16, 192, 128)):
        for seq in (131072, 1048576):
            h_q, h_kv, d_qk, d_v = heads
            p = _problem(s_local=seq // 64, h_q=h_q, h_kv=h_kv, d_qk=d_qk, d_v=d_v, mesh_shape=(64,))
            laid_out = options(p, hw)
            assert [(o.strategy, o.mesh_shape) for o in laid_out] == [
                ("ring", (64,)), ("allgather", (64,)), ("ulysses", (64,)), ("hybrid", (32, 2)), ("hybrid", (16, 4)),
                ("hybrid", (8, 8))]
            best = fastest(laid_out)
            assert (best.strategy, best.mesh_shape) == ("hybrid", (8, 8)), (heads, seq)


def test_an_option_that_does_not_fit_memory_does_not_run():
    """All-gather holds the whole sequence's K and V: at 1M tokens on 8 GPUs, more than 20 GB."""
    p = _problem(s_local=1048576 // 8, mesh_shape=(8,))
    laid_out = {o.strategy: o for o in options(p, Hardware(gpu_memory_gb=20.0))}
    assert laid_out["allgather"].reason == (f"needs {laid_out['allgather'].memory_bytes / 1e9:.3g} GB per GPU, more "
                                            f"than the 20 GB one holds")
    assert laid_out["allgather"].memory_bytes > 20e9 and not laid_out["ring"].reason
    assert fastest(options(p, Hardware(gpu_memory_gb=0.1))) is None


def test_a_ring_that_cannot_overlap_adds_its_transfers():
    """With ring_overlap=0 (the default, which the measured fwd+bwd fits best) every step's transfer
    adds to its compute; with 1 the compute-bound ring hides them all."""
    p = _problem(mesh_shape=(4,))
    hidden, exposed = estimate("ring", p, Hardware(ring_overlap=1.0)), estimate("ring", p)
    assert hidden.transfer_s < hidden.compute_s / 10
    assert exposed.time_s == pytest.approx(hidden.time_s + hidden.transfer_s)
    half = estimate("ring", p, Hardware(ring_overlap=0.5))
    assert half.time_s == pytest.approx(hidden.time_s + hidden.transfer_s / 2)
