"""q, k, v laid out (B, S, H, D) and transposed reach the op as views: no .contiguous() copy."""
import torch
import torch.nn.functional as F
from expecttest import TestCase

from compiled import assert_matches_eager, rewrite


def bshd_attention(q, k, v):
    q, k, v = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous()


def output_viewed(q, k, v):
    q, k, v = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).view(q.shape[0], -1)


def head_dim_strided(q, k, v):
    return F.scaled_dot_product_attention(q, k.transpose(-1, -2).contiguous(), v)


class TestLayouts(TestCase):
    def test_contiguous_copies_are_dropped(self):
        torch.manual_seed(0)
        q, k, v = (torch.randn(2, 24, 4, 16, requires_grad=True) for _ in range(3))
        graph, sites = rewrite(bshd_attention, q, k, v)
        self.assertExpectedInline(graph, """\
l_k_ = input
l_q_ = input
l_v_ = input
transpose = transpose(l_q_, 1, 2)
transpose_1 = transpose(l_k_, 1, 2)
transpose_2 = transpose(l_v_, 1, 2)
attention_default = attn_cp.attention.default(transpose, transpose_1, transpose_2, None, True, None)
getitem = getitem(attention_default, 0)
transpose_3 = transpose(getitem, 1, 2)
contiguous_3 = contiguous(transpose_3)
return (contiguous_3)""")
        self.assertEqual(sites[0].notes, ["dropped .contiguous() of q, k, v"])
        assert_matches_eager(bshd_attention, q, k, v)

    def test_copy_of_q_is_kept_where_the_output_strides_matter(self):
        """The output takes q's memory order: without q's copy, ``.view`` of it would fail."""
        torch.manual_seed(0)
        q, k, v = (torch.randn(2, 24, 4, 16, requires_grad=True) for _ in range(3))
        graph, sites = rewrite(output_viewed, q, k, v)
        self.assertIn("attn_cp.attention.default(q, transpose_1, transpose_2, None, True, None)", graph)
        self.assertEqual(sites[0].notes, ["dropped .contiguous() of k, v"])
        assert_matches_eager(output_viewed, q, k, v)

    def test_copy_of_a_tensor_strided_in_its_last_axis_is_kept(self):
        torch.manual_seed(0)
        q, v = (torch.randn(2, 4, 24, 16, requires_grad=True) for _ in range(2))
        kt = torch.randn(2, 4, 16, 24, requires_grad=True)
        graph, sites = rewrite(head_dim_strided, q, kt, v)
        self.assertIn("attn_cp.attention.default(l_q_, contiguous, l_v_, None, False, None)", graph)
        self.assertEqual(sites[0].notes, [])
        assert_matches_eager(head_dim_strided, q, kt, v)

    def test_results_follow_the_inputs_layouts(self):
        """The output lies in q's memory order and each gradient like its input, fake and real
        alike: an output transposed back to (B, S, H, D) is contiguous, with no copy."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        torch.manual_seed(0)
        q, k = (torch.randn(2, 24, 4, 16).transpose(1, 2) for _ in range(2))
        v = torch.randn(2, 4, 24, 8)
        out, lse = torch.ops.attn_cp.attention(q, k, v, None, True)
        self.assertTrue(out.transpose(1, 2).is_contiguous())
        grads = torch.ops.attn_cp.attention_backward(torch.randn_like(out), q, k, v, out, lse, None, True, None, -1, -1,
                                                     None, 0)
        self.assertEqual([g.stride() for g in grads], [x.stride() for x in (q, k, v)])
        with FakeTensorMode() as mode:
            fake = [mode.from_tensor(x) for x in (q, k, v)]
            fake_out, fake_lse = torch.ops.attn_cp.attention(*fake, None, True)
            fake_grads = torch.ops.attn_cp.attention_backward(mode.from_tensor(out), *fake, fake_out, fake_lse, None,
                                                              True, None, -1, -1, None, 0)
        self.assertEqual(fake_out.stride(), out.stride())
        self.assertEqual([g.stride() for g in fake_grads], [g.stride() for g in grads])

    def test_the_demo_model_under_inductor_matches_eager(self):
        """Inductor's code asserts the strides the fake results had, on the real ones (with code
        cached for the ops' earlier, contiguous output this failed: see inductor_cache.py)."""
        from attn_compile.demo import TinyGQATransformer

        torch.manual_seed(0)
        model = TinyGQATransformer().eval()
        tokens = torch.randint(0, 256, (2, 32))
        with torch.no_grad():
            torch.testing.assert_close(torch.compile(model, backend="attn_cp")(tokens), model(tokens),
                                       atol=1e-5, rtol=1e-5)
        torch._dynamo.reset()
        weight = model.blocks[0].attn.q.weight
        got = torch.autograd.grad(torch.compile(model, backend="attn_cp")(tokens).sum(), weight)
        torch.testing.assert_close(got, torch.autograd.grad(model(tokens).sum(), weight), atol=1e-5, rtol=1e-5)
