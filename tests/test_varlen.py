"""varlen_attention without a group: packed documents against a per-document float64 oracle."""
import functools
import itertools
import re

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._subclasses.fake_tensor import FakeTensorMode

import attn_compile
from attn_compile import varlen_attention
from attn_compile.backend import attn_cp
from oracle import naive_attention, rel_err

HEADS = {"mha": (4, 4, 16, 16), "gqa": (8, 2, 16, 16), "mla": (4, 4, 24, 16), "gqa_mla": (8, 2, 24, 16)}
WINDOWS = [(8, 0), (8, 8), (-1, -1)]
LONG = 300  # more keys than the reference kernel's block (256): one document spans two key blocks
BOUND = 1e-5


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The ops here are tiny and many: a second intra-op thread only synchronises, and on a shared,
    loaded machine makes this file ten times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _cu(lengths):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def _self_lengths(generator):
    """A 1-token document, random ones, an empty one in the middle and a long one."""
    short = torch.randint(2, 20, (4,), generator=generator).tolist()
    return [1, short[0], short[1], 0, LONG, short[2], 1, short[3]]


def _cross_lengths(q_lengths, generator):
    """Other key lengths per document: queries with no keys (document 1), keys with no queries
    (the empty query document 3), and a long key document."""
    lengths = torch.randint(1, 40, (len(q_lengths),), generator=generator).tolist()
    lengths[1], lengths[4] = 0, LONG + 17
    return lengths


def _documents(x, cu):
    """Each document's rows of a packed (total, H, D) tensor as (1, H, L, D)."""
    return [x[a:b].transpose(0, 1).unsqueeze(0) for a, b in itertools.pairwise(cu.tolist())]


def _oracle_lse(q, k, scale, is_causal, window):
    """float64 log-sum-exp (1, H, L_q) of one document's visible scores; -inf where nothing is visible."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    scores = q.double() @ k.double().transpose(-1, -2) * scale
    i, j = torch.arange(q.shape[2])[:, None], torch.arange(k.shape[2])[None, :]
    left, right = window
    hidden = ((j > i) & is_causal) | ((j < i - left) & (left >= 0)) | ((j > i + right) & (right >= 0))
    return scores.masked_fill(hidden, float("-inf")).logsumexp(-1)


def _oracle(q, k, v, cu_q, cu_k, is_causal, window, scale):
    """(out, lse) in float64, packed like varlen_attention's, from one naive_attention per document."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    outs, lses = [], []
    for qd, kd, vd in zip(_documents(q, cu_q), _documents(k, cu_k), _documents(v, cu_k)):
        outs.append(naive_attention(qd, kd, vd, is_causal=is_causal, window=window, scale=scale)[0].transpose(0, 1))
        lses.append(_oracle_lse(qd, kd, scale, is_causal, window)[0].transpose(0, 1))
    return torch.cat(outs), torch.cat(lses)


def _lse_err(got, want):
    assert torch.equal(got.isinf(), want.isinf()), "rows that see no key must have lse -inf, and only they"
    finite = want.isfinite()
    return rel_err(got[finite], want[finite])


def _errors(heads, q_lengths, k_lengths, is_causal, window, scale=None):
    """Relative errors of out, lse, dq, dk, dv against the oracle, after checking the shapes."""
    h_q, h_kv, d_qk, d_v = HEADS[heads]
    cu_q, cu_k = _cu(q_lengths), _cu(k_lengths)
    total_q, total_k = sum(q_lengths), sum(k_lengths)
    q, k, v = (torch.randn(*shape, requires_grad=True)
               for shape in ((total_q, h_q, d_qk), (total_k, h_kv, d_qk), (total_k, h_kv, d_v)))
    out, lse = varlen_attention(q, k, v, cu_q, cu_k, max(q_lengths), max(k_lengths), is_causal=is_causal,
                                window=window, scale=scale, return_lse=True)
    assert out.shape == (total_q, h_q, d_v) and out.dtype == torch.float32
    assert lse.shape == (total_q, h_q) and lse.dtype == torch.float32
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    want, want_lse = _oracle(*leaves, cu_q, cu_k, is_causal, window, scale)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    want_grads = torch.autograd.grad(want, leaves, dout.double())
    errors = {"out": rel_err(out, want), "lse": _lse_err(lse, want_lse)}
    errors.update({name: rel_err(g, w) for name, g, w in zip(("dq", "dk", "dv"), grads, want_grads)})
    return errors


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("heads", list(HEADS))
def test_matches_oracle(heads, is_causal, window):
    torch.manual_seed(0)
    lengths = _self_lengths(torch.Generator().manual_seed(1))
    errors = _errors(heads, lengths, lengths, is_causal, window)
    assert max(errors.values()) <= BOUND, errors


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("heads", list(HEADS))
def test_cross_attention_matches_oracle(heads, is_causal, window):
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(2)
    q_lengths = _self_lengths(generator)
    errors = _errors(heads, q_lengths, _cross_lengths(q_lengths, generator), is_causal, window, scale=0.3)
    assert max(errors.values()) <= BOUND, errors


def _op_args(is_causal, window, dtype=torch.float32):
    """Arguments of attn_cp::varlen_attention for a small GQA+MLA cross-attention pack."""
    q_lengths, k_lengths = [1, 5, 0, 4, 3], [2, 5, 3, 6, 0]
    q = torch.randn(sum(q_lengths), 4, 6, dtype=dtype, requires_grad=True)
    k = torch.randn(sum(k_lengths), 2, 6, dtype=dtype, requires_grad=True)
    v = torch.randn(sum(k_lengths), 2, 4, dtype=dtype, requires_grad=True)
    return (q, k, v, _cu(q_lengths), _cu(k_lengths), max(q_lengths), max(k_lengths), is_causal, 0.4, *window, False)


@pytest.mark.parametrize("is_causal, window", [(True, (2, 0)), (False, (-1, -1)), (False, (1, 2))])
def test_opcheck(is_causal, window):
    torch.manual_seed(0)
    args = _op_args(is_causal, window)
    torch.library.opcheck(torch.ops.attn_cp.varlen_attention.default, args)
    out, lse = torch.ops.attn_cp.varlen_attention(*args)
    backward_args = (torch.randn_like(out), *(x.detach() for x in args[:3]), out.detach(), lse, *args[3:-1])
    torch.library.opcheck(torch.ops.attn_cp.varlen_attention_backward.default, backward_args)


@pytest.mark.parametrize("is_causal, window", [(True, (2, 0)), (False, (1, 2))])
def test_gradcheck(is_causal, window):
    torch.manual_seed(0)
    q, k, v, *rest = _op_args(is_causal, window, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda q, k, v: torch.ops.attn_cp.varlen_attention(q, k, v, *rest)[0], (q, k, v))


def test_compiled_matches_eager_and_new_document_lengths_do_not_recompile():
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("attn_cp")

    def fn(q, k, v, cu_seqlens):
        return varlen_attention(q, k, v, cu_seqlens, cu_seqlens, 16, 16, is_causal=True, window=(8, 0))

    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    for lengths in ([16, 4, 0, 12], [1, 16, 15, 0], [16, 16, 0, 0]):  # 32 tokens, longest 16
        q, k, v = (torch.randn(32, h, d, requires_grad=True) for h, d in ((8, 24), (2, 24), (2, 16)))
        got, want = compiled(q, k, v, _cu(lengths)), fn(q, k, v, _cu(lengths))
        assert torch.equal(got, want)
        dout = torch.randn_like(got)
        for g, w in zip(torch.autograd.grad(got, (q, k, v), dout), torch.autograd.grad(want, (q, k, v), dout)):
            assert torch.equal(g, w)
    assert counter.frame_count == 1


# Packed batches of 32 tokens as a training loop draws them: the document count (cu_seqlens's
# length) and max_seqlen change from step to step. Step 1 changes the count alone, step 2 max_seqlen
# alone, then both, one document, and documents of one token.
_PACKED_STEPS = ([8, 8, 8, 8], [4, 4, 8, 8, 8], [2, 30], [5, 5, 6, 7, 9], [32], [1] * 32, [3, 29], [10, 9, 13])


@pytest.mark.parametrize("dynamic, graphs", [(None, [1, 2, 3, 3, 3, 3, 3, 3]), (True, [1] * 8)])
def test_packed_batches_recompile_only_as_the_readme_says(dynamic, graphs):
    """Dynamo compiles the first call for its inputs as they are: the first call that changes the
    document count compiles again with it symbolic, the first that changes max_seqlen likewise, and
    no later call does; with dynamic=True the first graph takes every batch."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(functools.partial(attn_cp, options={"inner": "aot_eager"}))

    def fn(q, k, v, cu_seqlens, max_seqlen):
        return varlen_attention(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, is_causal=True)

    compiled = torch.compile(fn, backend=counter, dynamic=dynamic, fullgraph=True)
    counts = []
    for lengths in _PACKED_STEPS:
        q, k, v = (torch.randn(32, h, 8) for h in (4, 2, 2))
        assert torch.equal(compiled(q, k, v, _cu(lengths), max(lengths)), fn(q, k, v, _cu(lengths), max(lengths)))
        counts.append(counter.frame_count)
    assert counts == graphs


def _args(q_lengths=(3, 0, 7), k_lengths=(3, 0, 7), h_q=8, d_q=24, **overrides):
    """Valid (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), with some replaced."""
    args = dict(q=torch.randn(sum(q_lengths), h_q, d_q), k=torch.randn(sum(k_lengths), 2, 24),
                v=torch.randn(sum(k_lengths), 2, 16), cu_seqlens_q=_cu(q_lengths), cu_seqlens_k=_cu(k_lengths),
                max_seqlen_q=max(q_lengths), max_seqlen_k=max(k_lengths))
    args.update(overrides)
    return list(args.values())


def _i32(*values):
    return torch.tensor(values, dtype=torch.int32)


CU_FORM = "must be a 1-D int32 tensor of (documents + 1) cumulative lengths starting at 0; got"
CASES = {
    "start": (lambda: _args(cu_seqlens_q=_i32(1, 3, 3, 10)), {}, "cu_seqlens_q must start at 0; got 1"),
    "decreasing": (lambda: _args(cu_seqlens_k=_i32(0, 5, 3, 10)), {},
                   "cu_seqlens_k must be non-decreasing (cumulative document lengths); got 5 then 3 at index 2"),
    "end": (lambda: _args(cu_seqlens_q=_i32(0, 3, 3, 9)), {},
            "cu_seqlens_q must end at the token count q.shape[0] = 10; got 9"),
    "end_k": (lambda: _args(k_lengths=(3, 0, 8), cu_seqlens_k=_i32(0, 3, 3, 10)), {},
              "cu_seqlens_k must end at the token count k.shape[0] = 11; got 10"),
    "int64": (lambda: _args(cu_seqlens_q=_cu([3, 0, 7]).long()), {},
              f"cu_seqlens_q {CU_FORM} torch.int64 of shape (4,)"),
    "2d": (lambda: _args(cu_seqlens_k=_cu([3, 0, 7])[None]), {}, f"cu_seqlens_k {CU_FORM} torch.int32 of shape (1, 4)"),
    "no_documents": (lambda: _args(cu_seqlens_q=_i32(0)), {}, f"cu_seqlens_q {CU_FORM} torch.int32 of shape (1,)"),
    "document_count": (lambda: _args(k_lengths=(3, 7)), {},
                       "cu_seqlens_q and cu_seqlens_k must count the same documents; got 3 and 2"),
    "cu_device": (lambda: _args(cu_seqlens_k=_cu([3, 0, 7]).to("meta")), {},
                  "cu_seqlens_k must be on q's device cpu; got meta"),
    "max_seqlen_q": (lambda: _args(max_seqlen_q=6), {},
                     "max_seqlen_q must be at least the longest document in cu_seqlens_q, 7 tokens; got 6"),
    "max_seqlen_k": (lambda: _args(k_lengths=(9, 0, 1), max_seqlen_k=7), {},
                     "max_seqlen_k must be at least the longest document in cu_seqlens_k, 9 tokens; got 7"),
    "max_seqlen_negative": (lambda: _args(max_seqlen_k=-1), {}, "max_seqlen_k must be a length >= 0; got -1"),
    "q_4d": (lambda: [_args()[0][None], *_args()[1:]], {},
             "q must be 3-D (total_tokens, heads, dim); got shape (1, 10, 8, 24)"),
    "head_dim": (lambda: _args(d_q=32), {}, "q and k must have the same head dim; got q=32, k=24"),
    "heads": (lambda: _args(h_q=3), {}, "q heads must be a multiple of k/v heads (GQA); got h_q=3, h_kv=2"),
    "window": (lambda: _args(), {"window": (-2, 0)},
               "window must be (left, right) with each >= 0, or -1 for unbounded; got (-2, 0)"),
    "strategy_without_group": (lambda: _args(), {"strategy": "ring"},
                               "strategy='ring' needs a group; without one varlen_attention runs locally"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_message(case):
    make_args, kwargs, message = CASES[case]
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        varlen_attention(*make_args(), **kwargs)


@pytest.mark.parametrize("case", ["int64", "document_count", "q_4d", "head_dim"])
def test_raised_at_trace_time(case):
    make_args, kwargs, message = CASES[case]
    args = make_args()
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            varlen_attention(*fake, **kwargs)


def test_cpu_runs_the_reference_kernel():
    q, k, v = _args()[:3]
    for is_causal, window in itertools.product((False, True), WINDOWS):
        assert attn_compile.kernels.select_varlen_kernel(q, k, v, is_causal=is_causal, window=window) == "reference"
