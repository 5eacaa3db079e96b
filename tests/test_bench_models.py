"""The model benchmark runs end to end on the CPU (--tiny): a table row per measure, all sites
rewritten (inside activation checkpoints too), with the mask structure each kind of input gives
(Gemma 2's eager attention with its softcap)."""
import re
import sys

import pytest

import torchtitan_site

pytest.importorskip("transformers")


STRUCTURES = {"llama3-8b": "causal", "mistral-7b": "causal \\+ window_left=15", "gemma2-9b": "causal \\+ window_left=15"}


@pytest.mark.parametrize("options, masking", [([], "key_padding_mask"), (["--inputs", "packed"], "document_ids"),
                                             (["--checkpointing", "--models", "llama3-8b"], "key_padding_mask")])
def test_tiny_benchmark_runs(capsys, options, masking):
    from attn_compile.bench_models import main

    assert main(["--tiny", "--compiler", "aot_eager", *options]) == 0
    out = capsys.readouterr().out
    models = options[options.index("--models") + 1:] if "--models" in options else list(STRUCTURES)
    for model in models:
        for measure in ("attention fwd", "attention fwd\\+bwd", "step fwd\\+bwd"):
            assert re.search(rf"^{model} +1 +32  {measure} +[\d.]+ +[\d.]+ +[\d.]+x$", out, re.M), out
        assert re.search(rf"1 of 1 attention sites rewritten; .*mask -> {STRUCTURES[model]} \+ {masking}", out), out


@torchtitan_site.needs_its_torch
def test_tiny_torchtitan_benchmark_runs(capsys):
    """torchtitan's Llama 3 (its debug model's first 2 layers): attn_cp runs every measure, flex its
    attention forward (no CPU backward), varlen nothing (no CPU kernel); both layers rewritten."""
    from attn_compile.bench_models import main

    torchtitan_site.install()
    assert main(["--tiny", "--compiler", "aot_eager", "--models", "titan-llama3", "--inputs", "packed"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^model +layers +S +measure +varlen aot_eager +flex aot_eager +attn_cp +vs varlen +vs flex$",
                     out, re.M), out
    assert re.search(r"^titan-llama3 +2 +32  attention fwd +- +[\d.]+ +[\d.]+ +- +[\d.]+x$", out, re.M), out
    for measure in ("attention fwd\\+bwd", "step fwd\\+bwd"):
        assert re.search(rf"^titan-llama3 +2 +32  {measure} +- +- +[\d.]+ +- +-$", out, re.M), out
    assert re.search(r"2 of 2 attention sites rewritten; .*-> attn_cp.varlen_attention", out), out


@pytest.mark.parametrize("options, rule", [(["--inputs", "padding"], "takes packed documents"),
                                           (["--inputs", "packed", "--checkpointing"], "no --checkpointing"),
                                           (["--inputs", "packed"], "pip install --no-deps torchtitan==0.3.0")])
def test_torchtitan_benchmark_refuses(capsys, monkeypatch, options, rule):
    from attn_compile.bench_models import main

    monkeypatch.setitem(sys.modules, "torchtitan.models.llama3", None)  # as if torchtitan were not installed
    with pytest.raises(SystemExit):
        main(["--tiny", "--models", "titan-llama3", *options])
    assert rule in capsys.readouterr().err
