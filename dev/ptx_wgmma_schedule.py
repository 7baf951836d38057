"""Where the compiled kernels wait for their tensor cores (sm_90a PTX, no GPU needed).

    python dev/ptx_wgmma_schedule.py      # writes dev/results/sm90_ptx_wgmma_schedule.txt
    python dev/ptx_wgmma_schedule.py --head-dim 64 --recipe kernels_naive_fp8 --out -   # print only

Compiles the forward, dq and dkdv kernels with Triton's own compiler (``dmref.kernels.
compile_check``) and prints, per kernel, the order of the loop's wgmma issues (``MMA``), commits
(``C``), waits (``W<n>``: ``wgmma.wait_group n``), ``ex2.approx`` (``E``) and FP8 conversions
(``F8``), runs compressed (``MMAx4`` = four in a row); ``|`` marks a basic-block label. A
``W0`` right after every ``C`` means each matmul completes before anything else runs in that
warpgroup: no overlap of tensor cores with the softmax inside a CTA.

Then, for the warp-specialized Gluon kernels (``fwd_ws``, overlapped, serial and chained; ``bwd_ws``'s dq for
the stale and the matched recipe; its dkdv), the sm_90a SASS instructions a consumer thread
issues per iteration of its key- or query-tile loop (the innermost loop that holds a wgmma and an
exp2; the forward's takes two key tiles an iteration), with the most frequent opcodes and the
local-memory (spill) accesses:
these kernels are issue-bound, so the count per tile is where their time goes.
docs/kernels_speed.md cites the result.
"""

from __future__ import annotations

import argparse
import os
import re

RESULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "sm90_ptx_wgmma_schedule.txt")


def schedule(compiled) -> str:
    seq = []
    for line in compiled.asm["ptx"].splitlines():
        text = line.strip()
        if text.startswith("wgmma.mma_async"):
            seq.append("MMA")
        elif text.startswith("wgmma.commit_group"):
            seq.append("C")
        elif text.startswith("wgmma.wait_group"):
            n = re.findall(r"wait_group\.sync\.aligned\s+(\d+)", text)
            seq.append("W" + (n[0] if n else "?"))
        elif "ex2.approx" in text:
            seq.append("E")
        elif "cvt.rn.satfinite.e4m3x2" in text or "cvt.rn.satfinite.e5m2x2" in text:
            seq.append("F8")
        elif text.startswith("$L__BB"):
            seq.append("|")
    runs: list[list] = []
    for x in seq:
        if runs and runs[-1][0] == x:
            runs[-1][1] += 1
        else:
            runs.append([x, 1])
    return " ".join(f"{x}x{n}" if n > 1 else x for x, n in runs)


def gluon_loops(head_dims) -> list[str]:
    """One line per Gluon kernel and head dim: SASS instructions per loop iteration."""
    from dmref.kernels import bwd_ws, fwd_ws
    from dmref.kernels.compile_check import sass_loop

    lines = ["# sm_90a SASS instructions per consumer thread and loop iteration of the Gluon kernels "
             "(non-causal; fwd_ws: 128-key tiles of 64 queries, two an iteration in the overlapped (ov) schedules, "
             "one in the serial one; dq: one 64-key tile of 64 queries; "
             "dkdv: one 64-query tile of 64 keys), the most frequent opcodes after the total"]
    for d in head_dims:
        for name, compile_ in (("fwd_ws, ov", lambda: fwd_ws.compile_sm90(d)),  # noqa: B023 (called at once)
                               # the shipped schedule (PV promoted, overlapped), the serial one, and
                               # the overlap with PV chained over all keys
                               ("fwd_ws, serial", lambda: fwd_ws.compile_sm90(d, overlap=False)),
                               ("fwd_ws, ov, chained", lambda: fwd_ws.compile_sm90(d, chain=True)),
                               ("dq stale", lambda: bwd_ws.compile_sm90_dq(d, recipe="kernels_naive_fp8")),
                               ("dq matched", lambda: bwd_ws.compile_sm90_dq(d, recipe="kernels_delta_matching")),
                               ("dkdv", lambda: bwd_ws.compile_sm90(d, recipe="kernels_delta_matching"))):
            ops = sass_loop(compile_())
            top = " ".join(f"{op} {n}" for op, n in ops.most_common(10))
            lines.append(f"D={d:<3d} {name:19s} {sum(ops.values()):5d}  {top}  | spills: STL {ops['STL']} LDL {ops['LDL']}")
            print(lines[-1], flush=True)
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head-dim", type=int, choices=(64, 128), default=None, help="default: both")
    ap.add_argument("--recipe", default="kernels_delta_matching")
    ap.add_argument("--out", default=RESULT, help="result file, '-' to print only (default: %(default)s)")
    args = ap.parse_args()
    import triton

    from dmref.kernels import compile_check as cc
    from dmref.kernels.config import get_spec

    r = get_spec(args.recipe)
    lines = [f"# sm_90a PTX wgmma schedule, recipe {args.recipe}, Triton {triton.__version__}, compiled "
             "without a GPU: python dev/ptx_wgmma_schedule.py"]
    for d in (args.head_dim,) if args.head_dim else (128, 64):
        for name, run in cc.recipe_variants(r, d, False, gluon=False):
            if name == "quantize":
                continue
            ck = cc.compile_launch(run, do_format=r.recipe.do_dp.fmt.name)
            lines.append(f"D={d:<3d} {name:5s} {schedule(ck)}")
            print(lines[-1], flush=True)
    lines += gluon_loops((args.head_dim,) if args.head_dim else (128, 64))
    if args.out != "-":
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
