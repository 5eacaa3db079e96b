"""The passes are never wrong: a corpus of attention-like code that the attn_cp backend must either
rewrite into attn_cp.attention or leave as it is, and either way compute what eager computes,
output and gradients. Each entry says how many sites it expects rewritten, so a look-alike that
starts being rewritten (or a real attention that stops) shows up too."""
import dataclasses
from typing import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dist_harness import run_distributed
from oracle import rel_err

B, H, S, D = 2, 4, 16, 8
SCALE = D ** -0.5
NEG = float("-inf")


def _qkv(dtype=torch.float32, *, k_dtype=None, h_kv=H, spread=1.0):
    q = torch.randn(B, H, S, D) * spread
    k, v = (torch.randn(B, h_kv, S, D) * spread for _ in range(2))
    return [q.to(dtype), k.to(k_dtype or dtype), v.to(dtype)]


def _causal():
    return torch.ones(S, S, dtype=torch.bool).tril()


def sdpa_causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def hand_written(q, k, v):
    return (q @ k.transpose(-2, -1) * SCALE).softmax(-1) @ v


def negative_scale(q, k, v):
    return (q @ k.mT * -0.5).softmax(-1) @ v


def softmax_over_queries(q, k, v):
    return (q @ k.mT * SCALE).softmax(dim=-2) @ v


def scale_after_softmax(q, k, v):
    return (q @ k.mT).softmax(-1) * SCALE @ v


def mask_from_the_scores(q, k, v):
    """Keeps, per query, only the keys whose score is within 1 of the best: a mask made of the data."""
    s = q @ k.mT * SCALE
    return s.masked_fill(s < s.amax(-1, keepdim=True) - 1.0, NEG).softmax(-1) @ v


def mask_from_other_data(q, k, v):
    """A data mask that is not the scores themselves may stay a mask tensor of the op (rows it
    hides entirely give 0, as SDPA's)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(q @ k.mT) > 0)


class ALiBi(nn.Module):
    """Linear biases by distance, added to the scores: an additive mask the op takes as it is."""

    def __init__(self, causal):
        super().__init__()
        self.causal = causal
        self.register_buffer("slopes", 2.0 ** (-8.0 * torch.arange(1, H + 1) / H))

    def forward(self, q, k, v):
        i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
        bias = self.slopes[:, None, None] * (j - i)
        if self.causal:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias.masked_fill(j > i, NEG))
        return (q @ k.mT * SCALE + bias).softmax(-1) @ v


def softcapped(q, k, v):
    """Gemma 2's logit softcapping, tanh(s / c) * c: the op's softcap."""
    return (2.0 * torch.tanh(q @ k.mT * SCALE / 2.0)).softmax(-1) @ v


def keys_along_dim_minus_2(q, k, v):
    """Attention with the scores laid out (keys, queries), normalized over dim -2."""
    return (k @ q.mT * SCALE).softmax(dim=-2).mT @ v


def five_dim(q, k, v):
    """Axial attention along the last-but-one axis of a (B, H, X, S, D) tensor: the op takes 4-D only."""
    q, k, v = (x.unflatten(2, (4, S // 4)) for x in (q, k, v))
    return ((q @ k.mT * SCALE).softmax(-1) @ v).flatten(2, 3)


def scores_filled_in_place(q, k, v):
    s = q @ k.mT * SCALE
    s.masked_fill_(~_causal(), NEG)
    return s.softmax(-1) @ v


def prefix_lm_mask_edited_in_place(q, k, v):
    """A causal mask made bidirectional over a 4-token prefix by an in-place edit."""
    mask = _causal()
    mask[:, :4] = True
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def mask_edited_after_use(q, k, v):
    """The scores take the mask before the edit; the op, at the value matmul, would read it after."""
    mask = torch.zeros(S, S).masked_fill(~_causal(), NEG)
    s = q @ k.mT * SCALE + mask
    mask[:, :4] = 0.0
    return s.softmax(-1) @ v


def padding_edited_through_a_view(q, k, v, padding):
    """The mask reads the key padding before the edit; as key_padding_mask the op would read it after."""
    mask = padding[:, None, None, :] & _causal()
    padding[:, 2:5].fill_(False)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def repeated_kv_edited_through_a_view(q, k, v):
    """repeat_kv copies k before the edit; without the copy the op would read the edited k."""
    k = k * 1.0
    k2, v2 = (x.repeat_interleave(2, dim=1) for x in (k, v))
    k[:, :, :3].mul_(3.0)
    return F.scaled_dot_product_attention(q, k2, v2)


def copy_of_q_edited_at_its_source(q, k, v):
    """.contiguous() copies q before the edit; without the copy the op would read the edited source."""
    x = q.transpose(1, 2).contiguous()  # (B, S, H, D), as a projection gives it
    q = x.transpose(1, 2).contiguous()
    x.mul_(2.0)
    return F.scaled_dot_product_attention(q, k, v)


def copy_of_q_edited(q, k, v):
    """The op must read the edited copy, not its source."""
    q = q.transpose(1, 2).contiguous().transpose(1, 2).contiguous()
    q.mul_(2.0)
    return F.scaled_dot_product_attention(q, k, v)


def repeated_k_edited(q, k, v):
    """The op must read the edited repeat, not the un-repeated k."""
    k2, v2 = (x.repeat_interleave(2, dim=1) for x in (k, v))
    k2.mul_(3.0)
    return F.scaled_dot_product_attention(q, k2, v2)


def hf_repeated_k_edited(q, k, v):
    b, h, s, d = k.shape
    k2, v2 = (x[:, :, None].expand(b, h, 2, s, d).reshape(b, 2 * h, s, d) for x in (k, v))
    k2[:, 0] = 0.0
    return F.scaled_dot_product_attention(q, k2, v2)


def positions_through_a_wrapping_index(q, k, v):
    """pos[pos - 1] reads pos[-1] = S - 1 at row 0: the mask is causal only from row 1 on."""
    pos = torch.arange(q.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=pos[None, :] <= pos[pos - 1][:, None] + 1)


def uint8_differences(q, k, v):
    """i - j wraps in uint8: every difference is >= 0, so every key is visible."""
    i = torch.arange(q.shape[2], dtype=torch.uint8)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(i[:, None] - i[None, :]) >= 0)


def int8_positions_that_wrap(q, k, v):
    """Positions from 120 pass 127 and wrap to -128 in int8."""
    pos = torch.arange(q.shape[2], dtype=torch.int8) + 120
    return F.scaled_dot_product_attention(q, k, v, attn_mask=pos[None, :] <= pos[:, None])


def softmax_narrower_than_q(q, k, v):
    return F.softmax(q @ k.mT * SCALE, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def k_in_float64(q, k, v):
    return (q.double() @ k.mT * SCALE).softmax(-1).float() @ v


def upcast_from_half(q, k, v):
    return (q.float() @ k.float().mT * SCALE).softmax(-1) @ v.float()


def hf_eager_half(q, k, v):
    """transformers' eager attention in half precision: a float32 softmax, cast back."""
    return F.softmax(q @ k.mT * SCALE, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def scores_downcast_to_half(q, k, v):
    """The softmax in half precision, as written: the op would compute it in fp32."""
    return (q @ k.mT * SCALE).half().softmax(-1).float() @ v


def float64_additive_mask(q, k, v):
    mask = torch.zeros(S, S, dtype=torch.float64).masked_fill(~_causal(), torch.finfo(torch.float64).min)
    return F.softmax(q @ k.mT * SCALE + mask, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def where_with_the_fill_first(q, k, v):
    return torch.where(~_causal(), NEG, q @ k.mT * SCALE).softmax(-1) @ v


class DropoutAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.dropout = nn.Dropout(0.1)

    def forward(self, q, k, v):
        return self.dropout((q @ k.mT * SCALE).softmax(-1)) @ v


class LearnedTemperature(nn.Module):
    def __init__(self):
        super().__init__()
        self.temperature = nn.Parameter(torch.tensor(0.3))

    def forward(self, q, k, v):
        return (q @ k.mT * self.temperature).softmax(-1) @ v


class LearnedBias(nn.Module):
    """A trained relative-position bias: a mask that requires grad, which the op does not differentiate."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(H, S, S) * 0.1)

    def forward(self, q, k, v):
        return (q @ k.mT * SCALE + self.bias).softmax(-1) @ v


def _positions(q):
    i = torch.arange(q.shape[2])
    return i[:, None], i[None, :]


def constant_converted_to_bool(q, k, v):
    """masked_fill writes 5 into a bool tensor as True: the mask is causal plus the superdiagonal."""
    i, j = _positions(q)
    kept = torch.zeros(S, S, dtype=torch.bool).masked_fill(j == i + 1, 5)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(j <= i) | (kept == True))  # noqa: E712


def constant_truncated_to_long(q, k, v):
    """masked_fill writes 0.5 into a long tensor as 0: every key is visible."""
    i, j = _positions(q)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.zeros(S, S, dtype=torch.long)
                                          .masked_fill(j > i, 0.5) == 0)


def constant_rounded_to_half(q, k, v):
    """1e-8 in float16 is 0: every key is visible."""
    i, j = _positions(q)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(j <= i) | (torch.full((S, S), 1e-8).half() == 0))


def bits_viewed_as_int32(q, k, v):
    """1.0's bits read as an int32 are 1065353216 > 1: causal plus the superdiagonal."""
    i, j = _positions(q)
    bits = torch.where(j == i + 1, 1.0, 0.0).view(torch.int32)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(j <= i) | (bits > 1))


def scale_truncated_to_long(q, k, v):
    """torch.full((), 2.5, dtype=torch.long) holds 2."""
    return ((q @ k.mT) / torch.full((), 2.5, dtype=torch.long)).softmax(-1) @ v


def scale_rounded_to_bfloat16(q, k, v):
    """torch.full((), 0.3, dtype=torch.bfloat16) holds 0.30078125."""
    return ((q @ k.mT) * torch.full((), 0.3, dtype=torch.bfloat16)).softmax(-1) @ v


def padding_edited_through_out(q, k, v, padding, other):
    """The mask is built from the key padding before ``out=`` edits the padding."""
    mask = padding[:, None, None, :].expand(B, 1, S, S).clone()
    torch.logical_and(padding, other, out=padding)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def copy_source_edited_by_inplace_relu(q, x, v):
    x = x * 2  # not a leaf, which autograd would not let relu edit
    k = x.transpose(1, 2).contiguous()
    F.relu(x, inplace=True)
    return F.scaled_dot_product_attention(q, k, v)


def nan_in_a_negated_comparison(q, k, v):
    """~(j < nan) is True everywhere; j >= nan would be False everywhere."""
    _, j = _positions(q)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=~(j < float("nan")))


def output_viewed_after_a_copy_of_q(q, k, v):
    """SDPA of a contiguous q gives a contiguous output, which ``.view`` needs."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2).contiguous().transpose(1, 2).contiguous(), k, v)
    return out.view(B, H, S * D)


def keyword_spellings(q, k, v):
    i, j = _positions(q)
    scores = torch.matmul(input=q, other=k.transpose(dim0=-2, dim1=-1)).masked_fill(mask=j > i, value=NEG)
    return torch.softmax(input=scores, dim=-1) @ v


def _padding_and_other():
    padding, other = (torch.rand(B, S) < 0.8 for _ in range(2))
    padding[:, 0] = other[:, 0] = True
    return [*_qkv(), padding, other]


def _q_and_projection():
    q, _, v = _qkv()
    return [q, torch.randn(B, S, H, D), v]


@dataclasses.dataclass
class Case:
    model: Callable  # a function or an nn.Module
    rewrites: int
    inputs: Callable = _qkv
    tolerance: float = 1e-5


def _half():
    return _qkv(torch.float16)


CORPUS = {
    "sdpa": Case(sdpa_causal, 1),
    "hand-written": Case(hand_written, 1),
    "negative scale": Case(negative_scale, 1),
    "softmax over the wrong dim": Case(softmax_over_queries, 0),
    "scale after softmax": Case(scale_after_softmax, 0),
    "mask from the scores": Case(mask_from_the_scores, 0),
    "mask from other data": Case(mask_from_other_data, 1),
    "alibi, hand-written": Case(ALiBi(causal=False), 1),
    "alibi + causal, sdpa": Case(ALiBi(causal=True), 1),
    "softcapping": Case(softcapped, 1, lambda: _qkv(spread=3.0)),
    "keys along dim -2": Case(keys_along_dim_minus_2, 0),
    "5-D": Case(five_dim, 0),
    "scores filled in place": Case(scores_filled_in_place, 0),
    "prefix-LM mask edited in place": Case(prefix_lm_mask_edited_in_place, 1),
    "mask edited after use": Case(mask_edited_after_use, 0),
    "key padding edited through a view": Case(padding_edited_through_a_view, 1,
                                              lambda: [*_qkv(), torch.rand(B, S) < 0.8]),
    "repeated k edited through a view": Case(repeated_kv_edited_through_a_view, 1, lambda: _qkv(h_kv=H // 2)),
    "copy of q edited at its source": Case(copy_of_q_edited_at_its_source, 1),
    "copy of q edited": Case(copy_of_q_edited, 1),
    "repeated k edited": Case(repeated_k_edited, 1, lambda: _qkv(h_kv=H // 2)),
    "HF-repeated k edited": Case(hf_repeated_k_edited, 1, lambda: _qkv(h_kv=H // 2)),
    "positions through a wrapping index": Case(positions_through_a_wrapping_index, 1),
    "uint8 differences": Case(uint8_differences, 1),
    "int8 positions that wrap": Case(int8_positions_that_wrap, 1),
    "softmax narrower than q": Case(softmax_narrower_than_q, 0, lambda: _qkv(torch.float64)),
    "q float32, k float64": Case(k_in_float64, 0, lambda: _qkv(k_dtype=torch.float64)),
    "half, upcast to float32": Case(upcast_from_half, 1, _half),
    # eager rounds the scores and the probabilities to half, the op does not: 4x half's unit roundoff
    "half, hf eager": Case(hf_eager_half, 1, _half, tolerance=2e-3),
    "scores downcast to half": Case(scores_downcast_to_half, 0),
    "float64 additive mask": Case(float64_additive_mask, 1),
    "where(mask, -inf, scores)": Case(where_with_the_fill_first, 0),
    "dropout 0.1, training": Case(DropoutAttention().train(), 0),
    "dropout 0.1, eval": Case(DropoutAttention().eval(), 1),
    "learned temperature": Case(LearnedTemperature(), 0),
    "learned bias": Case(LearnedBias(), 0),
    "constant converted to bool": Case(constant_converted_to_bool, 1),
    "constant truncated to long": Case(constant_truncated_to_long, 1),
    "constant rounded to half": Case(constant_rounded_to_half, 1),
    "bits viewed as int32": Case(bits_viewed_as_int32, 1),
    "scale truncated to long": Case(scale_truncated_to_long, 1),
    "scale rounded to bfloat16": Case(scale_rounded_to_bfloat16, 1),
    "key padding edited through out=": Case(padding_edited_through_out, 1, _padding_and_other),
    "copy's source edited by relu(inplace=True)": Case(copy_source_edited_by_inplace_relu, 1, _q_and_projection),
    "nan in a negated comparison": Case(nan_in_a_negated_comparison, 1),
    "output viewed after a copy of q": Case(output_viewed_after_a_copy_of_q, 1),
    "keyword spellings": Case(keyword_spellings, 1),
}


@pytest.mark.parametrize("name", list(CORPUS))
def test_compiled_equals_eager(name, inner_graphs):
    case = CORPUS[name]
    torch.manual_seed(0)
    model, inputs = case.model, case.inputs()
    params = list(model.parameters()) if isinstance(model, nn.Module) else []
    compiled = torch.compile(model, backend="attn_cp", options={"inner": "aot_eager"}, fullgraph=True)
    results = []
    for fn in (compiled, model):
        args = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]  # some are edited in place
        leaves = [x for x in args + params if x.requires_grad]
        torch.manual_seed(1)  # the same dropout mask in both
        out = fn(*args)
        results.append([out, *torch.autograd.grad(out, leaves, torch.ones_like(out))])
    for got, want in zip(*results):
        assert got.dtype == want.dtype and rel_err(got, want) <= case.tolerance, (got.dtype, rel_err(got, want))
    ops = [n for gm in inner_graphs for n in gm.graph.nodes if n.target is torch.ops.attn_cp.attention.default]
    assert len(ops) == case.rewrites


def _failing_pass_with_a_mesh(rank, world):
    import attn_compile.passes as passes

    def broken(call):
        raise RuntimeError("planted failure")

    passes.REFINEMENTS = (broken,)
    q, k, v = (torch.randn(1, 2, 8, 8) for _ in range(3))
    fn = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), backend="attn_cp",
                       options={"inner": "eager", "mesh": dist.group.WORLD})
    with pytest.raises(Exception, match="planted failure"):
        fn(q, k, v)


def test_a_failing_pass_re_raises_when_a_mesh_is_given():
    """Without strict, a failing pass compiles the graph unchanged (test_backend.py); with a mesh,
    the unchanged graph would attend within each rank's shard only, so the failure is raised."""
    run_distributed(_failing_pass_with_a_mesh, 1)
