"""Masks built from index arithmetic become causal / window / key-padding / document-id arguments
of the op; every other mask stays a tensor, with the reason in the site's notes (here: why neither
a structure nor, with gradients on CPU, flex_attention fits; tests/test_flex_route.py has the rest)."""
import functools
from unittest import mock

import torch
import torch.nn.functional as F
from expecttest import TestCase
from torch._dynamo.testing import CompileCounterWithBackend

import attn_compile.backend as backend
from attn_compile.passes.index_formula import Affine, Eq, Le
from attn_compile.passes.mask_proof import prove
from attn_compile.passes.mask_structure import Structure, classify
from attn_compile.passes.mask_trace import Unsupported
from compiled import assert_matches_eager, mask_with_is_causal, rewrite
from oracle import rel_err


def hf_mask(pad, window=0, q_offset=0):
    """transformers.masking_utils.sdpa_mask's construction: AND of index comparisons and pad[b, kv]."""
    b, s = pad.shape
    batch = torch.arange(b)[:, None, None, None]
    q = (torch.arange(s) + q_offset)[None, None, :, None]
    kv = (torch.arange(s) + 0)[None, None, None, :]
    mask = q.new_ones((), dtype=torch.bool) & (kv <= q)
    if window:
        mask = mask & (kv > q - window)
    return (mask & pad[batch, kv]).expand(b, -1, s, s)


def attend(mask_fn):
    def fn(q, k, v, *data):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask_fn(q, *data), enable_gqa=True)
    return fn


def _inputs(s=24, padded=True):
    torch.manual_seed(0)
    q = torch.randn(2, 8, s, 16, requires_grad=True)
    k, v = (torch.randn(2, 2, s, 16, requires_grad=True) for _ in range(2))
    pad = torch.ones(2, s, dtype=torch.bool)
    if padded:
        pad[0, :5] = False  # left padding
        pad[1, -7:] = False  # right padding
    return q, k, v, pad


CASES = {
    "hf causal + padding": (lambda q, pad: hf_mask(pad), "True, None, key_padding_mask=l_data_0_"),
    "hf sliding window + padding": (lambda q, pad: hf_mask(pad, window=6),
                                    "True, None, window_left=5, key_padding_mask=l_data_0_"),
    "hf bidirectional + padding": (lambda q, pad: (torch.arange(q.shape[2])[None, None, :, None] >= 0)
                                   & pad[:, None, None, :], "False, None, key_padding_mask=l_data_0_"),
    "query offset": (lambda q, pad: hf_mask(pad, q_offset=3),
                     "False, None, window_right=3, key_padding_mask=l_data_0_"),
    "tril of ones": (lambda q, pad: torch.tril(torch.ones(q.shape[2], q.shape[2], dtype=torch.bool)), "True, None"),
    "additive triu of -inf": (lambda q, pad: torch.triu(torch.full((q.shape[2], q.shape[2]), float("-inf")), 1),
                              "True, None"),
    "additive where of -inf": (lambda q, pad: torch.where(hf_mask(pad, window=4), torch.zeros(()), float("-inf")),
                               "True, None, window_left=3, key_padding_mask=l_data_0_"),
    "additive where of torch.tensor(0.0), as transformers 5.17 writes it": (  # -inf: the left-padded rows match
        lambda q, pad: torch.where(hf_mask(pad), torch.tensor(0.0), float("-inf")),
        "True, None, key_padding_mask=l_data_0_"),
    "local window via abs, as ModernBERT writes it": (
        lambda q, pad: (abs(torch.arange(24)[:, None] - torch.arange(24)) <= 3) & pad[:, None, None, :],
        "False, None, window_left=3, window_right=3, key_padding_mask=l_data_0_"),
    "band via Tensor.abs, the distance on the right": (
        lambda q, pad: 4 > (torch.arange(24)[:, None] - torch.arange(24)).abs(),
        "False, None, window_left=3, window_right=3"),
    "band via abs-free comparisons": (
        lambda q, pad: (lambda i, j: (j - i <= 2) & (i - j <= 2))(torch.arange(24)[:, None], torch.arange(24)),
        "False, None, window_left=2, window_right=2"),
}


class TestStructuredMasks(TestCase):
    def test_hf_mask_graph(self):
        graph, sites = rewrite(attend(lambda q, pad: hf_mask(pad)), *_inputs())
        self.assertExpectedInline(graph, """\
l_data_0_ = input
l_k_ = input
l_q_ = input
l_v_ = input
attention_default = attn_cp.attention.default(l_q_, l_k_, l_v_, None, True, None, key_padding_mask=l_data_0_)
getitem_4 = getitem(attention_default, 0)
return (getitem_4)""")
        self.assertEqual(sites[0].notes, ["mask -> causal + key_padding_mask=l_data_0_"])

    def test_each_structure_is_recognised(self):
        for name, (mask_fn, arguments) in CASES.items():
            with self.subTest(name):
                graph, _ = rewrite(attend(mask_fn), *_inputs())
                self.assertIn(f"attn_cp.attention.default(l_q_, l_k_, l_v_, None, {arguments})", graph)

    def test_each_structure_matches_eager(self):
        for name, (mask_fn, _) in CASES.items():
            with self.subTest(name):
                assert_matches_eager(attend(mask_fn), *_inputs())

    @mask_with_is_causal
    def test_sdpa_is_causal_and_a_window_mask_combine(self):
        def fn(q, k, v, pad):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=hf_mask(pad, q_offset=3) & pad[:, None, None, :],
                                                  is_causal=True, enable_gqa=True)

        graph, _ = rewrite(fn, *_inputs())
        self.assertIn("attn_cp.attention.default(l_q_, l_k_, l_v_, None, True, None, key_padding_mask=l_pad_)", graph)
        assert_matches_eager(fn, *_inputs())

    def test_new_sequence_length_reuses_the_graph(self):
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("attn_cp")
        fn = attend(lambda q, pad: hf_mask(pad, window=6))
        compiled = torch.compile(fn, backend=counter, dynamic=True)
        inner_graphs, inner = [], backend._inner_compile
        with mock.patch.object(backend, "_inner_compile",
                               lambda gm, *args: inner_graphs.append(gm) or inner(gm, *args)):
            for s in (20, 29, 37):
                q, k, v, pad = _inputs(s)
                assert rel_err(compiled(q, k, v, pad), fn(q, k, v, pad)) <= 1e-5
        self.assertEqual(counter.frame_count, 1)
        targets = [n.target for n in inner_graphs[0].graph.nodes]
        self.assertIn(torch.ops.attn_cp.attention.default, targets)
        self.assertNotIn(torch.arange, targets)


LEFT = {
    "a mask tensor from outside": (
        lambda q, pad, m: m, "mask kept: the mask reads data, l_data_1_[i, j]: only key padding [b, j] is structured; not flex_attention: "
        "the mask reads l_data_1_[i, j]: only per-key tensors read at [b, j] go into a mask_mod"),
    "document ids compared by order": (
        lambda q, pad, m: (lambda ids: ids[:, None, :, None] >= ids[:, None, None, :])(pad.long().cumsum(-1)),
        "mask kept: the mask compares data, 'cumsum[b, i] >= cumsum[b, j]': only key padding [b, j] is structured"
        "; not flex_attention: the mask reads cumsum[b, i]: only per-key tensors read at [b, j] go into a mask_mod"),
    "OR of conditions (attention sink)": (
        lambda q, pad, m: (torch.arange(24)[:, None] >= torch.arange(24)) | (torch.arange(24) < 2),
        "mask kept: '(j - i <= 0 | j - 1 <= 0)' is not a causal, sliding-window or key-padding condition"
        "; not flex_attention: flex_attention has no backward on CPU"),
    "chunked": (
        lambda q, pad, m: torch.arange(24)[:, None] // 4 == torch.arange(24) // 4,
        "mask kept: '(i) // 4 == (j) // 4' is not a causal, sliding-window or key-padding condition"
        "; not flex_attention: flex_attention has no backward on CPU"),
    "strictly before the query": (
        lambda q, pad, m: torch.arange(24)[:, None] > torch.arange(24),
        "mask kept: the mask hides the query's own position and 0 before it (j <= i - 1)"
        "; not flex_attention: flex_attention has no backward on CPU"),
    "per-head": (
        lambda q, pad, m: torch.arange(8)[:, None, None] + torch.arange(24)[:, None] >= torch.arange(24),
        "mask kept: 'j - i - h <= 0' depends on the batch or head index"
        "; not flex_attention: flex_attention has no backward on CPU"),
    "a slope other than 1": (
        lambda q, pad, m: 2 * torch.arange(24) <= torch.arange(24)[:, None],
        "mask kept: '2*j - i <= 0' is not a causal or sliding-window bound"
        "; not flex_attention: flex_attention has no backward on CPU"),
    "padding read at another key": (
        lambda q, pad, m: pad[torch.arange(2)[:, None, None, None], 23 - torch.arange(24)[None, None, None, :]],
        "mask kept: the mask reads data, l_data_0_[b, -j + 23]: only key padding [b, j] is structured"
        "; not flex_attention: the mask reads l_data_0_[b, -j + 23]: only per-key tensors read at [b, j] go into a "
        "mask_mod"),
    "keys farther than a distance (an OR)": (
        lambda q, pad, m: 2 < torch.abs(torch.arange(24)[:, None] - torch.arange(24)),
        "mask kept: '(j - i + 3 <= 0 | -j + i + 3 <= 0)' is not a causal, sliding-window or key-padding condition"
        "; not flex_attention: flex_attention has no backward on CPU"),
    "clamped index": (
        lambda q, pad, m: torch.arange(24).clamp(max=20) <= torch.arange(24)[:, None],
        "mask kept: clamp = clamp(...) is not index arithmetic"),
    "finite additive value": (
        lambda q, pad, m: torch.where(hf_mask(pad), 0.0, -1e4),
        "mask kept: additive mask where((j - i <= 0 & l_data_0_[b, j]), 0.0, -10000.0) is not where(cond, 0, -inf or "
        "the dtype's minimum)"),
}


def packed_causal(q, k, v, ids):
    """Packed documents as custom training code masks them: same document, and causal."""
    i = torch.arange(q.shape[2])
    same_document = ids[:, None, :, None] == ids[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=same_document & (i[None, :] <= i[:, None]),
                                          enable_gqa=True)


def _document_ids(contiguous=True):
    """Runs of 5, 1, 10 and 8 tokens in row 0, one document in row 1; or ids that come back."""
    if contiguous:
        row = torch.repeat_interleave(torch.arange(4), torch.tensor([5, 1, 10, 8]))
        return torch.stack([row, torch.full((24,), 7)])
    return torch.stack([torch.arange(24) % 3, torch.arange(24) // 12])


class TestDocumentMasks(TestCase):
    def test_document_ids_reach_the_op_and_the_mask_goes(self):
        q, k, v, _ = _inputs()
        graph, sites = rewrite(packed_causal, q, k, v, _document_ids())
        self.assertExpectedInline(graph, """\
l_ids_ = input
l_k_ = input
l_q_ = input
l_v_ = input
attention_default = attn_cp.attention.default(l_q_, l_k_, l_v_, None, True, None, document_ids=l_ids_)
getitem_4 = getitem(attention_default, 0)
return (getitem_4)""")
        self.assertEqual(sites[0].notes, ["mask -> causal + document_ids=l_ids_"])
        self.assertEqual(sites[0].kernel, "varlen:reference")

    def test_new_sequence_length_reuses_the_graph(self):
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("attn_cp")
        compiled = torch.compile(packed_causal, backend=counter, dynamic=True)
        for s in (20, 29, 37):
            q, k, v, _ = _inputs(s)
            ids = torch.randint(0, 3, (2, s)).sort(-1).values
            assert rel_err(compiled(q, k, v, ids), packed_causal(q, k, v, ids)) <= 1e-5
        self.assertEqual(counter.frame_count, 1)

    def test_contiguous_and_interleaved_documents_match_eager(self):
        for contiguous in (True, False):
            with self.subTest(contiguous=contiguous):
                q, k, v, _ = _inputs()
                assert_matches_eager(packed_causal, q, k, v, _document_ids(contiguous))


def hf_packed_mask(positions, window=0, documents=None):
    """transformers.masking_utils' mask for packed sequences given by position_ids: the same run of
    consecutive positions, and causal (and the window) in positions."""
    b, s = positions.shape
    if documents is None:
        documents = (torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1) != 1).cumsum(-1)
    batch = torch.arange(b)[:, None, None, None]
    q, kv = torch.arange(s)[None, None, :, None], torch.arange(s)[None, None, None, :]
    mask = (documents[batch, q] == documents[batch, kv]) & (positions[batch, kv] <= positions[batch, q])
    if window:
        mask = mask & (positions[batch, kv] > positions[batch, q] - window)
    return mask.expand(b, -1, s, s)


def _packed_positions(batch=2):
    """Row 0: runs of 5, 1, 10 and 8 tokens; row 1: one sequence starting at 3."""
    row = torch.cat([torch.arange(n) for n in (5, 1, 10, 8)])
    return torch.stack([row, torch.arange(3, 27)])[:batch]


def _batch(batch, *tensors):
    return [t[:batch].detach().requires_grad_(t.requires_grad) for t in tensors]


class TestPositionRuns(TestCase):
    def test_positions_become_document_ids_and_causal(self):
        for window, arguments in ((0, "True, None"), (6, "True, None, window_left=5")):
            for batch in (2, 1):
                with self.subTest(window=window, batch=batch):
                    q, k, v, _ = _batch(batch, *_inputs())
                    fn = attend(lambda q, positions: hf_packed_mask(positions, window))
                    graph, sites = rewrite(fn, q, k, v, _packed_positions(batch))
                    self.assertIn(f"attn_cp.attention.default(l_q_, l_k_, l_v_, None, {arguments}, "
                                  f"document_ids=documents)", graph)
                    self.assertNotIn("l_data_0_", graph.split("attention_default")[1])
                    assert_matches_eager(fn, q, k, v, _packed_positions(batch))

    def test_new_documents_in_the_positions_reuse_the_graph(self):
        """Hugging Face's packing passes the documents as data: a new count or length of them is
        the same graph."""
        torch._dynamo.reset()
        counter = CompileCounterWithBackend(functools.partial(backend.attn_cp, options={"inner": "aot_eager"}))
        fn = attend(lambda q, positions: hf_packed_mask(positions))
        compiled = torch.compile(fn, backend=counter, fullgraph=True)
        q, k, v, _ = _inputs()
        for lengths in ((5, 1, 10, 8), (24,), (12, 12), (1,) * 24, (3, 4, 5, 6, 6)):
            positions = torch.cat([torch.arange(n) for n in lengths]).expand(2, -1)
            self.assertLessEqual(rel_err(compiled(q, k, v, positions), fn(q, k, v, positions)), 1e-5)
        self.assertEqual(counter.frame_count, 1)

    def test_positions_of_their_own_length_are_tied_to_the_sequence_by_a_guard(self):
        """Under dynamic shapes the positions, an input of their own, get a length apart from q's.
        Their runs are document ids only while the two lengths agree, and a guard keeps them so:
        longer positions, of which the mask reads a prefix, compile again and keep the mask."""
        def prefix_mask(q, positions):
            documents = (torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1) != 1).cumsum(-1)
            batch = torch.arange(q.shape[0])[:, None, None, None]
            i, j = torch.arange(q.shape[2])[None, None, :, None], torch.arange(q.shape[2])[None, None, None, :]
            return (documents[batch, i] == documents[batch, j]) & (positions[batch, j] <= positions[batch, i])

        torch._dynamo.reset()
        fn = attend(prefix_mask)
        counter = CompileCounterWithBackend("attn_cp")
        compiled = torch.compile(fn, backend=counter)  # dynamic from the second length on
        inner_graphs, inner = [], backend._inner_compile
        with mock.patch.object(backend, "_inner_compile",
                               lambda gm, *args: inner_graphs.append(gm) or inner(gm, *args)):
            for s, longer_by in ((20, 0), (29, 0), (37, 0), (37, 3)):
                q, k, v, _ = _inputs(s)
                positions = torch.cat([torch.arange(s // 2), torch.arange(s - s // 2 + longer_by)]).expand(2, -1)
                assert rel_err(compiled(q, k, v, positions), fn(q, k, v, positions)) <= 1e-5
        self.assertEqual(counter.frame_count, 3)
        ops = [n for gm in inner_graphs for n in gm.graph.nodes if n.target is torch.ops.attn_cp.attention.default]
        self.assertEqual([("document_ids" in op.kwargs, op.args[3] is None) for op in ops],
                         [(True, True), (True, True), (False, False)])

    def test_positions_of_an_arange_are_one_document(self):
        def positions_of_arange(q, _):
            return hf_packed_mask(torch.arange(3, 3 + q.shape[2])[None].expand(q.shape[0], -1))

        graph, _ = rewrite(attend(positions_of_arange), *_inputs())
        self.assertIn("attn_cp.attention.default(l_q_, l_k_, l_v_, None, True, None)", graph)

    def test_a_batch_of_one_reads_key_padding_at_row_zero(self):
        q, k, v, pad = _batch(1, *_inputs())
        graph, _ = rewrite(attend(lambda q, pad: hf_mask(pad)), q, k, v, pad)
        self.assertIn("attn_cp.attention.default(l_q_, l_k_, l_v_, None, True, None, key_padding_mask=l_data_0_)",
                      graph)
        assert_matches_eager(attend(lambda q, pad: hf_mask(pad)), q, k, v, pad)

    def test_positions_compared_outside_their_runs_are_data(self):
        """Document ids that are not the runs of the positions compared say nothing about them."""
        ids = torch.stack([torch.arange(24) // 6, torch.zeros(24, dtype=torch.long)])
        not_runs = {
            "ids given": lambda q, positions, ids: hf_packed_mask(positions, documents=ids),
            "runs of other positions": lambda q, positions, ids: hf_packed_mask(
                positions, documents=(torch.diff(ids, prepend=ids[:, :1] - 1, dim=-1) != 1).cumsum(-1)),
            "positions that wrap (uint8)": lambda q, positions, ids: hf_packed_mask(positions.to(torch.uint8) + 250),
            "another spelling of the runs": lambda q, positions, ids: hf_packed_mask(
                positions, documents=(torch.diff(positions, prepend=positions[:, :1], dim=-1) != 1).cumsum(-1)),
        }
        for name, mask_fn in not_runs.items():
            with self.subTest(name):
                q, k, v, _ = _inputs()
                _, sites = rewrite(attend(mask_fn), q, k, v, _packed_positions(), ids)
                self.assertRegex(sites[0].notes[0],
                                 r"^mask kept: the mask compares data, '(\w+)\[b, j\] <= \1\[b, i\]'")
                assert_matches_eager(attend(mask_fn), q, k, v, _packed_positions(), ids)


class TestLeftMasks(TestCase):
    def test_each_mask_is_kept_with_its_reason(self):
        for name, (mask_fn, note) in LEFT.items():
            with self.subTest(name):
                q, k, v, pad = _inputs()
                m = torch.rand(24, 24) > 0.3
                graph, sites = rewrite(attend(mask_fn), q, k, v, pad, m)
                self.assertTrue(sites[0].rewritten)
                self.assertEqual("; ".join(sites[0].notes), note)
                self.assertNotIn("None, False, None", graph)  # the mask is still an argument
                assert_matches_eager(attend(mask_fn), q, k, v, pad, m)


# Key padding however it is written, on a (B, S) int64 attention mask p (1 = a real key): a cast or
# a comparison with a constant reads the same after the indexing as before it.
SPELLINGS = {
    "bool() after indexing": (lambda q, p: p[:, None, None, :].bool(), "l_data_0_[b, j] != 0"),
    "bool() before indexing": (lambda q, p: p.bool()[:, None, None, :], "l_data_0_[b, j] != 0"),
    "to(torch.bool) after indexing": (lambda q, p: p[:, None, None, :].to(torch.bool), "l_data_0_[b, j] != 0"),
    "to(torch.bool) before indexing": (lambda q, p: p.to(torch.bool)[:, None, None, :], "l_data_0_[b, j] != 0"),
    "== 1 after indexing": (lambda q, p: p[:, None, None, :] == 1, "l_data_0_[b, j] == 1"),
    "== 1 before indexing": (lambda q, p: (p == 1)[:, None, None, :], "l_data_0_[b, j] == 1"),
    "1 == after indexing": (lambda q, p: 1 == p[:, None, None, :], "l_data_0_[b, j] == 1"),
    "> 0 after indexing, with causal": (
        lambda q, p: (p[:, None, None, :] > 0) & torch.ones(24, 24, dtype=torch.bool).tril(),
        "causal + key_padding_mask=l_data_0_[b, j] > 0"),
    "not == 0 after indexing": (lambda q, p: ~(p[:, None, None, :] == 0), "l_data_0_[b, j] != 0"),
}


def _long_padding(pad):
    return pad.long()


class TestKeyPaddingSpellings(TestCase):
    def test_each_spelling_reads_as_key_padding(self):
        for name, (mask_fn, structure) in SPELLINGS.items():
            with self.subTest(name):
                q, k, v, pad = _inputs()
                graph, sites = rewrite(attend(mask_fn), q, k, v, _long_padding(pad))
                note = structure if structure.startswith("causal") else f"key_padding_mask={structure}"
                self.assertEqual(sites[0].notes, [f"mask -> {note}"])
                self.assertRegex(graph, r"attn_cp\.attention\.default\(l_q_, l_k_, l_v_, None, (True|False), None, "
                                        r"key_padding_mask=\w+\)")

    def test_each_spelling_matches_eager(self):
        for name, (mask_fn, _) in SPELLINGS.items():
            with self.subTest(name):
                q, k, v, pad = _inputs()
                assert_matches_eager(attend(mask_fn), q, k, v, _long_padding(pad))

    def test_a_cast_after_indexing_is_made_once_for_every_layer(self):
        def two_layers(q, k, v, p):
            x = F.scaled_dot_product_attention(q, k, v, attn_mask=p[:, None, None, :].bool(), enable_gqa=True)
            return F.scaled_dot_product_attention(x, k, v, attn_mask=p[:, None, None, :].bool(), enable_gqa=True)

        q, k, v, pad = _inputs()
        graph, sites = rewrite(two_layers, q, k, v, _long_padding(pad))
        self.assertExpectedInline(graph, """\
l_k_ = input
l_p_ = input
l_q_ = input
l_v_ = input
ne = ne(l_p_, 0)
attention_default = attn_cp.attention.default(l_q_, l_k_, l_v_, None, False, None, key_padding_mask=ne)
getitem_2 = getitem(attention_default, 0)
attention_default_1 = attn_cp.attention.default(getitem_2, l_k_, l_v_, None, False, None, key_padding_mask=ne)
getitem_3 = getitem(attention_default_1, 0)
return (getitem_3)""")
        assert_matches_eager(two_layers, q, k, v, _long_padding(pad))

    def test_a_padding_mask_of_unit_axes_is_key_padding(self):
        """A (B, 1, 1, S) bool mask reads m[b, 0, 0, j]: key padding, not data that contradicts it."""
        q, k, v, pad = _inputs()
        for mask_fn, note in ((lambda q, m: m, "l_data_0_[b, 0, 0, j]"), (lambda q, m: ~m, "~l_data_0_[b, 0, 0, j]")):
            graph, sites = rewrite(attend(mask_fn), q, k, v, pad[:, None, None, :])
            self.assertEqual(sites[0].notes, [f"mask -> key_padding_mask={note}"])
            self.assertIn("getitem(l_data_0_, (slice(None, None, None), 0, 0, slice(None, None, None)))", graph)
            assert_matches_eager(attend(mask_fn), q, k, v, pad[:, None, None, :])


class TestPaddingModifiedInPlace(TestCase):
    def test_the_mask_is_kept(self):
        def fn(q, k, v, pad):
            mask = hf_mask(pad)
            pad.logical_not_()
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

        q, k, v, pad = _inputs()
        graph, sites = rewrite(fn, q, k, v, pad)
        self.assertEqual(sites[0].notes, ["mask kept: key padding l_pad_ is modified in place",
                                          "not flex_attention: the mask reads l_pad_, which is modified in place"])
        self.assertIn("attn_cp.attention.default(l_q_, l_k_, l_v_, mask_1, False, None)", graph)


class TestDtypeMinimumMask(TestCase):
    def test_only_rows_that_see_no_key_differ(self):
        def mask_fn(q, pad):
            return torch.where(hf_mask(pad, window=4), torch.zeros(()), torch.finfo(torch.float32).min)

        q, k, v, pad = _inputs()
        _, sites = rewrite(attend(mask_fn), q, k, v, pad)
        self.assertEqual(sites[0].notes, ["mask -> causal + window_left=3 + key_padding_mask=l_data_0_; a query that "
                                          "sees no key gets 0, where the code as written gives the mean of v "
                                          "(adding -3.403e+38)"])
        got = torch.compile(attend(mask_fn), backend="attn_cp", options={"inner": "aot_eager"})(q, k, v, pad)
        want = attend(mask_fn)(q, k, v, pad)
        sees_a_key = hf_mask(pad, window=4).any(-1)[:, :, :, None].expand_as(got)
        self.assertLessEqual(rel_err(got[sees_a_key], want[sees_a_key]), 1e-5)
        self.assertTrue(got[~sees_a_key].eq(0).all())
        mean_of_v = v.mean(2, keepdim=True).repeat_interleave(4, 1).expand_as(want)
        torch.testing.assert_close(want[~sees_a_key], mean_of_v[~sees_a_key])


class TestProof(TestCase):
    def test_equality_is_a_band_of_width_zero(self):
        self.assertEqual(classify(Eq(Affine.index(-1) - Affine.index(-2))), Structure(left=0, right=0))

    def test_a_wrong_claim_fails_the_check(self):
        window = Le(Affine.index(-2) - Affine.index(-1) - 5)  # j >= i - 5
        self.assertEqual(classify(window), Structure(left=5))
        prove(window, Structure(left=5), batch=1, s_q=3, s_k=3)  # the window never binds at 3 tokens...
        with self.assertRaisesRegex(Unsupported, "^classification as window_left=4 failed its check at b=0, i=5, j=0$"):
            prove(window, Structure(left=4), batch=1, s_q=3, s_k=3)  # ...the proof looks beyond it

    def test_long_sequences_check_the_band_edges(self):
        causal = Le(Affine.index(-1) - Affine.index(-2))
        prove(causal, Structure(right=0), batch=2, s_q=4096, s_k=4096)
        with self.assertRaisesRegex(Unsupported, "failed its check at b=0, i=0, j=1$"):
            prove(causal, Structure(right=1), batch=2, s_q=4096, s_k=4096)
