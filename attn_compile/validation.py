"""Argument checks for the attention op: every message names the argument and the rule.

They run on real and fake tensors alike, so a bad call fails at trace time where it can.
"""
import math

import torch


def _fail(message: str):
    raise ValueError(message)


def check_attention_args(q, k, v, attn_mask, window, key_padding_mask=None, document_ids=None, q_offset=0,
                         softcap=0.0):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4:
            _fail(f"{name} must be 4-D (batch, heads, seq, dim); got shape {tuple(x.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        _fail(f"q, k and v must share one floating-point dtype; got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if not (q.device == k.device == v.device):
        _fail(f"q, k and v must be on one device; got q={q.device}, k={k.device}, v={v.device}")
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        _fail(f"q, k and v must have the same batch size; got q={q.shape[0]}, k={k.shape[0]}, v={v.shape[0]}")
    if k.shape[1] != v.shape[1]:
        _fail(f"k and v must have the same number of heads; got k={k.shape[1]}, v={v.shape[1]}")
    if k.shape[2] != v.shape[2]:
        _fail(f"k and v must have the same sequence length; got k={k.shape[2]}, v={v.shape[2]}")
    if q.shape[1] % k.shape[1] != 0:
        _fail(f"q heads must be a multiple of k/v heads (GQA); got h_q={q.shape[1]}, h_kv={k.shape[1]}")
    if q.shape[-1] != k.shape[-1]:
        _fail(f"q and k must have the same head dim; got q={q.shape[-1]}, k={k.shape[-1]}")
    left, right = window
    if left < -1 or right < -1:
        _fail(f"window must be (left, right) with each >= 0, or -1 for unbounded; got {tuple(window)}")
    if not 0 <= softcap < math.inf:
        _fail(f"softcap must be 0 (no cap) or a finite cap > 0; got {softcap}")
    if attn_mask is not None:
        _check_mask(q, k, attn_mask, window)
    if key_padding_mask is not None:
        _check_key_padding(q, k, key_padding_mask)
    if document_ids is not None:
        _check_documents(q, k, attn_mask, document_ids, q_offset)


def _check_documents(q, k, attn_mask, document_ids, q_offset):
    expected = (q.shape[0], q.shape[2])
    if document_ids.dtype.is_floating_point or document_ids.dtype.is_complex or \
            tuple(document_ids.shape) != expected:
        _fail(f"document_ids must be integer or bool of shape (batch, S) = {expected}; got {document_ids.dtype} "
              f"of shape {tuple(document_ids.shape)}")
    if document_ids.device != q.device:
        _fail(f"document_ids must be on q's device {q.device}; got {document_ids.device}")
    if q.shape[2] != k.shape[2] or q_offset:
        _fail(f"document_ids need queries and keys at the same positions (S_q == S_k, q_offset=0); got "
              f"S_q={q.shape[2]}, S_k={k.shape[2]}, q_offset={q_offset}")
    if attn_mask is not None:
        _fail("document_ids cannot be combined with attn_mask; fold the documents into the mask or drop the mask")


def _check_key_padding(q, k, key_padding_mask):
    expected = (q.shape[0], k.shape[2])
    if key_padding_mask.dtype != torch.bool or tuple(key_padding_mask.shape) != expected:
        _fail(f"key_padding_mask must be bool of shape (batch, S_k) = {expected} (True = a real key); "
              f"got {key_padding_mask.dtype} of shape {tuple(key_padding_mask.shape)}")
    if key_padding_mask.device != q.device:
        _fail(f"key_padding_mask must be on q's device {q.device}; got {key_padding_mask.device}")


def _check_mask(q, k, attn_mask, window):
    if tuple(window) != (-1, -1):
        _fail(f"window={tuple(window)} cannot be combined with attn_mask; fold the window into the mask or drop the mask")
    if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
        _fail(f"attn_mask must be bool (True = attend) or floating point (added to the scores); got {attn_mask.dtype}")
    if attn_mask.device != q.device:
        _fail(f"attn_mask must be on q's device {q.device}; got {attn_mask.device}")
    target = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    shape = tuple(attn_mask.shape)
    if len(shape) > 4 or any(m != 1 and m != t for m, t in zip(reversed(shape), reversed(target))):
        _fail(f"attn_mask of shape {shape} does not broadcast to (batch, h_q, S_q, S_k) = {target}")
