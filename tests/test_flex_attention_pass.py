"""flex_attention sites whose mask_mod is causal, a window, key padding or document ids become
attn_cp.attention (a softcap score_mod goes along), and a block mask built in the graph is built no
more; other mask_mods and score_mods stay flex_attention, with the reason."""
import pytest
import torch
from expecttest import TestCase
from torch._dynamo.testing import CompileCounterWithBackend
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from compiled import rewrite
from oracle import naive_attention, rel_err

S = 40
GENERATOR = torch.Generator().manual_seed(0)
IDS = torch.tensor([[0] * 7 + [1] * 20 + [2] * 13, [0] * 40])  # documents of each row
PADDING = torch.arange(S)[None, :] < torch.tensor([[S], [29]])  # row 1 pads its last 11 keys


def causal(b, h, q, kv):
    return kv <= q


def window(b, h, q, kv):
    return (kv <= q) & (q - kv < 6)


def documents(b, h, q, kv):
    return (IDS[b, q] == IDS[b, kv]) & (kv <= q)


def padded(b, h, q, kv):
    return PADDING[b, kv]


def prefix_lm(b, h, q, kv):
    return (kv <= q) | (kv < 4)


def softcap(score, b, h, q, kv):
    return 20 * torch.tanh(score / 20)


def relative(score, b, h, q, kv):
    return score + (q - kv) * 0.1


# the dense bool mask (B, 1, S, S) each mask_mod means
DENSE = {causal: lambda i, j: j <= i, window: lambda i, j: (j <= i) & (i - j < 6),
         documents: lambda i, j: (IDS[:, None, :, None] == IDS[:, None, None, :]) & (j <= i),
         padded: lambda i, j: PADDING[:, None, None, :].expand(2, 1, S, S)}


def _qkv(requires_grad=True):
    q = torch.randn(2, 4, S, 16, dtype=torch.float64, generator=GENERATOR)
    k, v = (torch.randn(2, 2, S, 16, dtype=torch.float64, generator=GENERATOR) for _ in range(2))
    return [x.requires_grad_(requires_grad) for x in (q, k, v)]


def _attention(mask_mod, score_mod=None):
    def fn(q, k, v):
        block_mask = create_block_mask(mask_mod, 2, None, q.shape[2], k.shape[2], device=q.device)
        return flex_attention(q, k, v, block_mask=block_mask, score_mod=score_mod, enable_gqa=True)
    return fn


class TestGraphs(TestCase):
    def test_documents_with_softcap_and_the_block_mask_gone(self):
        graph, sites = rewrite(_attention(documents, softcap), *_qkv(False))
        self.assertExpectedInline(graph, """\
g_ids_ = input
l_k_ = input
l_q_ = input
l_v_ = input
attention_default = attn_cp.attention.default(l_q_, l_k_, l_v_, None, True, 0.25, document_ids=g_ids_, softcap=20.0)
getitem_5 = getitem(attention_default, 0)
return (getitem_5)""")
        assert "causal + document_ids" in sites[0].notes[0]

    def test_block_mask_from_outside(self):
        block_mask = create_block_mask(window, 2, None, S, S, device="cpu")
        graph, _ = rewrite(lambda q, k, v, m: flex_attention(q, k, v, block_mask=m, enable_gqa=True), *_qkv(False),
                           block_mask)
        self.assertIn("attn_cp.attention.default(l_q_, l_k_, l_v_, None, True, 0.25, window_left=5)", graph)
        self.assertNotIn("flex_attention", graph)


def _check_against_oracle(mask_mod, device, requires_grad):
    q, k, v = (x.detach().to(device).requires_grad_(requires_grad) for x in _qkv(False))
    global IDS, PADDING
    IDS, PADDING = IDS.to(device), PADDING.to(device)  # the mask_mods read them where q is
    torch._dynamo.reset()
    got = torch.compile(_attention(mask_mod, softcap), backend="attn_cp", options={"inner": "aot_eager"},
                        fullgraph=True)(q, k, v)
    i, j = torch.arange(S, device=device)[:, None], torch.arange(S, device=device)
    want = naive_attention(q, k, v, attn_mask=DENSE[mask_mod](i, j), softcap=20.0)
    assert rel_err(got, want) <= 1e-6
    if requires_grad:
        dout = torch.randn_like(got)
        for g, w in zip(torch.autograd.grad(got, (q, k, v), dout), torch.autograd.grad(want, (q, k, v), dout)):
            assert rel_err(g, w) <= 1e-6


@pytest.mark.parametrize("mask_mod", list(DENSE), ids=lambda m: m.__name__)
def test_matches_float64_oracle(mask_mod):
    """Forward only: flex_attention refuses inputs that require grad on the CPU, at trace time."""
    _check_against_oracle(mask_mod, "cpu", requires_grad=False)


@pytest.mark.gpu
@pytest.mark.parametrize("mask_mod", list(DENSE), ids=lambda m: m.__name__)
def test_gradients_match_float64_oracle_on_gpu(mask_mod):
    try:
        _check_against_oracle(mask_mod, "cuda", requires_grad=True)
    finally:
        global IDS, PADDING
        IDS, PADDING = IDS.cpu(), PADDING.cpu()


def _reason(fn, *args) -> str:
    _, sites = rewrite(fn, *args)
    (site,) = sites
    assert not site.rewritten and site.op is None
    return site.reason


def test_other_mask_and_score_mods_stay_flex_attention():
    q, k, v = _qkv(False)
    assert "is not causal, a window, key padding or document ids" in _reason(_attention(prefix_lm), q, k, v)
    assert "score_mod is not the identity or a softcap" in _reason(_attention(causal, relative), q, k, v)


def test_torchtitan_packed_document_mask_is_read_but_not_proven():
    """torchtitan's get_efficient_causal_mask_mod_for_packed_document, batch > 1: the mask_mod is
    ``q_idx <= doc_end_by_token[b, kv_idx]`` with doc_end_by_token computed from positions outside
    the model; read as a comparison of the query index with data, which no check can show to be
    the documents' ends, so the site stays flex_attention."""
    ends = torch.tensor([[6] * 7 + [26] * 20 + [39] * 13, [39] * 40], dtype=torch.int32)

    def packed_document_mask(b, h, q_idx, kv_idx):
        return q_idx <= ends[b, kv_idx]

    def both(b, h, q_idx, kv_idx):
        return causal(b, h, q_idx, kv_idx) & packed_document_mask(b, h, q_idx, kv_idx)

    reason = _reason(_attention(both), *_qkv(False))
    assert "the mask compares data, 'i <= " in reason and "[b, j]'" in reason, reason


def test_new_sequence_length_does_not_recompile():
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("attn_cp")
    fn = torch.compile(_attention(window), backend=counter, dynamic=True)
    for s in (40, 56, 77):
        q, k, v = (torch.randn(2, h, s, 16, dtype=torch.float64, generator=GENERATOR) for h in (4, 2, 2))
        i, j = torch.arange(s)[:, None], torch.arange(s)
        assert rel_err(fn(q, k, v), naive_attention(q, k, v, attn_mask=DENSE[window](i, j))) <= 1e-6
    assert counter.frame_count == 1


def _check_ranks(rank, world):
    from attn_compile import shard_sequence

    group = torch.distributed.group.WORLD
    q, k, v = _qkv(False)
    i, j = torch.arange(S)[:, None], torch.arange(S)
    want = naive_attention(q, k, v, attn_mask=DENSE[window](i, j), softcap=0.0)
    compiled = torch.compile(_attention(window), backend="attn_cp", options={"mesh": group, "inner": "aot_eager"})
    got = compiled(*(shard_sequence(x, group) for x in (q, k, v)))
    assert rel_err(got, shard_sequence(want, group)) <= 1e-6
    torch._dynamo.reset()
    with pytest.raises(Exception, match="run locally it would see only this rank"):  # a compile-time error
        torch.compile(_attention(documents), backend="attn_cp", options={"mesh": group, "inner": "aot_eager"})(
            *(shard_sequence(x, group) for x in (q, k, v)))


def test_flex_site_on_sequence_shards_runs_context_parallel():
    from dist_harness import run_distributed

    run_distributed(_check_ranks, 2)
