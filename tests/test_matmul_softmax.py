"""Hand-written softmax attention becomes attn_cp.attention; look-alikes stay as written."""
import math

import torch
import torch.nn.functional as F
from expecttest import TestCase
from torch import nn

from attn_compile.passes import rewrite_attention
from compiled import assert_matches_eager, rewrite


def hf_eager(q, k, v, mask):
    """transformers' eager_attention_forward (mask: additive, 0 / dtype minimum)."""
    w = torch.matmul(q, k.transpose(2, 3)) * 0.25
    w = w + mask
    w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    w = F.dropout(w, p=0.0, training=False)
    return torch.matmul(w, v)


class NanoGPTAttention(nn.Module):
    """nanoGPT's CausalSelfAttention without flash: masked_fill from a tril buffer."""

    def __init__(self, block_size=32):
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))
        self.attn_dropout = nn.Dropout(0.1)

    def forward(self, q, k, v):
        t = q.size(-2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        return att @ v


class TimmAttention(nn.Module):
    """timm's vision_transformer.Attention with fused_attn off: q scaled before the matmul."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.scale = self.head_dim ** -0.5
        self.qkv, self.proj = nn.Linear(dim, dim * 3), nn.Linear(dim, dim)
        self.attn_drop = nn.Dropout(0.0)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q = q * self.scale
        attn = q @ k.transpose(-2, -1)
        attn = attn.softmax(dim=-1)
        attn = self.attn_drop(attn)
        x = attn @ v
        return self.proj(x.transpose(1, 2).reshape(b, n, c))


def nanogpt_inline_tril(q, k, v):
    att = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    t = q.size(-2)
    att = att.masked_fill(torch.tril(torch.ones(t, t)) == 0, float("-inf"))
    return F.softmax(att, dim=-1) @ v


def gpt2_legacy(q, k, v, causal):
    w = torch.matmul(q, k.permute(0, 1, 3, 2)) / torch.full([], v.size(-1) ** 0.5)
    w = torch.where(causal, w, torch.finfo(torch.float32).min)
    return torch.matmul(w.float().softmax(-1).type_as(q), v)


def mt_and_division(q, k, v):
    return (q @ k.mT / math.sqrt(q.size(-1))).softmax(-1) @ v


def softcapped(q, k, v):
    """Gemma 2's eager attention: the scaled scores capped at 2 by tanh (Gemma 2's own cap is 50,
    which scores of these sizes never reach)."""
    return (torch.tanh(q @ k.transpose(-2, -1) * 0.25 / 2.0) * 2.0).softmax(-1) @ v


def _qkv(requires_grad=True):
    torch.manual_seed(0)
    return [torch.randn(2, 4, 24, 16, requires_grad=requires_grad) for _ in range(3)]


def _padding_mask():
    pad = torch.ones(2, 24, dtype=torch.bool)
    pad[1, -6:] = False
    return torch.where(pad[:, None, None, :], 0.0, torch.finfo(torch.float32).min)


class TestRewritten(TestCase):
    def test_hf_eager(self):
        graph, sites = rewrite(hf_eager, *_qkv(), _padding_mask())
        self.assertExpectedInline(graph, """\
l_k_ = input
l_mask_ = input
l_q_ = input
l_v_ = input
attention_default = attn_cp.attention.default(l_q_, l_k_, l_v_, l_mask_, False, 0.25)
getitem = getitem(attention_default, 0)
return (getitem)""")
        self.assertEqual(sites[0].notes[0], "hand-written softmax attention")
        assert_matches_eager(hf_eager, *_qkv(), _padding_mask())

    def test_nanogpt(self):
        model = NanoGPTAttention().eval()
        graph, sites = rewrite(model, *_qkv())
        self.assertIn("logical_not = logical_not(eq)", graph)
        self.assertIn("attn_cp.attention.default(l_q_, l_k_, l_v_, logical_not, False, 0.25)", graph)
        self.assertEqual(sites[0].notes[1:3], ["a query that sees no key gets 0, where the code as written gives NaN",
                                               "mask kept: the mask compares data, 'l_self_buffers_bias_[0, 0, i, j] "
                                               "!= 0': only key padding [b, j] is structured"])
        assert_matches_eager(model, *_qkv())

    def test_nanogpt_with_an_index_built_mask_becomes_causal(self):
        graph, _ = rewrite(nanogpt_inline_tril, *_qkv())
        self.assertExpectedInline(graph, """\
l_k_ = input
l_q_ = input
l_v_ = input
attention_default = attn_cp.attention.default(l_q_, l_k_, l_v_, None, True, 0.25)
getitem = getitem(attention_default, 0)
return (getitem)""")
        assert_matches_eager(nanogpt_inline_tril, *_qkv())

    def test_timm_vit(self):
        torch.manual_seed(0)
        model = TimmAttention().eval()
        x = torch.randn(2, 17, 32, requires_grad=True)
        graph, _ = rewrite(model, x)
        self.assertIn("attn_cp.attention.default(q, k, v, None, False, 0.3535533905932738)", graph)
        self.assertNotIn("softmax", graph)
        assert_matches_eager(model, x)

    def test_mt_and_division(self):
        graph, _ = rewrite(mt_and_division, *_qkv())
        self.assertIn("attn_cp.attention.default(l_q_, l_k_, l_v_, None, False, 0.25)", graph)
        assert_matches_eager(mt_and_division, *_qkv())

    def test_gpt2_legacy_division_where_and_float_upcast(self):
        causal = torch.ones(24, 24, dtype=torch.bool).tril()
        graph, _ = rewrite(gpt2_legacy, *_qkv(), causal)
        self.assertIn("attn_cp.attention.default(l_q_, l_k_, l_v_, l_causal_, False, 0.25)", graph)
        assert_matches_eager(gpt2_legacy, *_qkv(), causal)

    def test_gemma2_softcapping(self):
        """tanh(s / cap) * cap of the scaled scores s is the op's softcap; its scale takes the cap's
        factor back (0.25 / 2 inside the tanh, times 2)."""
        graph, sites = rewrite(softcapped, *_qkv())
        self.assertExpectedInline(graph, """\
l_k_ = input
l_q_ = input
l_v_ = input
attention_default = attn_cp.attention.default(l_q_, l_k_, l_v_, None, False, 0.25, softcap=2.0)
getitem = getitem(attention_default, 0)
return (getitem)""")
        self.assertEqual(sites[0].notes, ["hand-written softmax attention", "scores softcapped at 2"])
        assert_matches_eager(softcapped, *_qkv())

    def test_a_tanh_without_a_cap_caps_at_1(self):
        def tanh_only(q, k, v, mask):
            return (torch.tanh(q @ k.transpose(-2, -1) / 2.0) + mask).softmax(-1) @ v

        graph, _ = rewrite(tanh_only, *_qkv(), _padding_mask())
        self.assertIn("attn_cp.attention.default(l_q_, l_k_, l_v_, l_mask_, False, 0.5, softcap=1.0)", graph)
        assert_matches_eager(tanh_only, *_qkv(), _padding_mask())

    def test_a_fill_that_gives_rows_without_keys_another_value_is_noted(self):
        """The op gives a query that sees no key 0; the code as written gives it the mean of v (a
        dtype's minimum) or NaN (-inf)."""
        hidden_row = torch.ones(24, 24, dtype=torch.bool).tril()
        hidden_row[3] = False
        _, sites = rewrite(gpt2_legacy, *_qkv(), hidden_row)
        self.assertEqual(sites[0].notes[1], "a query that sees no key gets 0, where the code as written gives the "
                                            "mean of v (filling with -3.403e+38)")

    def test_an_additive_mask_is_noted_for_rows_of_minus_inf(self):
        """Softmax over a row of -inf scores is NaN as written; the op gives 0, as SDPA does."""
        def additive(q, k, v, padding):
            mask = torch.zeros(2, 1, 24, 24).masked_fill(~padding[:, None, None, :], float("-inf"))
            return (q @ k.transpose(-2, -1) / 2.0 + mask).softmax(-1) @ v

        padding = torch.ones(2, 24, dtype=torch.bool)
        padding[1, 20:] = False
        _, sites = rewrite(additive, *_qkv(), padding)
        self.assertEqual(sites[0].notes, ["hand-written softmax attention",
                                          "a query whose every score is -inf gets 0, where the code as written gives NaN",
                                          "mask -> key_padding_mask=l_padding_"])
        assert_matches_eager(additive, *_qkv(), padding)


def softmax_over_queries(q, k, v):
    return (q @ k.transpose(-2, -1) * 0.25).softmax(dim=-2) @ v


def scale_after_softmax(q, k, v):
    return (q @ k.transpose(-2, -1)).softmax(dim=-1) * 0.25 @ v


def mask_before_scale(q, k, v, mask):
    return ((q @ k.transpose(-2, -1) + mask) * 0.25).softmax(dim=-1) @ v


def keys_already_transposed(q, kt, v):
    return (q @ kt * 0.25).softmax(dim=-1) @ v


def activation_after_softmax(q, k, v):
    return F.relu((q @ k.transpose(-2, -1) * 0.25).softmax(dim=-1) - 0.01) @ v


class TestLookAlikes(TestCase):
    def test_are_not_rewritten(self):
        q, k, v = _qkv()
        for fn, args in ((softmax_over_queries, (q, k, v)), (scale_after_softmax, (q, k, v)),
                         (keys_already_transposed, (q, k.transpose(-2, -1).detach().requires_grad_(), v)),
                         (activation_after_softmax, (q, k, v))):
            with self.subTest(fn.__name__):
                graph, sites = rewrite(fn, *args)
                self.assertEqual(sites, [])
                self.assertIn("softmax", graph)
                assert_matches_eager(fn, *args)


def active_dropout(q, k, v):
    return F.dropout((q @ k.transpose(-2, -1) * 0.25).softmax(-1), p=0.1, training=True) @ v


def weights_returned(q, k, v):
    w = (q @ k.transpose(-2, -1) * 0.25).softmax(-1)
    return w @ v, w


def finite_fill(q, k, v):
    return (q @ k.transpose(-2, -1)).masked_fill(torch.ones(24, 24, dtype=torch.bool).triu(1), -1e4).softmax(-1) @ v


def scaled_in_place(q, k, v):
    """Falcon's eager attention: ``scores /= sqrt(d)``."""
    scores = q @ k.transpose(-2, -1)
    scores /= 4.0
    return scores.softmax(-1) @ v


def two_biases(q, k, v, mask):
    """T5's eager attention: a position bias and the mask, both added."""
    return (q @ k.transpose(-2, -1) + mask + mask.transpose(-2, -1)).softmax(-1) @ v


class TestUnmatchedScores(TestCase):
    def test_are_left_with_the_steps_named(self):
        q, k, v = _qkv()
        mask = torch.randn(24, 24)
        for fn, args, steps in ((mask_before_scale, (q, k, v, _padding_mask()), "add, mul"),
                                (scaled_in_place, (q, k, v), "itruediv"),
                                (two_biases, (q, k, v, mask), "add, add")):
            with self.subTest(fn.__name__):
                graph, sites = rewrite(fn, *args)
                self.assertEqual([(s.rewritten, s.reason) for s in sites],
                                 [(False, f"the scores pass through {steps} between the score matmul and the softmax, "
                                          f"a form the pattern does not take (the fused op caps scores only as "
                                          f"tanh(s / cap) * cap, and takes no second bias)")])
                self.assertIn("softmax", graph)
                self.assertNotIn("attn_cp", graph)
                assert_matches_eager(fn, *args)


class TestLeft(TestCase):
    def test_reasons(self):
        def negative_cap(q, k, v):
            return (torch.tanh(q @ k.transpose(-2, -1) * 0.25) * -2.0).softmax(-1) @ v

        for fn, reason in ((active_dropout, "dropout p=0.1 while training: the fused op has no dropout"),
                           (negative_cap, "the tanh of the scores is scaled by -2.0 < 0, which is no softcap"),
                           (weights_returned, "w is also used by matmul_1, output"),
                           (finite_fill, "masked_fill with -10000.0, not -inf or a dtype's minimum: not a mask")):
            with self.subTest(fn.__name__):
                graph, sites = rewrite(fn, *_qkv(requires_grad=False))
                self.assertEqual([(s.rewritten, s.reason) for s in sites], [(False, reason)])
                self.assertEqual(sites[0].shapes["q"], (2, 4, 24, 16))
                self.assertIn("softmax", graph)
                self.assertNotIn("attn_cp", graph)

    def test_q_edited_in_place_between_the_matmuls(self):
        """F.silu(q, inplace=True) edits q after the scores read it: the op would read the edited q."""
        def silu_between(q, k, v):
            scores = q @ k.transpose(-2, -1) * 0.25
            F.silu(q, inplace=True)
            return scores.softmax(-1) @ v

        _, sites = rewrite(silu_between, *_qkv(requires_grad=False))
        self.assertEqual([(s.rewritten, s.reason) for s in sites],
                         [(False, "modified in place between the score and the value matmul: q")])
        q, k, v = _qkv(requires_grad=False)
        torch._dynamo.reset()
        compiled = torch.compile(silu_between, backend="attn_cp", options={"inner": "aot_eager"})
        torch.testing.assert_close(compiled(q.clone(), k, v), silu_between(q.clone(), k, v))

    def test_softmax_narrower_than_q(self):
        def softmax_in_float32(q, k, v):
            return F.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-1, dtype=torch.float32).double() @ v

        _, sites = rewrite(softmax_in_float32, *(x.double() for x in _qkv(requires_grad=False)))
        self.assertEqual([(s.rewritten, s.reason) for s in sites],
                         [(False, "the softmax runs in torch.float32, narrower than q's torch.float64")])

    def test_scale_from_a_dynamic_head_dim(self):
        sites = []

        def recording(gm, example_inputs):
            sites.extend(rewrite_attention(gm))
            return gm.forward

        torch._dynamo.reset()
        torch.compile(mt_and_division, backend=recording, dynamic=True)(*_qkv(requires_grad=False))
        self.assertEqual([(s.rewritten, s.reason) for s in sites], [(False, "the scale is only known at run time")])

    def test_dropout_then_matmul_without_softmax_is_no_site(self):
        def fn(q, k, v):
            return F.dropout(q @ k.transpose(-2, -1), p=0.1, training=True) @ v

        graph, sites = rewrite(fn, *_qkv(requires_grad=False))
        self.assertEqual(sites, [])
        self.assertIn("dropout", graph)
