"""varlen_attn sites (torch_attn._varlen_attn) become attn_cp.varlen_attention, which runs on the CPU
where PyTorch has no varlen kernel; forms the op cannot take stay, with the reason."""
import inspect
import itertools
from operator import getitem

import pytest
import torch
from expecttest import TestCase
from torch._dynamo.testing import CompileCounterWithBackend

from attn_compile.passes import rewrite_attention
from compiled import rewrite
from oracle import rel_err, varlen_reference as reference

varlen = pytest.importorskip("torch.nn.attention.varlen")
varlen_attn, AuxRequest = varlen.varlen_attn, varlen.AuxRequest
# torch 2.13 asks for enable_gqa where h_q != h_kv; torch 2.11's varlen_attn has no such argument
GQA = {"enable_gqa": True} if "enable_gqa" in inspect.signature(varlen_attn).parameters else {}
needs_seqused_k = pytest.mark.skipif("seqused_k" not in inspect.signature(varlen_attn).parameters,
                                     reason="this torch's varlen_attn has no seqused_k (torch 2.11)")


def _cu(lengths):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def _packed(total, heads, dim, dtype=torch.float64):
    return torch.randn(total, heads, dim, dtype=dtype, requires_grad=True)


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="attn_cp", options={"inner": "aot_eager", "strict": True}, fullgraph=True)


class TestGraphs(TestCase):
    def test_causal_with_lse_and_window(self):
        def fn(q, k, v, cu):
            out, lse = varlen_attn(q, k, v, cu, cu, 11, 11, window_size=(-1, 0), **GQA,
                                   return_aux=AuxRequest(lse=True))
            return out + varlen_attn(q, k, v, cu, cu, 11, 11, window_size=(3, 0), **GQA, scale=0.25), lse

        q, k, v = _packed(16, 4, 8), _packed(16, 2, 8), _packed(16, 2, 8)
        graph, sites = rewrite(fn, q, k, v, _cu([5, 11]))
        self.assertExpectedInline(graph, """\
l_cu_ = input
l_k_ = input
l_q_ = input
l_v_ = input
varlen_attention_default = attn_cp.varlen_attention.default(l_q_, l_k_, l_v_, l_cu_, l_cu_, 11, 11, True, 0.3535533905932738, -1, -1, False)
getitem_6 = getitem(varlen_attention_default, 0)
getitem_7 = getitem(varlen_attention_default, 1)
transpose = transpose(getitem_7, 0, 1)
float_1 = float(transpose)
varlen_attention_default_1 = attn_cp.varlen_attention.default(l_q_, l_k_, l_v_, l_cu_, l_cu_, 11, 11, True, 0.25, 3, -1, False)
getitem_8 = getitem(varlen_attention_default_1, 0)
add = add(getitem_6, getitem_8)
return (add, float_1)""")
        assert [s.op for s in sites] == ["attn_cp.varlen_attention"] * 2
        assert "test_varlen_attn_pass.py" in sites[0].location

    @needs_seqused_k
    def test_seqused_k_full_attention(self):
        q, k, v = (x.detach() for x in (_packed(9, 2, 8), _packed(12, 2, 8), _packed(12, 2, 8)))
        used = torch.tensor([3, 5], dtype=torch.int32)
        fn = lambda q, k, v, cu_q, cu_k, used: varlen_attn(q, k, v, cu_q, cu_k, 5, 6, seqused_k=used)  # noqa: E731
        graph, _ = rewrite(fn, q, k, v, _cu([4, 5]), _cu([6, 6]), used)
        self.assertExpectedInline(graph, """\
l_cu_k_ = input
l_cu_q_ = input
l_k_ = input
l_q_ = input
l_used_ = input
l_v_ = input
varlen_attention_default = attn_cp.varlen_attention.default(l_q_, l_k_, l_v_, l_cu_q_, l_cu_k_, 5, 6, False, 0.3535533905932738, -1, -1, False, seqused_k=l_used_)
getitem_3 = getitem(varlen_attention_default, 0)
return (getitem_3)""")

    def test_mla_with_zero_padded_v(self):
        """V zero-padded to q's head dim and the output trimmed (FA2's way): the op takes V as it is."""
        lengths = [6, 1, 13]
        cu = _cu(lengths)
        q, k, v = _packed(20, 4, 24), _packed(20, 2, 24), _packed(20, 2, 16)

        def fn(q, k, v, cu):
            out = varlen_attn(q, k, torch.nn.functional.pad(v, (0, 8)), cu, cu, 13, 13, window_size=(-1, 0),
                              **GQA)
            return out[..., :16]

        graph, _ = rewrite(fn, *(x.detach() for x in (q, k, v)), cu)
        self.assertExpectedInline(graph, """\
l_cu_ = input
l_k_ = input
l_q_ = input
l_v_ = input
varlen_attention_default = attn_cp.varlen_attention.default(l_q_, l_k_, l_v_, l_cu_, l_cu_, 13, 13, True, 0.2041241452319315, -1, -1, False)
getitem_4 = getitem(varlen_attention_default, 0)
return (getitem_4)""")
        got = _compiled(fn)(q, k, v, cu)
        want, _ = reference(q, k, v, cu, cu, window=(-1, 0))
        assert rel_err(got, want) <= 1e-6
        dout = torch.randn_like(got)
        for g, w in zip(torch.autograd.grad(got, (q, k, v), dout), torch.autograd.grad(want, (q, k, v), dout)):
            assert rel_err(g, w) <= 1e-6


class _Traced(Exception):
    """Stops the compile once the passes ran: the site left as it is has no CPU kernel to run."""


def _left_reason(fn, *args) -> str:
    sites = []

    def passes_only(gm, example_inputs):
        sites.extend(rewrite_attention(gm))
        raise _Traced

    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="_Traced"):
        torch.compile(fn, backend=passes_only, fullgraph=True)(*args)
    (site,) = sites
    assert not site.rewritten
    return site.reason


def test_forms_the_op_cannot_take_stay_with_the_reason():
    q, k, v = (x.detach() for x in (_packed(10, 2, 8), _packed(10, 2, 8), _packed(10, 2, 8)))
    cu_q, cu_k = _cu([4, 6]), _cu([4, 6])
    causal_apart = _left_reason(lambda q, k, v, a, b: varlen_attn(q, k, v, a, b, 6, 6, window_size=(-1, 0)),
                                q, k, v, cu_q, cu_k)
    assert "bottom-right" in causal_apart and "different tensors" in causal_apart


@needs_seqused_k
def test_forms_with_seqused_k_the_op_cannot_take_stay_with_the_reason():
    q, k, v = (x.detach() for x in (_packed(10, 2, 8), _packed(10, 2, 8), _packed(10, 2, 8)))
    cu_q = _cu([4, 6])
    used = torch.tensor([3, 5], dtype=torch.int32)
    causal_used = _left_reason(lambda q, k, v, c, u: varlen_attn(q, k, v, c, c, 6, 6, window_size=(-1, 0),
                                                                 seqused_k=u), q, k, v, cu_q, used)
    assert "seqused_k" in causal_used
    pages = torch.randn(3, 4, 2, 8, dtype=torch.float64)
    table = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32)
    paged = _left_reason(lambda q, k, c, u, t: varlen_attn(q, k, k, c, c, 6, 8, seqused_k=u, block_table=t),
                         q, pages, cu_q, used, table)
    assert "block_table is given" in paged


@pytest.mark.parametrize("window", [(-1, 0), (3, 0), (2, 1), (-1, -1)])
def test_matches_per_document_reference(window):
    lengths = [1, 7, 0, 19, 5]
    cu = _cu(lengths)
    q, k, v = _packed(32, 4, 16), _packed(32, 2, 16), _packed(32, 2, 16)

    def fn(q, k, v, cu):
        out, lse = varlen_attn(q, k, v, cu, cu, 19, 19, window_size=window, **GQA,
                               return_aux=AuxRequest(lse=True))
        return out, lse

    out, lse = _compiled(fn)(q, k, v, cu)
    want_out, want_lse = reference(q, k, v, cu, cu, window=window)
    assert lse.dtype == torch.float32 and lse.shape == (4, 32)
    assert rel_err(out, want_out) <= 1e-6
    seen = want_lse.isfinite()
    assert torch.equal(lse.isfinite(), seen) and rel_err(lse[seen], want_lse[seen]) <= 1e-6
    dout = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(want_out, (q, k, v), dout)):
        assert rel_err(got, want) <= 1e-6


DISTINCT = _cu([3, 0, 6]), _cu([5, 2, 4])  # documents' query and key lengths differ


def test_distinct_lengths_full_attention():
    cu_q, cu_k = DISTINCT
    q, k, v = _packed(9, 2, 8), _packed(11, 2, 8), _packed(11, 2, 8)
    got = _compiled(lambda q, k, v, a, b: varlen_attn(q, k, v, a, b, 6, 5, scale=0.4))(q, k, v, cu_q, cu_k)
    want, _ = reference(q, k, v, cu_q, cu_k, scale=0.4)
    assert rel_err(got, want) <= 1e-6
    dout = torch.randn_like(got)
    for g, w in zip(torch.autograd.grad(got, (q, k, v), dout), torch.autograd.grad(want, (q, k, v), dout)):
        assert rel_err(g, w) <= 1e-6


@needs_seqused_k
def test_distinct_lengths_with_seqused_k():
    cu_q, cu_k = DISTINCT
    q, k, v = _packed(9, 2, 8), _packed(11, 2, 8), _packed(11, 2, 8)
    used = torch.tensor([4, 0, 3], dtype=torch.int32)
    with torch.no_grad():  # varlen_attn takes seqused_k for inference only
        got = _compiled(lambda q, k, v, a, b, u: varlen_attn(q, k, v, a, b, 6, 5, seqused_k=u))(q, k, v, cu_q, cu_k,
                                                                                                 used)
    assert rel_err(got, reference(q, k, v, cu_q, cu_k, seqused_k=used)[0]) <= 1e-6


def test_new_lengths_do_not_recompile():
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("attn_cp")
    fn = torch.compile(lambda q, k, v, cu, m: varlen_attn(q, k, v, cu, cu, m, m, window_size=(-1, 0)),
                       backend=counter, dynamic=True)
    for lengths in ([5, 9], [3, 20, 4], [33], [7, 7, 7, 2]):
        total, cu = sum(lengths), _cu(lengths)
        q, k, v = _packed(total, 2, 8), _packed(total, 2, 8), _packed(total, 2, 8)
        got = fn(q, k, v, cu, max(lengths))
        assert rel_err(got, reference(q, k, v, cu, cu, window=(-1, 0))[0]) <= 1e-6
        got.sum().backward()
    assert counter.frame_count == 1


def test_opcheck_with_seqused_k():
    q, k, v = (_packed(9, 4, 8), _packed(12, 2, 8), _packed(12, 2, 6))
    cu_q, cu_k, used = _cu([4, 5]), _cu([6, 6]), torch.tensor([3, 6], dtype=torch.int32)
    torch.library.opcheck(torch.ops.attn_cp.varlen_attention.default,
                          (q, k, v, cu_q, cu_k, 5, 6, False, 0.3, -1, -1, False), {"seqused_k": used})


@pytest.mark.gpu
@pytest.mark.parametrize("window", [(-1, 0), (64, 0), (-1, -1)])
def test_against_torch_varlen_attn_on_gpu(window, inner_graphs):
    """The rewritten site against varlen_attn itself (FA2), bf16, forward and gradients."""
    lengths = [1, 300, 7, 1024, 3, 513]
    cu = _cu(lengths).cuda()
    q, k, v = (torch.randn(sum(lengths), h, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for h in (8, 2, 2))

    def fn(q, k, v, cu):
        return varlen_attn(q, k, v, cu, cu, 1024, 1024, window_size=window, **GQA)

    got, want = _compiled(fn)(q, k, v, cu), fn(q, k, v, cu)
    ops = [n.target for n in inner_graphs[0].graph.nodes if n.op == "call_function" and n.target is not getitem]
    assert ops == [torch.ops.attn_cp.varlen_attention.default], ops  # a site left alone would pass as well
    assert rel_err(got, want) <= 2e-2
    dout = torch.randn_like(got)
    for g, w in zip(torch.autograd.grad(got, (q, k, v), dout), torch.autograd.grad(want, (q, k, v), dout)):
        assert rel_err(g, w) <= 2e-2
