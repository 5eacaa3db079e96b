"""Differential fuzzing against the float64 oracle: ``attn_cp.attention`` on hypothesis-drawn shapes,
masks (tensor, causal, window, key padding, at query offsets) and softcaps, and every
context-parallel strategy on seeded random configurations.

The draws are derandomized, so every run tries the same cases; ``ATTN_CP_FUZZ_EXAMPLES=N`` tries
at least N of each (local op and CP per world size). A case the fuzzer finds failing belongs in
test_fuzz_regressions.py as a named test with its config written out."""
import math
import os
import random

import pytest
import torch
import torch.distributed as dist
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.distributed.device_mesh import init_device_mesh

import attn_compile.ops  # noqa: F401  (registers torch.ops.attn_cp)
from attn_compile.cp.api import context_parallel_attention
from attn_compile.cp.layout import shard_sequence, unshard_sequence
from dist_harness import run_distributed
from oracle import oracle_problems

EXAMPLES = int(os.environ.get("ATTN_CP_FUZZ_EXAMPLES", "0"))
settings.register_profile("attn_cp_fuzz", derandomize=True, database=None, deadline=None,
                          max_examples=max(100, EXAMPLES))
FUZZ = settings.get_profile("attn_cp_fuzz")
CP_CASES = max(24, EXAMPLES)  # per world size
TOL = {torch.float32: 1e-5, torch.float64: 1e-10}


@st.composite
def local_cases(draw):
    """One call of the local op, as plain values (hypothesis prints them on failure)."""
    h_kv = draw(st.sampled_from([1, 2, 3]))
    masking = draw(st.sampled_from(["bool", "additive", "window", None]))  # the op takes no window with a mask
    scale = draw(st.floats(0.01, 2.0))
    window = [draw(st.integers(0, 10)), draw(st.integers(0, 10))]
    unbounded = draw(st.sampled_from([None, 0, 1]))  # a side of the window that is -1
    if unbounded is not None:
        window[unbounded] = -1
    return dict(
        batch=draw(st.integers(1, 2)), h_kv=h_kv, h_q=h_kv * draw(st.integers(1, 3)),
        s_q=draw(st.integers(1, 40)), s_k=draw(st.integers(1, 40)),
        d_qk=draw(st.sampled_from([8, 16, 24])), d_v=draw(st.sampled_from([8, 16, 24])),
        is_causal=draw(st.booleans()),
        window=tuple(window) if masking == "window" else (-1, -1),
        mask=masking if masking in ("bool", "additive") else None,
        # which of (B, h_q, S_q, S_k) the mask has (else size 1), and how many leading size-1 axes it drops
        mask_axes=draw(st.tuples(*[st.booleans()] * 4)), mask_rank=draw(st.integers(2, 4)),
        hidden_rows=draw(st.integers(0, 3)),  # rows the mask hides entirely (every key False or -inf)
        scale=draw(st.sampled_from([None, scale])),
        dtype=draw(st.sampled_from(["float32", "float64"])),
        softcap=draw(st.sampled_from([0.0, draw(st.floats(0.3, 5.0))])),
        key_padding=draw(st.booleans()),  # a random (B, S_k) key_padding_mask, some rows left with no key
        q_offset=draw(st.sampled_from([0, draw(st.integers(-10, 40))])),
        seed=draw(st.integers(0, 2 ** 31 - 1)),
    )


def _mask(case, gen):
    full = (case["batch"], case["h_q"], case["s_q"], case["s_k"])
    shape = [n if keep else 1 for n, keep in zip(full, case["mask_axes"])]
    while len(shape) > case["mask_rank"] and shape[0] == 1:
        shape.pop(0)
    if case["mask"] == "bool":
        mask = torch.rand(shape, generator=gen) < 0.7
    else:
        mask = torch.randn(shape, generator=gen, dtype=torch.float64).to(getattr(torch, case["dtype"])) * 3
        mask = mask.masked_fill(torch.rand(shape, generator=gen) < 0.2, float("-inf"))
    rows = torch.randint(0, shape[-2], (case["hidden_rows"],), generator=gen)
    mask[..., rows, :] = False if case["mask"] == "bool" else float("-inf")
    return mask


def random_qkv(case, gen, s_q, s_k):
    """q, k, v and dout of the case's shapes and dtype, drawn from ``gen``."""
    shapes = ((case["h_q"], s_q, case["d_qk"]), (case["h_kv"], s_k, case["d_qk"]), (case["h_kv"], s_k, case["d_v"]),
              (case["h_q"], s_q, case["d_v"]))
    return [torch.randn(case["batch"], *shape, generator=gen, dtype=torch.float64).to(getattr(torch, case["dtype"]))
            for shape in shapes]


def local_inputs(case):
    """q, k, v (leaves that require grad), attn_mask or None, key_padding_mask or None, dout:
    random, from the case's seed."""
    gen = torch.Generator().manual_seed(case["seed"])
    q, k, v, dout = random_qkv(case, gen, case["s_q"], case["s_k"])
    mask = _mask(case, gen) if case["mask"] else None
    padding = torch.rand(case["batch"], case["s_k"], generator=gen) < 0.8 if case["key_padding"] else None
    return [x.requires_grad_() for x in (q, k, v)], mask, padding, dout


def check_local_case(case):
    """The op's output and gradients against the float64 oracle on the case's inputs."""
    (q, k, v), mask, padding, dout = local_inputs(case)
    out, lse = torch.ops.attn_cp.attention(q, k, v, mask, case["is_causal"], case["scale"], *case["window"], padding,
                                           case["q_offset"], None, case["softcap"])
    assert lse.shape == out.shape[:-1] and not lse.isnan().any()
    got = [out, *torch.autograd.grad(out, (q, k, v), dout)]
    problems = oracle_problems(got, q, k, v, dout, tol=TOL[q.dtype], attn_mask=mask, is_causal=case["is_causal"],
                               scale=case["scale"], window=case["window"], key_padding_mask=padding,
                               q_offset=case["q_offset"], softcap=case["softcap"])
    assert not problems, "; ".join(problems)


_CORNER = dict(batch=1, h_kv=1, h_q=1, d_qk=8, d_v=8, is_causal=True, window=(-1, -1), mask=None,
               mask_axes=(False, False, True, True), mask_rank=2, hidden_rows=0, scale=None, dtype="float32",
               softcap=0.0, key_padding=False, q_offset=0, seed=1)


@FUZZ
@given(case=local_cases())
@example(case=dict(_CORNER, s_q=1, s_k=1))
@example(case=dict(_CORNER, s_q=1, s_k=37, is_causal=False, window=(0, 3)))
@example(case=dict(_CORNER, s_q=33, s_k=7, mask="bool", hidden_rows=3, h_kv=3, h_q=9, d_v=24))
@example(case=dict(_CORNER, s_q=5, s_k=9, is_causal=False, mask="additive", hidden_rows=2, dtype="float64"))
def test_local_op_matches_oracle(case):
    check_local_case(case)


def cp_cases(world: int, count: int, seed: int) -> list[dict]:
    """``count`` context-parallel configs on ``world`` ranks, every strategy equally often."""
    rng = random.Random(seed)
    strategies = ("ring", "allgather", "ulysses") + (("hybrid",) if world == 4 else ())
    cases = []
    for i in range(count):
        strategy = strategies[i % len(strategies)]
        head_split = {"ulysses": world, "hybrid": 2}.get(strategy, 1)  # ranks the query heads are divided among
        h_kv = rng.choice([1, 2, 3])
        cases.append(dict(
            strategy=strategy, layout=rng.choice(["zigzag", "contiguous"]), is_causal=rng.random() < 0.5,
            recompute_kv=strategy in ("ring", "allgather") and rng.random() < 0.5,
            batch=rng.randint(1, 2), h_kv=h_kv, h_q=math.lcm(h_kv, head_split) * rng.randint(1, 2),
            d_qk=rng.choice([8, 16, 24]), d_v=rng.choice([8, 16, 24]), seq=2 * world * rng.randint(1, 4),
            scale=rng.choice([None, rng.uniform(0.05, 1.0)]), dtype=rng.choice(["float32", "float64"]),
            seed=rng.randrange(2 ** 31)))
    return cases


def check_cp_cases(rank, world, cases):
    """Every case on this rank's shard; gathered output and gradients against the oracle."""
    mesh = init_device_mesh("cpu", (2, 2)) if world == 4 else None
    failures = []
    for case in cases:
        group = mesh if case["strategy"] == "hybrid" else dist.group.WORLD
        gen = torch.Generator().manual_seed(case["seed"])  # the same global inputs on every rank
        q, k, v, dout = random_qkv(case, gen, case["seq"], case["seq"])
        shards = [shard_sequence(x, group, layout=case["layout"]) for x in (q, k, v, dout)]
        local = [x.requires_grad_() for x in shards[:3]]
        out = context_parallel_attention(*local, group=group, strategy=case["strategy"], is_causal=case["is_causal"],
                                         scale=case["scale"], layout=case["layout"], recompute_kv=case["recompute_kv"])
        grads = torch.autograd.grad(out, local, shards[3])
        got = [unshard_sequence(x.detach(), group, layout=case["layout"]) for x in (out, *grads)]
        problems = oracle_problems(got, q, k, v, dout, tol=TOL[q.dtype], is_causal=case["is_causal"],
                                   scale=case["scale"])
        if problems:
            failures.append(f"{case}: {'; '.join(problems)}")
    assert not failures, f"{len(failures)} of {len(cases)} cases failed on {world} ranks:\n" + "\n".join(failures)


@pytest.mark.timeout(max(300, 12 * CP_CASES))
@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_matches_oracle(world):
    run_distributed(check_cp_cases, world, cp_cases(world, CP_CASES, seed=world), timeout=max(120.0, 10.0 * CP_CASES))
