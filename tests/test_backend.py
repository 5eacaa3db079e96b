"""The attn_cp backend end to end on CPU: Inductor output and gradients equal eager, no SDPA remains."""
import re

import pytest
import torch
import torch.nn.functional as F

import attn_compile.backend as backend
from attn_compile.demo import TinyGQATransformer
from attn_compile.passes.sdpa import SDPA
from oracle import rel_err
from shapes import HEADS, make_qkv


def _targets(graphs):
    return [n.target for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]


def attention_block(q, k, v, bias):
    causal = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    masked = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
    return (causal * masked).tanh()


@pytest.mark.parametrize("heads", list(HEADS))
def test_inductor_forward_and_backward_match_eager(heads, inner_graphs):
    torch.manual_seed(0)
    q, k, v = make_qkv(heads, s_q=24)
    bias = torch.randn(q.shape[1], 24, 24)
    compiled = torch.compile(attention_block, backend="attn_cp")
    got = compiled(q, k, v, bias)
    dout = torch.randn_like(got)
    got_grads = torch.autograd.grad(got, (q, k, v), dout)
    # against float64: compiled and eager float32 each measure about 2e-7 from it
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    want = attention_block(q64, k64, v64, bias.double())
    want_grads = torch.autograd.grad(want, (q64, k64, v64), dout.double())
    assert rel_err(got, want) <= 1e-5
    assert max(rel_err(g, w) for g, w in zip(got_grads, want_grads)) <= 1e-5
    assert SDPA not in _targets(inner_graphs)
    assert _targets(inner_graphs).count(torch.ops.attn_cp.attention.default) == 2


def test_training_a_model_matches_eager(inner_graphs):
    torch.manual_seed(0)
    model = TinyGQATransformer()
    tokens = torch.randint(0, 256, (2, 32))
    compiled = torch.compile(model, backend="attn_cp")
    loss = compiled(tokens).logsumexp(-1).mean()
    grads = torch.autograd.grad(loss, list(model.parameters()))
    want_loss = model(tokens).logsumexp(-1).mean()
    want_grads = torch.autograd.grad(want_loss, list(model.parameters()))
    assert abs(loss.item() - want_loss.item()) <= 1e-5
    assert max(rel_err(g, w) for g, w in zip(grads, want_grads)) <= 1e-4
    assert _targets(inner_graphs).count(torch.ops.attn_cp.attention.default) == 2
    assert SDPA not in _targets(inner_graphs)


@pytest.mark.parametrize("inner", ["eager", "aot_eager", "inductor"])
def test_inner_compilers(inner):
    torch.manual_seed(0)
    torch._dynamo.reset()
    q, k, v = make_qkv("gqa_mla", s_q=16, requires_grad=False)
    fn = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                       backend="attn_cp", options={"inner": inner})
    assert rel_err(fn(q, k, v), F.scaled_dot_product_attention(q, k, v, enable_gqa=True)) <= 1e-5


def test_unknown_option_lists_valid_ones():
    with pytest.raises(ValueError, match=r"^unknown attn_cp option\(s\) \['inerr'\]; valid options: \['hardware', "
                                         r"'inner', 'layout', 'mesh', 'recompute_kv', 'seq_dim', 'strategy', "
                                         r"'strict'\]$"):
        backend.parse_options({"inerr": "eager"})


def test_bad_inner_compiler():
    with pytest.raises(ValueError, match=r"^options\['inner'\] must be one of \('inductor', 'aot_eager', 'eager'\); "
                                         r"got 'tvm'$"):
        backend.parse_options({"inner": "tvm"})


@pytest.mark.parametrize("key, value, expected", [
    ("seq_dim", 1, "2, the sequence dim of SDPA's (batch, heads, seq, dim) operands"),
    ("layout", "striped", "one of ('zigzag', 'contiguous')"),
    ("strategy", "p2p", "one of ('ring', 'allgather', 'ulysses', 'hybrid', 'auto')"),
    ("hardware", {"link_gbps": 100}, "an attn_compile.cost_model.Hardware"),
    ("recompute_kv", 1, "True or False"),
])
def test_bad_option_values(key, value, expected):
    with pytest.raises(ValueError, match=f"^{re.escape(f'options[{key!r}] must be {expected}; got {value!r}')}$"):
        backend.parse_options({key: value})


def _break_repeat_kv_removal(monkeypatch):
    import attn_compile.passes as passes

    def broken(call):
        raise RuntimeError("planted failure")

    refinements = tuple(broken if r is passes.strip_repeat_kv else r for r in passes.REFINEMENTS)
    monkeypatch.setattr(passes, "REFINEMENTS", refinements)


def _fail_on_rewritten_graphs(monkeypatch):
    inner = backend._inner_compile

    def failing(gm, example_inputs, *args):
        if torch.ops.attn_cp.attention.default in _targets([gm]):
            raise RuntimeError("planted lowering failure\nsecond line")
        return inner(gm, example_inputs, *args)

    monkeypatch.setattr(backend, "_inner_compile", failing)


FAILURES = {  # what fails: (how to plant it, what the warning says failed)
    "a pass": (_break_repeat_kv_removal, r"the attention passes failed at test_backend\.py:\d+ "
                                         r"\(scaled_dot_product_attention\): RuntimeError: planted failure"),
    "the inner compiler": (_fail_on_rewritten_graphs, r"eager failed on the rewritten graph \(RuntimeError: planted "
                                                      r"lowering failure\)"),
}


@pytest.mark.parametrize("failure", list(FAILURES))
def test_a_failing_rewrite_compiles_the_graph_unchanged_with_a_warning(failure, monkeypatch, inner_graphs):
    plant, failed = FAILURES[failure]
    plant(monkeypatch)
    q, k, v = make_qkv("gqa", s_q=16, requires_grad=False)
    fn = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                       backend="attn_cp", options={"inner": "eager"})
    with pytest.warns(UserWarning, match=rf"^attn_compile: {failed}; this graph is compiled unchanged "
                                         r"\(options=\{'strict': True\} re-raises\)$"):
        got = fn(q, k, v)
    assert rel_err(got, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)) <= 1e-6
    assert SDPA in _targets(inner_graphs) and torch.ops.attn_cp.attention.default not in _targets(inner_graphs)


@pytest.mark.parametrize("failure", list(FAILURES))
def test_strict_re_raises_a_failing_rewrite(failure, monkeypatch):
    FAILURES[failure][0](monkeypatch)
    torch._dynamo.reset()
    q, k, v = make_qkv("gqa", s_q=16, requires_grad=False)
    fn = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                       backend="attn_cp", options={"inner": "eager", "strict": True})
    with pytest.raises(Exception, match="planted"):
        fn(q, k, v)


def test_mode_needs_inductor():
    """torch.compile never passes mode and options together; a direct call can."""
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    with pytest.raises(ValueError, match="^mode='max-autotune' applies to the inductor inner compiler only; "
                                         "got inner='eager'$"):
        backend.attn_cp(gm, [torch.randn(3)], mode="max-autotune", options={"inner": "eager"})


def test_an_unknown_mode_is_reported_as_itself(recwarn):
    """Not as Inductor failing on the rewritten graph, with a fallback warning, before the same error."""
    torch._dynamo.reset()
    q, k, v = make_qkv("gqa", s_q=16, requires_grad=False)
    fn = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                       backend="attn_cp", mode="fastest")
    with pytest.raises(Exception, match="Unrecognized mode=fastest"):
        fn(q, k, v)
    assert not [w for w in recwarn if "compiled unchanged" in str(w.message)]


def _causal(q):
    return F.scaled_dot_product_attention(q, q, q, is_causal=True)


def _ineffective_warnings(recwarn) -> list[str]:
    return [str(w.message) for w in recwarn if "has no effect" in str(w.message)]


@pytest.mark.parametrize("options, expected", [
    ({"strategy": "ring"}, ["attn_compile: options['strategy'] has no effect: it steers distributed attention, and "
                            "no attention of this graph is distributed (no options['mesh'], no DTensor q, k, v)"]),
    ({"hardware": backend.cost_model.Hardware()},
     ["attn_compile: options['hardware'] has no effect: it steers distributed attention, and no attention of this "
      "graph is distributed (no options['mesh'], no DTensor q, k, v)"]),
    ({"recompute_kv": True},
     ["attn_compile: options['recompute_kv'] has no effect: it steers distributed attention, and no attention of "
      "this graph is distributed (no options['mesh'], no DTensor q, k, v)"]),
    ({"layout": "contiguous"}, ["attn_compile: options['layout'] has no effect without options['mesh']: it is the "
                                "layout of the mesh's sequence shards (DTensor shards are contiguous)"]),
    ({"inner": "eager"}, []),
])
def test_options_without_a_mesh_or_dtensors_warn_that_they_have_no_effect(recwarn, options, expected):
    torch._dynamo.reset()
    q = torch.randn(1, 2, 8, 4)
    torch.compile(_causal, backend="attn_cp", options={"inner": "eager", **options})(q)
    assert _ineffective_warnings(recwarn) == expected


def test_cuda_graph_modes_on_the_cpu_warn_that_they_have_no_effect(recwarn, monkeypatch):
    monkeypatch.setattr(backend, "_inner_compile", lambda gm, example_inputs, inner, mode: gm.forward)
    for mode, expected in (("reduce-overhead", True), ("max-autotune", True), ("max-autotune-no-cudagraphs", False)):
        torch._dynamo.reset()
        recwarn.clear()
        torch.compile(_causal, backend="attn_cp", mode=mode)(torch.randn(1, 2, 8, 4))
        assert _ineffective_warnings(recwarn) == ([f"attn_compile: mode={mode!r} records CUDA graphs, which has no "
                                                  f"effect here: no input of this graph is on a CUDA device"]
                                                 if expected else [])


def test_inductor_caches_key_on_the_package_source(monkeypatch):
    """Inductor caches compiled code by graph, config and torch version; code cached with other
    versions of the ops (whose fake functions may lay results out otherwise) must not come back.
    The inner compile carries a post-grad pass whose uuid, part of Inductor's cache keys, hashes the
    package's source, passes and kernels included (and the process groups the graph names:
    tests/test_compile_cache.py)."""
    import torch._inductor.compile_fx as compile_fx_module
    from pathlib import Path

    from attn_compile import inductor_cache

    patches, graphs = {}, []

    def spy(gm, example_inputs, config_patches=None):
        patches.update(config_patches)
        graphs.append(gm)
        return gm.forward

    monkeypatch.setattr(compile_fx_module, "compile_fx", spy)
    torch._dynamo.reset()
    q, k, v = make_qkv("mha", s_q=8)
    torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), backend="attn_cp")(q, k, v)
    stamp = patches["post_grad_custom_post_pass"].uuid()
    assert stamp == inductor_cache.cache_key(graphs[0])

    read = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda p: read(p) + (b"#" if p.name == "result_layout.py" else b""))
    inductor_cache.source_hash.cache_clear()
    try:
        assert inductor_cache.cache_key(graphs[0]) != stamp
    finally:
        monkeypatch.undo()
        inductor_cache.source_hash.cache_clear()
    assert inductor_cache.cache_key(graphs[0]) == stamp


def test_a_users_post_grad_pass_runs_and_keys_the_caches_with_the_stamp():
    import torch._inductor.config as inductor_config
    from torch._inductor.custom_graph_pass import CustomGraphPass

    from attn_compile import inductor_cache

    class Own(CustomGraphPass):
        seen = []

        def __call__(self, graph):
            self.seen.append(graph)

        def uuid(self):
            return "own"

    graph = torch.fx.symbolic_trace(lambda x: x + 1)
    key = inductor_cache.cache_key(graph)
    with inductor_config.patch(post_grad_custom_post_pass=Own()):
        stamp = inductor_cache.config_patches(graph)["post_grad_custom_post_pass"]
    stamp(graph.graph)
    assert Own.seen == [graph.graph] and stamp.uuid() == f"{key}:own"
    with inductor_config.patch(post_grad_custom_post_pass=lambda graph: None):
        stamp = inductor_cache.config_patches(graph)["post_grad_custom_post_pass"]
    assert stamp.uuid() is None  # a pass without a uuid: Inductor does not cache, as without the stamp


def test_a_users_inference_aware_post_grad_pass_gets_is_inference():
    """Newer torch hands ``is_inference`` to a CustomInferenceAwareGraphPass; the stamp in its
    place is one too, and passes it on (torch 2.11 has no such passes)."""
    import torch._inductor.config as inductor_config
    from torch._inductor import custom_graph_pass

    from attn_compile import inductor_cache

    if not hasattr(custom_graph_pass, "CustomInferenceAwareGraphPass"):
        assert torch.__version__ < "2.13"
        return

    class Own(custom_graph_pass.CustomInferenceAwareGraphPass):
        seen = []

        def __call__(self, graph, is_inference):
            self.seen.append(is_inference)

        def uuid(self):
            return "own"

    graph = torch.fx.symbolic_trace(lambda x: x + 1)
    with inductor_config.patch(post_grad_custom_post_pass=Own()):
        stamp = inductor_cache.config_patches(graph)["post_grad_custom_post_pass"]
    assert isinstance(stamp, custom_graph_pass.CustomInferenceAwareGraphPass)
    stamp(graph.graph, is_inference=True)
    assert Own.seen == [True]
