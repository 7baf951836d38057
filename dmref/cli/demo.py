"""``dmref demo``: every preset recipe on a realistic attention problem (CPU), as a table, a
PNG plot (``--no-plot``: none) and, with ``--json``, a list of objects, one per recipe (the
averaged recipes' with figure panel A's series and reading under ``accumulation``). The tables
fit 80 columns.

Every option is checked before anything is computed: sizes are positive, sequence lengths at
least 2 (with one key softmax is constant, dQ and dK are exactly 0 and their relative errors
undefined), the largest problem fits in the memory available (:func:`dmref.demo.peak_bytes`),
recipe names are known (:func:`dmref.recipes.get_recipe`), the plot's folder exists and can be
written. The results are printed before the plot is written; if writing it fails anyway, the
message says so and the exit status is 1.
"""

from __future__ import annotations

import argparse
import math
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


def _seqlen(text: str) -> int:
    value = int_at_least(1)(text)
    if value < 2:
        raise argparse.ArgumentTypeError(
            f"{value}: with one key per query row softmax is constant (P = 1), so dQ and dK are exactly 0 "
            "and their relative errors undefined; give at least 2")
    return value


def available_bytes() -> int | None:
    """Memory available to a new process (Linux: MemAvailable of /proc/meminfo; else the
    physical memory), or None where neither can be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None


def check_memory(config, available: int | None) -> None:
    """UsageError when the demo's largest problem (:func:`dmref.demo.peak_bytes`) needs more
    memory than ``available`` bytes; the message names the sizes and the largest length that fits."""
    from dmref import demo

    if available is None:
        return
    need = demo.peak_bytes(config)
    if need <= available:
        return
    problems = [(f"--seqlen {config.seqlen}", config.heads, config.seqlen)]
    problems += [(f"--sweep {n}", config.sweep_heads or config.heads, n) for n in config.sweep_seqlens]
    if config.accum_draws:
        problems.append((f"--draws {config.accum_draws} (its problem has {config.accum_heads} head, "
                         f"{config.accum_seqlen} keys)", config.accum_heads, config.accum_seqlen))
    size = {p: demo.problem_bytes(config.batch, p[1], p[2], config.head_dim) for p in problems}
    worst = max(problems, key=size.get)
    what, heads, n = worst
    advice = "lower --batch, --heads or --head-dim"
    if what.startswith(("--seqlen", "--sweep")) and all(size[p] <= available for p in problems if p is not worst):
        # the largest N with problem_bytes(batch, heads, N, head_dim) <= available: a quadratic in N
        a, b = demo.SQUARE_ARRAYS, demo.ROW_ARRAYS * config.head_dim
        c = available // (8 * config.batch * heads)
        fits = (math.isqrt(b * b + 4 * a * c) - b) // (2 * a)
        if fits >= 2:
            advice = f"the largest sequence length that fits is {fits}"
    gib = 2 ** 30
    raise UsageError(
        f"{what} with --batch {config.batch}, {heads} heads and --head-dim {config.head_dim} needs about "
        f"{need / gib:.3g} GiB of memory (8 bytes x batch x heads x seqlen x ({demo.SQUARE_ARRAYS} seqlen + "
        f"{demo.ROW_ARRAYS} head_dim): dmref.demo.problem_bytes), and {available / gib:.3g} GiB is available; "
        f"{advice}")


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
    p.add_argument("--no-plot", action="store_true", help="write no plot (the same as --out '')")
    p.add_argument("--batch", type=positive, default=1)
    p.add_argument("--heads", type=positive, default=4)
    p.add_argument("--seqlen", "-n", type=_seqlen, default=1024, help="keys (and queries) per head, >= 2")
    p.add_argument("--head-dim", type=positive, default=64)
    p.add_argument("--no-causal", action="store_true", help="full attention instead of causal")
    p.add_argument("--seed", type=_seed, default=0)
    p.add_argument("--recipes", nargs="*", default=None, metavar="NAME",
                   help="preset names (default: all); NAME@hopper for the Hopper accumulation model")
    p.add_argument("--sweep", nargs="*", type=_seqlen, default=None, metavar="N",
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
    check_memory(config, available_bytes())
    if args.no_plot:
        args.out = ""
    if args.out:
        check_out_path(args.out)
    # One thread: on a 2-core CPU, intra-op threads on these small matrices cost more than they save
    torch.set_num_threads(1)
    err = Console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=err, transient=args.json) as progress:
        result = demo.run_demo(config, progress)
    out = Console()  # the terminal's width, COLUMNS, else 80: every table fits 80 columns
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
