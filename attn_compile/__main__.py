"""Command line: ``python -m attn_compile demo [--world N] [--device cpu|cuda]``."""
import argparse
import sys

from . import demo
from .cp import demo as cp_demo


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attn_compile")
    commands = parser.add_subparsers(dest="command", required=True)
    run_demo = commands.add_parser("demo", help="compile a small GQA transformer and check it against eager")
    run_demo.add_argument("--world", type=int, default=2, help="processes for the context-parallel part")
    run_demo.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args(argv)
    failed = demo.local_demo()
    return cp_demo.main(args.world, args.device) or failed


if __name__ == "__main__":
    sys.exit(main())
