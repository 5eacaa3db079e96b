"""Document ids on FlashAttention-4's varlen kernel (kernels/fa4_segments.py) on the CPU: the
segment tables made on the device (kernels/triton_segments.py, under the interpreter), which
problems the path takes, and the whole path (FA4's rows through the stand-in of
test_fa4_adapter.py, the marked rows through the Triton kernels) against the float64 oracle, with
every buffer the path allocates poisoned. The real FA4 runs in tests/test_gpu_fa4.py."""
import pytest
import torch
import triton.language as tl

from attn_compile.kernels import fa4_segments, triton_run_chunks
from attn_compile.kernels.documents import same_document_mask
from attn_compile.kernels.triton_segments import document_segments
from attn_compile.kernels.triton_tiles import mask_args
from oracle import errors_against_oracle
from shapes import document_runs
from test_fa4_adapter import _on, _problem, poisoned_empty, standin  # noqa: F401 (fixtures)


def assert_tables(segments, ids):
    """The Triton kernels' arguments made beside the segments are those ``mask_args`` makes from
    the marks as key padding and the ids (spans, runs flags, padding bounds)."""
    expected = mask_args(segments.marked, ids)
    assert len(segments.tables) == len(expected)
    for made, want in zip(segments.tables, expected):
        assert torch.equal(made, want) if isinstance(want, torch.Tensor) else made == want


def test_document_segments():
    """A row's runs fill its slots in order and the empty slots sit at its end; a row whose ids fall
    or that has more runs than the budget gives FA4 no rows and is marked throughout."""
    ids = torch.stack([document_runs(3, 2, 5), document_runs(10),
                       torch.tensor([0, 1, 0, 0, 0, 0, 0, 0, 0, 0]),  # id 0 comes back
                       document_runs(*[1] * 10)])  # 10 runs
    segments = document_segments(ids, 4)
    assert segments.starts.tolist() == [0, 3, 5, 10, 10, 20, 20, 20, 20, 21, 22, 30, 30, 31, 32, 33, 40]
    assert segments.used.tolist() == [3, 2, 5, 0, 10, 0, 0, 0] + [0] * 8
    assert segments.marked.tolist() == [[False] * 10] * 2 + [[True] * 10] * 2
    assert_tables(segments, ids)
    bool_ids = document_segments(ids[:1].bool(), 3)  # False, then True: two runs
    assert bool_ids.starts.tolist() == [0, 3, 10, 10] and bool_ids.used.tolist() == [3, 7, 0]
    assert_tables(bool_ids, ids[:1].bool())


@pytest.mark.parametrize("summary_block", [None, 2], ids=["one read", "summaries read 2 at a time"])
def test_document_segments_across_chunks(summary_block, monkeypatch):
    """Rows of several chunks (``triton_run_chunks.CHUNK``, 1024 ids): runs that cross a chunk's
    edges, a chunk with no run start, and the counts that decide the marks summed over the row (a
    fall in the last chunk; a budget exceeded only by the row's runs together). Rows of more than
    a million ids have more summaries than a program reads at once: read 2 at a time, the 4 chunks
    here take that loop too."""
    if summary_block is not None:
        monkeypatch.setattr(triton_run_chunks, "SUMMARY_BLOCK", tl.constexpr(summary_block))
    lengths = (5, 1019, 2000, 500, 76)  # runs cut at 5, 1024 (a chunk's edge), 3024, 3524
    rising = document_runs(*lengths)
    falling = rising.clone()
    falling[3524:] = 2  # the last run's id falls back to the third's: five runs still
    over = document_runs(*[700] * 5, 100)  # 6 runs, 1 or 2 in each chunk
    ids = torch.stack([rising, falling, over])
    segments = document_segments(ids, 5)
    assert_tables(segments, ids)
    starts, used = segments.starts.view(-1)[:-1].view(3, 5), segments.used.view(3, 5)
    s = 3600
    assert starts[0].tolist() == [0, 5, 1024, 3024, 3524] and used[0].tolist() == list(lengths)
    assert used[1:].count_nonzero() == 0 and segments.starts[-1] == 3 * s
    assert starts[1].tolist() == [s + p for p in (0, 5, 1024, 3024, 3524)]
    assert starts[2].tolist() == [2 * s + 700 * i for i in range(5)]
    assert segments.marked.tolist() == [[False] * s] + [[True] * s] * 2


SUPPORTS = {  # name: (problem, facts, taken)
    "causal": (_problem(is_causal=True, document_ids=torch.empty(0)), {}, True),
    "gqa, window": (_problem(h_q=8, h_kv=2, window=(8, 0), document_ids=torch.empty(0)), {}, True),
    "softcap": (_problem(is_causal=True, softcap=30.0, document_ids=torch.empty(0)), {}, True),
    "d 256": (_problem(d_qk=256, d_v=256, document_ids=torch.empty(0)), {}, True),
    "mla backward": (_problem(d_qk=192, d_v=128, document_ids=torch.empty(0), backward=True), {}, True),
    "gqa+mla backward": (_problem(h_q=8, h_kv=2, d_qk=192, d_v=128, document_ids=torch.empty(0), backward=True),
                         {}, False),
    "no document ids": (_problem(is_causal=True), {}, False),
    "document ids and key padding": (_problem(key_padding_mask=torch.empty(0), document_ids=torch.empty(0)), {},
                                     False),
    "position offset": (_problem(is_causal=True, q_offset=32, k_offset=0, document_ids=torch.empty(0)), {}, False),
    "before sm90": (_problem(is_causal=True, document_ids=torch.empty(0)), {"sm": (8, 0)}, False),
    "float32": (_problem(dtype=torch.float32, document_ids=torch.empty(0)), {}, False),
}


@pytest.mark.parametrize("name", list(SUPPORTS))
def test_supports(standin, name):
    problem, facts, taken = SUPPORTS[name]
    assert fa4_segments.supports(_on(problem, **facts)) is taken


def test_refused_without_triton(standin, monkeypatch):
    """The segments and the marked rows are Triton kernels: without Triton the path takes nothing."""
    monkeypatch.setattr(fa4_segments, "triton_attention", None)
    assert not fa4_segments.supports(_on(_problem(is_causal=True, document_ids=torch.empty(0))))


IDS = {  # name: (B, S) ids of S = 70, and which rows FA4 runs
    "runs": (torch.stack([document_runs(9, 30, 1, 30), document_runs(70)]), [True, True]),
    "ids that come back": (torch.stack([document_runs(9, 30, 31), torch.arange(70) // 20 % 2]), [True, False]),
    "bool ids": (torch.stack([torch.arange(70) >= 33, torch.arange(70) % 40 < 25]), [True, False]),
    "more runs than the budget": (torch.stack([document_runs(*[5] * 14), document_runs(35, 35)]), [False, True]),
}

MASKING = {
    "causal": dict(is_causal=True),
    "full": {},
    "causal window 9": dict(is_causal=True, window=(9, -1)),
    "window (6, 3)": dict(window=(6, 3)),
    "causal, softcap": dict(is_causal=True, softcap=2.0),
}


@pytest.mark.parametrize("masking", list(MASKING))
@pytest.mark.parametrize("ids", list(IDS))
def test_path_against_oracle(standin, poisoned_empty, monkeypatch, ids, masking):
    """GQA, MLA head dims, projected (B, S, H, D) views; a budget of one segment per 8 tokens, so
    a row of 14 documents in 70 tokens goes to Triton."""
    monkeypatch.setattr(fa4_segments, "MEAN_LENGTH", {False: 8, True: 8})
    torch.manual_seed(1)
    ids, by_fa4 = IDS[ids]
    q, k, v = (torch.randn(2, 70, h, d).transpose(1, 2) for h, d in ((4, 24), (2, 24), (2, 16)))
    masking = dict(MASKING[masking], document_ids=ids)
    scale = 24 ** -0.5
    out, lse = fa4_segments.attention_forward(q, k, v, scale=scale, **masking)
    dout = torch.randn_like(out)
    grads = fa4_segments.attention_backward(dout, q, k, v, out, lse, scale=scale, **masking)
    assert [call["direction"] for call in standin.calls] == ["fwd", "bwd"]
    for call in standin.calls:  # FA4 is handed the unmarked rows' runs, the marked rows none
        rows = call["seqused_q"].view(2, -1).sum(1)
        assert rows.tolist() == [70 if fa4 else 0 for fa4 in by_fa4]
        assert torch.equal(call["seqused_q"], call["seqused_k"])
    assert out.stride() == torch.empty(2, 70, 4, 16).transpose(1, 2).stride()  # q's memory order
    oracle_masking = {**masking, "attn_mask": same_document_mask(masking["document_ids"])}
    del oracle_masking["document_ids"]
    errors = errors_against_oracle(q, k, v, dout, out, grads, **oracle_masking)
    assert max(errors) <= 1e-5, errors
    for grad, x in zip(grads, (q, k, v)):
        assert grad.stride() == torch.empty_like(x).stride()
