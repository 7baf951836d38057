"""Errors of the emulated recipes against float64 attention, on the CPU, on the inputs of
``bench_attention.py --accuracy`` (same shapes and distribution; a CPU random draw).

    python benchmarks/cpu_accuracy.py [--out DIR] [--heads 8]   # writes benchmarks/results/cpu_accuracy.json

For (1, H, 2048, 128) causal and (1, H, 2048, 64) not causal, q, k, v, dO ~ randn with every 16th
channel of q and k x4, rounded to BF16, and for (1, H, 2048, 128) causal the same with K and V
scaled per token (log-uniform over 2^-3 .. 2^3, 1% of tokens 16x more: what per-head scales
cannot follow): the relative errors ||X - X*|| / ||X*|| of O, dQ, dK, dV
under ``dmref.tiled`` for the presets bf16, naive_fp8, cudnn_fp8, delta_matching and the recipes
the kernels run (``KernelSpec.reference_recipe``, float32 accumulation). The GPU numbers of
the kernels and cuDNN (bench_attention ``--accuracy``) were measured on a CUDA draw of the same
distribution: normwise errors over 8 x 2048 x D elements differ between draws far less than
between recipes. Writes DIR/cpu_accuracy.json; docs/kernels_speed.md ("Accuracy") cites it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                    help="directory for cpu_accuracy.json (default: %(default)s)")
    ap.add_argument("--heads", type=int, default=8)
    args = ap.parse_args()
    from dmref import reference, tiled
    from dmref.recipes import KERNEL_RECIPES

    rows = []
    problems = [((1, 2048, 128), True, "channels"), ((1, 2048, 64), False, "channels"),
                ((1, 2048, 128), True, "tokens")]
    for (b, n, d), causal, kind in problems:
        h = args.heads
        g = torch.Generator().manual_seed(0)
        outlier = torch.ones(d)
        outlier[::16] = 4.0
        q = torch.randn(b, h, n, d, generator=g) * outlier
        k = torch.randn(b, h, n, d, generator=g) * outlier
        v = torch.randn(b, h, n, d, generator=g)
        do = torch.randn(b, h, n, d, generator=g)
        inputs = "randn (CPU draw, seed 0), every 16th channel of q and k x4"
        if kind == "tokens":
            # magnitudes that vary by token, which a per-head (folded) scale of K and V cannot follow
            # and a per-token one can: log-uniform over 2^-3 .. 2^3, and 1% of tokens 16x more
            for x in (k, v):
                x *= torch.exp2(torch.empty(b, h, n, 1).uniform_(-3, 3, generator=g))
                x[:, :, torch.randperm(n, generator=g)[: n // 100]] *= 16.0
            inputs += "; k and v scaled per token by 2^U(-3, 3), 1% of tokens x16 more"
        q, k, v, do = (t.bfloat16() for t in (q, k, v, do))
        _, _, dq, dk, dv = reference.attention_ref(*(t.double() for t in (q, k, v, do)), causal=causal)
        out = reference.attention_forward(*(t.double() for t in (q, k, v)), causal=causal)[0]
        ref = dict(o=out, dq=dq, dk=dk, dv=dv)
        row = dict(shape=[b, h, n, d], causal=causal, inputs=inputs)
        recipes = {name: name for name in ("bf16", "naive_fp8", "cudnn_fp8", "delta_matching")}
        for name, kr in KERNEL_RECIPES.items():
            recipes[f"{name} (declared, fp32 accumulation)"] = kr.with_accumulation("fp32")
        for label, recipe in recipes.items():
            t0 = time.perf_counter()
            fwd, bwd = tiled.attention(*(t.float() for t in (q, k, v, do)), recipe=recipe, causal=causal)
            got = dict(o=fwd.out, dq=bwd.dq, dk=bwd.dk, dv=bwd.dv)
            row[label] = {x: ((got[x].double() - ref[x]).norm() / ref[x].norm()).item() for x in ref}
            row[label]["seconds"] = round(time.perf_counter() - t0, 1)
            print(json.dumps({"shape": row["shape"], "causal": causal, label: row[label]}), flush=True)
        rows.append(row)
    meta = {"date": datetime.date.today().isoformat(), "machine": platform.machine(), "torch": torch.__version__,
            "metric": "||X - X*|| / ||X*||, X* float64 attention of the BF16 inputs"}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "cpu_accuracy.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
