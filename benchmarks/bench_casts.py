"""Cast throughput on this machine's CPU, in one run: dmref encode/decode against torch's native
cast and ml_dtypes astype, for 2**24 float32 values of a wide exponent range.

    python benchmarks/bench_casts.py [--out FILE]    # default: benchmarks/results/cpu_casts.json

Each timing is the median of --repeats runs (after one warm-up). Goals: nearest-even encode at
least 1.0x torch's cast; every other rounding mode at least 2x ml_dtypes astype. docs/casts.md
("Speed") cites the result file.
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import time

import ml_dtypes
import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from dmref.emulation import decode, encode

N = 1 << 24


def _median_seconds(fns, repeats):
    """Median time of each function; the functions take turns, so load from elsewhere on the
    machine falls on all of them alike."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for i in range(repeats):
        order = list(zip(fns, times))
        for fn, t in (order if i % 2 == 0 else order[::-1]):  # alternate who goes first
            t0 = time.perf_counter()
            fn()
            t.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "cpu_casts.json"), help="result file (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    # normal values spread over 2**-20 .. 2**20, with NaN/inf sprinkled in
    x = (rng.standard_normal(N) * np.exp2(rng.uniform(-20, 20, N))).astype(np.float32)
    x[rng.integers(0, N, 1000)] = np.nan
    x[rng.integers(0, N, 1000)] = np.inf
    xt = torch.from_numpy(x)
    rbits = rng.integers(0, 1 << 16, N).astype(np.uint16)
    rows = []

    def add(what, ours_fn, base_name, base_fn, goal):
        t_ours, t_base = _median_seconds([ours_fn, base_fn], args.repeats)
        rows.append({
            "what": what, "dmref_gval_s": N / t_ours / 1e9, "baseline": base_name,
            "baseline_gval_s": N / t_base / 1e9, "ratio": t_base / t_ours, "goal_ratio": goal,
        })

    for name, sat in (("float8_e4m3fn", True), ("float8_e5m2", False)):
        tdt = getattr(torch, name)
        add(f"encode {name} nearest_even saturate={sat} (torch tensor)",
            lambda: encode(xt, name, saturate=sat), "torch .to()", lambda: xt.to(tdt), 1.0)
        add(f"encode {name} nearest_even saturate={sat} (numpy array)",
            lambda: encode(x, name, saturate=sat), "torch .to()", lambda: xt.to(tdt), 1.0)
    with np.errstate(invalid="ignore", over="ignore"):
        for name in ("float8_e4m3fn", "float8_e5m2"):
            mdt = getattr(ml_dtypes, name)
            base = lambda: x.astype(mdt)  # noqa: E731
            add(f"encode {name} nearest_even saturate=False (ml_dtypes semantics)",
                lambda: encode(x, name, saturate=False), "ml_dtypes astype", base, 2.0)
            for mode in ("toward_zero", "toward_positive", "toward_negative"):
                add(f"encode {name} {mode}", lambda: encode(x, name, rounding=mode),
                    "ml_dtypes astype", base, 2.0)
            add(f"encode {name} stochastic (16 random bits)",
                lambda: encode(x, name, rounding="stochastic", rbits=rbits), "ml_dtypes astype", base, 2.0)
        codes = encode(x, "float8_e4m3fn")
        codes_t = torch.from_numpy(codes)
        add("decode float8_e4m3fn (numpy)", lambda: decode(codes, "float8_e4m3fn"),
            "ml_dtypes astype(float32)", lambda: codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32), None)
        add("decode float8_e4m3fn (torch)", lambda: decode(codes_t, "float8_e4m3fn"),
            "torch .float()", lambda: codes_t.view(torch.float8_e4m3fn).float(), None)

    table = Table(title=f"casts of 2**24 float32 values, {os.cpu_count()} CPU cores, torch {torch.__version__}")
    for col in ("what", "dmref Gval/s", "baseline", "baseline Gval/s", "ratio", "goal"):
        table.add_column(col)
    for r in rows:
        goal = "" if r["goal_ratio"] is None else f">= {r['goal_ratio']}x"
        ok = r["goal_ratio"] is None or r["ratio"] >= r["goal_ratio"]
        table.add_row(r["what"], f"{r['dmref_gval_s']:.3f}", r["baseline"], f"{r['baseline_gval_s']:.3f}",
                      f"[{'green' if ok else 'red'}]{r['ratio']:.2f}x[/]", goal)
    Console(width=160).print(table)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"date": datetime.date.today().isoformat(), "device": "cpu",
                       "cpu_count": os.cpu_count(), "machine": platform.machine(),
                       "torch": torch.__version__, "ml_dtypes": ml_dtypes.__version__,
                       "n_values": N, "repeats": args.repeats, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
