"""Which delta for a five-GEMM FP8 backward: each candidate's row-sum residual against the
Delta-Matching float32 bound, and its dQ, dK, dV errors against float64, on the CPU.

    python benchmarks/cpu_delta_study.py                       # the table of docs/delta_study.md
    python benchmarks/cpu_delta_study.py --part hopper --out A.json   # one part (parts run in parallel)
    python benchmarks/cpu_delta_study.py --merge A.json B.json --train T.json --out RESULT.json
    python benchmarks/cpu_delta_study.py --part dsq --hopper-seqlens 2048 4096 --out C.json   # dS for dQ, below

The problem is the demo's (:func:`dmref.problems.make_problem`: outlier channels, an attention sink,
peaked rows, log-normal gradient scales), causal, with grouped-query heads. Every candidate runs
through :func:`dmref.diagnostics.evaluate` (:mod:`dmref.tiled`) against a float64 reference computed
here in blocks of query rows (the reference's N x N float64 matrices do not fit in memory at 16k
keys). Two accumulation models: ``fp32`` (every matmul a float32 matmul of the quantized operands)
at every length, and the recipes as Hopper's FP8 tensor cores accumulate (the bit-exact wgmma
model of :mod:`dmref.emulation.gemm`, ``hopper``) at the lengths of ``--hopper-seqlens``, where it
is affordable on a CPU.

Part ``dsq``: ``kernels_folded_delta_prepass`` beside ``kernels_folded_delta_prepass_dsq_row`` (dS for
dQ scaled per query over all keys from the pre-pass's bound, ``Recipe.ds_dq_bound``), under both
models, with dQ's error per query row (:func:`dq_row_errors`) besides the normwise one.

``rowsum_over_bound_max`` is max_i |r_i| / B_i with r_i = sum_j dS_ij (dS as the backward forms it,
before its FP8 cast) and B_i :func:`dmref.diagnostics.matched_rowsum_bound`, the bound Delta-Matching
meets in float32 (Theorem 3 of dmref/proofs/rounding_bounds.md). ``--train``: the ``final`` section of
``examples/train_transformers.py``'s JSON is copied in.
Writes benchmarks/results/cpu_delta_study.json (``--out``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

from dmref import diagnostics
from dmref.problems import make_problem
from dmref.recipes import get_recipe, with_prepass_delta

#: GEMMs of each candidate's backward in FA3's structure (one CTA per key block), and what it adds
#: to the forward. "delta_matching" is the seven-GEMM schedule: a pre-pass of QKᵀ and dO Vᵀ that
#: forms D = sum_j P_ij dP_ij with the very wgmma chains of the main pass, then five GEMMs.
CANDIDATES = {
    "naive_fp8": dict(gemms=5, delta="stale: D = dO_bf16 . O_bf16 (FlashAttention-2/3 preprocess)"),
    "mxfp8_stale": dict(gemms=5, delta="stale, MX-32 blocks (cuDNN MXFP8)"),
    "cudnn_fp8": dict(gemms=5, delta="stale, per-tensor FP8 dO and O (cuDNN FP8)"),
    "kernels_naive_fp8": dict(gemms=5, delta="stale, the kernels' quantization"),
    "stale_fp32_o": dict(gemms=5, delta="(b) D = dO^ . O_fp32, dS with the float32 P"),
    "consistent_p": dict(gemms=5, delta="(a) consistent P, fixed 2^8 P grid, D = dO^ . O_fp32"),
    "consistent_p_tile": dict(gemms=5, delta="(a') consistent P, P scaled per row and 128-key tile"),
    "consistent_p_fp32_pv_dp": dict(gemms=5, delta="(b') consistent_p_tile, PV and dP on BF16 tensor cores"),
    "delta_matching": dict(gemms=7, delta="(c) matched, D from a pre-pass of QKᵀ and dO Vᵀ"),
    "kernels_delta_prepass": dict(gemms=7, delta="(c) matched, pre-pass, the kernels' quantization: the choice"),
    "kernels_delta_matching": dict(gemms=8, delta="matched, deferred dQ (today's kernels)"),
    "kernels_folded_delta_prepass": dict(gemms=7, delta="(c) matched, pre-pass, the folded kernels' quantization"),
    "kernels_folded_delta_prepass_dsq_row": dict(
        gemms=7, delta="(c) as kernels_folded_delta_prepass, dS for dQ per query from the pre-pass's bound, K for dQ "
                       "per head (a one-pass kernel adds dQ's partials unscaled)"),
}

#: (recipe, accumulation) pairs of each part; "recipe" is run as it is ("as is": the kernels'
#: recipes and consistent_p_fp32_pv_dp state their own Hopper models), "fp32" as the preset.
PARTS = {
    "fp32": [(r, "fp32") for r in ("naive_fp8", "mxfp8_stale", "cudnn_fp8", "stale_fp32_o", "consistent_p",
                                   "consistent_p_tile", "delta_matching")],
    "hopper": [("kernels_delta_prepass", "as is"), ("consistent_p_tile", "hopper"), ("consistent_p_fp32_pv_dp", "as is"),
               ("kernels_naive_fp8", "as is"), ("kernels_delta_matching", "as is")],
    # dS for dQ with a scale known before the pass, beside the recipe it refines, both models
    "dsq": [("kernels_folded_delta_prepass", "fp32"), ("kernels_folded_delta_prepass_dsq_row", "fp32"),
            ("kernels_folded_delta_prepass", "as is"), ("kernels_folded_delta_prepass_dsq_row", "as is")],
}
#: the recipes the longer fp32 lengths run (the others are ruled out at the shortest), and at the longest
LONG_FP32 = ("naive_fp8", "cudnn_fp8", "consistent_p", "consistent_p_tile", "delta_matching")
LONGEST_FP32 = ("naive_fp8", "consistent_p_tile", "delta_matching")


def recipe_for(name: str, accumulation: str):
    """The Recipe of one row: kernels_delta_prepass is kernels_delta_matching with its D from a
    pre-pass (MATCHED, no deferred dQ); "hopper" runs a preset with every matmul under the wgmma model."""
    if name == "kernels_delta_prepass":
        return with_prepass_delta(get_recipe("kernels_delta_matching"), name)
    if accumulation == "hopper" or (accumulation == "fp32" and name.startswith("kernels_")):
        return get_recipe(f"{name}@{accumulation}")  # the kernels' recipes state Hopper's model
    return get_recipe(name)


def exact_chunked(q, k, v, dout, *, causal: bool, rows: int = 512) -> diagnostics.Exact:
    """:func:`dmref.diagnostics.exact_results` computed in float64 one block of ``rows`` query
    rows at a time (rows are independent; dK and dV are summed over the blocks). Same equations
    as :func:`dmref.reference.attention_ref`, the softmax's LSE form; Nq == Nk for ``causal``."""
    b, h, n_q, d = q.shape
    g = h // k.shape[1]
    scale = 1.0 / math.sqrt(d)
    q64, do64 = q.double(), dout.double()
    k64, v64 = (t.double().repeat_interleave(g, dim=1) for t in (k, v))
    out = torch.empty(b, h, n_q, v.shape[-1], dtype=torch.float64)
    lse = torch.empty(b, h, n_q, dtype=torch.float64)
    dq, kbar = torch.empty_like(q64), torch.empty_like(q64)
    dk, dv = torch.zeros_like(k64), torch.zeros_like(v64)
    cols = torch.arange(k.shape[2])
    for i0 in range(0, n_q, rows):
        i1 = min(i0 + rows, n_q)
        s = scale * q64[..., i0:i1, :] @ k64.transpose(-1, -2)
        if causal:
            s = s.masked_fill(cols[None, :] > torch.arange(i0, i1)[:, None], -math.inf)
        lse_b = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse_b[..., None])
        o = p @ v64
        dp = do64[..., i0:i1, :] @ v64.transpose(-1, -2)
        ds = p * (dp - (do64[..., i0:i1, :] * o).sum(-1, keepdim=True))
        out[..., i0:i1, :], lse[..., i0:i1] = o, lse_b
        dq[..., i0:i1, :] = scale * ds @ k64
        kbar[..., i0:i1, :] = p @ k64
        dk += scale * ds.transpose(-1, -2) @ q64[..., i0:i1, :]
        dv += p.transpose(-1, -2) @ do64[..., i0:i1, :]
    dk, dv = (t.reshape(b, h // g, g, *t.shape[2:]).sum(2) for t in (dk, dv))
    return diagnostics.Exact(out, lse, dq, dk, dv, kbar,
                             diagnostics.problem_fingerprint(q, k, v, dout, causal=causal))


def dq_row_errors(q, k, v, do, recipe, exact, before=None) -> tuple[dict, torch.Tensor]:
    """Per query row, dQ's relative error against float64, ||dQ_i - dQ*_i|| / ||dQ*_i|| (rows with
    dQ* = 0 left out): its quantiles and maximum; and, given ``before``, the same rows' errors of
    the recipe this one refines (on the same problem), the ratio of the two row by row:
    its quantiles, maximum, and the size of dQ*_i where it is largest against the median row's. A
    dS-for-dQ scale from a bound of the row's amax loses precision where the bound is loose, on
    rows whose dS is small against max_j P|dP| (peaked rows), which normwise errors do not show.
    Returns the statistics and the per-row errors."""
    from dmref import tiled

    _, bwd = tiled.attention(q, k, v, do, recipe=recipe, causal=True)
    ref = exact.dq.norm(dim=-1).flatten()
    live = ref > 0
    err = ((bwd.dq.double() - exact.dq).norm(dim=-1).flatten() / ref)[live]
    at = torch.tensor([0.5, 0.99, 0.999], dtype=torch.float64)
    out = {"dq_row_rel_err_quantiles": dict(zip(("p50", "p99", "p999"), torch.quantile(err, at).tolist())),
           "dq_row_rel_err_max": err.max().item()}
    if before is not None:
        ratio = err / before.clamp_min(torch.finfo(torch.float64).tiny)
        worst = ratio.argmax()
        out.update({"dq_row_err_ratio_quantiles": dict(zip(("p50", "p99", "p999"), torch.quantile(ratio, at).tolist())),
                    "dq_row_err_ratio_max": ratio.max().item(),
                    "dq_row_norm_at_ratio_max_over_median": (ref[live][worst] / ref[live].median()).item()})
    return out, err


def run_part(part: str, seqlens, args, rows: list, save) -> list[dict]:
    """Run one part's rows at ``seqlens``, appending to ``rows`` and calling ``save()`` after each."""
    for n in seqlens:
        q, k, v, do = make_problem(1, args.heads, n, args.head_dim, kv_heads=args.kv_heads, seed=args.seed)
        if args.do_row_exponent:  # per-token gradient magnitudes: dO's rows times 2^U(-E, E), integer E
            g = torch.Generator().manual_seed(args.seed)
            e = args.do_row_exponent
            do = do * torch.exp2(torch.randint(-e, e + 1, (*do.shape[:-1], 1), generator=g).to(do.dtype))
        t0 = time.perf_counter()
        exact = exact_chunked(q, k, v, do, causal=True)
        print(f"N={n}: float64 reference in {time.perf_counter() - t0:.0f} s", flush=True)
        row_errors = {}  # dsq: the first recipe's per-row dQ errors under each model, for the next
        for name, acc in PARTS[part]:
            if part == "dsq" and acc != "fp32" and n > max(args.hopper_seqlens):
                continue  # the wgmma model at the --hopper-seqlens only
            if part == "fp32" and n > min(args.seqlens) and name not in LONG_FP32:
                continue
            if part == "fp32" and len(args.seqlens) > 2 and n == max(args.seqlens) and name not in LONGEST_FP32:
                continue
            recipe = recipe_for(name, acc)
            t0 = time.perf_counter()
            report, rs = diagnostics.evaluate(q, k, v, do, recipe, causal=True, exact=exact)
            ratio = rs.residual.abs() / diagnostics.matched_rowsum_bound(rs)
            row = {**report.as_dict(), "recipe": name,
                   "accumulation": acc if acc != "as is" else "hopper (the recipe's own)",
                   "seqlen": n, "gemms": CANDIDATES[name]["gemms"], "delta": CANDIDATES[name]["delta"],
                   **({"do_row_exponent": args.do_row_exponent} if args.do_row_exponent else {}),
                   "rowsum_over_bound_median": ratio[torch.isfinite(ratio)].median().item(),
                   "seconds": time.perf_counter() - t0}
            if part == "dsq":
                stats, err = dq_row_errors(q, k, v, do, recipe, exact, row_errors.get(acc))
                row_errors.setdefault(acc, err)
                row.update(stats)
            rows.append(row)
            save()
            print(f"  {name:26s} {row['accumulation']:26s} r/B max {row['rowsum_over_bound_max']:9.3g} "
                  f"median {row['rowsum_over_bound_median']:9.3g}  dQ {row['dq_rel_err']:.4f} dK {row['dk_rel_err']:.4f} "
                  f"dV {row['dv_rel_err']:.4f}  along kbar {row['dq_bias_fraction']:.3f}  ({row['seconds']:.0f} s)",
                  flush=True)
    return rows


def markdown(result: dict) -> str:
    """The table of docs/delta_study.md from a result file."""
    lines = ["| candidate | GEMMs | accumulation | keys | max_i r_i/B_i | median r_i/B_i | dQ | dK | dV | dQ error along k̄ |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(result["rows"], key=lambda r: (r["accumulation"] != "fp32", r["seqlen"], r["gemms"])):
        keys = f"{r['seqlen']}" + (f", dO rows x 2^U(±{r['do_row_exponent']})" if r.get("do_row_exponent") else "")
        lines.append(f"| `{r['recipe']}` | {r['gemms']} | {r['accumulation']} | {keys} "
                     f"| {r['rowsum_over_bound_max']:.3g} | {r['rowsum_over_bound_median']:.3g} "
                     f"| {r['dq_rel_err']:.4f} | {r['dk_rel_err']:.4f} | {r['dv_rel_err']:.4f} "
                     f"| {r['dq_bias_fraction']:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("fp32", "hopper", "dsq", "all"), default="all")
    ap.add_argument("--seqlens", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--hopper-seqlens", type=int, nargs="+", default=[4096])
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--do-row-exponent", type=int, default=0,
                    help="multiply dO's rows by 2^U(-E, E), integer exponents (per-token gradient magnitudes)")
    ap.add_argument("--merge", nargs="+", help="combine the rows of these result files instead of running")
    ap.add_argument("--markdown", help="print the table of this result file and exit")
    ap.add_argument("--train", help="examples/train_transformers.py's JSON, its 'final' section copied in")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cpu_delta_study.json"))
    args = ap.parse_args(argv)
    if args.heads % args.kv_heads:
        print(f"cpu_delta_study.py: --heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}",
              file=sys.stderr)
        raise SystemExit(2)
    if args.markdown:
        print(markdown(json.load(open(args.markdown))))
        return
    torch.set_num_threads(1)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    def save():
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    if args.merge:
        docs = [json.load(open(p)) for p in args.merge]
        result = {**docs[0], "rows": [r for d in docs for r in d["rows"]],
                  "parts": sorted({p for d in docs for p in d["parts"]}),
                  "candidates": {k: v for d in docs for k, v in d.get("candidates", {}).items()}}
    else:
        parts = ("fp32", "hopper") if args.part == "all" else (args.part,)
        result = {"problem": dict(maker="dmref.problems.make_problem", batch=1, heads=args.heads, kv_heads=args.kv_heads,
                                  head_dim=args.head_dim, seed=args.seed, causal=True),
                  "candidates": CANDIDATES, "parts": list(parts), "torch": torch.__version__, "rows": []}
        for part in parts:
            lengths = {"fp32": args.seqlens, "hopper": args.hopper_seqlens,
                       "dsq": sorted(set(args.seqlens) | set(args.hopper_seqlens))}[part]
            run_part(part, lengths, args, result["rows"], save)
    if args.train:
        train = json.load(open(args.train))
        result["train_transformers"] = {"config": train["config"], "final": train["final"]}
    save()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
