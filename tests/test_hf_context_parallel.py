"""Hugging Face models, unchanged, context-parallel through options["mesh"]: each rank runs its
sequence shard (and the matching position_ids) through the compiled model, and the gathered logits
and the summed parameter gradients equal eager on the whole sequence. Llama (GQA, causal) and
Mistral (GQA, sliding window: the mask HF builds from local positions is the same relative window),
and both with gradient checkpointing (each layer a checkpoint body, recomputed in the backward;
transformers then builds its mask from the position_ids, whose shards are checked to make one
sequence; an all-ones attention_mask is checked to pad nothing), 2 gloo processes, both layouts.
Packed position_ids and padding raise on every rank."""
import pytest
import torch
import torch.distributed as dist

from attn_compile.cp.layout import shard_sequence, unshard_sequence
from dist_harness import run_distributed
from oracle import rel_err

transformers = pytest.importorskip("transformers")

SEQ, TOLERANCE = 32, 1e-4
MODELS = {"llama": ("Llama", {}), "mistral": ("Mistral", {"sliding_window": 8})}


def _model(name, checkpointing):
    model_type, overrides = MODELS[name]
    config = getattr(transformers, f"{model_type}Config")(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, **overrides)
    config._attn_implementation = "sdpa"
    model = getattr(transformers, f"{model_type}ForCausalLM")(config)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _loss_and_grads(model, ids, positions, weights, **masking):
    logits = model(input_ids=ids, position_ids=positions, **masking).logits
    model.zero_grad()
    (logits * weights).sum().backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters()]


def _check(rank, world, name, layout, checkpointing, attention_mask):
    group = dist.group.WORLD
    torch.manual_seed(0)  # the same weights and inputs on every rank
    model = _model(name, checkpointing)
    ids = torch.randint(0, 64, (1, SEQ))
    positions = torch.arange(SEQ)[None]
    weights = torch.randn(1, SEQ, 64)
    masking = {"attention_mask": torch.ones(1, SEQ, dtype=torch.long)} if attention_mask else {}
    want_logits, want_grads = _loss_and_grads(model, ids, positions, weights, **masking)

    torch._dynamo.reset()
    compiled = torch.compile(model, backend="attn_cp", options={"mesh": group, "layout": layout, "inner": "aot_eager"})
    shard = lambda x: shard_sequence(x, group, seq_dim=1, layout=layout)  # noqa: E731
    logits, grads = _loss_and_grads(compiled, shard(ids), shard(positions), shard(weights),
                                    **{name: shard(x) for name, x in masking.items()})
    for grad in grads:
        dist.all_reduce(grad)  # each rank's gradient is its shard's part of the whole
    errors = [rel_err(unshard_sequence(logits, group, seq_dim=1, layout=layout), want_logits)]
    errors += [rel_err(g, w) for g, w in zip(grads, want_grads)]
    assert max(errors) <= TOLERANCE, (name, layout, max(errors))


@pytest.mark.parametrize("name, layout, checkpointing, attention_mask",
                         [("llama", "zigzag", False, False), ("mistral", "contiguous", False, False),
                          ("llama", "contiguous", True, False), ("mistral", "zigzag", True, True)])
def test_hugging_face_model_context_parallel_matches_eager(name, layout, checkpointing, attention_mask):
    run_distributed(_check, 2, name, layout, checkpointing, attention_mask)


def _unsupported_inputs_raise(rank, world, inputs, message):
    group = dist.group.WORLD
    torch.manual_seed(0)
    compiled = torch.compile(_model("llama", checkpointing=False), backend="attn_cp",
                             options={"mesh": group, "inner": "aot_eager"})
    shard = lambda x: shard_sequence(x, group, seq_dim=1)  # noqa: E731
    with pytest.raises(ValueError, match=message):
        compiled(input_ids=shard(torch.randint(0, 64, (1, SEQ))), use_cache=False,
                 **{name: shard(x) for name, x in inputs.items()})


def test_packed_position_ids_or_padding_raise_on_every_rank():
    padded = torch.ones(1, SEQ, dtype=torch.long)
    padded[0, 27:] = 0
    cases = [({"position_ids": torch.cat([torch.arange(20), torch.arange(SEQ - 20)])[None]},
              "must rise by one along each row of the whole sequence .*; row 0 goes from 19 to 0 at token 20"),
             ({"position_ids": torch.arange(SEQ)[None], "attention_mask": padded},
              "must pad no token: key padding is not distributed; row 0 pads token 27 of the whole sequence")]
    for inputs, message in cases:
        run_distributed(_unsupported_inputs_raise, 2, inputs, message)
