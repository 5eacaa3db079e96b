"""``python -m attn_compile.bench plan`` on the CPU: the plan's table for a shape past one node, a
plan that does not fit memory, bad arguments, and the model's error against the measured tables."""
import re

import pytest

from attn_compile.bench import main

NUMBER = r" +\d+\.\d\d"


def _plan(capsys, *argv):
    assert main(["plan", *argv]) == 0
    return capsys.readouterr().out


def test_plan_past_one_node(capsys):
    out = _plan(capsys, "--gpus", "16", "--gpus-per-node", "8", "--seq", "131072", "--heads", "32", "8", "128", "128")
    assert out.startswith("assumptions: cost_model.Hardware(kernel_tflops=600.0, link_gbps=306.0, ")
    assert "gpus_per_node=8, internode_gbps=50.0, gpu_memory_gb=80.0, ring_overlap=0.0, " in out.splitlines()[0]
    table = out.split("\n\n")[1].splitlines()
    assert table[0] == "heads 32/8 d 128/128, 131072 tokens, batch 1, on 16 GPUs (2 nodes)"
    assert table[1].split() == ["strategy", "mesh", "ms", "fwd+bwd", "ms", "exposed", "GB", "per", "GPU"]
    for row, (strategy, mesh) in zip(table[2:8], [("ring", "16"), ("allgather", "16"), ("ulysses", "16"),
                                                  ("hybrid", "8x2"), ("hybrid", "4x4"), ("hybrid", "2x8")]):
        assert re.fullmatch(rf"  {strategy} +{mesh}{NUMBER * 3}", row), row
    assert table[8:] == ["  choice: hybrid 2x8: Ulysses over 8 GPUs inside a node, the ring across the 2 nodes"]
    assert re.search(r"^the model against measured tables: mean \|error\| \d+\.\d%", out, re.M)


def test_plan_that_does_not_fit_memory_says_so(capsys):
    """MLA at 1M tokens on 8 GPUs: all-gather needs more than 20 GB per GPU; with 1 GB nothing fits."""
    argv = ("--gpus", "8", "--seq", "1048576", "--heads", "16", "16", "192", "128")
    out = _plan(capsys, *argv, "--memory-gb", "20")
    assert re.search(rf"^  allgather +8{NUMBER * 3}   does not fit: needs \d+(\.\d+)? GB per GPU, more than the "
                     r"20 GB one holds$", out, re.M), out
    assert "  choice: ulysses over 8 GPUs" in out
    out = _plan(capsys, *argv, "--memory-gb", "1")
    assert re.search(r"^  choice: none fits in 1 GB per GPU; the least memory is ulysses 8's \d+(\.\d+)? GB$",
                     out, re.M), out


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "16", "--seq", "1000"], "--seq must be a multiple of 2 x GPUs (zigzag shards); got 1000 on 16 GPUs"),
    (["--gpus", "12", "--gpus-per-node", "8"], "--gpus must fill whole nodes of --gpus-per-node 8; got 12"),
    (["--heads", "32", "6", "128", "128"], "--heads: H_Q must be a multiple of H_KV >= 1; got 32 and 6"),
    (["--validate", "--ring-overlap", "1.5"], "--ring-overlap must be a share between 0 and 1; got 1.5"),
])
def test_bad_arguments_are_named(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_validation_prints_the_model_error_against_measured_tables(capsys):
    """fwd+bwd, then the forward alone (the choice where no gradient is needed). The summary
    bounds how far the model's pick falls short of the measured fastest: in both, the fastest in
    every shape (the ring on 2 GPUs, Ulysses on 4), though the model puts the all-gather's MLA
    forward 8-28% too slow and its MLA fwd+bwd up to 11% too slow."""
    fwd_bwd, forward = (part.splitlines() for part in _plan(capsys, "--validate").strip().split("\n\n"))
    assert fwd_bwd[0].startswith("validation: the cost model's fwd+bwd TFLOP/s")
    assert forward[0].startswith("validation: the cost model's forward alone TFLOP/s")
    summaries = []
    for out in (fwd_bwd, forward):
        rows = [line for line in out if re.fullmatch(r" +[24] (GQA|MLA) .* +\d+ +\d+ +[+-]\d+\.\d%", line)]
        assert len(rows) == 28, out  # 2 GPUs: 4 shapes x 3 strategies; 4 GPUs: 4 shapes x 4 (the hybrid as 2x2)
        assert sum(" hybrid " in row and " 2x2 " in row for row in rows) == 4
        summary = re.fullmatch(r"  mean \|error\| (\d+\.\d)% over 28 points; the model's fastest is the measured "
                               r"fastest in (\d) of 8 shapes, and measured at (\d\.\d+) of it or more", out[-1])
        assert summary, out[-1]
        summaries.append((float(summary[1]), int(summary[2]), float(summary[3])))
    (fb_error, fb_agreed, fb_worst), (f_error, f_agreed, f_worst) = summaries
    assert fb_error < 3.0 and fb_agreed == 8 and fb_worst == 1.0
    assert f_error < 5.0 and f_agreed == 8 and f_worst == 1.0


def test_efficiency_against_gpu_count():
    """The plot's points: the best measured strategy and PyTorch's context_parallel over the
    single-GPU op, one GPU at 1.0 (4x H200, GQA 32/8 at 128K: Ulysses 599 / 613 and 507 / 613)."""
    from attn_compile import bench_plan

    curves = bench_plan.efficiency()
    assert set(curves) == {(name, seq) for _, name, seq in bench_plan.MEASURED}
    gqa = curves["GQA 32/8 d128", 131072]
    assert [gpus for gpus, _ in gqa["attn_cp"]] == [1, 2, 4]
    assert abs(gqa["attn_cp"][2][1] - 599 / 613) < 1e-9 and abs(gqa["PyTorch"][2][1] - 507 / 613) < 1e-9
