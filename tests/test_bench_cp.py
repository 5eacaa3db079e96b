"""The context-parallel benchmark's CPU parts: its `auto` row, its refusal to run outside torchrun
(the timing itself needs GPUs), its interleaved rounds (with a stand-in timer), and both checks on
CPU gloo ranks: the dense one prints each case as it finishes, the packed documents' one passes."""
import io
import os
from contextlib import redirect_stdout
from types import SimpleNamespace

import pytest
import torch

from attn_compile.cp import bench, bench_documents
from dist_harness import run_distributed


def test_auto_row_names_the_choice_and_its_ratios():
    """GQA 32/8 d128 on 2 ranks at 64K tokens: the cost model chooses the ring (see test_cost_model)."""
    q, k, v = (torch.empty(1, h, 32768, 128, dtype=torch.bfloat16) for h in (32, 8, 8))
    name = bench.auto_name(q, k, v, (SimpleNamespace(size=lambda: 2),))
    assert name == "auto -> ring"
    row = bench._row(name, [400.0, 380.0], local=[500.0, 400.0], peer=[380.0, 361.0])
    assert row[:30] == f"  {name:28s}", "the name in the strategies' column"
    assert row[30:].split() == ["400", "380", "0.800", "/", "0.950", "1.053", "/", "1.053"], row
    forward = bench._row(f"{name}, no grad", [400.0, None], local=[500.0, 400.0], peer=[380.0, 361.0])
    assert len(forward) == len(row) and forward[30:].split() == ["400", "0.800", "/", "1.053", "/"], forward
    short = bench._row("ring", [473.0, 568.0], local=[500.0, 600.0])
    assert short.split()[-3:] == ["0.946", "/", "0.947"], "a ratio just short of 0.95 does not print as 0.95"


def test_needs_torchrun_and_sets_no_nccl_environment(monkeypatch, capsys):
    """Whoever launches a run sets NCCL's environment (NVLink multicast, say), not the benchmark."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--seq", "1024"])
    assert exit_info.value.code == 2
    assert "run under torchrun" in capsys.readouterr().err
    assert "NCCL_NVLS_ENABLE" not in os.environ


def _check_on_cpu(rank, world):
    """``check`` on a small config: before each case runs, every case before it has been printed."""
    bench.DEVICE, bench.CONFIGS = "cpu", {"gqa 4/2 d16/8": (4, 2, 16, 8)}
    printed, lines_before_each = io.StringIO(), []
    attention = bench.context_parallel_attention

    def counting(*args, **kwargs):
        lines_before_each.append(printed.getvalue().count("\n"))
        return attention(*args, **kwargs)

    bench.context_parallel_attention = counting
    with redirect_stdout(printed):
        assert bench.check(32, bench._groups(world)) == 0
    if rank == 0:  # 2 header lines, then one line per case
        assert lines_before_each == list(range(2, 2 + len(lines_before_each))), (lines_before_each, printed.getvalue())
        assert printed.getvalue().count("\n") == 2 + len(lines_before_each) == 11, printed.getvalue()


def test_check_prints_each_case_as_it_finishes():
    run_distributed(_check_on_cpu, 2)


def _documents_check_on_cpu(rank, world):
    """The packed documents' check: every strategy, window and mask passes against the reference."""
    bench_documents.DEVICE = "cpu"
    bench_documents.CHECK_CASES = (((4, 2, 16, 8), None), ((4, 2, 16, 16), "allgather"))
    printed = io.StringIO()
    with redirect_stdout(printed):
        assert bench_documents.check(bench._groups(world), total=300) == 0, printed.getvalue()
    if rank == 0:  # 2 header lines, then 6 (window, mask) cases of 3 strategies on 2 layouts, then of the all-gather
        lines = printed.getvalue().splitlines()
        assert len(lines) == 2 + 36 + 12, printed.getvalue()
        assert all(line.split()[:2] == ["4/2", "16/16"] and line.split()[2] == "allgather" for line in lines[-12:])


def test_documents_check_passes():
    run_distributed(_documents_check_on_cpu, 2)


def test_rows_are_warmed_then_timed_in_rotating_rounds():
    """Every call warms before any is timed; round r starts at row r; each call reports the median
    of its rounds, so one slow round (the first, on GPUs that were idle) does not set a row's figure."""
    calls = []
    rows = {name: [lambda name=name, i=i: calls.append((name, i)) for i in range(n)]
            for name, n in (("local", 2), ("ring", 2), ("auto, no grad", 1))}
    timed, figures = [], iter([9.0, 9.5, 2.0, 3.0, 1.0] + [1.0, 2.0, 3.0, 2.0, 3.0] * 2)

    def fake_time(call, warmup):
        assert warmup == 0, "rounds only time: the warm-up ran before them"
        call()
        timed.append(calls[-1])
        return next(figures)

    ms = bench.interleaved_ms(rows, 3, time=fake_time)
    warm = calls[:5 * bench.WARMUP]
    assert sorted(set(warm)) == sorted(set(timed)) and len(warm) == 5 * bench.WARMUP, warm
    order = [name for name, i in timed if i == 0]
    assert order == ["local", "ring", "auto, no grad", "ring", "auto, no grad", "local",
                     "auto, no grad", "local", "ring"], order
    # local timed 9.0, 9.5 in round 0, then 2.0, 3.0 in rounds 1 and 2; ring 2, 3 then 1, 2 then 2, 3
    assert ms == {"local": [2.0, 3.0], "ring": [2.0, 3.0], "auto, no grad": [1.0]}, ms


def test_rounds_must_be_positive(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--rounds", "0"])
    assert exit_info.value.code == 2
    assert "--rounds must be at least 1, got 0" in capsys.readouterr().err


def _timed_on_cpu(benchmark):
    """(what ``benchmark()`` printed, the calls it timed), with a counting stand-in for the CUDA
    event timer and the device name."""
    torch.cuda.get_device_name = lambda: "cpu"
    timed = []

    def count(call, warmup):
        call()
        timed.append(call)
        return 1.0

    interleaved = bench.interleaved_ms
    bench.interleaved_ms = lambda rows, rounds: interleaved(rows, rounds, time=count)
    printed = io.StringIO()
    with redirect_stdout(printed):
        benchmark()
    return printed.getvalue(), timed


def _benchmark_on_cpu(rank, world):
    """The whole timed benchmark at a tiny shape."""
    bench.DEVICE, bench.CONFIGS = "cpu", {"gqa 4/2 d16/8": (4, 2, 16, 8)}
    printed, timed = _timed_on_cpu(lambda: bench.benchmark([256], bench._groups(world), rounds=2))
    # local 2 calls, ring, all-gather and Ulysses 2 each, auto 2, auto without grad 1; each round
    assert len(timed) == 2 * 11, len(timed)
    if rank == 0:
        rows = [line.split()[0] for line in printed.splitlines()[2:] if "torch CP" not in line]
        assert rows == ["local,", "ring", "allgather", "ulysses", "auto", "auto"], printed
        assert "the median of 2 interleaved rounds" in printed


def test_benchmark_times_every_row_in_rounds():
    run_distributed(_benchmark_on_cpu, 2)


def _documents_benchmark_on_cpu(rank, world):
    """The packed documents' timed benchmark at a tiny batch."""
    bench_documents.DEVICE, bench_documents.HEADS = "cpu", (4, 2, 16, 8)
    printed, timed = _timed_on_cpu(
        lambda: bench_documents.benchmark(bench._groups(world), rounds=2, total=1024, window=(128, 0)))
    # the window: local, 3 strategies x 3 variants, auto x 2 layouts; no window: local, 3 strategies
    # and auto x 2 layouts; each row a forward and a forward+backward, then auto's forward alone
    # under no_grad x 2 layouts, in each of 2 rounds
    assert len(timed) == 2 * (2 * (12 + 9) + 2 * 2), len(timed)
    if rank == 0:
        lines = printed.splitlines()[2:]
        rows = [line.split()[0] for line in lines]
        assert rows == ["local", "ring", "ring", "ring", "allgather", "allgather", "allgather", "ulysses", "ulysses",
                        "ulysses", "auto", "auto", "auto", "auto", "local", "ring", "ring", "allgather", "allgather",
                        "ulysses", "ulysses", "auto", "auto", "auto", "auto"], printed
        assert sum("contiguous" in line for line in printed.splitlines()) == 10, printed
        # the forward alone: on zigzag shards of two ranks the all-gather, whose prefix segments the
        # reference runs; on contiguous ones the ring
        no_grad = [line.split("  ")[1].strip() for line in lines if "no grad" in line]
        assert no_grad == ["auto -> allgather, no grad", "auto -> ring contiguous, no grad"] * 2, printed
        assert "the median of 2 interleaved rounds" in printed


def test_documents_benchmark_times_every_row_in_rounds():
    run_distributed(_documents_benchmark_on_cpu, 2)
