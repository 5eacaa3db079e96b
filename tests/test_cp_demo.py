"""The context-parallel demo: every strategy compiled with backend="attn_cp" matches one process."""
import os
import re

import pytest

from attn_compile.cp import demo


def test_demo_matches_single_process(capfd):
    assert demo.main(world=2) == 0
    printed = capfd.readouterr().out
    for strategy in ("ring", "allgather", "ulysses"):
        assert re.search(rf"^{strategy} +\d\.\d\de[-+]\d\d +\d\.\d\de[-+]\d\d +\d+\.\d$", printed, re.MULTILINE), printed
    assert "tolerance 1e-04: all match" in printed


def test_demo_needs_a_world_that_splits_the_heads():
    with pytest.raises(ValueError, match=r"^world must be 2, 4 or 8 \(ulysses splits the 8 query heads among the "
                                         r"ranks\); got 3$"):
        demo.main(world=3)


def test_demo_sets_no_nccl_environment(monkeypatch):
    """Whoever launches a run sets NCCL's environment (NVLink multicast, say), not the demo."""
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="^world=2, but torchrun started WORLD_SIZE=4 processes$"):
        demo.main(world=2)
    assert "NCCL_NVLS_ENABLE" not in os.environ
