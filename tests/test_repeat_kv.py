"""repeat_kv copies of k and v feeding attention are removed; attention runs GQA natively."""
import torch
import torch.nn.functional as F
from expecttest import TestCase

from compiled import assert_matches_eager, rewrite


def hf_repeat_kv(x, n):
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n, s, d).reshape(b, h * n, s, d)


def unsqueeze_flatten(x, n):
    return x.unsqueeze(2).expand(-1, -1, n, -1, -1).flatten(1, 2)


def interleave(x, n):
    return x.repeat_interleave(n, dim=1)


def tiled(x, n):  # head i = head i % h: not GQA's grouping
    return x.repeat(1, n, 1, 1)


def tiled_by_expand(x, n):
    b, h, s, d = x.shape
    return x[:, None].expand(b, n, h, s, d).reshape(b, n * h, s, d)


def _qkv(h_q=8, h_kv=2, s=16):
    torch.manual_seed(0)
    return (torch.randn(2, h_q, s, 16, requires_grad=True), torch.randn(2, h_kv, s, 16, requires_grad=True),
            torch.randn(2, h_kv, s, 16, requires_grad=True))


def attention_with(repeat):
    def fn(q, k, v):
        n = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, repeat(k, n), repeat(v, n), is_causal=True)
    return fn


class TestRepeatKv(TestCase):
    def test_hf_repeat_kv_is_removed(self):
        graph, sites = rewrite(attention_with(hf_repeat_kv), *_qkv())
        self.assertExpectedInline(graph, """\
l_k_ = input
l_q_ = input
l_v_ = input
attention_default = attn_cp.attention.default(l_q_, l_k_, l_v_, None, True, None)
getitem_2 = getitem(attention_default, 0)
return (getitem_2)""")
        self.assertEqual(sites[0].notes, ["repeat_kv removed: k, v have 2 heads"])
        self.assertEqual(sites[0].shapes["k"], (2, 2, 16, 16))

    def test_equivalent_forms_are_removed(self):
        for repeat in (unsqueeze_flatten, interleave):
            graph, _ = rewrite(attention_with(repeat), *_qkv())
            self.assertIn("attn_cp.attention.default(l_q_, l_k_, l_v_, None, True, None)", graph)
            self.assertEqual(graph.count("\n"), 5, graph)  # inputs, op, getitem, return: no copy left

    def test_single_kv_head_expand_is_removed(self):
        def fn(q, k, v):
            return F.scaled_dot_product_attention(q, k.expand(-1, 8, -1, -1), v.expand(-1, 8, -1, -1))

        graph, _ = rewrite(fn, *_qkv(h_kv=1))
        self.assertIn("attn_cp.attention.default(l_q_, l_k_, l_v_, None, False, None)", graph)

    def test_tiling_is_not_grouping(self):
        for repeat in (tiled, tiled_by_expand):
            graph, sites = rewrite(attention_with(repeat), *_qkv())
            self.assertNotIn("l_k_, l_v_", graph)
            self.assertEqual(sites[0].shapes["k"], (2, 8, 16, 16))
            assert_matches_eager(attention_with(repeat), *_qkv())

    def test_results_and_gradients_match_eager(self):
        for repeat in (hf_repeat_kv, unsqueeze_flatten, interleave):
            assert_matches_eager(attention_with(repeat), *_qkv())
        assert_matches_eager(attention_with(hf_repeat_kv), *_qkv(h_q=6, h_kv=3))
