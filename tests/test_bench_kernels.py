"""``bench kernels --candidates`` on the CPU: which kernels it times for a problem, in the order
the dispatch tries them, and its verdict on the dispatch's choice against the measured times
(FA4 through a stand-in; the timing itself needs a GPU)."""
import pytest
import torch

from attn_compile.kernels import bench_kernels
from attn_compile.kernels.visibility import effective_window, visible
from test_fa4_adapter import _on, _problem, standin  # noqa: F401  (standin is a fixture)

CANDIDATES = {  # name: (problem, [(kernel, takes the forward, takes the backward)])
    "key padding, 4096 tokens": (
        _problem(h_q=8, h_kv=2, s_q=4096, s_k=4096, is_causal=True, key_padding_mask=torch.empty(0)),
        [("fa4 mask_mod", True, True), ("triton", True, True), ("fa4", True, True)]),
    "key padding, 8192 tokens": (
        _problem(h_q=8, h_kv=2, s_q=8192, s_k=8192, is_causal=True, key_padding_mask=torch.empty(0)),
        [("fa4", True, True), ("fa4 mask_mod", True, True), ("triton", True, True)]),
    "key padding with a window": (
        _problem(is_causal=True, window=(8, -1), key_padding_mask=torch.empty(0)),
        [("fa4 mask_mod", True, True), ("triton", True, True)]),
    "document ids": (_problem(h_q=8, h_kv=2, is_causal=True, document_ids=torch.empty(0)),
                     [("triton", True, True), ("fa4 mask_mod", True, True), ("fa4 segments", True, True)]),
    "document ids, 8192 tokens": (_problem(h_q=8, h_kv=2, s_q=8192, s_k=8192, is_causal=True,
                                           document_ids=torch.empty(0)),
                                  [("fa4 segments", True, True), ("fa4 mask_mod", True, True), ("triton", True, True)]),
    "gqa+mla": (_problem(h_q=8, h_kv=2, d_qk=192, d_v=128, is_causal=True),
                [("fa4", True, False), ("cudnn", True, True), ("triton", True, True)]),
}


@pytest.mark.parametrize("name", list(CANDIDATES))
def test_candidates_in_the_dispatch_order(standin, name):  # noqa: F811
    problem, expected = CANDIDATES[name]
    got = [(kernel.name, forward, backward) for kernel, forward, backward in bench_kernels.candidates(_on(problem))]
    assert got == expected


def test_packed_documents_take_the_varlen_kernels(standin):  # noqa: F811
    names = [kernel.name for kernel, *_ in bench_kernels.candidates(_on(_problem(is_causal=True)), packed=True)]
    assert names == ["fa4", "triton", "flash"]


@pytest.mark.parametrize("times, verdicts", [
    ({"fa4 mask_mod": (0.5, 1.5), "fa4": (1.1, 1.7), "triton": (0.9, 2.0)}, ["agrees", "agrees"]),
    ({"fa4 mask_mod": (0.5, 1.9), "fa4": (1.1, 1.7), "triton": (0.4, 2.0)}, ["DIFFERS", "DIFFERS"]),
])
def test_the_table_says_where_the_dispatch_is_not_the_fastest(standin, times, verdicts):  # noqa: F811
    problem = _on(CANDIDATES["key padding, 4096 tokens"][0])
    shape = bench_kernels.Shape("padded", 8, 2, 4096, padding=(4096, 3584))
    text = bench_kernels.candidates_table([(shape, problem, times)])
    lines = text.splitlines()
    assert lines[:4] == ["padded", "  fa4 mask_mod   " + " / ".join(f"{t:.3f}" for t in times["fa4 mask_mod"]) + " ms",
                         "  fa4            " + " / ".join(f"{t:.3f}" for t in times["fa4"]) + " ms",
                         "  triton         " + " / ".join(f"{t:.3f}" for t in times["triton"]) + " ms"]
    for line, direction, verdict in zip(lines[4:], ("forward", "backward"), verdicts):
        assert line.startswith(f"  {direction}: the dispatch runs fa4 mask_mod, fastest measured ")
        assert line.endswith(verdict)


def test_a_direction_a_kernel_does_not_take_shows_a_dash(standin):  # noqa: F811
    problem = _on(CANDIDATES["gqa+mla"][0])
    shape = bench_kernels.Shape("gqa+mla", 8, 2, 32, 192, 128)
    text = bench_kernels.candidates_table([(shape, problem, {"fa4": (1.0, None), "cudnn": (1.2, 2.0),
                                                              "triton": (1.5, 3.0)})])
    assert "  fa4            1.000 / - ms" in text.splitlines()
    assert text.splitlines()[-1] == "  backward: the dispatch runs cudnn, fastest measured cudnn: agrees"


def test_the_kernels_named_before_a_run(standin):  # noqa: F811
    assert bench_kernels.described(_on(CANDIDATES["gqa+mla"][0])) == "fa4 (backward cudnn)"
    assert bench_kernels.described(_on(_problem(is_causal=True, softcap=50.0))) == "triton (backward fa4)"
    assert bench_kernels.described(_on(CANDIDATES["key padding with a window"][0])) == "fa4 mask_mod"
    assert bench_kernels.described(_on(_problem(is_causal=True)), packed=True) == "varlen fa4"


PAIRS = (  # small shapes of each kind the benchmark has
    bench_kernels.Shape("causal", 1, 1, 64),
    bench_kernels.Shape("full", 1, 1, 64, is_causal=False),
    bench_kernels.Shape("causal window", 1, 1, 64, window=(7, -1)),
    bench_kernels.Shape("two-sided window", 1, 1, 64, is_causal=False, window=(5, 3)),
    bench_kernels.Shape("ring step", 1, 1, 64, q_offset=72, k_offset=64),
    bench_kernels.Shape("documents", 1, 1, 64, documents=(10, 30, 24)),
    bench_kernels.Shape("documents, window", 1, 1, 64, window=(7, -1), documents=(10, 30, 24)),
    bench_kernels.Shape("right-padded", 1, 1, 64, padding=(64, 40, 3)),
    bench_kernels.Shape("left-padded", 1, 1, 64, padding=(64, 40, 3), left=True),
    bench_kernels.Shape("right-padded, full", 1, 1, 64, is_causal=False, padding=(64, 40)),
    bench_kernels.Shape("right-padded, window", 1, 1, 64, window=(7, -1), padding=(64, 40, 3)),
    bench_kernels.Shape("left-padded, window", 1, 1, 64, window=(7, -1), padding=(64, 40, 3), left=True),
)


def _mask_pairs(shape):
    """The shape's visible query-key pairs, counted on its whole (B, S, S) mask."""
    q = torch.arange(shape.s) + shape.q_offset
    mask = visible(q, torch.arange(shape.s) + shape.k_offset, *effective_window(shape.is_causal, shape.window))
    if shape.documents:
        ids = torch.repeat_interleave(torch.arange(len(shape.documents)), torch.tensor(shape.documents))
        mask &= ids[:, None] == ids[None, :]
    positions = torch.arange(shape.s)
    real = [positions >= shape.s - n if shape.left else positions < n for n in shape.padding] or [positions >= 0]
    return sum(int((mask & keys[None, :]).sum()) for keys in real)


@pytest.mark.parametrize("shape", PAIRS, ids=lambda shape: shape.name)
def test_the_flops_count_every_pair_the_mask_leaves(shape):
    """TFLOP/s divide these pairs' FLOPs: padded rows see the real keys their band reaches."""
    assert shape.pairs() == _mask_pairs(shape)
