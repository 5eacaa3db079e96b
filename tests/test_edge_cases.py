"""Numerical edge cases: queries that see no key, partial results merged where one or both sides
saw none, logits far outside softmax's comfortable range, float16, and how the ring's merge error
grows with the number of ranks."""
import json

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import attn_compile.ops  # noqa: F401  (registers torch.ops.attn_cp)
from attn_compile.cp.api import context_parallel_attention
from attn_compile.cp.layout import shard_sequence, unshard_sequence
from attn_compile.cp.merge import MergedResult
from dist_harness import run_distributed
from oracle import naive_attention, naive_probs, oracle_problems, rel_err

B, H_Q, H_KV, S_Q, S_K, D = 2, 4, 2, 12, 8, 16
FP32_ROUNDOFF = 2.0 ** -24


def _qkv(dtype=torch.float32, s_q=S_Q, s_k=S_K, d=D):
    q = torch.randn(B, H_Q, s_q, d, dtype=dtype)
    k, v = (torch.randn(B, H_KV, s_k, d, dtype=dtype) for _ in range(2))
    return [x.requires_grad_() for x in (q, k, v)]


def _bool_mask():
    mask = torch.rand(B, 1, S_Q, S_K) < 0.6
    mask[:, :, [0, 5]] = False
    return mask


def _key_padding():
    padding = torch.rand(B, S_K) < 0.7
    padding[1] = False  # every query of batch 1 sees nothing
    return padding


# Each hides whole rows a different way: (op keyword arguments, an SDPA call masking the same keys).
# The window (2, 0) with S_q > S_k hides queries i >= S_k + 2; the compiled SDPA builds that mask
# from aranges, which the passes turn back into a causal window.
def _window_mask(q, k):
    i, j = torch.arange(q.shape[2])[:, None], torch.arange(k.shape[2])[None, :]
    return (j <= i) & (j >= i - 2)


MASKINGS = {
    "bool attn_mask": (lambda: dict(attn_mask=_bool_mask()),
                       lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)),
    "window": (lambda: dict(window=(2, 0)),
               lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=_window_mask(q, k), enable_gqa=True)),
    "key_padding_mask": (lambda: dict(key_padding_mask=_key_padding()),
                         lambda q, k, v, p: F.scaled_dot_product_attention(q, k, v, attn_mask=p[:, None, None, :],
                                                                           enable_gqa=True)),
}


def _op(q, k, v, attn_mask=None, window=(-1, -1), key_padding_mask=None):
    return torch.ops.attn_cp.attention(q, k, v, attn_mask, False, None, *window, key_padding_mask=key_padding_mask)


def _check_hidden_rows(out, grads, q, k, v, dout, masking):
    """Rows that see no key: out exactly 0; everything finite; all of it equal to the oracle."""
    hidden = naive_probs(q, k, **masking).sum(-1) == 0
    assert hidden.any() and not hidden.all()
    assert out[hidden].eq(0).all() and grads[0][hidden].eq(0).all()
    assert all(x.isfinite().all() for x in (out, *grads))
    problems = oracle_problems([out, *grads], q, k, v, dout, tol=1e-5, **masking)
    assert not problems, problems
    return hidden


@pytest.mark.parametrize("masking", list(MASKINGS))
def test_rows_that_see_no_key_local_op(masking):
    torch.manual_seed(0)
    q, k, v = _qkv()
    kwargs = MASKINGS[masking][0]()
    out, lse = _op(q, k, v, **kwargs)
    dout = torch.randn_like(out)
    hidden = _check_hidden_rows(out, torch.autograd.grad(out, (q, k, v), dout), q, k, v, dout, kwargs)
    assert lse[hidden].eq(float("-inf")).all() and lse[~hidden].isfinite().all()


@pytest.mark.parametrize("masking", list(MASKINGS))
def test_rows_that_see_no_key_compiled_sdpa(masking, inner_graphs):
    torch.manual_seed(1)
    q, k, v = _qkv()
    kwargs, sdpa = MASKINGS[masking][0](), MASKINGS[masking][1]
    data = [x for x in (kwargs.get("attn_mask"), kwargs.get("key_padding_mask")) if x is not None]
    out = torch.compile(sdpa, backend="attn_cp", fullgraph=True)(q, k, v, *data)
    dout = torch.randn_like(out)
    _check_hidden_rows(out, torch.autograd.grad(out, (q, k, v), dout), q, k, v, dout, kwargs)
    targets = [n.target for gm in inner_graphs for n in gm.graph.nodes]
    assert torch.ops.attn_cp.attention.default in targets


def _oracle_lse(q, k, mask, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = q.double() @ k.double().repeat_interleave(q.shape[1] // k.shape[1], 1).mT * scale
    return scores.masked_fill(~mask, float("-inf")).logsumexp(-1)


def test_merge_where_one_or_both_sides_saw_no_key():
    """Two ring steps, each over half the keys, merged from the empty start: row 0 sees no key in
    either half (both sides -inf at every merge), row 1 none in the first, row 2 none in the second."""
    torch.manual_seed(2)
    q, k, v = (x.detach() for x in _qkv())
    mask = torch.rand(B, 1, S_Q, S_K) < 0.6
    first, second = slice(0, S_K // 2), slice(S_K // 2, S_K)
    mask[:, :, 3:, [0, -1]] = True  # the other rows see keys in both halves
    mask[:, :, 0] = False
    mask[:, :, 1, first] = False
    mask[:, :, 2, second] = False
    rows = slice(0, S_Q)
    result = MergedResult(q, v, [rows, rows])
    for keys in (first, second):
        result.add(rows, *_op(q, k[:, :, keys], v[:, :, keys], attn_mask=mask[..., keys]))
    out, lse = result.out, result.lse
    want, want_lse = naive_attention(q, k, v, attn_mask=mask), _oracle_lse(q, k, mask)
    assert not out.isnan().any() and not lse.isnan().any()
    assert out[:, :, 0].eq(0).all() and lse[:, :, 0].eq(float("-inf")).all()
    assert rel_err(out, want) <= 1e-5
    assert lse[:, :, 1:].isfinite().all() and rel_err(lse[:, :, 1:], want_lse[:, :, 1:]) <= 1e-6


def _integer_valued(shape, bound, dtype):
    """Random integers in [-bound, bound]: q k^T is then exact in fp32, so the oracle and the
    op see the very same logits, however large."""
    return torch.randint(-bound, bound + 1, shape).to(dtype).requires_grad_()


def _check_causal(q, k, v, scale, tol, grad_tol):
    """Causal attention: everything finite, out within ``tol`` of the oracle, the LSE within 1e-6,
    the gradients within ``grad_tol`` (relative to the size of their terms)."""
    out, lse = torch.ops.attn_cp.attention(q, k, v, None, True, scale)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert all(x.isfinite().all() for x in (out, lse, *grads))
    causal = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
    errors = (rel_err(out, naive_attention(q, k, v, is_causal=True, scale=scale)),
              rel_err(lse, _oracle_lse(q, k, causal, scale)))
    problems = oracle_problems([out, *grads], q, k, v, dout, tol=grad_tol, is_causal=True, scale=scale)
    assert errors[0] <= tol and errors[1] <= 1e-6 and not problems, (errors, problems)


def test_large_logits_float32():
    """|scale q.k| up to ~1.3e4. The forward normalizes by the row sum, so out keeps fp32 accuracy.
    The backward recomputes p = exp(s - lse) from the fp32 LSE, whose rounding at |lse| ~ 1.3e4 is
    2^-24 * 1.3e4 ~ 8e-4 relative per probability: what a one-ulp change of q does to such logits
    anyway, so that bounds the gradients' error (measured: 6e-6)."""
    torch.manual_seed(4)
    q, k, v = (_integer_valued((B, h, 64, D), 12, torch.float32) for h in (H_Q, H_KV, H_KV))
    scale = 16.0
    largest = (q.detach() @ k.detach().repeat_interleave(H_Q // H_KV, 1).mT * scale).abs().max().item()
    assert largest >= 1e4
    _check_causal(q, k, v, scale, tol=1e-5, grad_tol=FP32_ROUNDOFF * largest)


FP16_TOL = 2e-3  # 4x float16's unit roundoff 2^-11: the op accumulates in fp32 and rounds once at the end


def test_float16():
    torch.manual_seed(5)
    _check_causal(*_qkv(torch.float16, s_q=64, s_k=64), None, tol=FP16_TOL, grad_tol=FP16_TOL)


def test_float16_products_beyond_its_range():
    """q.k beyond float16's largest value 65504 (fp16 arithmetic would give inf), logits up to ~1.7e4;
    the LSE's rounding there (2^-24 * 1.7e4 ~ 1e-3, see the float32 case) stays within FP16_TOL too."""
    torch.manual_seed(6)
    q, k = (_integer_valued((B, h, 64, 32), 128, torch.float16) for h in (H_Q, H_KV))
    v = torch.randn(B, H_KV, 64, 32, dtype=torch.float16, requires_grad=True)
    products = q.detach().double() @ k.detach().double().repeat_interleave(H_Q // H_KV, 1).mT
    assert products.abs().max() > torch.finfo(torch.float16).max
    _check_causal(q, k, v, 0.125, tol=FP16_TOL, grad_tol=FP16_TOL)


def _ring_errors(rank, world, path):
    """Causal zigzag ring attention on the same global inputs at every world size; rank 0 writes the
    relative errors of out, dq, dk, dv against the oracle and against the local op."""
    torch.manual_seed(7)
    q, k, v = (torch.randn(1, h, 256, 32) for h in (H_Q, H_KV, H_KV))
    dout = torch.randn(1, H_Q, 256, 32)
    group = dist.group.WORLD
    shards = [shard_sequence(x, group).requires_grad_() for x in (q, k, v)]
    out = context_parallel_attention(*shards, group=group, strategy="ring", is_causal=True, layout="zigzag")
    grads = torch.autograd.grad(out, shards, shard_sequence(dout, group))
    got = [unshard_sequence(x.detach(), group) for x in (out, *grads)]
    results = {}
    for name, dtype in (("oracle", torch.float64), ("local op", torch.float32)):
        leaves = [x.to(dtype).requires_grad_() for x in (q, k, v)]
        want = (naive_attention(*leaves, is_causal=True) if dtype == torch.float64 else
                torch.ops.attn_cp.attention(*leaves, None, True)[0])
        results[name] = [want, *torch.autograd.grad(want, leaves, dout.to(dtype))]
    if rank == 0:
        errors = {f"{tensor} vs {name}": rel_err(g, w) for name, wants in results.items()
                  for tensor, g, w in zip(("out", "dq", "dk", "dv"), got, wants)}
        with open(path, "w") as f:
            json.dump(errors, f)


@pytest.mark.timeout(240)
def test_ring_merge_error_at_world_2_and_4(tmp_path, record_property):
    errors = {}
    for world in (2, 4):
        path = tmp_path / f"world_{world}.json"
        run_distributed(_ring_errors, world, str(path))
        errors[world] = json.loads(path.read_text())
    record_property("ring_relative_errors", errors)
    report = "; ".join(f"world {world}: " + ", ".join(f"{name} {e:.2e}" for name, e in errs.items())
                       for world, errs in errors.items())
    print(report)
    assert max(e for errs in errors.values() for e in errs.values()) <= 1e-5, report
