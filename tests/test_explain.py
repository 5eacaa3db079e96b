"""explain() reports one entry per attention site: where, shapes, outcome."""
import torch
import torch.nn.functional as F
from expecttest import TestCase

import attn_compile
from attn_compile.demo import TinyGQATransformer


class TestExplain(TestCase):
    def test_model_report(self):
        report = attn_compile.explain(TinyGQATransformer(layers=2), torch.randint(0, 256, (2, 12)))
        self.assertExpectedInline(str(report), """\
attn_compile: 2 attention site(s), 2 rewritten, 0 left as is
  [0] blocks.0.attn @ demo.py:24: q(2, 8, 12, 8) k(2, 2, 12, 8) v(2, 2, 12, 8) -> attn_cp.attention [reference]
  [1] blocks.1.attn @ demo.py:24: q(2, 8, 12, 8) k(2, 2, 12, 8) v(2, 2, 12, 8) -> attn_cp.attention [reference]""")

    def test_left_site_has_its_reason(self):
        def fn(q, k, v, mask):
            return F.scaled_dot_product_attention(q, k, v, mask, dropout_p=0.25)

        q = torch.randn(1, 2, 4, 8)
        report = attn_compile.explain(fn, q, q, q, torch.ones(4, 4, dtype=torch.bool))
        self.assertEqual(len(report.left), 1)
        self.assertEqual(report.left[0].shapes, {"q": (1, 2, 4, 8), "k": (1, 2, 4, 8), "v": (1, 2, 4, 8),
                                                  "attn_mask": (4, 4)})
        self.assertEqual(report.left[0].reason, "dropout_p=0.25 > 0: the fused op has no dropout")
        self.assertTrue(str(report).startswith("attn_compile: 1 attention site(s), 0 rewritten, 1 left as is"))


class _Attention(torch.nn.Module):
    def forward(self, x):
        return F.scaled_dot_product_attention(x, x, x)


_GLOBAL_BLOCKS = torch.nn.ModuleList([_Attention(), _Attention()])


def test_layer_of_a_global_module_list_is_named_as_named_modules_names_it():
    """Dynamo's source for it is "G['_GLOBAL_BLOCKS'].0"."""
    def fn(x):
        for block in _GLOBAL_BLOCKS:
            x = block(x)
        return x

    report = attn_compile.explain(fn, torch.randn(1, 2, 4, 8))
    names = [f"_GLOBAL_BLOCKS.{name}" for name, _ in _GLOBAL_BLOCKS.named_children()]
    assert [site.location.split(" @ ")[0] for site in report.sites] == names == ["_GLOBAL_BLOCKS.0", "_GLOBAL_BLOCKS.1"]


class _Causal(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_explain_reports_past_dynamos_recompile_limit():
    """Each call traces anew (a new backend for dynamo); past the 8th it used to get no graph and
    return an empty report."""
    torch._dynamo.reset()
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    reports = [attn_compile.explain(_Causal(), q, k, v) for _ in range(torch._dynamo.config.recompile_limit + 2)]
    assert [len(report.rewritten) for report in reports] == [1] * len(reports)
    torch._dynamo.reset()
