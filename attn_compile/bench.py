"""Benchmarks (never timed tests): ``python -m attn_compile.bench {kernels,cp,models} [options]``.

kernels: single-GPU TFLOP/s of the dispatched op and the Triton kernels beside cuDNN, flash and
flex_attention. cp: per-GPU TFLOP/s of each context-parallel strategy beside the single-GPU op
and PyTorch's context_parallel (run under torchrun). models: Hugging Face-shaped stacks compiled
with backend="attn_cp" against backend="inductor". Each prints a table; ``--plot FILE.png`` where
offered draws one.
"""
import importlib
import sys

SUITES = {
    "kernels": "attn_compile.kernels.bench_kernels",
    "cp": "attn_compile.cp.bench",
    "models": "attn_compile.bench_models",
    "plan": "attn_compile.bench_plan",
}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in SUITES:
        print(f"usage: python -m attn_compile.bench {{{','.join(SUITES)}}} [options]", file=sys.stderr)
        return 2
    return importlib.import_module(SUITES[argv[0]]).main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
