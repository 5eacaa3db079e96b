"""Benchmarks (never timed tests): ``python -m attn_compile.bench {kernels,cp,models,plan} [options]``.

Each suite prints a table; ``--plot FILE.png`` where offered draws one. ``python -m
attn_compile.bench SUITE --help`` lists a suite's own options.
"""
import argparse
import importlib
import sys
import textwrap
from typing import NamedTuple


class Suite(NamedTuple):
    module: str  # whose main(argv) runs the suite
    summary: str


SUITES = {
    "kernels": Suite("attn_compile.kernels.bench_kernels",
                     "single-GPU TFLOP/s of the dispatched op and the Triton kernels beside cuDNN, flash and "
                     "flex_attention (needs a CUDA device)"),
    "cp": Suite("attn_compile.cp.bench",
                "per-GPU TFLOP/s of each context-parallel strategy beside the single-GPU op and PyTorch's "
                "context_parallel (needs CUDA devices; run under torchrun)"),
    "models": Suite("attn_compile.bench_models",
                    "Hugging Face-shaped stacks (and torchtitan's Llama 3) compiled with backend=\"attn_cp\" "
                    "against backend=\"inductor\" (--tiny: small shapes on the CPU)"),
    "plan": Suite("attn_compile.bench_plan",
                  "the cost model's estimates and choice of strategy for clusters, on a CPU (--validate: against "
                  "the measured context-parallel tables)"),
}


def _suite_list() -> str:
    return "suites:\n" + "\n".join(textwrap.fill(suite.summary, 100, initial_indent=f"  {name:<9} ",
                                                  subsequent_indent=" " * 12) for name, suite in SUITES.items())


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="python -m attn_compile.bench", usage=f"%(prog)s [-h] {{{','.join(SUITES)}}} [options of the suite]",
        description="Benchmarks (never timed tests). SUITE --help lists a suite's own options.",
        epilog=_suite_list(), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suite", choices=tuple(SUITES), help="the benchmark to run (listed below)")
    suite = parser.parse_args(argv[:1]).suite  # the rest is the suite's, --help included
    return importlib.import_module(SUITES[suite].module).main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
