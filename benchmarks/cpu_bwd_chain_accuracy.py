"""What the chained backward (``Recipe.bwd_chain``) costs in accuracy, on the CPU: dV, dK and dQ of
one attention head accumulated as the kernels do, under the bit-exact Hopper wgmma model.

    python benchmarks/cpu_bwd_chain_accuracy.py            # writes benchmarks/results/cpu_bwd_chain_accuracy.json
    python benchmarks/cpu_bwd_chain_accuracy.py --cases 4096:full:channels --out -   # print only

Per case (N tokens, D = 128, causal or not; inputs as ``cpu_accuracy.py``: randn with every 16th
channel of q and k x4, rounded to BF16; ``tokens``: k and v also scaled per token by 2^U(-3, 3),
1% of tokens x16 more), the same FP8 operands and the same float32 P, dP, matched D and dS for
both accumulations (Q and dO per token, K per head, V per token for dP: the folded recipes'):

- ``promoted`` (``kernels_*``): the transposed copies (dO for dV, Q for dK, K for dQ) with one
  scale per channel and 128 tokens, dS with one per row and 64-wide tile, each 64-wide tile's
  wgmma chain from zero, promoted to float32;
- ``chained`` (``kernels_chained_*``): the transposed copies with one scale per channel over all
  tokens, dS against each row's running scale, one wgmma chain over the whole contraction (the
  accumulator rescaled by exact powers of two when a row's scale drops).

For dV, dK and dQ: ``rel_err`` (||X - X*|| / ||X*|| against float64 attention on the BF16 inputs),
``acc_err`` (against the float64 sum of the very codes the matmul sees: the accumulation's own
error) and ``acc_bias`` (the component of that error along X itself, relative: a systematic
shrink of the result is negative). docs/kernels_speed.md cites the result.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time

import torch

RESULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "cpu_bwd_chain_accuracy.json")
CASES = ["4096:full:channels", "4096:causal:channels", "4096:causal:tokens", "16384:full:channels"]
TILE = 64  #: the kernels' tile along every backward contraction


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
    return [t.bfloat16().float() for t in (q, k, v, do)]


def pow2_down(amax):
    """The POW2_DOWN exponent k (codes = x * 2^k) of each amax; the emulation's rule."""
    from dmref.emulation.blocked import scales_from_amax

    return -torch.log2(scales_from_amax(amax, "float8_e4m3fn", "pow2_down").float())


def e4m3(x):
    return x.to(torch.float8_e4m3fn).float()


def quantize(x, dim, block=None):
    """x as E4M3 codes times a power of two per line along ``dim`` (per ``block`` elements of it, or
    the whole line): (codes, 2^-k) with the scale broadcast to x's shape."""
    if block is None:
        k = pow2_down(x.abs().amax(dim, keepdim=True))
        return e4m3(x * torch.exp2(k)), torch.exp2(-k).expand_as(x)
    xb = x.unflatten(dim, (-1, block))
    k = pow2_down(xb.abs().amax(dim + 1 if dim >= 0 else dim, keepdim=True))
    codes = e4m3(xb * torch.exp2(k)).flatten(dim, dim + 1 if dim >= 0 else dim)
    return codes, torch.exp2(-k).expand_as(xb).flatten(dim, dim + 1 if dim >= 0 else dim)


def promoted(a, b):
    """sum_k a[:, k] b[k, :]: a (R, K) float (dS or 2^8 P), b (K, C) float. a quantized per row and
    64-wide tile (P: its fixed scale), b per column and 128 rows; each 64-wide tile's wgmma chain
    from zero, promoted to float32. Returns (result, float64 sum of the same codes)."""
    from dmref.emulation import gemm

    b_codes, b_s = quantize(b, 0, 128)
    out = torch.zeros(a.shape[0], b.shape[1])
    exact = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float64)
    for c0 in range(0, a.shape[1], TILE):
        x = a[:, c0:c0 + TILE]
        ac, a_s = quantize(x, 1)
        part = gemm.matmul(ac.contiguous(), b_codes[c0:c0 + TILE].T.contiguous(), fa="e4m3", fb="e4m3", model="hopper")
        out = out + part * (a_s[:, :1] * b_s[c0:c0 + 1])
        exact += (ac * a_s).double() @ (b_codes[c0:c0 + TILE] * b_s[c0:c0 + TILE]).double()
    return out, exact


def chained(a, b, running=True):
    """The same sum as one wgmma chain: b quantized per column over all K, a against each row's
    running scale (``running=False``: a is 2^8 P, cast as it is), the accumulator in code units and
    rescaled by 2^max(drop, -126). Returns (result, float64 sum of the same codes)."""
    from dmref.emulation import gemm

    b_codes, b_s = quantize(b, 0)
    acc = torch.zeros(a.shape[0], b.shape[1])
    exact = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float64)
    k_run = torch.full((a.shape[0], 1), 126.0)
    for c0 in range(0, a.shape[1], TILE):
        x = a[:, c0:c0 + TILE]
        if running:
            amax = x.abs().amax(1, keepdim=True)
            k_new = torch.where(amax > 0, torch.minimum(k_run, pow2_down(amax)), k_run)
            acc = acc * torch.exp2((k_new - k_run).clamp(min=-126))
            k_run = k_new
        ac = e4m3(x * torch.exp2(k_run)) if running else e4m3(x)
        acc = gemm.matmul(ac.contiguous(), b_codes[c0:c0 + TILE].T.contiguous(), acc.contiguous(),
                          fa="e4m3", fb="e4m3", model="hopper")
        scale = torch.exp2(-k_run) if running else 1.0
        exact += (ac * scale).double() @ (b_codes[c0:c0 + TILE] * b_s[:1]).double()
    return acc * (torch.exp2(-k_run) if running else 1.0) * b_s[:1], exact


def errors(x, exact_codes, exact_attention):
    x, e = x.double(), exact_codes
    return dict(rel_err=float((x - exact_attention).norm() / exact_attention.norm()),
                acc_err=float((x - e).norm() / e.norm()),
                acc_bias=float(((x - e) * e).sum() / (e * e).sum()))


def run(n, causal, kind, d=128, blk=1024):
    q, k, v, do = inputs(n, d, kind)
    tau = 1 / math.sqrt(d)
    mask = torch.ones(n, n, dtype=torch.bool).tril() if causal else None
    # float64 attention on the BF16 inputs
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
    # the FP8 operands of S and dP (Q, dO per token, K per head, V per token), P against the LSE of
    # the quantized logits, dP, the matched D, dS
    q8 = torch.mul(*quantize(q, 1))
    k8 = e4m3(k * torch.exp2(pow2_down(k.abs().amax()))) * torch.exp2(-pow2_down(k.abs().amax()))
    do8, v8 = torch.mul(*quantize(do, 1)), torch.mul(*quantize(v, 1))
    c = tau * math.log2(math.e)

    def logits(i0, i1):
        x = (q8[i0:i1] @ k8.T) * c
        return x.masked_fill(~mask[i0:i1], -math.inf) if causal else x

    lse2 = torch.cat([torch.logsumexp(logits(i0, i0 + blk).double() * math.log(2), -1) / math.log(2)
                      for i0 in range(0, n, blk)]).float()[:, None]
    p = torch.cat([(logits(i0, i0 + blk) - lse2[i0:i0 + blk]).exp2() for i0 in range(0, n, blk)])
    dp = do8 @ v8.T
    ds = p * (dp - (p * dp).double().sum(-1, keepdim=True).float())
    del dp
    rows = {}
    for name, fn in (("promoted", promoted), ("chained", chained)):
        t0 = time.time()
        dv, dv64 = (fn(p.T.contiguous() * 2.0**8, do, running=False) if name == "chained"
                    else fn(p.T.contiguous() * 2.0**8, do))
        dk, dk64 = fn(ds.T.contiguous(), q)
        dq, dq64 = fn(ds, k)
        rows[name] = dict(dv=errors(dv / 2.0**8, dv64 / 2.0**8, ex["dv"]), dk=errors(dk * tau, dk64 * tau, ex["dk"]),
                          dq=errors(dq * tau, dq64 * tau, ex["dq"]), seconds=round(time.time() - t0))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=CASES, help="N:full|causal:channels|tokens (default: %(default)s)")
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
