"""``dmref verify-gemm FILE.npz``: replay every case of a ground-truth file of real FP8 GEMM
outputs (the format of tests/data/h200_fp8_gemm.npz) under the ``hopper`` accumulation model and
report the fraction of float32 bit patterns reproduced exactly and the largest deviation in ulps:
per engine and settings (summed over operand formats and input distributions), with every group
that misses listed under the table; ``--wide``: per group (engine, settings, formats, input
distribution), one row each, wider than 80 columns. Exit status 0 only when every
bit pattern is reproduced; a file that cannot be replayed (missing, not an .npz, no cases, a case
outside the layout) or a bad ``--device`` gives a one-line message and exit status 2."""

from __future__ import annotations

import json
import sys
import time

from rich.console import Console
from rich.markup import escape

from dmref.cli import _tables


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "verify-gemm",
        help="replay real FP8 GEMM outputs under the hopper model; fraction reproduced per group",
    )
    p.add_argument("file", help="an .npz in the format of tests/data/h200_fp8_gemm.npz")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--device", default="cpu", help="torch device for the model (default cpu)")
    p.add_argument("--wide", action="store_true",
                   help="one row per group (engine, settings, formats, distribution) instead of per "
                        "engine and settings (about 135 columns)")
    p.set_defaults(func=_verify)


def _error(message: str) -> int:
    print(f"dmref verify-gemm: error: {message}", file=sys.stderr)
    return 2


def _device_problem(name: str) -> str | None:
    """Why ``--device name`` cannot run the model here, or None."""
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        return f"--device {name!r} is not a torch device; accepted: cpu, cuda, cuda:N"
    if device.type not in ("cpu", "cuda"):
        return f"--device {name!r}: the model runs on cpu or cuda (cuda:N), not {device.type}"
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (device.index or 0) >= count:
            return f"--device {name!r}: this machine has {count} CUDA device(s); use cpu"
    return None


def _verify(args) -> int:
    from dmref.emulation.gemm.captures import GemmFileError, verify

    problem = _device_problem(args.device)
    if problem:
        return _error(problem)
    start = time.perf_counter()
    try:
        groups = verify(args.file, device=args.device)
    except GemmFileError as e:
        return _error(str(e))
    seconds = time.perf_counter() - start
    outputs = sum(g.outputs for g in groups)
    matched = sum(g.matched for g in groups)
    if outputs == 0:  # load_cases refuses files without outputs; never report nothing as passed
        return _error(f"{args.file} holds no outputs to check")
    ok = matched == outputs
    if args.json:
        print(json.dumps({
            "file": args.file, "model": "hopper", "all_reproduced": ok,
            "outputs": outputs, "matched": matched, "fraction": matched / outputs,
            "seconds": round(seconds, 2), "groups": [g.as_dict() for g in groups],
        }, indent=2))
        return 0 if ok else 1
    console = Console()
    if args.wide:
        _print_groups(console, args.file, groups)
    else:
        _print_summary(console, args.file, groups)
    console.print(f"{matched}/{outputs} bit patterns reproduced in {len(groups)} groups "
                  f"({seconds:.1f} s): {'all reproduced' if ok else 'NOT all reproduced'}")
    return 0 if ok else 1


def _fraction(matched: int, outputs: int) -> str:
    """The percentage with three decimals, never 100.000% unless every output matched."""
    text = f"{100 * matched / outputs:.3f}%"
    return "99.999%" if text == "100.000%" and matched < outputs else text


def _print_summary(console, path: str, groups) -> None:
    """One row per engine and settings, summed over formats and distributions; then every group
    that misses, on its own line."""
    merged: dict[tuple[str, str], list] = {}
    formats, dists = {}, {}
    for g in groups:
        engine, settings, fmt, dist = g.group.split(" | ")
        merged.setdefault((engine, settings), []).append(g)
        formats[fmt] = dists[dist] = None
    table = _tables.table(f"{escape(path)}: float32 bit patterns reproduced by the hopper model")
    _tables.text_column(table, "engine, settings")
    for header in ("groups", "outputs", "reproduced", "max ulps"):
        _tables.number_column(table, header)
    for (engine, settings), gs in merged.items():
        outputs, matched = sum(g.outputs for g in gs), sum(g.matched for g in gs)
        table.add_row(f"{engine} {settings}", str(len(gs)), str(outputs), _fraction(matched, outputs),
                      str(max(g.max_ulps for g in gs)), style=None if matched == outputs else "bold red")
    console.print(table)
    console.print(f"Each row sums the groups of its engine and settings: operand formats {', '.join(formats)}; "
                  f"input distributions {', '.join(dists)} (--wide: one row per group).")
    for g in groups:
        if g.matched < g.outputs:
            console.print(f"[bold red]missed[/]: {escape(g.group)}: {g.matched}/{g.outputs} reproduced "
                          f"({_fraction(g.matched, g.outputs)}), max {g.max_ulps} ulps, cases {', '.join(g.cases)}",
                          highlight=False)


def _print_groups(console, path: str, groups) -> None:
    """One row per group."""
    table = _tables.table(f"{escape(path)}: float32 bit patterns reproduced by the hopper model")
    for name in ("engine", "settings", "formats", "dist"):
        _tables.text_column(table, name)
    for name in ("cases", "outputs", "reproduced", "max ulps"):
        _tables.number_column(table, name)
    for g in groups:
        engine, settings, formats, dist = g.group.split(" | ")
        table.add_row(engine, settings, formats, dist, str(len(g.cases)), str(g.outputs),
                      _fraction(g.matched, g.outputs), str(g.max_ulps),
                      style=None if g.matched == g.outputs else "bold red")
    _tables.print_wide(console, table)
