"""The oracle on the CPU targets of docs/oracle.md: torch SDPA's math backend (BF16 and float32),
torch SDPA as the README's example calls it (BF16, the default CPU backend: torch's flash
attention kernel), the same with ``enable_gqa``, and dmref's emulated recipes, exact-mode at BF16
bounds and as claims of Delta-Matching.

    python benchmarks/cpu_oracle.py --out DIR [--cases quick|standard] [--case NAME ...] [--only TEXT --name NAME]

Writes DIR/cpu_oracle.json (every report; DIR/NAME.json with --name) and prints the tables.
``--only TEXT`` keeps the targets whose label contains TEXT; ``--case NAME`` (repeatable) runs only
those cases of the set.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from dmref import oracle

from oracle_runs import Target, run  # this folder's module (a script's folder is first on sys.path)

RECIPES = ["exact", "bf16", "naive_fp8", "cudnn_fp8", "mxfp8_stale", "delta_matching", "consistent_p"]


def sdpa_readme(q, k, v, *, causal, scale):
    """The README's example: a thin wrapper of torch's SDPA (no enable_gqa, no mask)."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def sdpa_gqa(q, k, v, *, causal, scale):
    """The same with ``enable_gqa`` when k, v have fewer heads than q."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                                            **oracle.gqa_kwargs(q, k))


def targets(cases) -> list[Target]:
    out = [
        Target("sdpa_math bf16", oracle.sdpa_math, cases=cases),
        Target("sdpa_math fp32", oracle.sdpa_math, cases=cases, dtype=torch.float32),
        Target("sdpa bf16 (README wrapper)", sdpa_readme, cases=cases,
               note="torch's CPU flash-attention kernel; GQA unsupported without enable_gqa"),
        Target("sdpa bf16 enable_gqa", sdpa_gqa, cases=cases, note="torch's CPU flash-attention kernel"),
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
    ap.add_argument("--case", action="append", default=None, metavar="NAME", help="only this case (repeatable)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default=None, metavar="TEXT", help="only the targets whose label contains TEXT")
    ap.add_argument("--name", default="cpu_oracle", help="the result file's name, without .json")
    args = ap.parse_args(argv)
    cases = args.cases
    if args.case is not None:  # case names of the standard set (oracle.check takes names of that set)
        if args.cases != "standard":
            print("--case takes names of the standard set (--cases standard)", file=sys.stderr)
            return 2
        oracle.make_cases("standard", names=args.case, probe=False)  # an unknown or repeated name: ValueError here
        cases = args.case
    chosen = [t for t in targets(cases) if args.only is None or args.only in t.label]
    if not chosen:
        print(f"--only {args.only!r} matches no target; labels: {', '.join(t.label for t in targets(args.cases))}",
              file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    run(chosen, os.path.join(args.out, f"{args.name}.json"), title=f"dmref oracle, CPU ({args.cases})",
        seed=args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
