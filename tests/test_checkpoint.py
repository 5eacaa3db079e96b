"""Attention inside activation checkpointing (torch.utils.checkpoint, as Hugging Face's gradient
checkpointing uses it): the body of each checkpoint is rewritten like any graph, the mask built
outside it is read through the body's inputs and is then not built, and the result and gradients
(the body recomputed in the backward) equal the float64 oracle. The graph dynamo gave the backend
keeps its bodies as they were, for a fallback."""
import torch
import torch.nn.functional as F
from expecttest import TestCase
from torch.utils.checkpoint import checkpoint

import attn_compile  # noqa: F401  (registers torch.ops.attn_cp)
from attn_compile.backend import attn_cp
from graphs import normalized, rewritten_graphs
from oracle import naive_attention, rel_err

ATTENTION = torch.ops.attn_cp.attention.default
SEQ = 12


def _mask(padding):
    """Hugging Face's form: causal AND the padding read at [batch, key], built from aranges."""
    i, j = torch.arange(SEQ)[:, None], torch.arange(SEQ)[None, :]
    return ((j <= i)[None, None] & padding[:, None, None, :]).expand(padding.shape[0], 1, SEQ, SEQ)


def _attend(q, k, v, mask):
    k, v = (t[:, :, None].expand(-1, -1, 2, -1, -1).reshape(t.shape[0], 4, SEQ, t.shape[-1]) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _two_layers(q, k, v, padding):
    mask = _mask(padding)
    out = checkpoint(_attend, q, k, v, mask, use_reentrant=False)
    return checkpoint(_attend, out, k, v, mask, use_reentrant=False)


def _nested(q, k, v, padding):
    mask = _mask(padding)
    return checkpoint(lambda q, k, v: checkpoint(_attend, q, k, v, mask, use_reentrant=False), q, k, v,
                      use_reentrant=False)


def _inputs(dtype=torch.float64):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, h, SEQ, 8, dtype=dtype, requires_grad=True) for h in (4, 2, 2))
    padding = torch.ones(2, SEQ, dtype=torch.bool)
    padding[1, 7:] = False
    return q, k, v, padding


def _oracle(fn, q, k, v, padding):
    def attend(q, k, v):
        return naive_attention(q, k, v, is_causal=True, key_padding_mask=padding)
    return attend(attend(q, k, v), k, v) if fn is _two_layers else attend(q, k, v)


def _printout(gm) -> str:
    bodies = [f"{name}:\n{normalized(body)}" for name, body in gm.named_children()]
    return "\n".join([normalized(gm)] + bodies)


class TestCheckpoint(TestCase):
    def test_the_bodies_are_rewritten_and_the_mask_is_not_built(self):
        torch._dynamo.reset()
        graphs, sites, _ = rewritten_graphs(_two_layers, *_inputs())
        self.assertEqual([s.op for s in sites], ["attn_cp.attention"] * 2)
        self.assertExpectedInline(_printout(graphs[0]), """\
l_k_ = input
l_padding_ = input
l_q_ = input
l_v_ = input
wrap_body_0 = wrap_body_0()
tag_activation_checkpoint = tag_activation_checkpoint(wrap_body_0, l_k_, l_v_, l_q_, l_padding_, use_reentrant=False)
out = getitem(tag_activation_checkpoint, 0)
wrap_body_1 = wrap_body_1()
tag_activation_checkpoint_1 = tag_activation_checkpoint(wrap_body_1, l_k_, l_v_, out, l_padding_, use_reentrant=False)
getitem_5 = getitem(tag_activation_checkpoint_1, 0)
return (getitem_5)
wrap_body_0:
l_k_ = input
l_padding_ = input
l_q_ = input
l_v_ = input
attention_default = attn_cp.attention.default(l_q_, l_k_, l_v_, None, True, None, key_padding_mask=l_padding_)
getitem_2 = getitem(attention_default, 0)
return (getitem_2)
wrap_body_1:
l_k_ = input
l_padding_ = input
l_v_ = input
out = input
attention_default = attn_cp.attention.default(out, l_k_, l_v_, None, True, None, key_padding_mask=l_padding_)
getitem_2 = getitem(attention_default, 0)
return (getitem_2)""")

    def test_results_and_gradients_equal_the_oracle(self):
        for fn in (_two_layers, _nested):
            with self.subTest(fn=fn.__name__):
                torch._dynamo.reset()
                q, k, v, padding = _inputs()
                compiled = torch.compile(fn, backend="attn_cp", options={"inner": "aot_eager", "strict": True},
                                         fullgraph=True)
                got, want = compiled(q, k, v, padding), _oracle(fn, q, k, v, padding)
                self.assertLessEqual(rel_err(got, want), 1e-12)
                dout = torch.randn_like(want)
                for g, w in zip(torch.autograd.grad(got, (q, k, v), dout), torch.autograd.grad(want, (q, k, v), dout)):
                    self.assertLessEqual(rel_err(g, w), 1e-12)

    def test_nested_bodies_pass_what_they_need_through_each_level(self):
        torch._dynamo.reset()
        graphs, sites, _ = rewritten_graphs(_nested, *_inputs())
        self.assertEqual([s.op for s in sites], ["attn_cp.attention"])
        inner = graphs[0].wrap_body_1.wrap_body_0
        (op,) = inner.graph.find_nodes(op="call_function", target=ATTENTION)
        self.assertEqual(op.kwargs["key_padding_mask"].op, "placeholder")
        for gm in (graphs[0], graphs[0].wrap_body_1, inner):  # no S x S tensor at any level
            for node in gm.graph.nodes:
                value = node.meta.get("example_value")
                if isinstance(value, torch.Tensor):
                    self.assertNotEqual(tuple(value.shape[-2:]), (SEQ, SEQ), node.format_node())

    def test_the_backend_leaves_the_graph_it_was_given_as_it_was(self):
        given = []

        def backend(gm, example_inputs):
            given.append((gm, normalized(gm.wrap_body_0)))
            return attn_cp(gm, example_inputs, options={"inner": "eager"})

        torch._dynamo.reset()
        torch.compile(_two_layers, backend=backend, fullgraph=True)(*_inputs())
        ((gm, body_before),) = given
        self.assertEqual(normalized(gm.wrap_body_0), body_before)
        self.assertIn("scaled_dot_product_attention", body_before)
