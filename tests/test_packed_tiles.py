"""Tiles of many documents packed into a few varlen calls per context-parallel step: how many
kernel calls a step makes (counted at the entry points the calls go through), and the results of
a ring and an all-gather run step by step in one process against the float64 oracle."""
import itertools
import random

import pytest
import torch

from attn_compile.cp import device_copies, packed_tiles, tiles
from attn_compile.cp.bench_documents import mixed_lengths
from attn_compile.cp.documents import DocumentSharding
from attn_compile.cp.grad_sum import GradSum, IndexedGradSum, gradient_sum
from attn_compile.cp.layout import SequenceSharding
from attn_compile.cp.merge import IndexedResult, MergedResult, running_result
from attn_compile.cp.packed_tiles import PackedTiles
from attn_compile.cp.tiles import Tile, attend_tiles, attend_tiles_backward, k_parts, plan_calls, plan_tiles, q_parts
from attn_compile.kernels.dispatch import runs_ends_aligned
from attn_compile.kernels.visibility import effective_window
from oracle import naive_attention, rel_err

NO_WINDOW = (-1, -1)
HEADS = (4, 2, 16, 8)  # (h_q, h_kv, d_qk, d_v): GQA and MLA
SCALE = 0.3


def _cu(lengths) -> tuple:
    return (0, *itertools.accumulate(lengths))


def _bench_cu():
    """The bench's 17 documents of 1451..22360 tokens (131072 in all)."""
    return _cu(mixed_lengths(131072, seed=0))


@pytest.fixture
def counted(monkeypatch):
    """Counts the kernel calls of the tiles: dense ones (a single tile) and packed (varlen) ones."""
    counts = {"dense": 0, "varlen": 0}
    for module, name, kind in ((tiles, "attention_forward", "dense"), (tiles, "attention_backward", "dense"),
                               (packed_tiles, "varlen_forward", "varlen"),
                               (packed_tiles, "varlen_backward", "varlen")):
        def counting(*args, _kernel=getattr(module, name), _kind=kind, **kwargs):
            counts[_kind] += 1
            return _kernel(*args, **kwargs)
        monkeypatch.setattr(module, name, counting)
    return counts


def _documents(seed, tiny=(1, 3)):
    """17 document lengths like the bench's mix (log-uniform), scaled down to run on the reference,
    with ``tiny`` ones among them."""
    lengths = mixed_lengths(1024, seed=seed, shortest=16, longest=160, tiny=tiny)
    return lengths[:17 - len(tiny)] + list(tiny)


def _inputs(total, seed):
    torch.manual_seed(seed)
    h_q, h_kv, d_qk, d_v = HEADS
    return [torch.randn(1, h, total, d) for h, d in ((h_q, d_qk), (h_kv, d_qk), (h_kv, d_v), (h_q, d_v))]


def _oracle(q, k, v, dout, cu, is_causal, window):
    """Per-document float64 attention of (1, H, T, D) tensors: out, dq, dk, dv."""
    parts = []
    for start, end in itertools.pairwise(cu):
        x64 = [x[:, :, start:end].double().requires_grad_() for x in (q, k, v)]
        out = naive_attention(*x64, is_causal=is_causal, window=window, scale=SCALE)
        parts.append([out, *torch.autograd.grad(out, x64, dout[:, :, start:end].double())])
    return [torch.cat(column, 2) for column in zip(*parts)]


def _run_steps(sharding, is_causal, window, strategy, counts, seed=0, ends_aligned=False):
    """Runs every rank's ring (or all-gather) step by step in this process, in float64, checks the
    whole batch's out, dq, dk, dv against the oracle, and returns the kernel calls of each (rank,
    step), forward steps first. ``ends_aligned``: plan for kernels that take packed segments that
    end together."""
    q, k, v, dout = (x.double() for x in _inputs(sharding.total, seed))
    shard = lambda x, rank: sharding.take(x, rank, 2)  # noqa: E731
    whole = lambda pieces: sharding.join(torch.stack([sharding.pad(p, 2) for p in pieces]), 2)  # noqa: E731
    cp, per_step = sharding.cp, []
    held = [shard(torch.arange(sharding.total)[None, None], rank)[0, 0] for rank in range(cp)]
    sources = [[(rank - step) % cp for step in range(cp)] if strategy == "ring" else [None] for rank in range(cp)]

    def keys(rank, source):
        if source is None:
            return sharding.whole_chunks(), k, v
        return sharding.chunks(source), shard(k, source), shard(v, source)

    def counted_call(fn):
        before = dict(counts)
        fn()
        per_step.append(sum(counts.values()) - sum(before.values()))

    results, grads = [], [torch.zeros_like(x) for x in (q, k, v)]
    for rank in range(cp):
        plans = [plan_calls(sharding.chunks(rank), keys(rank, s)[0], is_causal, window, ends_aligned)
                 for s in sources[rank]]
        calls = [call for plan in plans for call in plan]  # as the ring of more than two steps merges them
        result = running_result(shard(q, rank), shard(v, rank), calls) if strategy == "ring" else \
            MergedResult(shard(q, rank), shard(v, rank), q_parts(calls))
        for plan, source in zip(plans, sources[rank]):
            counted_call(lambda: attend_tiles(shard(q, rank), *keys(rank, source)[1:], plan, SCALE, result))
        results.append(result)
    for rank in range(cp):
        out, lse = results[rank].out, results[rank].lse
        plans = [plan_calls(sharding.chunks(rank), keys(rank, s)[0], is_causal, window, ends_aligned)
                 for s in sources[rank]]
        # as the ring of more than two steps sums them: by index where a call has several parts
        summed = gradient_sum if strategy == "ring" else \
            (lambda x, calls, side: GradSum(x, q_parts(calls) if side == "q" else k_parts(calls)))
        dq = summed(shard(q, rank), [call for plan in plans for call in plan], "q")
        for plan, plan_source in zip(plans, sources[rank]):
            _, k_part, v_part = keys(rank, plan_source)
            dk, dv = (summed(x, plan, "k") for x in (k_part, v_part))
            counted_call(lambda: attend_tiles_backward(shard(dout, rank), shard(q, rank), k_part, v_part, out, lse,
                                                       plan, SCALE, dq, dk, dv))
            rows = torch.arange(sharding.total) if plan_source is None else held[plan_source]
            grads[1][:, :, rows] += dk.result()
            grads[2][:, :, rows] += dv.result()
        grads[0][:, :, held[rank]] += dq.result()
    got = [whole([r.out for r in results]), *grads]
    want = _oracle(q, k, v, dout, sharding.cu_seqlens, is_causal, window)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert rel_err(g, w) <= 1e-10, (name, rel_err(g, w))
    steps = len(sources[0])
    return [per_step[rank * steps:(rank + 1) * steps] for rank in range(2 * cp)]


@pytest.mark.parametrize("strategy", ["ring", "allgather"])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("cp", [2, 4])
def test_causal_calls_per_step_do_not_grow_with_documents(cp, layout, strategy, counted):
    """17 documents of mixed lengths, causal, no window: at most 2 calls per ring step (the
    diagonal's squares as one causal call, the fully visible tiles as one) and 3 for the all-gather
    (the keys before each zigzag chunk of a document in one non-causal call per chunk, the squares
    in one causal call), forward and backward alike; per tile they were up to 3 per document. The
    same with documents shorter than 2·cp, whose chunks are one token or none."""
    for tiny in ((), (1, 3, 2)):
        sharding = DocumentSharding(_cu(_documents(cp, tiny)), cp, layout)
        per_step = _run_steps(sharding, True, NO_WINDOW, strategy, counted)
        assert max(itertools.chain(*per_step)) <= (2 if strategy == "ring" else 3), (tiny, per_step)
    assert counted["varlen"] > 0


@pytest.mark.parametrize("window", [NO_WINDOW, (40, 0), (30, 30)])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("cp", [2, 4])
def test_allgather_runs_each_query_chunk_against_its_prefix_where_segments_may_end_together(cp, layout, window,
                                                                                          counted):
    """Kernels that take packed segments ending together (FA4): under the all-gather each query
    chunk's visible keys up to it are one segment, so a causal step is at most 2 calls (a zigzag
    shard's first chunks, then its second ones, whose keys overlap the first's), with or without a
    window; a band that reaches past the queries (30, 30) still packs its edges' squares. Exact
    against the oracle, with documents shorter than 2·cp among them."""
    for tiny in ((), (1, 3, 2)):
        sharding = DocumentSharding(_cu(_documents(cp, tiny)), cp, layout)
        per_step = _run_steps(sharding, True, window, "allgather", counted, ends_aligned=True)
        if window[1] <= 0:
            assert max(itertools.chain(*per_step)) <= 2, (tiny, per_step)
    assert counted["varlen"] > 0


def _check_windowed(calls):
    """Every masked call is a square whose queries and keys sit at the same positions (one that
    packs), whatever the document: the diagonal's under the window, and the band edges' squares."""
    for call in calls:
        for tile in (call.tiles if isinstance(call, PackedTiles) else (call,)):
            assert not tile.masking or (tile.masking["q_offset"] == tile.masking["k_offset"]
                                        and tile.q_rows.stop - tile.q_rows.start
                                        == tile.k_rows.stop - tile.k_rows.start), tile


@pytest.mark.parametrize("cp", [2, 4])
def test_calls_per_step_of_the_bench_batch(cp):
    """The bench's batch, causal: at most 2 calls per ring step (per tile: up to 51) and 3 for the
    all-gather (per tile: 34). With its window of 4096, at most 4 per ring step (per tile: 20 to
    51) and 5 for the all-gather (per tile: 34): the diagonal's squares under the window, the
    squares on the bands' edges (one causal call, one that sees from the diagonal on) and the fully
    visible tiles."""
    sharding = DocumentSharding(_bench_cu(), cp, "zigzag")
    for rank in range(cp):
        q_chunks = sharding.chunks(rank)
        for step in range(cp):
            k_chunks = sharding.chunks((rank - step) % cp)
            assert len(plan_calls(q_chunks, k_chunks, True)) <= 2 < 17 <= len(plan_tiles(q_chunks, k_chunks, True))
            windowed = plan_calls(q_chunks, k_chunks, True, (4096, 0))
            _check_windowed(windowed)
            assert len(windowed) <= 4
        assert len(plan_calls(q_chunks, sharding.whole_chunks(), True)) <= 3
        windowed = plan_calls(q_chunks, sharding.whole_chunks(), True, (4096, 0))
        _check_windowed(windowed)
        assert len(windowed) <= 5


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("cp", [2, 4])
def test_allgather_calls_of_the_bench_batch_where_segments_may_end_together(cp, layout):
    """The bench's batch under the all-gather, planned for kernels that take packed segments that
    end together: causal, with or without its window of 4096, a zigzag shard is 2 calls (each
    document's first chunk against its prefix, then its second chunk), a contiguous one 1; every
    tile of them ends together, and no key row is seen twice in a call."""
    sharding = DocumentSharding(_bench_cu(), cp, layout)
    for rank, window in itertools.product(range(cp), (NO_WINDOW, (4096, 0))):
        calls = plan_calls(sharding.chunks(rank), sharding.whole_chunks(), True, window, True)
        assert len(calls) == (2 if layout == "zigzag" else 1), calls
        for call in calls:
            assert isinstance(call, PackedTiles) and call.ends_aligned
            assert all(packed_tiles.ends_together(tile) for tile in call.tiles)
            assert all(a.k_rows.stop <= b.k_rows.start for a, b in itertools.pairwise(call.tiles))


def _pairs(tile, shape):
    """(rows, columns) of the buffers: 1 where the tile computes the pair."""
    seen = torch.zeros(shape, dtype=torch.int32)
    i = torch.arange(tile.q_rows.stop - tile.q_rows.start)[:, None]
    j = torch.arange(tile.k_rows.stop - tile.k_rows.start)[None, :]
    visible = torch.ones(i.shape[0], j.shape[1], dtype=torch.bool)
    if tile.masking:
        left, right = effective_window(tile.masking["is_causal"], tile.masking["window"])
        d = (tile.masking["k_offset"] + j) - (tile.masking["q_offset"] + i)
        visible &= (d >= -left if left != -1 else True) & (d <= right if right != -1 else True)
    seen[tile.q_rows, tile.k_rows] = visible.int()
    return seen


def test_band_parts_cover_each_visible_pair_once():
    """Random masked tiles (cut to their bands or not): the parts compute exactly the tile's pairs,
    each once, and every masked part is a square that packs."""
    rng = random.Random(0)
    for _ in range(400):
        n, m = rng.randint(1, 30), rng.randint(1, 40)
        window = tuple(rng.choice([-1, rng.randint(0, 20)]) for _ in range(2))
        tile = Tile(slice(2, 2 + n), slice(3, 3 + m), dict(is_causal=rng.random() < 0.6, window=window,
                                                           q_offset=rng.randint(0, 60), k_offset=rng.randint(0, 60)))
        parts = tiles._band_parts(tile)
        assert torch.equal(sum(_pairs(part, (40, 50)) for part in parts), _pairs(tile, (40, 50))), tile
        if len(parts) > 1:
            _check_windowed(parts)


@pytest.mark.parametrize("window", [(6, 0), (6, 6)])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("strategy", ["ring", "allgather"])
def test_windowed_steps_are_exact_and_pack_the_diagonal(strategy, is_causal, window, counted):
    """With a window, every call packs: the diagonal's squares, the squares on the bands' edges and
    the fully visible tiles."""
    sharding = DocumentSharding(_cu(_documents(7)), 2, "zigzag")
    _run_steps(sharding, is_causal, window, strategy, counted, seed=1)
    assert counted["varlen"] > 0


def test_full_attention_is_one_call_per_step(counted):
    sharding = DocumentSharding(_cu(_documents(3)), 4, "zigzag")
    per_step = _run_steps(sharding, False, NO_WINDOW, "ring", counted, seed=2)
    assert max(itertools.chain(*per_step)) == 1, per_step


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_a_dense_sequence_keeps_its_tiles(layout):
    """One document (a dense sequence) runs a call per tile as before: at most two per step."""
    sharding = SequenceSharding(4, layout, 16)
    for rank, step, window in itertools.product(range(4), range(4), (NO_WINDOW, (5, 0))):
        q_chunks = sharding.chunks(rank)
        for k_chunks in (sharding.chunks((rank - step) % 4), sharding.whole_chunks()):
            assert plan_calls(q_chunks, k_chunks, True, window) == plan_tiles(q_chunks, k_chunks, True, window)


def _nan_in(kernel, fillers):
    """``kernel`` with NaN written into each result's filler rows (``fillers``, one per result)."""
    def run(*args, **kwargs):
        results = kernel(*args, **kwargs)
        for result, rows in zip(results, fillers):
            result[rows] = float("nan")
        return results
    return run


@pytest.mark.parametrize("indexed", [False, True], ids=["part by part", "by index"])
def test_filler_rows_are_never_read_whatever_the_kernel_writes(monkeypatch, indexed):
    """Rows between a packed call's tiles (filler segments, with no key or no query) are no part of
    the results it adds to: its parts are the tiles' rows, and results over every row of the
    buffers are the same where a kernel leaves NaN in the filler rows; rows no tile covers come out
    seeing nothing and get no gradient."""
    q, k, v, dout = (x.double() for x in _inputs(12, 3))
    call = PackedTiles((Tile(slice(2, 4), slice(0, 3), {}), Tile(slice(7, 9), slice(5, 6), {})), {})
    assert call.q_parts == (slice(2, 4), slice(7, 9)) and call.k_parts == (slice(0, 3), slice(5, 6))
    q_fillers, k_fillers = [2, 3, 4], [3, 4]  # in the spans, rows 2..9 of q and 0..6 of k

    def run():
        result = IndexedResult(q, v) if indexed else MergedResult(q, v, q_parts([call]))
        attend_tiles(q, k, v, [call], SCALE, result)
        dq, dk, dv = (IndexedGradSum(x) if indexed else GradSum(x, parts)
                      for x, parts in ((q, call.q_parts), (k, call.k_parts), (v, call.k_parts)))
        attend_tiles_backward(dout, q, k, v, result.out, result.lse, [call], SCALE, dq, dk, dv)
        return result.out, result.lse, dq.result(), dk.result(), dv.result()

    want = run()
    out, lse, dq, dk, dv = want
    uncovered_q, uncovered_k = [0, 1, 4, 5, 6, 9, 10, 11], [3, 4, 6, 7, 8, 9, 10, 11]
    assert (lse[0, :, uncovered_q] == float("-inf")).all()
    assert not any(x[0, :, rows].any() for x, rows in ((out, uncovered_q), (dq, uncovered_q), (dk, uncovered_k),
                                                       (dv, uncovered_k)))
    monkeypatch.setattr(packed_tiles, "varlen_forward", _nan_in(packed_tiles.varlen_forward, [q_fillers] * 2))
    monkeypatch.setattr(packed_tiles, "varlen_backward", _nan_in(packed_tiles.varlen_backward,
                                                                 [q_fillers, k_fillers, k_fillers]))
    for got, expected in zip(run(), want):
        assert torch.equal(got, expected)


def test_sharding_indices_move_to_a_device_once():
    sharding = DocumentSharding(_cu([3, 5, 1]), 2, "zigzag")
    meta = torch.device("meta")
    assert sharding.cu_seqlens_on(meta) is sharding.cu_seqlens_on(meta)
    assert sharding.cu_seqlens_on(meta).dtype == torch.int32
    assert sharding._at(torch.empty(2, 9, device=meta), 1, "_slots")[1] is \
        sharding._at(torch.empty(2, 9, device=meta), 1, "_slots")[1]


def test_a_causal_window_no_narrower_than_causal_packs_as_causal():
    sharding = DocumentSharding(_cu([8 * n for n in _documents(2)]), 2, "zigzag")
    for keys in (sharding.chunks(0), sharding.chunks(1), sharding.whole_chunks()):  # ring steps, all-gather
        chunks = sharding.chunks(0), keys
        shapes = [[(type(call), call.q_rows, call.k_rows) for call in plan_calls(*chunks, True, window)]
                  for window in ((-1, 0), (-1, -1))]
        assert shapes[0] == shapes[1]


def test_a_masked_packed_call_refuses_tiles_off_the_diagonal():
    tile = Tile(slice(0, 4), slice(0, 6), dict(is_causal=True, window=(-1, -1), q_offset=2, k_offset=0))
    with pytest.raises(ValueError, match="squares on the diagonal only"):
        PackedTiles((tile,), dict(is_causal=True, window=(-1, -1)))


def test_device_copies_made_under_inference_mode_serve_a_later_backward():
    """An evaluation under inference mode first, then training on the same packing: the cached
    index must not be an inference tensor, which autograd cannot save."""
    sharding = DocumentSharding(_cu([3, 5, 1]), 2, "zigzag")
    with torch.inference_mode():
        sharding.take(torch.randn(1, 2, 9, 4), 0, 2)
    x = torch.randn(1, 2, 9, 4, requires_grad=True)
    sharding.take(x, 0, 2).sum().backward()
    assert x.grad.sum() == 2 * 4 * sharding.local_len(0)


def test_device_copies_are_bounded_whatever_holds_their_owners():
    """A new packing per batch: the copies of old packings are dropped, though the shardings' own
    caches keep the shardings."""
    shardings = [DocumentSharding(_cu([3, n, 1]), 2, "zigzag") for n in range(2, 2 + 2 * device_copies.LIMIT)]
    for sharding in shardings:
        sharding.take(torch.randn(1, 1, sharding.total, 1), 0, 2)
    assert len(device_copies._copies) == device_copies.LIMIT


def test_a_part_over_many_segments_in_one_state_merges_once(monkeypatch):
    """A packed call's part spans the segments that single tiles cut: where it finds them in the
    same state it writes them with one merge, not one per segment."""
    from attn_compile.cp import merge
    merges = []
    monkeypatch.setattr(merge, "merge_into", lambda *args, **kwargs: merges.append(args[0].shape))
    q, _, v, _ = _inputs(40, 4)
    rows = [slice(4 * i, 4 * i + 4) for i in range(10)]
    result = MergedResult(q, v, [*rows, slice(0, 40), slice(0, 40)])
    for part in (*rows, slice(0, 40), slice(0, 40)):
        result.add(part, torch.randn_like(result.out[:, :, part]), torch.randn_like(result.lse[:, :, part]))
    assert len(merges) == 2


def test_the_multi_step_ring_merges_and_sums_packed_calls_by_index():
    """A ring of more than two steps merges a packed call's rows, and adds its gradients' rows, in one
    launch (``IndexedResult``, ``IndexedGradSum``); those of a dense sequence, whose calls have one
    part each, part by part."""
    packed = DocumentSharding(_cu(_documents(3)), 4, "zigzag")
    calls = [call for step in range(4) for call in plan_calls(packed.chunks(1), packed.chunks((1 - step) % 4), True,
                                                                NO_WINDOW)]
    q, k, v, _ = _inputs(packed.local_len(1), 0)
    assert isinstance(running_result(q, v, calls), IndexedResult)
    assert all(isinstance(gradient_sum(x, calls, side), IndexedGradSum) for x, side in ((q, "q"), (k, "k")))
    dense = SequenceSharding(4, "zigzag", 16)
    calls = [call for step in range(4) for call in plan_calls(dense.chunks(1), dense.chunks((1 - step) % 4), True,
                                                               NO_WINDOW)]
    assert isinstance(running_result(q[:, :, :32], v[:, :, :32], calls), MergedResult)
    assert all(type(gradient_sum(x[:, :, :32], calls, side)) is GradSum for x, side in ((q, "q"), (k, "k")))


@pytest.mark.gpu
@pytest.mark.parametrize("window", [NO_WINDOW, (24, 0)])
def test_merging_by_index_matches_part_by_part_on_the_gpu(window):
    """A zigzag ring of 4 steps on packed documents, one rank's steps in one process on the
    dispatched kernels: the results merged by index (one fused launch a call, float32 to the end)
    against those merged part by part, and so the gradients summed."""
    sharding = DocumentSharding(_cu([8 * n for n in _documents(2)]), 4, "zigzag")
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, h, sharding.total, 128, device="cuda", dtype=torch.bfloat16) for h in (8, 2, 2))
    shard = lambda x, rank: sharding.take(x, rank, 2)  # noqa: E731
    steps = [(plan_calls(sharding.chunks(1), sharding.chunks(source), True, window), shard(k, source), shard(v, source))
             for source in (1, 0, 3, 2)]
    q1 = shard(q, 1)
    results = (IndexedResult(q1, v), MergedResult(q1, v, q_parts([call for calls, _, _ in steps for call in calls])))
    for result in results:
        for calls, k_part, v_part in steps:
            attend_tiles(q1, k_part, v_part, calls, SCALE, result)
    (out, lse), (want_out, want_lse) = ((r.out, r.lse) for r in results)
    assert out.dtype == q.dtype and out.stride() == want_out.stride()
    assert torch.equal(lse.isneginf(), want_lse.isneginf())
    assert rel_err(out.float(), want_out.float()) <= 1e-2
    assert rel_err(lse[lse.isfinite()], want_lse[want_lse.isfinite()]) <= 1e-5
    dout = torch.randn_like(out)
    keys = [(calls, x) for calls, k_part, v_part in steps for x in (k_part, v_part)]
    sums = [(IndexedGradSum(q1), [IndexedGradSum(x) for _, x in keys]),
            (GradSum(q1, q_parts([call for calls, _, _ in steps for call in calls])),
             [GradSum(x, k_parts(calls)) for calls, x in keys])]
    for dq, dkv in sums:
        for (calls, k_part, v_part), dk, dv in zip(steps, dkv[::2], dkv[1::2]):
            attend_tiles_backward(dout, q1, k_part, v_part, want_out, want_lse, calls, SCALE, dq, dk, dv)
    for got, want in zip([sums[0][0], *sums[0][1]], [sums[1][0], *sums[1][1]]):
        got, want = got.result(), want.result()
        assert got.dtype == want.dtype and got.stride() == want.stride()
        assert rel_err(got.float(), want.float()) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("ends_aligned", [False, True])
@pytest.mark.parametrize("is_causal, window", [(False, NO_WINDOW), (True, NO_WINDOW), (True, (24, 0))])
def test_packed_calls_match_their_tiles_run_alone_on_the_gpu(is_causal, window, ends_aligned):
    """On the dispatched kernels (FA4, Triton): a packed call's rows are its tiles' results, each
    tile run as its own call (what it writes in the filler rows between them is never read); so
    with tiles that end together where the kernels take them (FA4)."""
    sharding = DocumentSharding(_cu([8 * n for n in _documents(2)]), 2, "zigzag")
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(1, h, sharding.total, 128, device="cuda", dtype=torch.bfloat16)
                     for h in (8, 2, 2, 8))
    shard = lambda x, rank: sharding.take(x, rank, 2)  # noqa: E731
    if ends_aligned:
        assert runs_ends_aligned(q, k, v, is_causal=is_causal, window=window), "FA4 is not installed"
    plans = [(plan_calls(sharding.chunks(0), sharding.chunks(source), is_causal, window, ends_aligned),
              shard(k, source), shard(v, source)) for source in (0, 1)]
    plans.append((plan_calls(sharding.chunks(0), sharding.whole_chunks(), is_causal, window, ends_aligned), k, v))
    q0, dout0 = shard(q, 0), shard(dout, 0)
    for calls, k_part, v_part in plans:
        for call in (call for call in calls if isinstance(call, PackedTiles)):
            out, lse = call.forward(q0, k_part, v_part, SCALE)
            span_out, span_lse = torch.zeros_like(dout0), torch.zeros(q0.shape[:3], device="cuda")
            span_out[:, :, call.q_rows], span_lse[:, :, call.q_rows] = out, lse
            grads = call.backward(dout0, q0, k_part, v_part, span_out, span_lse, SCALE)
            for tile in call.tiles:
                q_rows = slice(tile.q_rows.start - call.q_rows.start, tile.q_rows.stop - call.q_rows.start)
                k_rows = slice(tile.k_rows.start - call.k_rows.start, tile.k_rows.stop - call.k_rows.start)
                alone = (*tile.forward(q0, k_part, v_part, SCALE),
                         *tile.backward(dout0, q0, k_part, v_part, span_out, span_lse, SCALE))
                packed = (out[:, :, q_rows], lse[:, :, q_rows], grads[0][:, :, q_rows], grads[1][:, :, k_rows],
                          grads[2][:, :, k_rows])
                for got, want in zip(packed, alone):
                    assert rel_err(got.float(), want.float()) <= 2e-2
