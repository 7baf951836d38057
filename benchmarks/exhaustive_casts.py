"""Sweep all 2**32 float32 bit patterns through dmref's encode, ml_dtypes and torch; print the
counts per comparison and the time taken (and the float64 double-rounding census).

    python benchmarks/exhaustive_casts.py [--json FILE]   # default: benchmarks/results/cpu_exhaustive_casts.json

docs/casts.md ("Agreement with ml_dtypes and torch") cites the result file. ``--bits B`` sweeps
the first 2**B patterns only and writes nothing unless ``--json`` is given.
"""

import argparse
import json
import os
import platform
import time
from dataclasses import asdict

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from dmref.emulation import sweep


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", help="result file (default with all 32 bits: benchmarks/results/cpu_exhaustive_casts.json)")
    ap.add_argument("--bits", type=int, default=32, help="sweep only the first 2**BITS patterns")
    args = ap.parse_args()
    if args.json is None and args.bits == 32:
        args.json = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "cpu_exhaustive_casts.json")
    stop = 1 << args.bits
    t0 = time.perf_counter()
    with Progress() as progress:
        task = progress.add_task("float32 bit patterns", total=stop)
        results = sweep.sweep_float32(stop=stop, progress=lambda n: progress.advance(task, n))
    elapsed = time.perf_counter() - t0
    table = Table(title=f"all {stop:,} float32 bit patterns, {elapsed:.0f} s on {platform.machine()}")
    for col in ("format", "saturate", "library", "inputs", "mismatches", "documented as", "undocumented", "s"):
        table.add_column(col)
    for r in results:
        table.add_row(r.fmt, str(r.saturate), r.library, f"{r.inputs:,}", f"{r.mismatches:,}",
                      r.allowed, str(r.undocumented), f"{r.seconds:.1f}")
    console = Console(width=150)
    console.print(table)
    census = [sweep.double_rounding_census(f) for f in
              ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")]
    t2 = Table(title="float64 just off every midpoint: wrongly rounded")
    for col in ("format", "inputs", "dmref", "ml_dtypes astype", "torch .to()", "example (x, right, ml, torch)"):
        t2.add_column(col)
    for c in census:
        t2.add_row(c.fmt, str(c.inputs), str(c.ours_wrong), str(c.ml_dtypes_wrong), str(c.torch_wrong), str(c.example))
    console.print(t2)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seconds": elapsed, "machine": platform.machine(),
                       "sweep": [asdict(r) for r in results],
                       "double_rounding": [asdict(c) for c in census]}, f, indent=1)


if __name__ == "__main__":
    main()
