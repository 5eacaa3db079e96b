"""On CUDA, through Inductor: small Hugging Face decoders (random weights, float32) compiled with
backend="attn_cp" in Hugging Face's training setups, logits and gradients against eager: packed
sequences given by position_ids (the op gets document_ids, which the Triton kernels read on the
device), and gradient checkpointing (the op inside each checkpoint's body, recomputed in the
backward). Under CUDA graphs (mode="reduce-overhead") the packed sites are recorded too. Run on the
device machine: pytest -m gpu tests/test_gpu_models.py"""
import pytest
import torch

import attn_compile  # noqa: F401
from oracle import rel_err

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.gpu
SEQ, TOL = 256, 1e-3


def _model(model_type: str, checkpointing: bool):
    config = getattr(transformers, f"{model_type}Config")(
        vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, sliding_window=64 if model_type == "Mistral" else None)
    config._attn_implementation = "sdpa"
    model = getattr(transformers, f"{model_type}ForCausalLM")(config).cuda().train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _logits_and_grads(model, batch):
    logits = model(**batch).logits
    return logits, torch.autograd.grad(logits.float().square().mean(), list(model.parameters()))


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("model_type", ["Llama", "Mistral"])
def test_packed_position_ids_train_like_eager(model_type, checkpointing, matmul_precision):
    matmul_precision("highest")
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = _model(model_type, checkpointing)
    positions = torch.stack([torch.cat([torch.arange(n) for n in (100, 28, 128)]), torch.arange(SEQ)]).cuda()
    batch = {"input_ids": torch.randint(0, 128, (2, SEQ), device="cuda"), "position_ids": positions,
             "use_cache": False}
    report = attn_compile.explain(model, **batch)
    assert len(report.rewritten) == 2 and all("document_ids" in " ".join(s.notes) for s in report.sites)
    torch._dynamo.reset()
    got, got_grads = _logits_and_grads(torch.compile(model, backend="attn_cp", fullgraph=True), batch)
    want, want_grads = _logits_and_grads(model, batch)
    assert rel_err(got, want) <= TOL
    assert max(rel_err(g, w) for g, w in zip(got_grads, want_grads)) <= TOL


def test_packed_sites_record_into_cuda_graphs(inner_graphs):
    torch.manual_seed(0)
    model = _model("Llama", checkpointing=False).eval()
    compiled = torch.compile(model, backend="attn_cp", mode="reduce-overhead")
    for first in (100, 60, 100):  # recorded, then replayed on new positions
        positions = torch.stack([torch.cat([torch.arange(first), torch.arange(SEQ - first)]), torch.arange(SEQ)])
        batch = {"input_ids": torch.randint(0, 128, (2, SEQ), device="cuda"), "position_ids": positions.cuda(),
                 "use_cache": False}
        with torch.no_grad():
            got, want = compiled(**batch).logits.clone(), model(**batch).logits
        assert rel_err(got, want) <= TOL
    assert inner_graphs and any(n.target is torch.ops.attn_cp.attention.default
                                for gm in inner_graphs for n in gm.graph.nodes)
