"""The float64 oracle every numerical test compares against: plain softmax attention."""
import torch


def naive_attention(q, k, v, *, attn_mask=None, is_causal=False, scale=None, window=(-1, -1),
                    key_padding_mask=None, q_offset=0, k_offset=0):
    """float64 attention with repeated KV heads and an explicit S_q x S_k mask; fully masked rows give 0."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = q @ k.transpose(-1, -2) * scale
    i = torch.arange(q.shape[2])[:, None] + q_offset
    j = torch.arange(k.shape[2])[None, :] + k_offset
    visible = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool)
    if is_causal:
        visible &= j <= i
    left, right = window
    if left >= 0:
        visible &= j >= i - left
    if right >= 0:
        visible &= j <= i + right
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            visible = visible & attn_mask
        else:
            scores = scores + attn_mask.double()
    if key_padding_mask is not None:
        visible = visible & key_padding_mask[:, None, None, :]
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return probs @ v


def rel_err(got, want) -> float:
    """||got - want|| / ||want||; where the reference is exactly zero (a gradient when every query
    sees a single key), the largest absolute error instead."""
    diff = got.double() - want.double()
    norm = want.double().norm()
    return (diff.abs().max() if norm == 0 else diff.norm() / norm).item()
