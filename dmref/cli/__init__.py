"""The ``dmref`` command line.

Each sub-command lives in its own module that exposes ``register(subparsers)``; this module only
collects them, so that adding a command never touches another command's code.

Errors (one place, :func:`main`):

- bad input (an option argparse rejects, or a :class:`UsageError` a command raises, e.g. from
  ``with input_errors():`` around its argument handling) prints one line
  ``dmref <command>: error: <message>`` on stderr and exits with status 2;
- Ctrl-C prints ``dmref <command>: interrupted``, status 130; a closed stdout pipe (``| head``)
  ends quietly with status 141, as a Unix tool killed by SIGPIPE;
- any other exception is an internal error: one line ``dmref <command>: internal error:
  <type>: <message>`` and status 1; with the environment variable ``DMREF_TRACEBACK=1`` it is
  raised instead, with its traceback.

JSON (:func:`dumps_json`, used by every ``--json``): strict RFC 8259 (``json.loads`` with a
``parse_constant`` that raises reads it). A non-finite float is written as the string ``"nan"``,
``"inf"`` or ``"-inf"``; every other float as Python's shortest repr, which reads back as the
same float64, so nothing is lost.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import json
import math
import os
import sys

__all__ = ["UsageError", "build_parser", "dumps_json", "input_errors", "int_at_least", "main", "version"]

#: Modules that contribute sub-commands, in the order they appear in ``dmref --help``.
COMMAND_MODULES = (
    "dmref.cli.formats",
    "dmref.cli.demo",
    "dmref.cli.gemm",
    "dmref.cli.check",
    "dmref.cli.attention",
)

#: Exit statuses: bad input, and an internal error (a bug, or the machine refusing, e.g. memory).
EXIT_USAGE, EXIT_INTERNAL = 2, 1

#: Set to 1 to get the traceback of an internal error instead of its one-line message.
TRACEBACK_ENV = "DMREF_TRACEBACK"


class UsageError(Exception):
    """Bad command-line input; :func:`main` prints ``dmref <command>: error: <message>``, exit 2."""


@contextlib.contextmanager
def input_errors():
    """Inside this block, ValueError, TypeError and OSError are the user's input errors (they
    become :class:`UsageError`). Use it only around argument handling, never around the
    computation, whose exceptions are internal errors."""
    try:
        yield
    except (ValueError, TypeError, OSError) as e:
        raise UsageError(str(e)) from e


def int_at_least(low: int):
    """An argparse ``type``: an integer >= ``low`` (the message names the value and the range)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} must be >= {low}")
        return value

    parse.__name__ = f"int >= {low}"
    return parse


def _strict(obj):
    """``obj`` with every non-finite float replaced by "nan", "inf" or "-inf" (numpy scalars
    become Python numbers)."""
    if isinstance(obj, dict):
        return {k: _strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_strict(v) for v in obj]
    if type(obj).__module__ == "numpy" and hasattr(obj, "item"):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    return obj


def dumps_json(obj, **kwargs) -> str:
    """Strict JSON of ``obj`` (see the module docstring for non-finite floats)."""
    return json.dumps(_strict(obj), allow_nan=False, **kwargs)


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (the usage is one ``--help`` away)."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def version() -> str:
    """``dmref <version>``: the installed distribution's version (importlib.metadata), which
    pyproject.toml sets; ``dmref (version unknown: not installed)`` when dmref is imported from a
    source tree that pip never installed."""
    try:
        return f"dmref {importlib.metadata.version('dmref')}"
    except importlib.metadata.PackageNotFoundError:
        return "dmref (version unknown: not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="dmref",
        description="The correctness oracle for FP8 attention training (dmref check), and the bit-exact "
                    "FP8 emulation and reference attention it rests on.",
        epilog=f"Exit status 2: bad input; 1: a failed check or an internal error "
               f"({TRACEBACK_ENV}=1 shows its traceback).",
    )
    parser.add_argument("--version", action="version", version=version(),
                        help="print the installed version of dmref and exit")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")  # subparsers are _Parser too
    subparsers.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    parser.commands = subparsers.choices  # name -> sub-command parser
    return parser


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # reported by the sub-command, so that the message names it
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    prog = f"dmref {args.command}"
    try:
        return int(args.func(args) or 0)
    except UsageError as e:
        print(f"{prog}: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of stdout left (``dmref formats | head -1``): no message
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 141  # 128 + SIGPIPE, the status of a Unix tool killed by it
    except Exception as e:  # noqa: BLE001 - the one place unexpected errors become one line
        if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
            raise
        print(f"{prog}: internal error: {type(e).__name__}: {_one_line(e)} "
              f"(run with {TRACEBACK_ENV}=1 for the traceback)", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
