"""Which rounding of dS = P (dP - D) attn_scale reproduces cuDNN's FP8 backward where P is one-hot
(docs/cudnn_fp8.md, "dS in one-hot rows"): every variant on one case of a capture, on the CPU.

    python dev/replay_dp_minus_d.py [--capture tests/data/h200_cudnn_fp8_sdpa_heldout.npz]
        [--case 1] [--out dev/results/cpu_replay_dp_minus_d.json]

The replay (dmref.cudnn.replay, ``dp_fma``) forms dP - D as one fused multiply-add of the
dO V accumulator; the variants round dP first, sum D in other float32 orders (sequential,
pairwise, butterfly, lanes over strided parts then a butterfly; from the codes then the
descales, or from dequantized operands), multiply the scalars in other orders, or expand
P (dP - D) as fma(P, dP, -P D). For each: how many dS codes change (dK's operand and dQ's), and
how many dQ and dK codes then differ from cuDNN's and by how many steps at most. Only the rows of
dQ and the keys of dK whose dS codes changed are recomputed; the rest are the replay's. Writes
the JSON and prints one line per variant.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

from dmref.cudnn import replay as ar
from dmref import emulation

F32 = np.float32
E4M3 = emulation.get_format("float8_e4m3fn")


def _seq(x):
    acc = np.zeros(x.shape[:-1], F32)
    for t in range(x.shape[-1]):
        acc = (acc + x[..., t]).astype(F32)
    return acc


def _pairwise(x):  # neighbours first: (0+1) + (2+3) ...
    while x.shape[-1] > 1:
        x = (x[..., 0::2] + x[..., 1::2]).astype(F32)
    return x[..., 0]


def _butterfly(x):  # lane l + lane l + n/2 first, as a warp shuffle-xor reduction
    while x.shape[-1] > 1:
        n = x.shape[-1] // 2
        x = (x[..., :n] + x[..., n:]).astype(F32)
    return x[..., 0]


def _lanes(n):
    def reduce(x):  # lane l sums elements l, l + n, ... in order, then a butterfly over the lanes
        return _butterfly(np.stack([_seq(x[..., lane::n]) for lane in range(n)], -1))
    return reduce


REDUCTIONS = {"sequential": _seq, "pairwise": _pairwise, "butterfly": _butterfly,
              **{f"{n} lanes": _lanes(n) for n in (4, 8, 16, 32)}}


def _inputs(case):
    """The replay's backward operands up to dS (dmref.cudnn.replay._backward)."""
    gf = emulation.get_format(ar._GRAD_FORMATS[case["grad_format"]])
    heads = case["q_fp8"].shape[1]
    p = ar.backward_p(case)
    acc = ar._mm(case["do_fp8"], ar._expand(case["v_fp8"], heads), gf, E4M3, "hopper")
    do, o = ar._decode(case["do_fp8"], gf).astype(F32), ar._decode(case["o_fp8"], E4M3).astype(F32)
    return gf, p, acc, do, o


def variants(case, p, acc, do, o):
    """name -> y = P (dP - D) attn_scale scale_dP (float32), the quantity both dS casts take; the
    replay's is ``fl(fl(P attn_scale) fl((dP - D) scale_dP))``."""
    sdo, so, sv = case["descale_dO"], case["descale_o"], case["descale_v"]
    attn, sdp = F32(case["attn_scale"]), case["scale_dP"]
    s_dp = sdo * sv
    exact = (do.astype(np.float64) * o).sum(-1).astype(F32)
    d_replay = ((exact * sdo).astype(F32) * so).astype(F32)

    def y(dp_minus_d, pm=p):
        return ((pm * attn).astype(F32) * (dp_minus_d * sdp).astype(F32)).astype(F32)

    def fused(d):
        return ar.fma32(acc, s_dp, -d[..., None])

    def rounded(d):
        return ((acc * s_dp).astype(F32) - d[..., None]).astype(F32)

    out = {"replay: fma(acc, descale, -D)": y(fused(d_replay)),
           "dP rounded, then - D": y(rounded(d_replay)),
           "fma; fl(attn_scale scale_dP) first": (p * fused(d_replay)).astype(F32) * (attn * sdp),
           "fma; scalars in sequence": ((p * fused(d_replay)).astype(F32) * attn).astype(F32) * sdp,
           "fma; P attn_scale first": ((p * attn).astype(F32) * fused(d_replay)).astype(F32) * sdp}
    dp = (acc * s_dp).astype(F32)
    pd = (p * d_replay[..., None]).astype(F32)
    out["fma(P, dP, -P D)"] = ((ar.fma32(p, dp, -pd) * attn).astype(F32) * sdp).astype(F32)
    for rname, reduce in REDUCTIONS.items():
        d_codes = ((reduce((do * o).astype(F32)) * sdo).astype(F32) * so).astype(F32)
        d_deq = reduce(((do * sdo).astype(F32) * (o * so).astype(F32)).astype(F32))
        for dname, d in (("codes", d_codes), ("dequantized", d_deq)):
            out[f"D {rname} ({dname}), fma"] = y(fused(d))
            out[f"D {rname} ({dname}), dP rounded"] = y(rounded(d))
    return out


def _ds_codes(y, gf):
    y16 = torch.from_numpy(y).to(torch.float16).to(torch.float32).numpy()
    return ar._encode(y, gf), ar._encode(y16, gf)


def evaluate(case, base, gf, y, ds_base) -> dict:
    """dQ and dK with dS from ``y``, recomputed where dS's codes differ from ``ds_base``."""
    dsk, dsq = _ds_codes(y, gf)
    dq, dk = base["dq"].copy(), base["dk"].copy()
    b, heads, _, _ = case["q_fp8"].shape
    kv_heads = case["k_fp8"].shape[1]
    group = heads // kv_heads
    for bi in range(b):
        for h in range(heads):
            k = case["k_fp8"][bi, h // group]
            for i in np.nonzero((dsq[bi, h] != ds_base[1][bi, h]).any(-1))[0]:
                part = None
                for j0 in range(0, k.shape[0], ar._DQ_KEY_BLOCK):
                    mm = ar._mm(dsq[bi, h, i][None, j0:j0 + ar._DQ_KEY_BLOCK],
                                ar._t(k[j0:j0 + ar._DQ_KEY_BLOCK]), gf, E4M3, "hopper")
                    part = mm if part is None else (part + mm).astype(F32)
                dq[bi, h, i] = ar._encode((part * (case["descale_dP"] * case["descale_k"])).astype(F32)
                                          * case["scale_dQ"], gf)[0]
        for kh in range(kv_heads):
            hs = range(kh * group, (kh + 1) * group)
            keys = np.nonzero(np.any([(dsk[bi, h] != ds_base[0][bi, h]).any(0) for h in hs], axis=0))[0]
            if len(keys):
                total = None
                for h in hs:
                    mm = ar._mm(ar._t(dsk[bi, h][:, keys]), ar._t(case["q_fp8"][bi, h]), gf, E4M3, "hopper") \
                        * (case["descale_dP"] * case["descale_q"])
                    total = mm if total is None else (total + mm).astype(F32)
                dk[bi, kh, keys] = ar._encode(total * case["scale_dK"], gf)
    row = {"ds_codes_changed": int((dsk != ds_base[0]).sum() + (dsq != ds_base[1]).sum())}
    for t, arr in (("dq", dq), ("dk", dk)):
        steps = ar.code_steps(arr, case[f"{t}_fp8"], gf)
        row[f"{t}_codes_off"] = int((steps > 0).sum())
        row[f"{t}_beyond_one_step"] = int((steps > ar.MAX_STEPS).sum())
        row[f"{t}_max_steps"] = int(steps.max())
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--capture", default="tests/data/h200_cudnn_fp8_sdpa_heldout.npz")
    ap.add_argument("--case", type=int, default=1)
    ap.add_argument("--out", default="dev/results/cpu_replay_dp_minus_d.json")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    case = ar.load_capture(args.capture)[args.case]
    base = ar.replay_case(case)
    gf, p, acc, do, o = _inputs(case)
    ys = variants(case, p, acc, do, o)
    ds_base = _ds_codes(ys["replay: fma(acc, descale, -D)"], gf)
    rows = {}
    for name, y in ys.items():
        rows[name] = evaluate(case, base, gf, y, ds_base)
        r = rows[name]
        print(f"{name:42s} dS codes changed {r['ds_codes_changed']:6d}   dQ off {r['dq_codes_off']:5d} "
              f"(>1 step {r['dq_beyond_one_step']}, max {r['dq_max_steps']})   dK off {r['dk_codes_off']:3d} "
              f"(>1 step {r['dk_beyond_one_step']}, max {r['dk_max_steps']})", flush=True)
    result = {"capture": args.capture, "case": args.case, "grad_format": case["grad_format"],
              "shape": list(case["q_fp8"].shape), "keys": int(case["k_fp8"].shape[2]),
              "seconds": time.perf_counter() - t0, "variants": rows}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
