"""The oracle on the CPU targets of docs/oracle.md: torch SDPA's math backend (BF16 and float32)
and dmref's emulated recipes, exact-mode at BF16 bounds and as claims of Delta-Matching.

    python benchmarks/cpu_oracle.py --out DIR [--cases quick|standard]

Writes DIR/cpu_oracle.json (every report) and prints the tables.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _oracle_runs import Target, run  # noqa: E402

from dmref import oracle  # noqa: E402

RECIPES = ["exact", "bf16", "naive_fp8", "cudnn_fp8", "mxfp8_stale", "delta_matching", "consistent_p"]


def targets(cases) -> list[Target]:
    out = [
        Target("sdpa_math bf16", oracle.sdpa_math, cases=cases),
        Target("sdpa_math fp32", oracle.sdpa_math, cases=cases, dtype=torch.float32),
    ]
    for r in RECIPES:
        out.append(Target(f"emulated {r}", oracle.emulated(r), cases=cases,
                          note="exact attention at BF16 bounds"))
    for r in ("naive_fp8", "cudnn_fp8", "mxfp8_stale", "delta_matching", "consistent_p"):
        out.append(Target(f"emulated {r} claims delta_matching", oracle.emulated(r), recipe="delta_matching",
                          cases=cases, note="held to Delta-Matching's recipe"))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for cpu_oracle.json")
    ap.add_argument("--cases", default="standard", choices=("quick", "standard", "thorough"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    run(targets(args.cases), os.path.join(args.out, "cpu_oracle.json"), title=f"dmref oracle, CPU ({args.cases})",
        seed=args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
