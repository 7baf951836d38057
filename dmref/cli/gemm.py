"""``dmref verify-gemm FILE.npz``: replay every case of a ground-truth file of real FP8 GEMM
outputs (the format of tests/data/h200_fp8_gemm.npz) under the ``hopper`` accumulation model and
report, per case group (engine, settings, formats, input distribution), the fraction of float32
bit patterns reproduced exactly and the largest deviation in ulps. Exit status 0 only when every
bit pattern is reproduced; a file that cannot be replayed (missing, not an .npz, no cases, a case
outside the layout) or a bad ``--device`` gives a one-line message and exit status 2."""

from __future__ import annotations

import json
import sys
import time

from rich.console import Console
from rich.table import Table


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "verify-gemm",
        help="replay real FP8 GEMM outputs under the hopper model; fraction reproduced per group",
    )
    p.add_argument("file", help="an .npz in the format of tests/data/h200_fp8_gemm.npz")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--device", default="cpu", help="torch device for the model (default cpu)")
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
    from dmref.emulation._gemm_npz import GemmFileError, verify

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
    table = Table(title=f"{args.file}: float32 bit patterns reproduced by the hopper model")
    for name, justify in (("engine", "left"), ("settings", "left"), ("formats", "left"),
                          ("dist", "left"), ("cases", "right"), ("outputs", "right"),
                          ("reproduced", "right"), ("max ulps", "right")):
        table.add_column(name, justify=justify)
    for g in groups:
        engine, settings, formats, dist = g.group.split(" | ")
        style = None if g.fraction == 1 else "bold red"
        table.add_row(engine, settings, formats, dist, str(len(g.cases)), str(g.outputs),
                      f"{100 * g.fraction:.3f}%", str(g.max_ulps), style=style)
    console = Console(width=160)
    console.print(table)
    console.print(f"{matched}/{outputs} bit patterns reproduced in {len(groups)} groups "
                  f"({seconds:.1f} s): {'all reproduced' if ok else 'NOT all reproduced'}")
    return 0 if ok else 1
