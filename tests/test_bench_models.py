"""The model benchmark runs end to end on the CPU (--tiny): a table row per measure, all sites
rewritten (inside activation checkpoints too), with the mask structure each kind of input gives
(Gemma 2's eager attention with its softcap)."""
import re

import pytest

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
