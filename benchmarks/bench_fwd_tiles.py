"""Forward tilings against cuDNN BF16 SDPA, forward only, in one process on the GPU.

    python benchmarks/bench_fwd_tiles.py --out DIR

For every shape of bench_attention.SHAPES and causal or not: cuDNN's forward and our forward
kernel (pre-quantized operands) under each tiling of ``CANDIDATES``; ``do_bench`` medians;
writes DIR/bench_fwd_tiles.json. Used to choose ``FwdTiles``: stages, TMA loads and register
caps (results: ``..._bench_fwd_tiles.json`` for the second session's candidates, among them
64-key tiles, which change the recipe; ``..._bench_fwd_tiles_maxnreg.json`` for these).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attention import SHAPES, _bench, _flops, forward_baseline  # noqa: E402

CANDIDATES = [  # FwdTiles(block_m, block_n, num_warps, num_stages, tma, maxnreg)
    (64, 128, 4, 3, True), (64, 128, 4, 2, True),
    (64, 128, 4, 2, True, 168), (64, 128, 4, 2, True, 160), (64, 128, 4, 2, True, 128),
    (64, 128, 4, 3, True, 168),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from dmref.kernels import fwd as fwd_mod
    from dmref.kernels.config import RECIPES, FwdTiles

    rows = []
    for b, h, n, d in SHAPES:
        for causal in (False, True):
            t_cudnn, saved = forward_baseline(b, h, n, d, causal)
            scale = 1 / math.sqrt(d)
            row = {"shape": [b, h, n, d], "causal": causal, "cudnn_ms": t_cudnn, "ours_ms": {}, "speedup": {}}
            for c in CANDIDATES:
                r = RECIPES["delta_matching"].with_tiles(fwd=FwdTiles(*c))
                try:
                    t = _bench(lambda: fwd_mod.forward(saved.q, saved.k, saved.v, batch=b, heads=h, kv_heads=h, n=n,
                                                       head_dim=d, causal=causal, scale=scale, recipe=r))
                    row["ours_ms"][str(c)] = t
                    row["speedup"][str(c)] = t_cudnn / t
                except Exception as exc:  # noqa: BLE001
                    row["ours_ms"][str(c)] = f"{type(exc).__name__}: {exc}"[:200]
            row["tflops_cudnn"] = _flops(b, h, n, d, causal) / t_cudnn * 1e-9
            rows.append(row)
            best = max(row["speedup"].items(), key=lambda kv: kv[1]) if row["speedup"] else None
            print(json.dumps({"shape": row["shape"], "causal": causal, "best": best,
                              "speedup": {k2: round(v2, 3) for k2, v2 in row["speedup"].items()}}), flush=True)
    meta = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "method": "triton.testing.do_bench medians, warmup 25 ms, rep 100 ms"}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_fwd_tiles.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
