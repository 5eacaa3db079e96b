"""The benchmark command line: help that lists the suites, and a suite that needs CUDA says so
before it starts on a machine without it."""
import pytest
import torch

from attn_compile import bench


def test_help_lists_every_suite(capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    assert out.startswith(f"usage: python -m attn_compile.bench [-h] {{{','.join(bench.SUITES)}}}")
    for name, suite in bench.SUITES.items():
        assert f"\n  {name:<9} {suite.summary[:40]}" in out, out


def test_unknown_suite_names_the_choices(capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.main(["kernel"])
    assert exit_.value.code == 2
    choices = ", ".join(map(repr, bench.SUITES))
    assert f"invalid choice: 'kernel' (choose from {choices})" in capsys.readouterr().err


def test_a_suites_own_help_reaches_it(capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.main(["models", "--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("usage: python -m attn_compile.bench models [-h] [--tiny]")


@pytest.mark.parametrize("argv", [["kernels"], ["cp"], ["cp", "--check"], ["models"]])
def test_cuda_suites_say_so_up_front_without_cuda(monkeypatch, capsys, argv):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("RANK", "0")  # as under torchrun, so cp gets as far as the device
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(SystemExit) as exit_:
        bench.main(argv)
    assert exit_.value.code == 2
    assert "error: needs a CUDA device" in capsys.readouterr().err
