"""``dmref demo``: every preset recipe on a realistic attention problem (CPU), as a table, a
PNG plot and, with ``--json``, a list of objects.

Every option is checked before anything is computed: sizes are positive, recipe names are
known (:func:`dmref.recipes.get_recipe`), the plot's folder exists and can be written. The
results are printed before the plot is written; if writing it fails anyway, the message says
so and the exit status is 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from dmref.cli import UsageError, dumps_json, input_errors, int_at_least

#: torch.Generator.manual_seed accepts [-2^63, 2^64 - 1]; the sweep uses seed + 1.
SEED_RANGE = (-(1 << 63), (1 << 64) - 2)


def _seed(text: str) -> int:
    value = int_at_least(SEED_RANGE[0])(text)
    if value > SEED_RANGE[1]:
        raise argparse.ArgumentTypeError(f"{value} must be <= {SEED_RANGE[1]} (2^64 - 2)")
    return value


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "demo",
        help="run every preset recipe on a realistic attention problem; table, JSON, PNG",
        description="Row-sum residual of dS, output and gradient errors and dQ bias fraction of "
                    "every preset recipe against the float64 reference, on a problem with "
                    "outlier channels, a sink key and peaked attention rows.",
        epilog="Exit status 2: a bad option (nothing is computed); 1: the results are printed "
               "but the plot could not be written.",
    )
    positive = int_at_least(1)
    p.add_argument("--json", action="store_true", help="print a JSON list of objects instead of the table")
    p.add_argument("--out", default="dmref_demo.png",
                   help="plot path (default dmref_demo.png; '' for none); the suffix picks the "
                        "image format (png, pdf, svg, ...); its folder must exist")
    p.add_argument("--batch", type=positive, default=1)
    p.add_argument("--heads", type=positive, default=4)
    p.add_argument("--seqlen", "-n", type=positive, default=1024)
    p.add_argument("--head-dim", type=positive, default=64)
    p.add_argument("--no-causal", action="store_true", help="full attention instead of causal")
    p.add_argument("--seed", type=_seed, default=0)
    p.add_argument("--recipes", nargs="*", default=None, metavar="NAME",
                   help="preset names (default: all); NAME@hopper for the Hopper accumulation model")
    p.add_argument("--sweep", nargs="*", type=positive, default=None, metavar="N",
                   help="sequence lengths of the error-vs-length sweep (default 128 256 512 1024; "
                        "give none to skip it)")
    p.add_argument("--sweep-heads", type=positive, default=None, help="heads of the sweep's problems (default: --heads)")
    p.add_argument("--draws", type=int_at_least(0), default=256, metavar="T",
                   help="largest number of roundings dQ's error is averaged over (default 256; 0 skips it)")
    p.set_defaults(func=_run)


def _config(args):
    """The DemoConfig of ``args``; UsageError for unknown or repeated recipe names."""
    from dmref.demo import DemoConfig
    from dmref.recipes import PRESETS, get_recipe

    names = tuple(args.recipes) if args.recipes else tuple(PRESETS)
    with input_errors():
        resolved = [get_recipe(n).name for n in names]
    repeated = sorted({n for n in resolved if resolved.count(n) > 1})
    if repeated:
        raise UsageError(f"--recipes names {', '.join(repeated)} more than once")
    return DemoConfig(
        batch=args.batch, heads=args.heads, seqlen=args.seqlen, head_dim=args.head_dim,
        causal=not args.no_causal, seed=args.seed, recipes=names,
        sweep_seqlens=tuple(args.sweep) if args.sweep is not None else DemoConfig.sweep_seqlens,
        sweep_heads=args.sweep_heads, accum_draws=args.draws,
    )


def check_out_path(path: str) -> None:
    """Raise UsageError unless ``path`` names an image file matplotlib can write and its folder
    exists and takes a new file (tried with a temporary file, removed at once)."""
    from matplotlib.backend_bases import FigureCanvasBase

    kinds = FigureCanvasBase.get_supported_filetypes()
    suffix = os.path.splitext(path)[1].lower().lstrip(".")
    if suffix not in kinds:
        raise UsageError(f"--out {path!r}: the suffix must name an image format; accepted: "
                         f"{', '.join(sorted(kinds))}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"--out {path!r}: folder {folder!r} does not exist")
    if os.path.isdir(path):
        raise UsageError(f"--out {path!r} is a folder")
    try:
        if os.path.exists(path):
            with open(path, "ab"):  # opened for writing, not changed
                pass
        else:
            with tempfile.NamedTemporaryFile(dir=folder):
                pass
    except OSError as e:
        raise UsageError(f"--out {path!r} cannot be written: {e.strerror or e}") from None


def _run(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    import torch

    from dmref import demo

    config = _config(args)
    if args.out:
        check_out_path(args.out)
    # One thread: on a 2-core CPU, intra-op threads on these small matrices cost more than they save
    torch.set_num_threads(1)
    err = Console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=err, transient=args.json) as progress:
        result = demo.run_demo(config, progress)
    out = Console(width=None if sys.stdout.isatty() else 200)  # no wrapped rows in a log file
    if args.json:
        print(dumps_json(result.json_rows(), indent=2))
    else:
        demo.print_table(result, out)
    if args.out:
        try:
            demo.write_plot(result, args.out)
        except OSError as e:
            print(f"dmref demo: error: the results are printed, but the plot could not be written "
                  f"to {args.out!r}: {e.strerror or e}", file=sys.stderr)
            return 1
        if not args.json:
            out.print(f"plot written to {args.out}")
    return 0
