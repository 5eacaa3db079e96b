"""Index-only masks outside the structured classes run as flex_attention with the mask's formula as
its mask_mod; masks that flex_attention would get wrong, or cannot run, stay with the reason.

On CPU flex_attention runs forward only (torch 2.13 has no CPU backward); gradients are checked on
CUDA (pytest -m gpu tests/test_flex_route.py on the device machine)."""
import pytest
import torch
import torch.nn.functional as F
from expecttest import TestCase
from torch._dynamo.testing import CompileCounterWithBackend

from attn_compile.explain import explain
from attn_compile.passes.placements import distribute_attention
from compiled import rewrite
from oracle import naive_attention, rel_err

S = 40  # not a multiple of flex_attention's 128-wide blocks
TOL = 1e-5


def _ij(s, device="cpu"):
    return torch.arange(s, device=device)[:, None], torch.arange(s, device=device)


def _per_head(s, ids):
    i, j = _ij(s, ids.device)
    return j <= i + torch.arange(8, device=ids.device)[:, None, None]  # head h also sees h keys ahead


MASKS = {  # mask(s, ids) with ids (B, S) document ids, 0 = padding
    "prefix-LM": lambda s, ids: (lambda i, j: (j <= i) | (j < 4))(*_ij(s, ids.device)),
    "chunked": lambda s, ids: (lambda i, j: i // 8 == j // 8)(*_ij(s, ids.device)),
    "strided": lambda s, ids: (lambda i, j: (i - j) % 3 == 0)(*_ij(s, ids.device)),
    "per-head": _per_head,
    "documents bidirectional, causal across": lambda s, ids: (
        (ids[:, None, :, None] == ids[:, None, None, :]) | (lambda i, j: j <= i)(*_ij(s, ids.device))),
    "prefix-LM + key padding": lambda s, ids: (
        (lambda i, j: (j <= i) | (j < 4))(*_ij(s, ids.device)) & (ids != 0)[:, None, None, :]),
}


def attend(mask):
    def fn(q, k, v, ids):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask(q.shape[2], ids), enable_gqa=True)
        return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)
    return fn


def reference(mask, q, k, v, ids):
    out = naive_attention(q, k, v, attn_mask=mask(q.shape[2], ids))
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


def inputs(s=S, device="cpu", requires_grad=False, dtype=torch.float32, d_qk=24, d_v=16):
    """GQA 8/2 heads, MLA head dims (d_qk != d_v); ids: documents of 5, 11 and the rest in row 0,
    row 1 padded on the left."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, h, s, d, device=device, dtype=dtype, requires_grad=requires_grad)
               for h, d in ((8, d_qk), (2, d_qk), (2, d_v)))
    row = torch.ones(s, dtype=torch.long)
    row[5:], row[16:] = 2, 3
    ids = torch.stack([row, (torch.arange(s) >= 6).long()]).to(device)
    return q, k, v, ids


class TestRewrite(TestCase):
    def test_prefix_lm_graph(self):
        graph, sites = rewrite(attend(MASKS["prefix-LM"]), *inputs())
        self.assertExpectedInline(graph, """\
l_k_ = input
l_q_ = input
l_v_ = input
flex_attention = flex_attention(l_q_, l_k_, l_v_)
transpose = transpose(flex_attention, 1, 2)
reshape = reshape(transpose, 2, 40, -1)
return (reshape)""")
        self.assertEqual(sites[0].op, "flex_attention")
        self.assertEqual(sites[0].notes, ["mask -> flex_attention mask_mod (j - i <= 0 | j - 3 <= 0)"])

    def test_per_batch_tensors_become_arguments(self):
        graph, sites = rewrite(attend(MASKS["prefix-LM + key padding"]), *inputs())
        self.assertIn("flex_attention = flex_attention(l_q_, l_k_, l_v_, l_ids_)", graph)
        self.assertEqual(sites[0].notes, ["mask -> flex_attention mask_mod ((j - i <= 0 | j - 3 <= 0) & l_ids_[b, j] != 0)"])

    def test_comparisons_spelled_as_dunder_methods(self):
        """dynamo on torch 2.11 (the GPU machine) recorded the chunked mask's == as a call to __eq__."""
        def chunked(q, k, v, ids):
            i, j = _ij(q.shape[2])
            return attend(lambda s, ids: (i // 8).__eq__(j // 8))(q, k, v, ids)

        _, sites = rewrite(chunked, *inputs())
        self.assertEqual(sites[0].notes, ["mask -> flex_attention mask_mod (i) // 8 == (j) // 8"])

    def test_explain_names_the_route_and_the_formula(self):
        report = str(explain(attend(MASKS["chunked"]), *inputs()))
        self.assertIn("-> flex_attention [block mask] (mask -> flex_attention mask_mod (i) // 8 == (j) // 8)", report)


class TestNumerics(TestCase):
    def _check(self, mask, inner):
        torch._dynamo.reset()
        q, k, v, ids = inputs()
        got = torch.compile(attend(mask), backend="attn_cp", options={"inner": inner}, fullgraph=True)(q, k, v, ids)
        self.assertLessEqual(rel_err(got, reference(mask, q, k, v, ids)), TOL)

    def test_each_mask_matches_float64_aot_eager(self):
        for name, mask in MASKS.items():
            with self.subTest(name):
                self._check(mask, "aot_eager")

    def test_a_negated_order_of_float_data_keeps_nan_visible(self):
        """~(x < 0) is True where x is NaN; x >= 0 is False there."""
        def mask(s, score):
            i, j = _ij(s)
            return ~(score[:, None, None, :] < 0) | (j <= i)

        q, k, v, _ = inputs()
        score = torch.randn(2, S)
        score[:, 5] = float("nan")
        _, sites = rewrite(attend(mask), q, k, v, score)
        self.assertEqual(sites[0].notes, ["mask -> flex_attention mask_mod (~l_ids_[b, j] < 0 | j - i <= 0)"])
        torch._dynamo.reset()
        got = torch.compile(attend(mask), backend="attn_cp", options={"inner": "aot_eager"})(q, k, v, score)
        self.assertLessEqual(rel_err(got, reference(mask, q, k, v, score)), TOL)

    def test_a_negated_order_with_nan_keeps_every_key(self):
        """~(j < nan) is True everywhere; j >= nan is False everywhere."""
        def mask(s, ids):
            i, j = _ij(s)
            return ~(j < float("nan")) & (j <= i + 4)

        q, k, v, ids = inputs()
        torch._dynamo.reset()
        got = torch.compile(attend(mask), backend="attn_cp", options={"inner": "aot_eager"})(q, k, v, ids)
        self.assertLessEqual(rel_err(got, reference(mask, q, k, v, ids)), TOL)

    def test_softcapped_scores(self):
        """Hand-written softcapping (tanh(s / 2) * 2) with a prefix-LM mask: flex_attention caps the
        scores in its score_mod."""
        def softcapped_prefix_lm(q, k, v, ids):
            i, j = _ij(q.shape[2])
            k, v = (x.repeat_interleave(4, 1) for x in (k, v))
            scores = torch.tanh(q @ k.transpose(-2, -1) * 0.25 / 2.0) * 2.0
            out = scores.masked_fill(~((j <= i) | (j < 4)), float("-inf")).softmax(-1) @ v
            return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)

        q, k, v, ids = inputs()
        _, sites = rewrite(softcapped_prefix_lm, q, k, v, ids)
        self.assertEqual((sites[0].op, sites[0].notes[1]), ("flex_attention", "scores softcapped at 2"))
        torch._dynamo.reset()
        got = torch.compile(softcapped_prefix_lm, backend="attn_cp", options={"inner": "aot_eager"})(q, k, v, ids)
        i, j = _ij(S)
        want = naive_attention(q, k, v, attn_mask=(j <= i) | (j < 4), scale=0.25, softcap=2.0)
        self.assertLessEqual(rel_err(got, want.transpose(1, 2).reshape(2, S, -1)), TOL)

    def test_inductor(self):
        for name in ("prefix-LM", "documents bidirectional, causal across"):
            with self.subTest(name):
                self._check(MASKS[name], "inductor")

    def test_dynamic_sequence_lengths_keep_the_mask_and_reuse_the_graph(self):
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("attn_cp")
        mask = MASKS["prefix-LM + key padding"]
        compiled = torch.compile(attend(mask), backend=counter, dynamic=True)
        for s in (20, 29, 37):
            q, k, v, ids = inputs(s)
            self.assertLessEqual(rel_err(compiled(q, k, v, ids), reference(mask, q, k, v, ids)), TOL)
        self.assertEqual(counter.frame_count, 1)
        q, k, v, ids = inputs()
        for t, dim in ((q, 2), (k, 2), (v, 2), (ids, 1)):
            torch._dynamo.mark_dynamic(t, dim)
        _, sites = rewrite(attend(mask), q, k, v, ids)
        self.assertEqual(sites[0].notes[-1], "not flex_attention: the block mask's sizes are symbolic (dynamic shapes): "
                                             "Inductor fails on a block mask made from them in the graph (torch 2.13)")


class TestKept(TestCase):
    def test_a_mask_tensor_from_outside_stays(self):
        q, k, v, _ = inputs()
        mask = torch.rand(2, 1, S, S) > 0.3
        graph, sites = rewrite(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
                               .transpose(1, 2), q, k, v, mask)
        self.assertIn("attn_cp.attention.default(l_q_, l_k_, l_v_, l_m_, False, None)", graph)
        self.assertEqual(sites[0].notes[1], "not flex_attention: the mask reads l_m_[b, 0, i, j]: only per-key tensors "
                                            "read at [b, j] go into a mask_mod")

    def test_structured_masks_still_go_to_the_op(self):
        graph, sites = rewrite(attend(lambda s, ids: (lambda i, j: j <= i)(*_ij(s))), *inputs())
        self.assertIn("attn_cp.attention.default(l_q_, l_k_, l_v_, None, True, None)", graph)
        self.assertEqual(sites[0].op, "attn_cp.attention")

    def test_softmax_with_a_row_that_may_see_no_key(self):
        def strictly_before(q, k, v):  # hand-written: row 0 sees no key, and eager gives it NaN
            i, j = _ij(q.shape[2])
            scores = (q @ k.transpose(-2, -1)).masked_fill(~((j < i) | (j > i + 8)), float("-inf"))
            return (scores.softmax(-1) @ v).transpose(1, 2).reshape(2, q.shape[2], -1)

        q, k, v, _ = inputs()
        graph, sites = rewrite(strictly_before, q, k[:, :1].expand_as(q), v[:, :1].expand(-1, 8, -1, -1))
        self.assertEqual(sites[0].op, "attn_cp.attention")
        self.assertEqual(sites[0].notes[-1], "not flex_attention: a query may see no key: flex_attention gives it 0, "
                                             "where the code as written gives NaN")

    def test_a_mask_that_reads_query_side_data_stays(self):
        _, sites = rewrite(attend(MASKS["documents bidirectional, causal across"]), *inputs())
        self.assertEqual(sites[0].op, "attn_cp.attention")
        self.assertEqual(sites[0].notes[-1], "not flex_attention: the mask reads l_ids_[b, i]: only per-key tensors "
                                             "read at [b, j] go into a mask_mod")

    def test_a_flex_site_under_a_mesh_raises(self):
        """With options["mesh"] q, k, v are shards: flex_attention on one would see this rank's keys only."""
        _, sites = rewrite(attend(MASKS["chunked"]), *inputs())
        with self.assertRaisesRegex(ValueError, r"^options\['mesh'\] makes q, k, v sequence shards, but attention at "
                                                r".* runs as flex_attention, which is not distributed, and run "
                                                r"locally it would see only this rank's keys$"):
            distribute_attention(torch.fx.GraphModule({}, torch.fx.Graph()), sites, mesh=object())

    def test_a_result_read_in_place_on_cpu(self):
        def scaled(q, k, v, ids):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=MASKS["chunked"](q.shape[2], ids),
                                                  enable_gqa=True) * 2

        _, sites = rewrite(scaled, *inputs())
        self.assertEqual(sites[0].op, "attn_cp.attention")
        self.assertEqual(sites[0].notes[-1], "not flex_attention: on CPU the result must first be transposed and "
                                             "copied (Inductor's CPU flex_attention cannot fuse the operations that "
                                             "read it)")


@pytest.mark.gpu
class TestCuda(TestCase):
    def test_forward_and_gradients_match_float64(self):
        """bf16 with head dims 64/32 (MLA), 256 positions, against the float64 oracle."""
        for inner in ("inductor", "aot_eager"):
            for name in ("prefix-LM", "chunked", "per-head", "prefix-LM + key padding"):
                with self.subTest(inner=inner, mask=name):
                    mask = MASKS[name]
                    q, k, v, ids = inputs(256, "cuda", True, torch.bfloat16, d_qk=64, d_v=32)
                    _, sites = rewrite(attend(mask), q, k, v, ids)
                    self.assertEqual(sites[0].op, "flex_attention")
                    torch._dynamo.reset()
                    compiled = torch.compile(attend(mask), backend="attn_cp", options={"inner": inner})
                    got = compiled(q, k, v, ids)
                    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
                    want = reference(mask, *leaves, ids.cpu())  # the oracle builds its index grids on the CPU
                    self.assertLessEqual(rel_err(got.cpu(), want), 2e-2)
                    dout = torch.randn_like(got)
                    for g, w in zip(torch.autograd.grad(got, (q, k, v), dout),
                                    torch.autograd.grad(want, leaves, dout.cpu().double())):
                        self.assertLessEqual(rel_err(g.cpu(), w), 2e-2)
