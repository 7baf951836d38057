"""What the chained backward (``Recipe.bwd_chain``) costs in accuracy, on the CPU: dV, dK and dQ of
one attention head as the recipes ``kernels_folded_delta_matching`` (promoted) and
``kernels_folded_chained_delta_matching`` (chained) state them, through ``dmref.tiled``.

    python benchmarks/cpu_bwd_chain_accuracy.py            # writes benchmarks/results/cpu_bwd_chain_accuracy.json
    python benchmarks/cpu_bwd_chain_accuracy.py --cases 4096:full:channels --out -   # print only

Per case (N tokens, D = 128, causal or not; inputs as ``cpu_accuracy.py``: randn with every 16th
channel of q and k x4, rounded to BF16; ``tokens``: k and v also scaled per token by 2^U(-3, 3),
1% of tokens x16 more; ``dc``: q and k x0.1, so that each row's mass spreads over all keys, and
v = 1 + randn / 4, dO = 1 + randn / 4: channels whose sums over tokens have one sign, which the
tensor cores' truncation relative to a growing accumulator bites, ``cpu_pv_accuracy.py``), each recipe runs twice with the forward, S and dP in float32 (so that
both see the same P, dP and delta up to their own quantization points):

- with dV, dK and dQ (and the deferred dQ's kbar) under the recipe's own accumulation: the Hopper
  wgmma model, promoted to float32 per 64-wide tile (``promoted``) or one chain over the whole
  contraction (``chained``);
- with those matmuls ``exact`` (each tile's product in float64, rounded once to float32): the
  same codes summed without the tensor cores' truncation.

For dV, dK and dQ: ``rel_err`` (||X - X*|| / ||X*|| against float64 attention on the BF16 inputs),
``acc_err`` (against the ``exact`` run: the accumulation's own error) and ``acc_bias`` (the
component of that error along X itself, relative: a systematic shrink of the result is negative).
docs/kernels_speed.md cites the result.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import time

import torch

from dmref import get_recipe, tiled

RESULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "cpu_bwd_chain_accuracy.json")
CASES = ["4096:full:channels", "4096:causal:channels", "4096:causal:tokens", "4096:full:dc", "4096:causal:dc",
         "16384:full:channels"]
RECIPES = {"promoted": "kernels_folded_delta_matching", "chained": "kernels_folded_chained_delta_matching"}


def inputs(n, d, kind, seed=0):
    g = torch.Generator().manual_seed(seed)
    outlier = torch.ones(d)
    outlier[::16] = 4.0
    q = torch.randn(n, d, generator=g) * outlier
    k = torch.randn(n, d, generator=g) * outlier
    v = torch.randn(n, d, generator=g)
    do = torch.randn(n, d, generator=g)
    if kind == "tokens":
        for x in (k, v):
            x *= torch.exp2(torch.empty(n, 1).uniform_(-3, 3, generator=g))
            x[torch.randperm(n, generator=g)[: n // 100]] *= 16.0
    if kind == "dc":
        q, k, v, do = q * 0.1, k * 0.1, 1 + v / 4, 1 + do / 4
    return [t.bfloat16().float() for t in (q, k, v, do)]


def with_backward_model(recipe, model=None):
    """``recipe`` with the forward, S and dP in float32 and dV, dK, dQ under ``model`` (None: the
    recipe's own)."""
    acc = recipe.accumulation
    bwd = {m: getattr(acc, m) if model is None else model for m in ("dv", "dq", "dk")}
    return dataclasses.replace(recipe, accumulation=dataclasses.replace(
        acc, qk="fp32", pv="fp32", qk_bwd="fp32", dp="fp32", **bwd))


def errors(x, exact_codes, exact_attention):
    x, e = x.double(), exact_codes.double()
    return dict(rel_err=float((x - exact_attention).norm() / exact_attention.norm()),
                acc_err=float((x - e).norm() / e.norm()),
                acc_bias=float(((x - e) * e).sum() / (e * e).sum()))


def float64_gradients(q, k, v, do, causal, blk=1024):
    """dQ, dK, dV of float64 attention on the inputs, in query blocks of ``blk``."""
    n, d = q.shape
    tau = 1 / math.sqrt(d)
    mask = torch.ones(n, n, dtype=torch.bool).tril() if causal else None
    qd, kd, vd, dod = (t.double() for t in (q, k, v, do))
    ex = {name: torch.zeros(n, d, dtype=torch.float64) for name in ("dq", "dk", "dv")}
    for i0 in range(0, n, blk):
        s = qd[i0:i0 + blk] @ kd.T * tau
        if causal:
            s = s.masked_fill(~mask[i0:i0 + blk], -math.inf)
        p = torch.softmax(s, -1)
        dp = dod[i0:i0 + blk] @ vd.T
        ds = p * (dp - (dod[i0:i0 + blk] * (p @ vd)).sum(-1, keepdim=True))
        ex["dv"] += p.T @ dod[i0:i0 + blk]
        ex["dq"][i0:i0 + blk] = ds @ kd * tau
        ex["dk"] += ds.T @ qd[i0:i0 + blk] * tau
    return ex


def run(n, causal, kind, d=128):
    q, k, v, do = inputs(n, d, kind)
    ex = float64_gradients(q, k, v, do, causal)
    q4, k4, v4, do4 = (t[None, None] for t in (q, k, v, do))
    rows = {}
    for name, recipe_name in RECIPES.items():
        t0 = time.time()
        recipe = get_recipe(recipe_name)
        _, bwd = tiled.attention(q4, k4, v4, do4, recipe=with_backward_model(recipe), causal=causal)
        _, ref = tiled.attention(q4, k4, v4, do4, recipe=with_backward_model(recipe, "exact"), causal=causal)
        rows[name] = {g: errors(getattr(bwd, g)[0, 0], getattr(ref, g)[0, 0], ex[g]) for g in ("dv", "dk", "dq")}
        rows[name].update(recipe=recipe_name, seconds=round(time.time() - t0))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=CASES, help="N:full|causal:channels|tokens|dc (default: %(default)s)")
    ap.add_argument("--out", default=RESULT, help="result file, '-' to print only (default: %(default)s)")
    args = ap.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    out = dict(script="benchmarks/cpu_bwd_chain_accuracy.py", torch=torch.__version__, machine=platform.machine(),
               head_dim=128, rows=[])
    for case in args.cases:
        n, mode, kind = case.split(":")
        t0 = time.time()
        row = dict(n=int(n), causal=mode == "causal", inputs=kind, **run(int(n), mode == "causal", kind))
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
