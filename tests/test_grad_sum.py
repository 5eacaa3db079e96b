"""Gradients summed from parts over rows (``cp/grad_sum.py``), the query split of a tile, and the
order of the two-step ring's backward, which hides both of its transfers behind kernels."""
from types import SimpleNamespace

import pytest
import torch

from attn_compile.cp import ring
from attn_compile.cp.grad_sum import GradSum, IndexedGradSum, most_parts
from attn_compile.cp.layout import SequenceSharding
from attn_compile.cp.tiles import Tile
from attn_compile.kernels.visibility import effective_window, visible
from tile_coverage import covered

# rows 0-1 get one part, 2-3 three, 4-5 two, 6 none
PARTS = [slice(0, 6), slice(2, 6), slice(2, 4)]


def _parts(dtype):
    torch.manual_seed(0)
    return [torch.randn(2, 3, rows.stop - rows.start, 8).to(dtype) for rows in PARTS]


def _fp32_sum(parts):
    total = torch.zeros(2, 3, 7, 8)
    for rows, part in zip(PARTS, parts):
        total[:, :, rows] += part.float()
    return total


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_parts_sum_in_float32_and_round_once(dtype):
    """bf16 parts: every row is the float32 sum of its parts rounded once to bf16, as a float32
    accumulator started at zero gives; a row of no part is 0; float32 parts sum exactly so."""
    parts = _parts(dtype)
    total = GradSum(torch.empty(2, 3, 7, 8, dtype=dtype), PARTS)
    for rows, part in zip(PARTS, parts):
        total.add(rows, part)
    got = total.result()
    assert got.dtype == dtype and got.is_contiguous()
    assert torch.equal(got, _fp32_sum(parts).to(dtype))
    assert got[:, :, 6].eq(0).all()


def test_rows_of_two_parts_need_no_float32_buffer():
    """A ring step of two on zigzag: the second part adds to the first where it lies."""
    rows = [slice(0, 6), slice(3, 6)]
    parts = [torch.randn(1, 2, 6, 8).bfloat16(), torch.randn(1, 2, 3, 8).bfloat16()]
    total = GradSum(torch.empty(1, 2, 6, 8, dtype=torch.bfloat16), rows)
    for r, part in zip(rows, parts):
        total.add(r, part)
    assert total._running is None
    want = parts[0].float()
    want[:, :, 3:] += parts[1].float()
    assert torch.equal(total.result(), want.bfloat16())


def test_a_whole_part_is_the_result_uncopied_and_float32_results_keep_their_bits():
    part = torch.randn(1, 2, 5, 8).bfloat16()
    total = GradSum(torch.empty(1, 2, 5, 8, dtype=torch.bfloat16), [slice(0, 5)])
    total.add(slice(0, 5), part)
    assert total.result().data_ptr() == part.data_ptr() and torch.equal(total.result(), part)
    wide = GradSum(torch.empty(1, 2, 5, 8, dtype=torch.bfloat16), [slice(0, 5)], dtype=torch.float32)
    wide.add(slice(0, 5), part)
    assert wide.result().dtype == torch.float32 and torch.equal(wide.result(), part.float())


def test_two_half_precision_parts_of_a_float32_sum_add_in_float32():
    """1 + 2^-8 rounds to 1 in bf16: a float32 result keeps it (the all-gather's dK, summed over
    ranks after)."""
    total = GradSum(torch.empty(1, 1, 2, 1), [slice(0, 2), slice(0, 2)], dtype=torch.float32)
    total.add(slice(0, 2), torch.ones(1, 1, 2, 1, dtype=torch.bfloat16))
    total.add(slice(0, 2), torch.full((1, 1, 2, 1), 2.0 ** -8, dtype=torch.bfloat16))
    assert torch.equal(total.result(), torch.full((1, 1, 2, 1), 1 + 2.0 ** -8))


def test_a_sum_missing_a_part_raises():
    total = GradSum(torch.empty(1, 1, 4, 2), [slice(0, 4), slice(2, 4)])
    total.add(slice(0, 4), torch.randn(1, 1, 4, 2))
    with pytest.raises(RuntimeError, match=r"^GradSum.result\(\) called before every part"):
        total.result()


@pytest.mark.parametrize("layout", ["token-major", "last dim strided"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_sum_by_index_rounds_once_and_lies_as_a_gradient_of_its_input(dtype, layout):
    """``IndexedGradSum``: a call's parts added by index (two parts of one call, with rows between them
    that the call's span holds but no part names, NaN here), then a whole-rows part, summed in
    float32 and rounded once; rows no part covers are 0, and the result has the strides of a
    gradient of ``like``, whatever they are (its float32 sum keeps rows of unit stride)."""
    torch.manual_seed(1)
    like = torch.empty(1, 7, 3, 8, dtype=dtype).transpose(1, 2)  # (1, 3, 7, 8), token-major
    if layout == "last dim strided":
        like = torch.empty(1, 3, 8, 7, dtype=dtype).transpose(2, 3)
    call = SimpleNamespace(q_parts=(slice(1, 3), slice(4, 5)), q_rows=slice(1, 5))
    grad = torch.randn(1, 3, 4, 8).to(dtype)
    grad[:, :, 2] = float("nan")  # row 3, between the parts
    whole = torch.randn(1, 3, 6, 8).to(dtype)  # row 6 gets no part
    total = IndexedGradSum(like)
    total.add_call(call, "q", grad)
    total.add(slice(0, 6), whole)
    got = total.result()
    want = torch.zeros(1, 3, 7, 8)
    want[:, :, :6] = whole.float()
    want[:, :, [1, 2, 4]] += grad[:, :, [0, 1, 3]].float()
    assert got.dtype == dtype and got.stride() == torch.empty_like(like).stride()
    assert torch.equal(got, want.to(dtype)) and got[:, :, 6].eq(0).all()
    assert total.result() is got


def test_most_parts():
    assert most_parts(PARTS) == 3
    assert most_parts([slice(0, 4), slice(4, 8)]) == 1
    assert most_parts([slice(3, 3), slice(0, 4)]) == 1
    assert most_parts([]) == 0


@pytest.mark.parametrize("masking", [
    {},
    dict(is_causal=True, window=(-1, -1), q_offset=0, k_offset=0),  # a shard's causal square
    dict(is_causal=True, window=(-1, -1), q_offset=16, k_offset=0),  # later queries: a causal rectangle
    dict(is_causal=True, window=(5, 0), q_offset=3, k_offset=0),  # a window's band
    dict(is_causal=False, window=(4, 2), q_offset=0, k_offset=0),
])
def test_split_queries_covers_the_tile_pairs_once(masking):
    """The two halves see every pair the tile sees, once, and their keys are cut to what their
    queries see: a causal square's first half gets the first half of the keys."""
    n = 16
    tile = Tile(slice(0, n), slice(0, 16 + masking.get("q_offset", 0)), masking)
    parts = tile.split_queries()
    assert [p.q_rows for p in parts] == [slice(0, 8), slice(8, 16)]
    index = torch.arange(64)
    assert torch.equal(covered(parts, index, index, 64), covered([tile], index, index, 64))
    if masking:
        left, right = effective_window(masking["is_causal"], masking["window"])
        for p in parts:
            seen = visible(torch.arange(p.q_rows.start, p.q_rows.stop) + masking["q_offset"],
                           torch.arange(tile.k_rows.stop) + masking["k_offset"], left, right)
            keys = seen.any(0).nonzero().flatten()
            assert (p.k_rows.start, p.k_rows.stop) == (keys.min().item(), keys.max().item() + 1)
    if masking.get("q_offset") == 0 and masking.get("window") == (-1, -1):
        assert parts[0].k_rows == slice(0, 8)


class _Group:
    def __init__(self, rank):
        self._rank = rank

    def rank(self):
        return self._rank

    def size(self):
        return 2


@pytest.mark.parametrize("rank", [0, 1])
def test_halo_backward_sends_its_grads_before_the_second_part_of_its_own_step(monkeypatch, rank):
    """A causal zigzag ring of two ranks: the keys' transfer is waited for after the first half of
    the rank's own step, and the halo's dK and dV go home before the second half runs; they travel,
    and are received, in k's dtype (each of their rows is one call's, on both ranks)."""
    events = []
    real_backward = ring.attend_tiles_backward

    def exchange(tensors, group, tag, send_rows, receive_rows, shift=1, dtype=None):
        events.append(("send", tag, tuple(t.dtype for t in tensors), dtype))
        rows = receive_rows.stop - receive_rows.start
        return [t.new_zeros((*t.shape[:2], rows, t.shape[3]), dtype=dtype) for t in tensors], [tag]

    def attend(dout, q, k, v, out, lse, calls, *args):
        events.append(("calls", len(calls)))
        return real_backward(dout, q, k, v, out, lse, calls, *args)

    monkeypatch.setattr(ring, "_halo_exchange", exchange)
    monkeypatch.setattr(ring, "attend_tiles_backward", attend)
    monkeypatch.setattr(ring, "wait", lambda works, group: events.append(("wait", *works)))
    sharding = SequenceSharding(2, "zigzag", 8)
    q, k, v = (torch.randn(1, 2, 8, 4, dtype=torch.bfloat16) for _ in range(3))
    out, lse = torch.randn(1, 2, 8, 4, dtype=torch.bfloat16), torch.randn(1, 2, 8)
    dq, dk, dv = ring.halo_backward(torch.randn_like(out), q, k, v, out, lse, _Group(rank), 0.5, True, (-1, -1),
                                    sharding)
    grads = ("send", ring.GRAD_TAG, (torch.bfloat16, torch.bfloat16), torch.bfloat16)
    assert events == [("send", ring.KV_TAG, (torch.bfloat16, torch.bfloat16), None), ("calls", 1),
                      ("wait", ring.KV_TAG), ("calls", 1), grads, ("calls", 1), ("wait", ring.GRAD_TAG)]
    assert all(g.dtype == torch.bfloat16 and g.shape == x.shape for g, x in zip((dq, dk, dv), (q, k, v)))
