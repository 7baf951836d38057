"""The ``dmref`` command line.

Each sub-command lives in its own module that exposes ``register(subparsers)``; this module only
collects them, so that adding a command never touches another command's code.
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: Modules that contribute sub-commands, in the order they appear in ``dmref --help``.
COMMAND_MODULES = (
    "dmref._cli_formats",
    "dmref._cli_demo",
    "dmref._cli_gemm",
    "dmref._cli_check",
    "dmref._cli_attention",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dmref",
        description="Bit-exact FP8 emulation, reference attention and Delta-Matching checks.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
