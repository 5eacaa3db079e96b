"""Bad input raises ValueError naming the argument and the rule, at trace time too."""
import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import attn_compile  # noqa: F401


def _qkv(h_q=8, h_kv=2, s_q=16, s_k=16, d_qk=24, d_v=16, dtype=torch.float32):
    return (torch.randn(2, h_q, s_q, d_qk, dtype=dtype), torch.randn(2, h_kv, s_k, d_qk, dtype=dtype),
            torch.randn(2, h_kv, s_k, d_v, dtype=dtype))


CASES = {
    "heads": (lambda: (*_qkv(h_q=6, h_kv=4),),
              "q heads must be a multiple of k/v heads (GQA); got h_q=6, h_kv=4"),
    "kv_length": (lambda: (*_qkv()[:2], torch.randn(2, 2, 15, 16)),
                  "k and v must have the same sequence length; got k=16, v=15"),
    "mask_broadcast": (lambda: (*_qkv(), torch.ones(16, 15, dtype=torch.bool)),
                       "attn_mask of shape (16, 15) does not broadcast to (batch, h_q, S_q, S_k) = (2, 8, 16, 16)"),
    "mask_rank": (lambda: (*_qkv(), torch.ones(1, 2, 8, 16, 16, dtype=torch.bool)),
                  "attn_mask of shape (1, 2, 8, 16, 16) does not broadcast to (batch, h_q, S_q, S_k) = (2, 8, 16, 16)"),
    "mask_dtype": (lambda: (*_qkv(), torch.ones(16, 16, dtype=torch.int64)),
                   "attn_mask must be bool (True = attend) or floating point (added to the scores); got torch.int64"),
    "window_with_mask": (lambda: (*_qkv(), torch.ones(16, 16, dtype=torch.bool), False, None, 4, 0),
                         "window=(4, 0) cannot be combined with attn_mask; fold the window into the mask or drop the mask"),
    "window_value": (lambda: (*_qkv(), None, False, None, -3, 0),
                     "window must be (left, right) with each >= 0, or -1 for unbounded; got (-3, 0)"),
    "dtype": (lambda: (_qkv()[0], *_qkv(dtype=torch.float64)[1:]),
              "q, k and v must share one floating-point dtype; got q=torch.float32, k=torch.float64, v=torch.float64"),
    "integer_dtype": (lambda: tuple(x.long() for x in _qkv()),
                      "q, k and v must share one floating-point dtype; got q=torch.int64, k=torch.int64, v=torch.int64"),
    "rank": (lambda: (_qkv()[0][0], *_qkv()[1:]),
             "q must be 4-D (batch, heads, seq, dim); got shape (8, 16, 24)"),
    "key_padding_shape": (lambda: (*_qkv(), None, True, None, -1, -1, torch.ones(2, 15, dtype=torch.bool)),
                          "key_padding_mask must be bool of shape (batch, S_k) = (2, 16) (True = a real key); "
                          "got torch.bool of shape (2, 15)"),
    "key_padding_dtype": (lambda: (*_qkv(), None, True, None, -1, -1, torch.ones(2, 16)),
                          "key_padding_mask must be bool of shape (batch, S_k) = (2, 16) (True = a real key); "
                          "got torch.float32 of shape (2, 16)"),
    "document_ids_shape": (lambda: (*_qkv(), None, True, None, -1, -1, None, 0, torch.zeros(2, 15, dtype=torch.long)),
                           "document_ids must be integer or bool of shape (batch, S) = (2, 16); got torch.int64 of "
                           "shape (2, 15)"),
    "document_ids_dtype": (lambda: (*_qkv(), None, True, None, -1, -1, None, 0, torch.zeros(2, 16)),
                           "document_ids must be integer or bool of shape (batch, S) = (2, 16); got torch.float32 of "
                           "shape (2, 16)"),
    "document_ids_lengths": (lambda: (*_qkv(s_k=20), None, True, None, -1, -1, None, 0,
                                      torch.zeros(2, 16, dtype=torch.long)),
                             "document_ids need queries and keys at the same positions (S_q == S_k, q_offset=0); "
                             "got S_q=16, S_k=20, q_offset=0"),
    "document_ids_with_mask": (lambda: (*_qkv(), torch.ones(16, 16, dtype=torch.bool), False, None, -1, -1, None, 0,
                                        torch.zeros(2, 16, dtype=torch.long)),
                               "document_ids cannot be combined with attn_mask; fold the documents into the mask or "
                               "drop the mask"),
    "softcap": (lambda: (*_qkv(), None, True, None, -1, -1, None, 0, None, -1.0),
                "softcap must be 0 (no cap) or a finite cap > 0; got -1.0"),
    "head_dim": (lambda: (torch.randn(2, 8, 16, 32), *_qkv()[1:]),
                 "q and k must have the same head dim; got q=32, k=24"),
    "batch": (lambda: (torch.randn(3, 8, 16, 24), *_qkv()[1:]),
              "q, k and v must have the same batch size; got q=3, k=2, v=2"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_message(case):
    make_args, message = CASES[case]
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        torch.ops.attn_cp.attention(*make_args())


@pytest.mark.parametrize("case", ["heads", "kv_length", "mask_broadcast", "window_with_mask"])
def test_raised_at_trace_time(case):
    make_args, message = CASES[case]
    args = make_args()
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            torch.ops.attn_cp.attention(*fake)


def test_device_mismatch():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"^q, k and v must be on one device; got q=cpu, k=meta, v=cpu$"):
        torch.ops.attn_cp.attention(q, k.to("meta"), v)


def test_mask_that_requires_grad_is_refused():
    q, k, v = (x.requires_grad_() for x in _qkv())
    bias = torch.randn(16, 16, requires_grad=True)
    with pytest.raises(ValueError, match="^attn_mask must not require grad: attn_cp.attention does not "
                                         "differentiate the mask$"):
        torch.ops.attn_cp.attention(q, k, v, bias)
