"""attn_cp.attention against the float64 oracle, forward and dq/dk/dv, fp32 on CPU."""
import dataclasses

import pytest
import torch

import attn_compile  # noqa: F401  (registers torch.ops.attn_cp)
from attn_compile.kernels import reference, select_kernel
from attn_compile.kernels.aten import Cudnn, Efficient, Flash, FlashVarlen
from attn_compile.kernels.problem import Problem
from oracle import naive_attention, rel_err
from shapes import HEADS, make_qkv

TOL = 1e-5


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """Several key blocks per call, so the online softmax and block skipping are exercised."""
    monkeypatch.setattr(reference, "BLOCK", 16)


def _masks(kind, batch, h_q, s_q, s_k):
    if kind == "none":
        return None
    if kind == "bool":
        mask = torch.rand(batch, 1, s_q, s_k) > 0.3
        mask[..., 0] = True  # every row sees a key; fully masked rows are tested on their own
        return mask
    return torch.randn(h_q, s_q, s_k)  # additive, broadcast over the batch


def _check(q, k, v, do, *, attn_mask=None, is_causal=False, scale=None, window=(-1, -1), key_padding_mask=None,
           document_ids=None, softcap=0.0):
    out, lse = torch.ops.attn_cp.attention(q, k, v, attn_mask, is_causal, scale, *window, key_padding_mask, 0,
                                           document_ids, softcap)
    if document_ids is not None:
        attn_mask = (document_ids[:, :, None] == document_ids[:, None, :]).unsqueeze(1)
    want = naive_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, window=window,
                           key_padding_mask=key_padding_mask, softcap=softcap)
    assert out.shape == (*q.shape[:-1], v.shape[-1]) and lse.shape == q.shape[:-1]
    assert lse.dtype == torch.float32 and out.dtype == q.dtype
    got_grads = torch.autograd.grad(out, (q, k, v), do)
    want_grads = torch.autograd.grad(want, (q, k, v), do.double())
    errors = [rel_err(out, want)] + [rel_err(g, w) for g, w in zip(got_grads, want_grads)]
    assert max(errors) <= TOL, dict(zip(("out", "dq", "dk", "dv"), errors))


CASES = [(causal, mask) for causal in (False, True) for mask in ("none", "bool", "additive")]


@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("is_causal,mask", CASES)
def test_matches_float64_reference(heads, is_causal, mask):
    torch.manual_seed(0)
    q, k, v = make_qkv(heads, s_q=40, s_k=40 if is_causal else 33)
    attn_mask = _masks(mask, 2, q.shape[1], q.shape[2], k.shape[2])
    _check(q, k, v, torch.randn(*q.shape[:-1], v.shape[-1]), attn_mask=attn_mask, is_causal=is_causal)


@pytest.mark.parametrize("heads", ["gqa", "gqa_mla"])
@pytest.mark.parametrize("is_causal,window", [(False, (5, 3)), (True, (7, -1)), (False, (-1, 0)), (False, (0, 0))])
def test_window(heads, is_causal, window):
    torch.manual_seed(1)
    q, k, v = make_qkv(heads, s_q=48)
    _check(q, k, v, torch.randn(*q.shape[:-1], v.shape[-1]), is_causal=is_causal, window=window)


@pytest.mark.parametrize("heads", ["gqa", "gqa_mla"])
@pytest.mark.parametrize("masking", [dict(is_causal=True), dict(window=(6, 2)), dict(attn_mask="bool"),
                                     dict(is_causal=True, document_ids="runs")])
def test_softcap(heads, masking):
    """Scores capped at 1.5 (scores ~ N(0, 1): the cap bends them), before each kind of mask; the
    documents run as packed varlen calls."""
    torch.manual_seed(2)
    q, k, v = make_qkv(heads, s_q=40)
    if masking.get("attn_mask") == "bool":
        masking["attn_mask"] = _masks("bool", 2, q.shape[1], 40, 40)
    if masking.get("document_ids") == "runs":
        masking["document_ids"] = DOCUMENTS["contiguous runs"]
    _check(q, k, v, torch.randn(*q.shape[:-1], v.shape[-1]), softcap=1.5, **masking)


def test_softcap_goes_to_no_aten_kernel():
    """cuDNN, flash and efficient have no softcap: the dispatch never hands them one, even where
    they would take the call without it (a Hopper GPU, described)."""
    q, k, v = (torch.empty(1, 4, 64, 64, dtype=torch.bfloat16, device="meta") for _ in range(3))
    on_hopper = dict(device_type="cuda", sm=(9, 0))
    plain = dataclasses.replace(Problem.of(q, k, v, is_causal=True), **on_hopper)
    capped = dataclasses.replace(Problem.of(q, k, v, is_causal=True, softcap=30.0), **on_hopper)
    for kernel in (Cudnn, Flash, Efficient, FlashVarlen):
        assert kernel.supports(plain) and not kernel.supports(capped), kernel.name


@pytest.mark.parametrize("heads", ["gqa", "gqa_mla"])
@pytest.mark.parametrize("is_causal,window", [(True, (-1, -1)), (True, (6, -1)), (False, (-1, -1))])
def test_key_padding_with_causal_and_window(heads, is_causal, window):
    """Left padding on batch 0, right padding on batch 1, as Hugging Face batches arrive."""
    torch.manual_seed(5)
    q, k, v = make_qkv(heads, s_q=40)
    keep = torch.ones(2, 40, dtype=torch.bool)
    keep[0, :9] = False
    keep[1, 31:] = False
    _check(q, k, v, torch.randn(*q.shape[:-1], v.shape[-1]), is_causal=is_causal, window=window,
           key_padding_mask=keep)


DOCUMENTS = {  # (B=2, S=40) ids
    "contiguous runs": torch.stack([torch.repeat_interleave(torch.arange(5), torch.tensor([1, 12, 3, 20, 4])),
                                    torch.full((40,), 3)]),
    "ids that come back": torch.stack([torch.arange(40) % 4, torch.arange(40) // 7 % 2]),
}


@pytest.mark.parametrize("documents", list(DOCUMENTS))
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("is_causal,window", [(False, (-1, -1)), (True, (-1, -1)), (True, (6, 0)), (False, (3, 3))])
@pytest.mark.parametrize("heads", ["gqa", "gqa_mla"])
def test_document_ids(heads, is_causal, window, padded, documents):
    """Contiguous runs run as one packed varlen call (key padding aside), ids that come back as a mask."""
    torch.manual_seed(6)
    q, k, v = make_qkv(heads, s_q=40)
    keep = torch.arange(40).expand(2, 40) < torch.tensor([[40], [33]]) if padded else None
    _check(q, k, v, torch.randn(*q.shape[:-1], v.shape[-1]), is_causal=is_causal, window=window,
           key_padding_mask=keep, document_ids=DOCUMENTS[documents])


@pytest.mark.parametrize("batch, seq", [(1, 0), (0, 6)], ids=["no tokens", "no batch"])
def test_document_ids_of_nothing(batch, seq):
    q, k, v = (torch.randn(batch, h, seq, 8, requires_grad=True) for h in (4, 2, 2))
    out, lse = torch.ops.attn_cp.attention(q, k, v, None, True, None, -1, -1, None, 0,
                                           torch.zeros(batch, seq, dtype=torch.long))
    assert out.shape == (batch, 4, seq, 8) and lse.shape == (batch, 4, seq)
    assert [g.shape for g in torch.autograd.grad(out, (q, k, v), torch.randn_like(out))] == [q.shape, k.shape, v.shape]


def test_documents_with_key_padding_report_the_kernel_that_runs_them():
    q, k, v = make_qkv("gqa", s_q=8)
    documents, keep = torch.zeros(2, 8, dtype=torch.long), torch.ones(2, 8, dtype=torch.bool)
    assert select_kernel(q, k, v, document_ids=documents) == "varlen:reference"  # on the CPU
    assert select_kernel(q, k, v, document_ids=documents, key_padding_mask=keep) == "reference"


@pytest.mark.parametrize("s_q,s_k", [(1, 1), (1, 37), (37, 5), (20, 50)])
def test_lengths_and_causal_alignment(s_q, s_k):
    """Causal is SDPA's top-left alignment: key j is visible to query i when j <= i."""
    torch.manual_seed(2)
    q, k, v = make_qkv("gqa_mla", s_q=s_q, s_k=s_k)
    _check(q, k, v, torch.randn(*q.shape[:-1], v.shape[-1]), is_causal=True, scale=0.37)


@pytest.mark.parametrize("window", [(-1, -1), (9, -1)])
def test_query_offset(window):
    """A query shard at global offset 24 of 64 positions against all 64 keys."""
    torch.manual_seed(6)
    q, k, v = make_qkv("gqa_mla", s_q=16, s_k=64)
    out, _ = torch.ops.attn_cp.attention(q, k, v, None, True, None, *window, None, 24)
    want = naive_attention(q, k, v, is_causal=True, window=window, q_offset=24)
    do = torch.randn_like(out)
    grads, want_grads = torch.autograd.grad(out, (q, k, v), do), torch.autograd.grad(want, (q, k, v), do.double())
    assert max([rel_err(out, want)] + [rel_err(g, w) for g, w in zip(grads, want_grads)]) <= TOL


def test_fully_masked_rows_give_zero_output_and_no_nan():
    torch.manual_seed(3)
    q, k, v = make_qkv("gqa", s_q=24)
    mask = torch.rand(24, 24) > 0.5
    mask[5] = False
    mask[17] = False
    out, lse = torch.ops.attn_cp.attention(q, k, v, mask)
    assert torch.all(out[:, :, [5, 17]] == 0) and torch.all(lse[:, :, [5, 17]] == float("-inf"))
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert all(torch.isfinite(g).all() for g in grads)
    assert torch.all(grads[0][:, :, [5, 17]] == 0)
    _check(q, k, v, torch.randn_like(out), attn_mask=mask)


def test_large_logits_stay_finite():
    torch.manual_seed(4)
    q, k, v = make_qkv("mla", s_q=32)
    _check(q, k, v, torch.randn(*q.shape[:-1], v.shape[-1]), scale=40.0)  # |scale*q.k| reaches ~1e3


def test_float64_keeps_float64_lse():
    q, k, v = make_qkv("gqa_mla", dtype=torch.float64, requires_grad=False)
    out, lse = torch.ops.attn_cp.attention(q, k, v, None, True)
    assert lse.dtype == torch.float64
    assert rel_err(out, naive_attention(q, k, v, is_causal=True)) < 1e-12
