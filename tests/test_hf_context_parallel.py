"""Hugging Face models, unchanged, context-parallel through options["mesh"]: each rank runs its
sequence shard (and the matching position_ids) through the compiled model, and the gathered logits
and the summed parameter gradients equal eager on the whole sequence. Llama (GQA, causal) and
Mistral (GQA, sliding window: the mask HF builds from local positions is the same relative window),
2 gloo processes, both layouts."""
import pytest
import torch
import torch.distributed as dist

from attn_compile.cp.layout import shard_sequence, unshard_sequence
from dist_harness import run_distributed
from oracle import rel_err

transformers = pytest.importorskip("transformers")

SEQ, TOLERANCE = 32, 1e-4
MODELS = {"llama": ("Llama", {}), "mistral": ("Mistral", {"sliding_window": 8})}


def _model(name):
    model_type, overrides = MODELS[name]
    config = getattr(transformers, f"{model_type}Config")(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, **overrides)
    config._attn_implementation = "sdpa"
    return getattr(transformers, f"{model_type}ForCausalLM")(config)


def _loss_and_grads(model, ids, positions, weights):
    logits = model(input_ids=ids, position_ids=positions).logits
    model.zero_grad()
    (logits * weights).sum().backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters()]


def _check(rank, world, name, layout):
    group = dist.group.WORLD
    torch.manual_seed(0)  # the same weights and inputs on every rank
    model = _model(name)
    ids = torch.randint(0, 64, (1, SEQ))
    positions = torch.arange(SEQ)[None]
    weights = torch.randn(1, SEQ, 64)
    want_logits, want_grads = _loss_and_grads(model, ids, positions, weights)

    torch._dynamo.reset()
    compiled = torch.compile(model, backend="attn_cp", options={"mesh": group, "layout": layout, "inner": "aot_eager"})
    shard = lambda x: shard_sequence(x, group, seq_dim=1, layout=layout)  # noqa: E731
    logits, grads = _loss_and_grads(compiled, shard(ids), shard(positions), shard(weights))
    for grad in grads:
        dist.all_reduce(grad)  # each rank's gradient is its shard's part of the whole
    errors = [rel_err(unshard_sequence(logits, group, seq_dim=1, layout=layout), want_logits)]
    errors += [rel_err(g, w) for g, w in zip(grads, want_grads)]
    assert max(errors) <= TOLERANCE, (name, layout, max(errors))


@pytest.mark.parametrize("name, layout", [("llama", "zigzag"), ("mistral", "contiguous")])
def test_hugging_face_model_context_parallel_matches_eager(name, layout):
    run_distributed(_check, 2, name, layout)
