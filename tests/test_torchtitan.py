"""torchtitan 0.3.0's Llama 3 debug model, unchanged, compiled with backend="attn_cp" on the CPU
(where PyTorch has no varlen_attn kernel): packed documents through ``positions``.

- logits equal the same weights run eagerly with its flex backend (forward only);
- logits and parameter gradients equal the model run eagerly with varlen_attn replaced by a
  per-document float64 reference, to bf16 (torchtitan casts q, k, v to bf16 for varlen_attn);
- every layer is rewritten (and, with its flex backend, every layer is left as it is, its
  packed-document mask_mod not being proven to be documents);
- under options["mesh"] on 2 gloo processes it runs context-parallel and matches.
"""
import itertools

import pytest
import torch

import attn_compile
import torchtitan_site
from attn_compile import shard_varlen
from dist_harness import run_distributed
from oracle import rel_err, varlen_reference

pytestmark = torchtitan_site.needs_its_torch

ROWS = ([5, 20, 15], [1, 39])  # documents packed into each row of the batch
BF16 = 2e-2  # the error bf16 q, k, v and attention outputs leave in the logits and gradients


@pytest.fixture(scope="module")
def site():
    return torchtitan_site.install()


def _positions(rows):
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])


def _build(backend):
    from torchtitan.models.llama3 import model_registry

    torch.manual_seed(0)
    model = model_registry("debugmodel", attn_backend=backend).model.build()
    model.init_states(buffer_device=torch.device("cpu"))
    return model


def per_document_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                             window_size=(-1, -1), **_gqa_and_splits):
    """varlen_attn computed in float64, one document at a time, returned in q's dtype."""
    out, lse = varlen_reference(query, key, value, cu_seq_q, cu_seq_k, scale=scale, window=window_size)
    out = out.to(query.dtype)
    return (out, lse.float()) if return_aux is not None and return_aux.lse else out


def _eager_flex(monkeypatch):
    """torchtitan's flex backend run eagerly: its compiled flex_attention and block-mask builder
    replaced by the functions they compile."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from torchtitan.models.common import attention, decoder

    monkeypatch.setattr(attention.FlexAttention, "_compiled_flex_attn", flex_attention)
    monkeypatch.setattr(decoder, "create_attention_mask", create_block_mask)


def test_llama3_debug_model_varlen_compiled(site, monkeypatch):
    from torchtitan.models.common import attention

    model, flex = _build("varlen"), _build("flex")
    flex.load_state_dict(model.state_dict())
    positions = _positions(ROWS)
    tokens = torch.randint(0, 2048, positions.shape, generator=torch.Generator().manual_seed(1))
    masks = model.get_attention_masks(positions)

    report = attn_compile.explain(model, tokens, positions, attention_masks=masks)
    assert len(report.sites) == 6 and all(s.op == "attn_cp.varlen_attention" for s in report.sites), str(report)

    torch._dynamo.reset()
    compiled = torch.compile(model, backend="attn_cp", options={"inner": "aot_eager"})
    logits = compiled(tokens, positions, attention_masks=masks)
    dout = torch.randn_like(logits)
    grads = torch.autograd.grad(logits, list(model.parameters()), dout)

    _eager_flex(monkeypatch)
    with torch.no_grad():
        block_mask = flex.get_attention_masks(positions)
        assert rel_err(logits, flex(tokens, positions, attention_masks=block_mask)) <= BF16
        # its packed-document mask_mod, q_idx <= doc_end_by_token[b, kv_idx], compares the query
        # index with data computed outside the model: not proven to be documents, so left as it is
        torch._dynamo.reset()
        report = attn_compile.explain(flex, tokens, positions, attention_masks=block_mask)
    assert len(report.sites) == 6 and all(
        not s.rewritten and "the mask compares data, 'i <= " in s.reason for s in report.sites), str(report)

    monkeypatch.setattr(attention, "varlen_attn", per_document_varlen_attn)
    want = model(tokens, positions, attention_masks=masks)
    assert rel_err(logits, want) <= BF16
    for (name, _), got, expected in zip(model.named_parameters(), grads,
                                        torch.autograd.grad(want, list(model.parameters()), dout)):
        assert rel_err(got, expected) <= BF16, name


def _check_ranks(rank, world, site):
    torchtitan_site.add_to_path(site)
    from torchtitan.models.common.attention import create_varlen_metadata_for_document

    group = torch.distributed.group.WORLD
    model = _build("varlen")
    lengths = list(itertools.chain(*ROWS))
    positions = _positions([lengths])  # the batch packed into one row, which the ranks shard
    tokens = torch.randint(0, 2048, positions.shape, generator=torch.Generator().manual_seed(1))
    masks = create_varlen_metadata_for_document(positions)
    cu = masks.cu_seq_q
    whole = torch.compile(model, backend="attn_cp", options={"inner": "aot_eager"})(tokens, positions,
                                                                                   attention_masks=masks)
    dout = torch.randn_like(whole)
    want_grads = torch.autograd.grad(whole, list(model.parameters()), dout)

    torch._dynamo.reset()
    sharded = torch.compile(model, backend="attn_cp", options={"inner": "aot_eager", "mesh": group})
    local_tokens, local_positions = (shard_varlen(x[0], cu, group)[0][None] for x in (tokens, positions))
    logits = sharded(local_tokens, local_positions, attention_masks=masks)
    assert rel_err(logits[0], shard_varlen(whole[0].detach(), cu, group)[0]) <= 1e-5
    grads = torch.autograd.grad(logits, list(model.parameters()), shard_varlen(dout[0], cu, group)[0][None])
    for (name, _), got, want in zip(model.named_parameters(), grads, want_grads):
        torch.distributed.all_reduce(got)  # each rank's part of the gradient of the whole batch
        assert rel_err(got, want) <= BF16, name  # bf16 dK, dV: rounded per rank before they are summed


def test_llama3_debug_model_varlen_context_parallel(site):
    run_distributed(_check_ranks, 2, site, timeout=300)
