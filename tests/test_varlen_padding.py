"""Seed 002: FA2 needs d_v == d_qk, so its adapter pads V for MLA and trims what comes back. The
padding happens inside that adapter only, and only for shapes that need it. Checked on the CPU
with the aten kernels replaced by stand-ins that record what they were handed and compute the
reference result on it."""
import dataclasses
import itertools
import types

import pytest
import torch

from attn_compile.kernels import aten as aten_kernels
from attn_compile.kernels import reference
from attn_compile.kernels.aten import FlashVarlen
from attn_compile.kernels.problem import Problem
from oracle import rel_err

LENGTHS = [3, 1, 6]


def _problem(d_qk, d_v):
    q, k, v = (torch.empty(1, 4, 8, d, dtype=torch.bfloat16, device="meta") for d in (d_qk, d_qk, d_v))
    return Problem.of(q, k, v, is_causal=True)


def test_flash_takes_no_v_wider_than_q():
    assert not FlashVarlen.supports(_problem(64, 128))


@pytest.mark.parametrize("masking", [{"is_causal": True}, {"window": (2, 0)}, {}])
def test_flash_takes_no_causal_or_window_mask_on_documents_of_unequal_lengths(masking):
    """FA2 aligns such masks bottom-right where a document's query and key lengths differ; the
    op's documents start at position 0 in both (top-left)."""
    q, k, v = (torch.empty(1, 4, 8, 64, dtype=torch.bfloat16, device="meta") for _ in range(3))
    on_hopper = dict(device_type="cuda", sm=(9, 0))
    aligned = dataclasses.replace(Problem.of(q, k, v, **masking), **on_hopper)
    unaligned = dataclasses.replace(Problem.of(q, k, v, **masking, aligned=False), **on_hopper)
    assert FlashVarlen.supports(aligned)
    assert FlashVarlen.supports(unaligned) == (not masking)


class _RecordingFlash:
    """aten's _flash_attention_forward/backward over the reference kernels, recording the V each is
    handed."""

    def __init__(self):
        self.vs = []

    def _flash_attention_forward(self, q, k, v, cu_q, cu_k, max_q, max_k, dropout, is_causal, debug, *, scale,
                                 window_size_left, window_size_right):
        self.vs.append(v)
        out, lse = reference.varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, is_causal=is_causal,
                                            window=(window_size_left, window_size_right))
        return out, lse.transpose(0, 1), None, None, None

    def _flash_attention_backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout, is_causal,
                                  rng, unused, *, scale, window_size_left, window_size_right):
        self.vs.append(v)
        return reference.varlen_backward(dout, q, k, v, out, lse.transpose(0, 1), cu_q, cu_k, max_q, max_k,
                                         scale=scale, is_causal=is_causal, window=(window_size_left, window_size_right))


@pytest.mark.parametrize("d_qk, d_v", [(24, 24), (24, 16)])
def test_flash_adapter_pads_v_trims_out_and_dv(d_qk, d_v, monkeypatch):
    recording = _RecordingFlash()
    monkeypatch.setattr(aten_kernels, "aten", types.SimpleNamespace(
        _flash_attention_forward=recording._flash_attention_forward,
        _flash_attention_backward=recording._flash_attention_backward))
    torch.manual_seed(0)
    total = sum(LENGTHS)
    q, k, v = (torch.randn(total, h, d) for h, d in ((4, d_qk), (2, d_qk), (2, d_v)))
    dout = torch.randn(total, 4, d_v)
    cu = torch.tensor([0, *itertools.accumulate(LENGTHS)], dtype=torch.int32)
    masking = dict(scale=d_qk ** -0.5, is_causal=True, window=(2, 0))
    documents = (cu, cu, max(LENGTHS), max(LENGTHS))
    out, lse = FlashVarlen.forward(q, k, v, *documents, **masking)
    grads = FlashVarlen.backward(dout, q, k, v, out, lse, *documents, **masking)
    want_out, want_lse = reference.varlen_forward(q, k, v, *documents, **masking)
    want = (want_out, *reference.varlen_backward(dout, q, k, v, want_out, want_lse, *documents, **masking))
    assert [x.shape[-1] for x in recording.vs] == [d_qk, d_qk]  # V reaches the kernel at d_qk
    assert all((x is v) == (d_v == d_qk) for x in recording.vs)  # and is a padded copy only for MLA
    assert [tuple(x.shape) for x in (out, *grads)] == [tuple(x.shape) for x in want]
    assert max(rel_err(g, w) for g, w in zip((out, *grads), want)) <= 1e-6
