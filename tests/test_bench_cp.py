"""The context-parallel benchmark's CPU parts: its `auto` row and its refusal to run outside torchrun
(the timing itself needs GPUs)."""
from types import SimpleNamespace

import pytest
import torch

from attn_compile.cp import bench


def test_auto_row_names_the_choice_and_its_ratios():
    """GQA 32/8 d128 on 2 ranks at 64K tokens: the cost model gathers K and V (see test_cost_model)."""
    q, k, v = (torch.empty(1, h, 32768, 128, dtype=torch.bfloat16) for h in (32, 8, 8))
    name = bench.auto_name(q, k, v, (SimpleNamespace(size=lambda: 2),))
    assert name == "auto -> allgather"
    row = bench._row(name, [400.0, 380.0], local=[500.0, 400.0], peer=[380.0, 361.0])
    assert row[:30] == f"  {name:28s}", "the name in the strategies' column"
    assert row[30:].split() == ["400", "380", "0.80", "/", "0.95", "1.05", "/", "1.05"], row


def test_needs_torchrun(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")  # main sets its default; keep the test's environment as it was
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--seq", "1024"])
    assert exit_info.value.code == 2
    assert "run under torchrun" in capsys.readouterr().err
