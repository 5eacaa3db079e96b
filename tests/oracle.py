"""The float64 oracle every numerical test compares against: plain softmax attention, and ways to
measure an error against it."""
import itertools

import torch


def naive_probs(q, k, *, attn_mask=None, is_causal=False, scale=None, window=(-1, -1), key_padding_mask=None,
                q_offset=0, k_offset=0, softcap=0.0):
    """float64 softmax(q k^T * scale) (B, h_q, S_q, S_k) with repeated KV heads and an explicit S_q x S_k
    mask, the scores capped first as softcap * tanh(scores / softcap) where softcap > 0; fully
    masked rows are 0."""
    q, k = q.double(), k.double()
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = q @ k.transpose(-1, -2) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    i = torch.arange(q.shape[2], device=q.device)[:, None] + q_offset
    j = torch.arange(k.shape[2], device=q.device)[None, :] + k_offset
    visible = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device)
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
        else:  # an additive -inf hides the key as False does: a row hidden entirely gets 0 and zero gradients
            scores = scores + attn_mask.double()
            visible = visible & (attn_mask != float("-inf"))
    if key_padding_mask is not None:
        visible = visible & key_padding_mask[:, None, None, :]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, dim=-1).nan_to_num(0.0)


def naive_attention(q, k, v, **masking):
    """float64 attention: naive_probs(q, k, **masking) @ v, with repeated KV heads."""
    return naive_probs(q, k, **masking) @ v.double().repeat_interleave(q.shape[1] // v.shape[1], 1)


def errors_against_oracle(q, k, v, dout, out, grads, **masking) -> list[float]:
    """rel_err of ``out`` and ``grads`` (dq, dk, dv) against float64 attention under ``masking``
    (naive_attention's arguments), the gradients taken for ``dout``."""
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    want = naive_attention(qd, kd, vd, **masking)
    want_grads = torch.autograd.grad(want, (qd, kd, vd), dout.double())
    return [rel_err(out, want), *(rel_err(g, w) for g, w in zip(grads, want_grads))]


def rel_err(got, want) -> float:
    """||got - want|| / ||want||; where the reference is exactly zero (a gradient when every query
    sees a single key), the largest absolute error instead. NaN anywhere is an infinite error (a NaN
    would otherwise slip through ``max`` and every comparison)."""
    diff = got.double() - want.double()
    if diff.isnan().any():
        return float("inf")
    norm = want.double().norm()
    return (diff.abs().max() if norm == 0 else diff.norm() / norm).item()


def magnitudes(q, k, v, dout, **masking) -> list[float]:
    """Norms of out, dq, dk, dv computed with every term's absolute value: the size they would have
    without cancellation, which is what sets the size of their rounding errors. (A row that sees one
    key has dq = 0 exactly, but dp - delta in a backward pass cancels to an fp32 residue.)"""
    q, k, v, dout = (x.detach().double() for x in (q, k, v, dout))
    scale = q.shape[-1] ** -0.5 if masking.get("scale") is None else masking["scale"]
    group = q.shape[1] // k.shape[1]
    p = naive_probs(q, k, **masking)
    k, v = (x.abs().repeat_interleave(group, 1) for x in (k, v))
    out = p @ v
    ds = p * (dout.abs() @ v.transpose(-1, -2) + (dout.abs() * out).sum(-1, keepdim=True))
    dk, dv = (x.unflatten(1, (-1, group)).sum(2) for x in (scale * ds.transpose(-1, -2) @ q.abs(),
                                                          p.transpose(-1, -2) @ dout.abs()))
    return [x.norm().item() for x in (out, scale * ds @ k, dk, dv)]


def oracle_problems(got, q, k, v, dout, *, tol, **masking) -> list[str]:
    """What is wrong with ``got`` (out, dq, dk, dv of attention on q, k, v with gradient dout)
    against the oracle: each error, relative to the size of its terms (``magnitudes``), must be
    within ``tol``. Empty if nothing is."""
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    want = naive_attention(*leaves, **masking)
    oracle = [want, *torch.autograd.grad(want, leaves, dout.double())]
    problems = []
    for name, g, o, size in zip(("out", "dq", "dk", "dv"), got, oracle, magnitudes(q, k, v, dout, **masking)):
        diff = (g.double() - o).norm().item()
        error = diff / size if size else diff
        if not error <= tol:  # a NaN anywhere fails too
            problems.append(f"{name}: error {error:.2e} > {tol:.1e} (rel_err {rel_err(g, o):.2e})")
    return problems


def varlen_reference(q, k, v, cu_q, cu_k, *, scale=None, window=(-1, -1), seqused_k=None):
    """float64 (out (T_q, H, d_v), lse (H, T_q)) of each document on its own, with FA2's masks:
    query i of a document of n_q queries and n_k keys sees keys i + n_k - n_q - left ..= i + n_k - n_q + right."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = q.shape[1] // k.shape[1]
    outs, lses = [], []
    used = seqused_k.tolist() if seqused_k is not None else None
    for d, ((q0, q1), (k0, k1)) in enumerate(zip(itertools.pairwise(cu_q.tolist()), itertools.pairwise(cu_k.tolist()))):
        k1 = k0 + used[d] if used is not None else k1
        qd = q[q0:q1].double().transpose(0, 1)
        kd, vd = (x[k0:k1].double().repeat_interleave(group, 1).transpose(0, 1) for x in (k, v))
        scores = qd @ kd.transpose(-1, -2) * scale
        i = torch.arange(q1 - q0)[:, None] + (k1 - k0) - (q1 - q0)
        j = torch.arange(k1 - k0)[None, :]
        visible = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool)
        if window[0] >= 0:
            visible &= j >= i - window[0]
        if window[1] >= 0:
            visible &= j <= i + window[1]
        scores = scores.masked_fill(~visible, float("-inf"))
        lses.append(scores.logsumexp(-1))
        outs.append((torch.softmax(scores, -1).nan_to_num(0.0) @ vd).transpose(0, 1))
    return torch.cat(outs), torch.cat(lses, dim=1)
