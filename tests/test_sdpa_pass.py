"""Every SDPA call form becomes attn_cp.attention; a dropout site is left alone, with its reason."""
import logging

import torch
import torch.nn.functional as F
from expecttest import TestCase

from compiled import mask_with_is_causal
from graphs import normalized, rewritten_graphs
from shapes import make_qkv


def _qkv(heads="gqa_mla"):
    return make_qkv(heads, s_q=16, requires_grad=False)


class TestSdpaCallForms(TestCase):
    def rewrite(self, fn, *args):
        graphs, sites, got = rewritten_graphs(fn, *args)
        torch.testing.assert_close(got, fn(*args), rtol=1e-5, atol=1e-5)
        return normalized(graphs[0]), sites

    def test_positional(self):
        q, k, v = _qkv("mha")
        mask = torch.rand(16, 16) > 0.2
        graph, _ = self.rewrite(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, m, 0.0, False), q, k, v, mask)
        self.assertExpectedInline(graph, """\
l_k_ = input
l_m_ = input
l_q_ = input
l_v_ = input
attention_default = attn_cp.attention.default(l_q_, l_k_, l_v_, l_m_, False, None)
getitem = getitem(attention_default, 0)
return (getitem)""")

    def test_keywords_causal_scale_gqa(self):
        def fn(q, k, v):
            return F.scaled_dot_product_attention(query=q, key=k, value=v, is_causal=True, scale=0.25, enable_gqa=True)

        graph, _ = self.rewrite(fn, *_qkv())
        self.assertExpectedInline(graph, """\
l_k_ = input
l_q_ = input
l_v_ = input
attention_default = attn_cp.attention.default(l_q_, l_k_, l_v_, None, True, 0.25)
getitem = getitem(attention_default, 0)
return (getitem)""")

    def test_additive_mask_keyword(self):
        q, k, v = _qkv()
        bias = torch.randn(1, 16, 16, 16)
        graph, _ = self.rewrite(
            lambda q, k, v, b: F.scaled_dot_product_attention(q, k, v, attn_mask=b, enable_gqa=True), q, k, v, bias)
        self.assertExpectedInline(graph, """\
l_b_ = input
l_k_ = input
l_q_ = input
l_v_ = input
attention_default = attn_cp.attention.default(l_q_, l_k_, l_v_, l_b_, False, None)
getitem = getitem(attention_default, 0)
return (getitem)""")

    def test_output_feeds_later_ops(self):
        def fn(q, k, v):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return y.transpose(1, 2).sum(-1)

        graph, _ = self.rewrite(fn, *_qkv())
        self.assertExpectedInline(graph, """\
l_k_ = input
l_q_ = input
l_v_ = input
attention_default = attn_cp.attention.default(l_q_, l_k_, l_v_, None, True, None)
getitem = getitem(attention_default, 0)
transpose = transpose(getitem, 1, 2)
sum_1 = sum(transpose, -1)
return (sum_1)""")

    def test_dropout_site_left_untouched_and_logged(self):
        def fn(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, dropout_p=0.0) + F.scaled_dot_product_attention(
                q, k, v, dropout_p=0.5)

        q, k, v = _qkv("mha")
        with self.assertLogs("attn_compile", level=logging.INFO) as logs:
            graphs, sites, _ = rewritten_graphs(fn, q, k, v)
        self.assertExpectedInline(normalized(graphs[0]), """\
l_k_ = input
l_q_ = input
l_v_ = input
attention_default = attn_cp.attention.default(l_q_, l_k_, l_v_, None, False, None)
getitem = getitem(attention_default, 0)
scaled_dot_product_attention_1 = scaled_dot_product_attention(l_q_, l_k_, l_v_, dropout_p=0.5)
add = add(getitem, scaled_dot_product_attention_1)
return (add)""")
        self.assertEqual([s.rewritten for s in sites], [True, False])
        self.assertEqual(sites[1].reason, "dropout_p=0.5 > 0: the fused op has no dropout")
        self.assertIn("dropout_p=0.5 > 0", logs.output[1])

    @mask_with_is_causal
    def test_mask_with_causal_is_rewritten_like_sdpa_computes_it(self):
        q, k, v = _qkv("gqa")  # SDPA's CPU math path takes both and ANDs them
        mask = torch.rand(16, 16) > 0.3
        graph, _ = self.rewrite(
            lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, m, is_causal=True, enable_gqa=True), q, k, v, mask)
        self.assertIn("attention_default = attn_cp.attention.default(l_q_, l_k_, l_v_, l_m_, True, None)", graph)

    def test_three_dimensional_inputs_are_left(self):
        q, k, v = (x[0] for x in _qkv("mha"))
        _, sites, _ = rewritten_graphs(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), q, k, v)
        self.assertEqual(sites[0].reason, "q, k, v are 3-D, 3-D, 3-D; the op takes 4-D (B, H, S, D)")


def test_a_tensor_mask_on_cuda_stays_as_it_is():
    """No fused kernel of the op takes a tensor mask: on CUDA the site keeps SDPA's masked kernels.
    Traced on fake CUDA tensors, so it runs without a GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    from attn_compile.passes import rewrite_attention

    gm = torch.fx.symbolic_trace(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m))
    mode = FakeTensorMode()
    with mode:
        args = [torch.randn(2, 4, 16, 8, device="cuda") for _ in range(3)]
        args.append(torch.rand(2, 1, 16, 16, device="cuda") > 0.2)
    FakeTensorProp(gm, mode).propagate(*args)
    (site,) = rewrite_attention(gm)
    assert not site.rewritten
    assert site.reason == ("its mask stays a tensor, which on CUDA the op runs only on its reference kernel; as it is, "
                           "the site runs on SDPA's or Inductor's fused code")
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [F.scaled_dot_product_attention]
