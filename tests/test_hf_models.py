"""Tiny random-weight Hugging Face models (built from configs, never downloaded) compiled with
backend="attn_cp": logits and gradients equal eager for batches with left and with right padding,
every layer's attention is rewritten, and the graph handed to the inner compiler computes no
S x S mask and no repeat_kv copy: k and v reach the op with their own head count. Beyond the
models the design names, more architectures check the forward alone (their training takes the
same code paths and would double this file's time)."""
import dataclasses
from typing import Callable

import pytest
import torch
from torch.torch_version import TorchVersion

import attn_compile  # noqa: F401  (registers torch.ops.attn_cp)
from oracle import rel_err

transformers = pytest.importorskip("transformers")

SEQ, LAYERS, TOLERANCE = 22, 2, 1e-4
ATTENTION = torch.ops.attn_cp.attention.default
# torch 2.11 (the GPU machine's) cannot compile the backward of transformers' MoE fallback
# (grouped_mm, a data-dependent guard), with aot_eager alone as with attn_cp
MOE_TRAINS_COMPILED = TorchVersion(torch.__version__) >= (2, 13)


@dataclasses.dataclass
class Case:
    build: Callable  # -> (model, kv heads)
    op_kwargs: dict | list  # the keyword arguments every op call gets (key_padding_mask: True = a (B, S) bool
    # tensor), or a list of them, one per layer
    is_causal: bool
    inputs: str = "text"  # "text" (ids and attention mask) or "image"
    no_key_rows_match: bool = True  # rows that see no key (left padding, causal): 0 in both, or eager averages
    inner: str = "aot_eager"  # for the forward; training always uses aot_eager (Inductor's CPU backward
    # compiles would take most of this file's time budget)
    trains: bool = True  # compiled training is compared too


def _auto(model_type: str, kv_heads: int, model_cls="AutoModelForCausalLM", attn="sdpa", **overrides):
    """Builds ``model_type`` through transformers' Auto classes (its modules are imported only
    when a test runs); ``kv_heads``: the KV heads its attention has."""
    def build():
        config = transformers.AutoConfig.for_model(
            model_type, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
            num_attention_heads=4, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            **overrides)
        config._attn_implementation = attn
        return getattr(transformers, model_cls).from_config(config), kv_heads
    return build


def _gpt2():
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=LAYERS, n_head=4, n_positions=64,
                                     attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    config._attn_implementation = "eager"
    return transformers.GPT2LMHeadModel(config), 4


def _bert():
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                                     num_attention_heads=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    config._attn_implementation = "eager"
    return transformers.BertModel(config, add_pooling_layer=False), 4


def _vit():
    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4,
                                    intermediate_size=64, image_size=16, patch_size=4, hidden_dropout_prob=0.0,
                                    attention_probs_dropout_prob=0.0)
    config._attn_implementation = "eager"
    return transformers.ViTModel(config, add_pooling_layer=False), 4


CASES = {
    "llama": Case(_auto("llama", 2, num_key_value_heads=2),
                  {"key_padding_mask": True}, is_causal=True, inner="inductor"),
    "llama_eager": Case(_auto("llama", 2, attn="eager", num_key_value_heads=2),
                        {"key_padding_mask": True}, is_causal=True, no_key_rows_match=False),
    "qwen2": Case(_auto("qwen2", 2, num_key_value_heads=2, use_sliding_window=True, sliding_window=6,
                        max_window_layers=0),
                  {"window_left": 5, "key_padding_mask": True}, is_causal=True),
    "mistral": Case(_auto("mistral", 1, num_key_value_heads=1, sliding_window=8),
                    {"window_left": 7, "key_padding_mask": True}, is_causal=True),
    "deepseek_v3": Case(_auto("deepseek_v3", 4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16,
                              qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6,  # MLA: d_qk 12, d_v 6
                              moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                              topk_group=1, first_k_dense_replace=1),
                        {"key_padding_mask": True}, is_causal=True, trains=MOE_TRAINS_COMPILED),
    # Gemma 2's eager attention caps its scores (tanh(s / cap) * cap) between the scale and the mask;
    # weights larger than the default make the scores big enough for the cap to bend them. A window
    # of 10 leaves every right-padded row a key (eager averages the rows that see none).
    "gemma2": Case(_auto("gemma2", 2, attn="eager", num_key_value_heads=2, head_dim=8, sliding_window=10,
                         query_pre_attn_scalar=8, attn_logit_softcapping=1.0, initializer_range=0.3,
                         layer_types=["sliding_attention", "full_attention"]),
                   [{"window_left": 9, "softcap": 1.0, "key_padding_mask": True},
                    {"softcap": 1.0, "key_padding_mask": True}], is_causal=True, no_key_rows_match=False),
    "gpt2": Case(_gpt2, {"key_padding_mask": True}, is_causal=True, no_key_rows_match=False),
    "bert": Case(_bert, {"key_padding_mask": True}, is_causal=False),
    "vit": Case(_vit, {}, is_causal=False, inputs="image"),
}
_PADDED = {"key_padding_mask": True}
_LOCAL_THEN_GLOBAL = ["sliding_attention", "full_attention"]
CASES.update({  # forward only (see the module docstring)
    "qwen3": Case(_auto("qwen3", 2, num_key_value_heads=2, head_dim=8), _PADDED, True, trains=False),
    "gemma": Case(_auto("gemma", 1, num_key_value_heads=1, head_dim=8), _PADDED, True, trains=False),
    "gemma3": Case(_auto("gemma3_text", 2, num_key_value_heads=2, head_dim=8, sliding_window=6,
                         layer_types=_LOCAL_THEN_GLOBAL),
                   [{"window_left": 5, **_PADDED}, _PADDED], True, trains=False),
    "cohere2": Case(_auto("cohere2", 2, num_key_value_heads=2, sliding_window=6, layer_types=_LOCAL_THEN_GLOBAL),
                    [{"window_left": 5, **_PADDED}, _PADDED], True, trains=False),
    "phi3": Case(_auto("phi3", 2, num_key_value_heads=2), _PADDED, True, trains=False),
    "starcoder2": Case(_auto("starcoder2", 2, num_key_value_heads=2, sliding_window=6),
                       {"window_left": 5, **_PADDED}, True, trains=False),
    "gpt_neox": Case(_auto("gpt_neox", 4), _PADDED, True, trains=False),
    "falcon": Case(_auto("falcon", 1), _PADDED, True, trains=False),  # multi-query
    "gpt_bigcode": Case(_auto("gpt_bigcode", 1), _PADDED, True, trains=False),  # multi-query
    "opt": Case(_auto("opt", 4, ffn_dim=64, word_embed_proj_dim=32), _PADDED, True, trains=False),
    "modernbert": Case(_auto("modernbert", 4, "AutoModel", local_attention=8, global_attn_every_n_layers=2,
                             cls_token_id=1, sep_token_id=2),
                       [_PADDED, {"window_left": 4, "window_right": 4, **_PADDED}], False, trains=False),
})


def _batches(case: Case):
    """Two batches of one shape: right padding (22 and 14 real tokens), then left padding (16 and 11)."""
    if case.inputs == "image":
        return [{"pixel_values": torch.randn(2, 3, 16, 16)} for _ in range(2)]
    ids = torch.randint(0, 64, (2, SEQ))
    right = torch.ones(2, SEQ, dtype=torch.long)
    right[1, 14:] = 0
    left = torch.ones(2, SEQ, dtype=torch.long)
    left[0, :6], left[1, :11] = 0, 0
    extra = {} if case.build is _bert else {"use_cache": False}
    return [{"input_ids": ids, "attention_mask": mask, **extra} for mask in (right, left)]


def _output(result):
    return result.logits if hasattr(result, "logits") else result.last_hidden_state


def _compared_rows(case: Case, batch) -> torch.Tensor:
    """(B, S) positions to compare: all, or those that see a key when eager averages the others."""
    if "attention_mask" not in batch or case.no_key_rows_match:
        return torch.ones(_output_shape(batch)[:2], dtype=torch.bool)
    return batch["attention_mask"].cumsum(-1) > 0


def _output_shape(batch):
    return (2, 17) if "pixel_values" in batch else batch["input_ids"].shape


def _loss(output, batch) -> torch.Tensor:
    real = batch.get("attention_mask", torch.ones(_output_shape(batch), dtype=torch.long)).bool()
    return output.logsumexp(-1)[real].mean()


def _assert_gradients_close(got, want):
    """Each gradient within TOLERANCE relative error; gradients that are zero but for rounding
    (the softmax is blind to a key bias) are measured against 1e-3 of the whole gradient's norm."""
    total = torch.cat([w.flatten() for w in want]).norm()
    for g, w in zip(got, want):
        assert (g - w).norm() <= TOLERANCE * max(w.norm(), 1e-3 * total)


def _graphs(gm):
    """gm and the bodies of its activation checkpoints."""
    return [m for m in gm.modules() if isinstance(m, torch.fx.GraphModule)]


def _live_nodes(gm):
    live, stack = set(), [n for m in _graphs(gm) for n in m.graph.nodes if n.op == "output"]
    while stack:
        node = stack.pop()
        if node not in live:
            live.add(node)
            stack.extend(node.all_input_nodes)
    return live


def _check_graph(gm, op_kwargs: dict | list, is_causal: bool, kv_heads: int, seq: int, batch: int = 2):
    """op_kwargs: the op's keyword arguments, True standing for a (batch, seq) tensor: key padding
    (bool) or document ids (integers); or a list of them, one per layer."""
    ops = [n for m in _graphs(gm) for n in m.graph.nodes if n.target is ATTENTION]
    assert len(ops) == LAYERS
    for op, want in zip(ops, op_kwargs if isinstance(op_kwargs, list) else [op_kwargs] * LAYERS):
        q, k, v = (a.meta["example_value"] for a in op.args[:3])
        assert k.shape[1] == v.shape[1] == kv_heads
        assert op.args[3] is None and op.args[4] is is_causal
        kwargs = dict(op.kwargs)
        for name in ("key_padding_mask", "document_ids"):
            if name in kwargs:
                t = kwargs[name].meta["example_value"]
                is_bool = name == "key_padding_mask"
                kwargs[name] = tuple(t.shape) == (batch, seq) and (t.dtype == torch.bool) == is_bool
        assert kwargs == want
    for node in _live_nodes(gm):
        value = node.meta.get("example_value")
        if isinstance(value, torch.Tensor):
            assert tuple(value.shape[-2:]) != (seq, seq), f"{node.format_node()} is an S x S tensor"
        assert node.target not in (torch.softmax, torch.nn.functional.softmax, "softmax", "repeat_interleave")


def _train_and_compare(model, compiled, batches, loss, compared_rows=lambda batch: slice(None)):
    """Outputs (the rows compared) and the parameters' gradients of ``loss`` equal eager's."""
    params = [p for p in model.parameters() if p.requires_grad]
    for batch in batches:
        got, want = _output(compiled(**batch)), _output(model(**batch))
        rows = compared_rows(batch)
        assert rel_err(got[rows], want[rows]) <= TOLERANCE
        _assert_gradients_close(torch.autograd.grad(loss(got, batch), params),
                                torch.autograd.grad(loss(want, batch), params))


@pytest.mark.parametrize("name", list(CASES))
def test_model(name, inner_graphs):
    case = CASES[name]
    torch.manual_seed(0)
    model, kv_heads = case.build()
    batches = _batches(case)
    model.eval()
    compiled = torch.compile(model, backend="attn_cp", options={"inner": case.inner}, fullgraph=True)
    with torch.no_grad():
        for batch in batches:
            rows = _compared_rows(case, batch)
            assert rel_err(_output(compiled(**batch))[rows], _output(model(**batch))[rows]) <= TOLERANCE
    if case.trains:
        compiled = torch.compile(model.train(), backend="attn_cp", options={"inner": "aot_eager"}, fullgraph=True)
        _train_and_compare(model, compiled, batches, _loss, lambda batch: _compared_rows(case, batch))
    assert len(inner_graphs) == 1 + case.trains  # eval and train; the second batch reused each
    seq = 17 if case.inputs == "image" else SEQ
    for gm in inner_graphs:
        _check_graph(gm, case.op_kwargs, case.is_causal, kv_heads, seq)


def test_new_sequence_length_reuses_the_graph(inner_graphs):
    torch.manual_seed(0)
    model, _ = CASES["mistral"].build()
    compiled = torch.compile(model.eval(), backend="attn_cp", options={"inner": "aot_eager"}, dynamic=True)
    compiled_after_first = None
    for seq in (SEQ, 29, 37):
        ids, padding = torch.randint(0, 64, (2, seq)), torch.ones(2, seq, dtype=torch.long)
        padding[1, -5:] = 0
        with torch.no_grad():
            got = compiled(input_ids=ids, attention_mask=padding, use_cache=False).logits
            want = model(input_ids=ids, attention_mask=padding, use_cache=False).logits
        assert rel_err(got, want) <= TOLERANCE
        compiled_after_first = compiled_after_first or len(inner_graphs)
    assert len(inner_graphs) == compiled_after_first
    ops = [n for gm in inner_graphs for n in gm.graph.nodes if n.target is ATTENTION]
    assert [(op.args[3], op.args[4], op.kwargs["window_left"]) for op in ops] == [(None, True, 7)] * LAYERS


def _packed_positions(batch):
    """Row 0: sequences of 9, 5 and 8 tokens packed together; row 1: one sequence."""
    return torch.stack([torch.cat([torch.arange(n) for n in (9, 5, 8)]), torch.arange(SEQ)])[:batch]


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_packed_sequences_given_by_position_ids(name, inner_graphs):
    """Hugging Face's training input: position_ids, no attention mask and no cache. Its mask puts
    each run of consecutive positions in a document of its own and compares positions; the op gets
    causal (and Mistral's window) within the runs as document_ids."""
    case = CASES[name]
    torch.manual_seed(0)
    model, kv_heads = case.build()
    compiled = torch.compile(model.train(), backend="attn_cp", options={"inner": "aot_eager"}, fullgraph=True)
    batches = [{"input_ids": torch.randint(0, 64, (b, SEQ)), "position_ids": _packed_positions(b), "use_cache": False}
               for b in (2, 1)]
    weights = torch.randn(2, SEQ, 64)
    _train_and_compare(model, compiled, batches, lambda out, batch: (out * weights[:out.shape[0]]).sum())
    assert len(inner_graphs) == 2
    op_kwargs = {**{k: v for k, v in case.op_kwargs.items() if k != "key_padding_mask"}, "document_ids": True}
    for gm, batch in zip(inner_graphs, (2, 1)):
        _check_graph(gm, op_kwargs, True, kv_heads, SEQ, batch)


def test_gradient_checkpointing(inner_graphs):
    """Each decoder layer an activation checkpoint, recomputed in the backward: the passes rewrite
    the checkpoints' bodies, and the mask built once before them is not built."""
    case = CASES["llama"]
    torch.manual_seed(0)
    model, kv_heads = case.build()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    compiled = torch.compile(model.train(), backend="attn_cp", options={"inner": "aot_eager"}, fullgraph=True)
    _train_and_compare(model, compiled, _batches(case), _loss)
    (gm,) = inner_graphs
    assert len(_graphs(gm)) == 1 + LAYERS
    _check_graph(gm, case.op_kwargs, case.is_causal, kv_heads, SEQ)
