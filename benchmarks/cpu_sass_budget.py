"""Where the warp-specialized kernels' time can go, read from their sm_90a SASS on the CPU:
``python benchmarks/cpu_sass_budget.py`` writes ``benchmarks/results/cpu_sass_budget.json``.

For the Gluon forward (``fwd_ws``, at both head dims) and the Gluon backwards (``bwd_ws``: the dkdv
kernel, the five-GEMM kernel adding dQ by TMA reduce-adds, and its dQ^T form, also for the recipe
``kernels_folded_delta_prepass_dsq_row``, dS for dQ scaled per query from the pre-pass's bound and
dQ^T added unscaled, and built under the timing probe ``bwd_ws.DQ_PROBE`` 3, no fifth GEMM, in a
process of its own), compiled as their launches describe
them (no GPU): the opcodes of the consumer's main loop (``compile_check.sass_loop``,
the innermost loop holding a wgmma and an exp2) per tile of the loop (the forward's overlapped loop
runs two key tiles an iteration; the backward's one query tile), and three cycle counts per tile
of one CTA, on an SM that runs two such CTAs (each SM sub-partition then issues for one consumer
warp of each):

- ``issue``: instructions a consumer warp issues per tile (a sub-partition issues one a cycle, for
  two warps: two tiles, one of each CTA, take twice that);
- ``mufu``: ``MUFU`` instructions x 8 (16 results a cycle an SM, CUDA's throughput table for
  compute capability 9.0: 8 cycles a warp instruction on a sub-partition's quarter);
- ``gemm``: the tile's wgmma FLOPs over an H100 SXM's dense FP8 peak an SM (1,979 TFLOP/s over 132
  SMs at 1,830 MHz: 8,192 FLOP a cycle), for one CTA's tile with the SM's tensor cores to itself.

These are counts and a model, not timings: which bound a kernel meets is what ``gpu_profile.py``
(the pipes' and the warps' states) and ``bench_attention.py`` measure on a GPU.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
#: dense FP8 FLOP an SM a cycle on an H100 SXM (1,979e12 / 132 / 1.83e9)
FP8_FLOP_PER_SM_CYCLE = 8192
#: SM sub-partition cycles a MUFU warp instruction occupies (16 results a cycle an SM)
MUFU_CYCLES = 8


def _row(name, compiled, tiles_per_iteration, flops_per_tile):
    from dmref.kernels.compile_check import resource_usage, sass_loop

    ops = sass_loop(compiled)
    regs, spills, shared = resource_usage(compiled)
    per_tile = {k: v / tiles_per_iteration for k, v in sorted(ops.items(), key=lambda kv: -kv[1])}
    issue = sum(per_tile.values())
    return dict(variant=name, registers=regs, spill_bytes=spills, shared_bytes=shared,
                opcodes_per_tile=per_tile,
                cycles_per_tile=dict(issue=issue, mufu=per_tile.get("MUFU", 0) * MUFU_CYCLES,
                                     gemm=flops_per_tile / FP8_FLOP_PER_SM_CYCLE))


def _fused_t(d: int, recipe: str = "kernels_naive_fp8") -> tuple:
    """(compiled five-GEMM dQ^T kernel of ``recipe`` at head dim ``d``, tiles an iteration, FLOPs a tile)."""
    from dmref.kernels import bwd_ws

    ck = bwd_ws.compile_sm90(d, False, kernel="fused", recipe=recipe, dq_tma=True, dq_t=True, n=4096)
    return ck, 1, 5 * (2 * 64 * 64 * d)


def _probe_rows(probe: int) -> list:
    """The dQ^T kernel's rows built under ``DQ_PROBE = probe`` (read at import: a process of its own)."""
    code = ("import json, sys; sys.path.insert(0, %r); from cpu_sass_budget import _row, _fused_t; "
            "print(json.dumps([_row('bwd_ws fused dq_tma d=%%d dq_t probe=%d' %% d, *_fused_t(d)) for d in (64, 128)]))"
            % (os.path.dirname(os.path.abspath(__file__)), probe))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["DMREF_FUSED_DQ_PROBE"] = str(probe)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    from dmref.kernels import bwd_ws, fwd_ws

    rows = []
    for d in (64, 128):
        # a key tile of 128 for 64 queries: QK^T and PV, 2 * 64 * 128 * d FLOPs each
        flops = 2 * (2 * 64 * 128 * d)
        rows.append(_row(f"fwd_ws d={d}", fwd_ws.compile_sm90(d, False), 2, flops))
        # a query tile of 64 for 64 keys: S^T, dP^T, dV, dK (and dQ): 2 * 64 * 64 * d FLOPs each
        gemm = 2 * 64 * 64 * d
        rows.append(_row(f"bwd_ws dkdv d={d}", bwd_ws.compile_sm90(d, False, kernel="dkdv",
                                                                 recipe="kernels_naive_fp8"), 1, 4 * gemm))
        for dq_t in (False, True):
            ck = bwd_ws.compile_sm90(d, False, kernel="fused", recipe="kernels_naive_fp8", dq_tma=True, dq_t=dq_t,
                                     n=4096)
            rows.append(_row(f"bwd_ws fused dq_tma d={d}{' dq_t' if dq_t else ''}", ck, 1, 5 * gemm))
        rows.append(_row(f"bwd_ws fused dq_tma d={d} dq_t dsq_row",
                         *_fused_t(d, "kernels_folded_delta_prepass_dsq_row")))
    rows += _probe_rows(3)
    import triton

    out = {"meta": {"date": datetime.date.today().isoformat(), "triton": triton.__version__,
                    "target": "sm_90a (ptxas of the Triton wheel), non-causal, N a multiple of 64",
                    "model": __doc__.split("\n\n")[1].replace("\n", " ")},
           "rows": rows}
    with open(os.path.join(RESULTS, "cpu_sass_budget.json"), "w") as f:
        json.dump(out, f, indent=1)
    for r in rows:
        c = r["cycles_per_tile"]
        print(f"{r['variant']:36s} issue {c['issue']:6.0f}  mufu {c['mufu']:5.0f}  gemm {c['gemm']:5.0f}  "
              f"spills {r['spill_bytes']}")


if __name__ == "__main__":
    main()
