"""What the forward's PV accumulation on the tensor cores costs in accuracy, on the CPU: the folded
recipe (``kernels_folded_naive_fp8``, the Hopper wgmma model) with PV chained over all keys (its
``pv_chain=True``) or promoted to float32 per 128-key tile (the recipe's), through ``dmref.tiled``,
against float64 attention.

    python dev/cpu_pv_accuracy.py            # writes dev/results/cpu_pv_accuracy.json
    python dev/cpu_pv_accuracy.py --cases 4096:dc --out -   # print only

One head, D = 64, not causal; per case N tokens and an input kind, rounded to BF16:

- ``channels``: randn with every 16th channel of q and k x4 (``cpu_accuracy.py``'s inputs);
- ``diffuse``: q, k x0.1 of that: logits near zero, each row's mass over all keys; v randn;
- ``dc``: as ``diffuse`` with v = 1 + randn / 4: every channel of V has a mean of one sign (an
  average of many values is what attention computes; the tensor cores' truncation is relative
  to the accumulator, which then grows with every key).

Per variant (``chained``, ``promoted``): ``o_err`` (||O - O*|| / ||O*||) and ``o_bias`` (the
component of O - O* along O*, relative: a systematic shrink of O is negative). The Hopper model
truncates each k-step's terms to 2^(E-13) with E the exponent of the largest of them and the
accumulator (docs/gemm.md): a chain over all keys whose accumulator outgrows its products loses
them. docs/kernels_speed.md cites the result.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time

import torch

from dmref import get_recipe, tiled

RESULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "cpu_pv_accuracy.json")
CASES = ["1024:channels", "4096:channels", "1024:diffuse", "4096:diffuse", "1024:dc", "4096:dc"]
VARIANTS = {"chained": True, "promoted": False}  # pv_chain; the folded recipes promote


def inputs(n, kind, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    outlier = torch.ones(d)
    outlier[::16] = 4.0
    small = 0.1 if kind in ("diffuse", "dc") else 1.0
    q = torch.randn(1, 1, n, d, generator=g) * outlier * small
    k = torch.randn(1, 1, n, d, generator=g) * outlier * small
    v = torch.randn(1, 1, n, d, generator=g)
    if kind == "dc":
        v = 1 + v / 4
    return [t.bfloat16().float() for t in (q, k, v)]


def run(n, kind):
    q, k, v = inputs(n, kind)
    exact = tiled.forward(q.double(), k.double(), v.double(), recipe="exact").out
    base = get_recipe("kernels_folded_naive_fp8")
    row = {}
    for name, chain in VARIANTS.items():
        out = tiled.forward(q, k, v, recipe=dataclasses.replace(base, pv_chain=chain)).out.double()
        row[name] = dict(o_err=float((out - exact).norm() / exact.norm()),
                         o_bias=float(((out - exact) * exact).sum() / (exact * exact).sum()))
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=CASES, help="N:channels|diffuse|dc (default: %(default)s)")
    ap.add_argument("--out", default=RESULT, help="result file, '-' to print only (default: %(default)s)")
    args = ap.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    out = dict(script="dev/cpu_pv_accuracy.py", torch=torch.__version__, machine=platform.machine(),
               recipe="kernels_folded_naive_fp8", head_dim=64, rows=[])
    for case in args.cases:
        n, kind = case.split(":")
        t0 = time.time()
        row = dict(n=int(n), inputs=kind, **run(int(n), kind))
        row["seconds"] = round(time.time() - t0)
        print(json.dumps(row), flush=True)
        out["rows"].append(row)
        if args.out != "-":
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)
                f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
