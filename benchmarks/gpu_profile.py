"""Where the Gluon kernels' cycles go, from Nsight Compute on a Hopper GPU: stall reasons, pipes
and throughputs of one launch of each kernel, and the SASS instructions that stall most.

    python benchmarks/gpu_profile.py --out DIR            # on the GPU: ncu on each target
    python benchmarks/gpu_profile.py --summarize DIR      # anywhere: DIR's raw reports -> JSON

The first form runs, for each target of ``TARGETS``, ``ncu --clock-control none`` (the card's
clocks as they are) on a child process that launches the target's kernel twice (the first
launch compiles it and is skipped) and keeps the second's report: the sections
``SpeedOfLight``, ``ComputeWorkloadAnalysis``, ``MemoryWorkloadAnalysis``, ``Occupancy``,
``LaunchStats``, ``WarpStateStats`` and ``SourceCounters``, printed as CSV (``--page raw``, and
``--page source --print-source sass`` for the per-instruction samples). The raw text goes into
``DIR/profile_raw.tar.gz``; the summary, ``<device>_kernel_profile.json``, is written from it by
the second form (also run at the end of the first). The inputs are the bench's
(``bench_attention.py``): randn BF16 at 4·16·4096·128 and 4·32·4096·64, not causal.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "MemoryWorkloadAnalysis", "Occupancy", "LaunchStats",
            "WarpStateStats", "SourceCounters")

#: target -> (kernel name regex for ncu, head dim, what it is)
TARGETS = {
    "fwd_ws_d128": ("_fwd_ws_kernel", 128, "warp-specialized forward (folded), kernel alone"),
    "fwd_ws_d64": ("_fwd_ws_kernel", 64, "warp-specialized forward (folded), kernel alone"),
    "bwd_dkdv_d128": ("_bwd_dkdv_ws_kernel", 128, "the default backward's dkdv kernel (matched D)"),
    "bwd_dq_d128": ("_bwd_dq_ws_kernel", 128, "the default backward's dq kernel (matched delta)"),
    "bwd_fused_tma_d128": ("_bwd_fused_ws_kernel", 128, "five-GEMM kernel, one consumer, TMA reduce-adds of dQ"),
    "bwd_fused_tma_d64": ("_bwd_fused_ws_kernel", 64, "five-GEMM kernel, one consumer, TMA reduce-adds of dQ"),
    "dsq_row_fused_d128": ("_bwd_fused_ws_kernel", 128,
                           "kernels_folded_delta_prepass_dsq_row's five-GEMM kernel as the API runs it (dQ^T)"),
    "dsq_row_fused_d64": ("_bwd_fused_ws_kernel", 64,
                          "kernels_folded_delta_prepass_dsq_row's five-GEMM kernel as the API runs it (dQ^T)"),
    "dsq_row_prepass_d128": ("_bwd_dq_ws_kernel", 128, "kernels_folded_delta_prepass_dsq_row's pre-pass (D and U)"),
}


def _shape(head_dim: int) -> tuple[int, int, int, int]:
    return (4, 16, 4096, 128) if head_dim == 128 else (4, 32, 4096, 64)


def launch(target: str) -> None:
    """Run ``target``'s kernel twice on the bench's inputs (the first launch compiles)."""
    import dataclasses

    import torch

    from dmref.kernels import api, bwd_ws, fwd_ws
    from dmref.kernels.quantize import quantize

    _, head_dim, _ = TARGETS[target]
    b, h, n, d = _shape(head_dim)
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale = 1 / math.sqrt(d)
    dims = dict(batch=b, heads=h, kv_heads=h, n=n, head_dim=d)
    kw = dict(causal=False, scale=scale, **dims)
    if target.startswith("dsq_row"):
        from dmref.kernels.quantize import quantize_with
        recipe = "kernels_folded_delta_prepass_dsq_row"
        o, _, saved, _ = api.attention_forward(q, k, v, causal=False, scale=scale, recipe=recipe)
        do8, _, q8 = quantize_with(do, "float8_e4m3fn", saved.q_pending, saved.q_fmt)
        sv = dataclasses.replace(saved, q=q8, q_pending=None)
        delta, u = bwd_ws.prepass(sv, do8, recipe=recipe, bound=True, **kw)
        if target.startswith("dsq_row_prepass"):
            fn = lambda: bwd_ws.prepass(sv, do8, recipe=recipe, bound=True, **kw)  # noqa: E731
        else:
            fn = lambda: bwd_ws.fused(sv, do8, delta, recipe=recipe, dsq_bound=u, **kw)  # noqa: E731
    elif target.startswith("fwd_ws"):
        _, _, kv = fwd_ws.attention_forward(q, k, v, causal=False, scale=scale)
        recipe = "kernels_folded_naive_fp8"
        fn = lambda: fwd_ws.forward(q, kv.k8, kv.k_scale, kv.vt8, kv.v_scale, kv_heads=h, causal=False,  # noqa: E731
                                    scale=scale, recipe=recipe)
    else:
        o, _, saved, _ = api.attention_forward(q, k, v, causal=False, scale=scale, recipe="kernels_delta_matching")
        do8, d_stale = quantize(do, "float8_e4m3fn", rows=True, cols=True, delta_with=o)
        if target.startswith("bwd_dkdv"):
            delta = bwd_ws.dq(saved, do8, d_stale, recipe="kernels_delta_matching", **kw)[1]
            fn = lambda: bwd_ws.dkdv(saved, do8, do8, delta, recipe="kernels_delta_matching", **kw)  # noqa: E731
        elif target.startswith("bwd_dq"):
            fn = lambda: bwd_ws.dq(saved, do8, d_stale, recipe="kernels_delta_matching", **kw)  # noqa: E731
        else:
            fn = lambda: bwd_ws.fused(saved, do8, d_stale, recipe="kernels_naive_fp8", dq_tma=True,  # noqa: E731
                                      dq_t=False, **kw)
    for _ in range(2):
        fn()
        torch.cuda.synchronize()


def _ncu(args: list[str], timeout: int) -> tuple[int, str]:
    try:
        p = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
        return p.returncode, p.stdout + p.stderr
    except (subprocess.TimeoutExpired, FileNotFoundError) as exc:
        return -1, f"{type(exc).__name__}: {exc}"


def profile(out: Path, targets: list[str], timeout: int) -> None:
    """ncu on each target; the raw CSV text of each into ``out/profile_raw.tar.gz``."""
    ncu = os.environ.get("NCU") or next((str(p) for p in sorted(Path("/opt/nvidia").glob("nsight-compute/*/ncu"))),
                                        "ncu")
    raw: dict[str, str] = {}
    work = Path("/tmp/dmref_profile")
    work.mkdir(exist_ok=True)
    for target in targets:
        regex, _, _ = TARGETS[target]
        rep = work / f"{target}.ncu-rep"
        rep.unlink(missing_ok=True)
        t0 = time.time()
        args = [ncu, "--clock-control", "none", "--target-processes", "all", "-k", f"regex:{regex}",
                "--launch-skip", "1", "--launch-count", "1", "-f", "-o", str(rep.with_suffix(""))]
        for s in SECTIONS:
            args += ["--section", s]
        rc, log = _ncu(args + [sys.executable, __file__, "--launch", target], timeout)
        raw[f"{target}.log"] = f"# rc {rc}, {time.time() - t0:.0f} s\n{log}"
        print(f"{target}: ncu rc {rc} in {time.time() - t0:.0f} s", flush=True)
        if not rep.exists():
            continue
        for page, extra in (("raw", []), ("details", []), ("source", ["--print-source", "sass"])):
            rc, text = _ncu([ncu, "-i", str(rep), "--page", page, "--csv", *extra], 120)
            raw[f"{target}.{page}.csv"] = text if rc == 0 else f"# rc {rc}\n{text}"
    with tarfile.open(out / "profile_raw.tar.gz", "w:gz") as tar:
        for name, text in raw.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


# ---------------------------------------------------------------------------------------------
# the summary
# ---------------------------------------------------------------------------------------------

#: raw metrics kept in the summary (the sum over the kernel's SMs or the average, as ncu names it)
METRICS = (
    "gpu__time_duration.sum", "sm__cycles_elapsed.avg.per_second", "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__inst_executed.avg.per_cycle_active", "sm__issue_active.avg.pct_of_peak_sustained_elapsed",
    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active",
    "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active",
    "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__pipe_shared_cycles_active.avg.pct_of_peak_sustained_active",
    "lts__t_sectors.avg.pct_of_peak_sustained_elapsed", "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed", "l1tex__throughput.avg.pct_of_peak_sustained_active",
    "launch__registers_per_thread", "launch__shared_mem_per_block_dynamic", "launch__occupancy_limit_shared_mem",
    "sm__warps_active.avg.per_cycle_active",
)


def _rows(text: str, header: str | None = None) -> list[dict]:
    """The CSV rows of an ncu page: its quoted lines, from the one starting with ``header``
    (the source page opens with a line naming the kernel) where given."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    if header is not None:
        start = next((i for i, ln in enumerate(lines) if ln.startswith(header)), len(lines))
        lines = lines[start:]
    return list(csv.DictReader(io.StringIO("\n".join(lines))))


def _number(x: str):
    try:
        return float(x.replace(",", ""))
    except (ValueError, AttributeError):
        return None


def summarize_target(files: dict[str, str], target: str) -> dict:
    out: dict = {"what": TARGETS[target][2], "shape": list(_shape(TARGETS[target][1]))}
    raw = _rows(files.get(f"{target}.raw.csv", ""))
    if raw:
        row, units = raw[-1], (raw[0] if len(raw) > 1 else {})
        out["metrics"] = {m: _number(row[m]) for m in METRICS if m in row}
        out["units"] = {m: units.get(m, "") for m in out["metrics"] if units.get(m)}
        stalls = {k.removeprefix("smsp__average_warps_issue_stalled_").removesuffix("_per_issue_active.ratio"):
                  _number(v) for k, v in row.items()
                  if k.startswith("smsp__average_warps_issue_stalled_") and k.endswith("_per_issue_active.ratio")}
        out["stalls_per_issue"] = dict(sorted(((k, v) for k, v in stalls.items() if v), key=lambda kv: -kv[1]))
    src = _rows(files.get(f"{target}.source.csv", ""), header='"Address"')
    if src:
        cols = [c for c in src[0] if c]
        samp = next((c for c in cols if c.lower().startswith("warp stall sampling (all")), None)
        text = next((c for c in cols if c.lower() in ("source", "sass")), None)
        reasons = [c for c in cols if c.startswith("stall_") and not c.endswith("(Not Issued)")]
        if samp and text:
            total = sum(_number(r[samp]) or 0 for r in src) or 1
            top = sorted(src, key=lambda r: -(_number(r[samp]) or 0))[:40]
            out["source_total_samples"] = total
            idle = sum(_number(r[samp]) or 0 for r in src
                       if (r[text] or "").strip() == "NOP" and (_number(r[samp]) or 0) / total > 0.05)
            out["idle_padding_share"] = round(idle / total, 4)
            out["samples_by_reason"] = {
                k.removeprefix("stall_"): round(v / total, 4) for k, v in sorted(
                    ((c, sum(_number(r[c]) or 0 for r in src)) for c in reasons), key=lambda kv: -kv[1])
                if v / total >= 0.005}
            out["top_stalled_instructions"] = [
                {"sass": r[text].strip(), "share": round((_number(r[samp]) or 0) / total, 4),
                 "address": r.get("Address", ""),
                 "reasons": {c.removeprefix("stall_"): round((_number(r[c]) or 0) / total, 4)
                             for c in reasons if (_number(r[c]) or 0) / total >= 0.002}} for r in top]
            ops: dict[str, float] = {}
            for r in src:
                m = re.match(r"\s*(?:@!?U?P\w+\s+)?([A-Z0-9]+)", r[text] or "")
                if m:
                    ops[m.group(1)] = ops.get(m.group(1), 0) + (_number(r[samp]) or 0)
            out["samples_by_opcode"] = {k: round(v / total, 4) for k, v in sorted(ops.items(), key=lambda kv: -kv[1])
                                        if v / total >= 0.005}
    log = files.get(f"{target}.log", "")
    if not raw:
        out["error"] = log[-1500:]
    return out


def summarize(directory: Path, device: str | None = None) -> Path:
    with tarfile.open(directory / "profile_raw.tar.gz") as tar:
        files = {m.name: tar.extractfile(m).read().decode(errors="replace") for m in tar.getmembers() if m.isfile()}
    targets = [t for t in TARGETS if f"{t}.log" in files]
    summary = {"meta": {"method": "ncu --clock-control none, sections " + ", ".join(SECTIONS) + "; one launch "
                        "(the second) of each target on randn BF16 inputs, not causal",
                        "device": device or _device_from(files),
                        "samples": "shares of the warp-state samples of all the kernel's warps; idle_padding_share: "
                                   "those of the producer warp group's three idle padding warps, which wait at two "
                                   "NOPs for the kernel's whole life (6 of an SM's 16 warps), not stalls of "
                                   "working warps"},
               "targets": {t: summarize_target(files, t) for t in targets}}
    tag = (summary["meta"]["device"] or "gpu").lower()
    path = directory / f"{tag}_kernel_profile.json"
    path.write_text(json.dumps(summary, indent=1) + "\n")
    return path


def _device_from(files: dict[str, str]) -> str | None:
    for text in files.values():
        m = re.search(r"NVIDIA (H\d+\w*)", text)
        if m:
            return m.group(1)
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="profile every target on the GPU, raw reports and summary into OUT")
    ap.add_argument("--summarize", type=Path, help="write the summary from DIR/profile_raw.tar.gz")
    ap.add_argument("--launch", choices=sorted(TARGETS), help=argparse.SUPPRESS)
    ap.add_argument("--targets", default=",".join(TARGETS), help="comma-separated targets (default: all)")
    ap.add_argument("--timeout", type=int, default=240, help="seconds for each target's ncu run")
    args = ap.parse_args(argv)
    if args.launch:
        launch(args.launch)
        return 0
    if args.out:
        targets = [t for t in args.targets.split(",") if t]
        unknown = set(targets) - set(TARGETS)
        if unknown:
            ap.error(f"unknown targets {sorted(unknown)}")
        args.out.mkdir(parents=True, exist_ok=True)
        import torch

        name = re.search(r"(H\d+\w*)", torch.cuda.get_device_name())
        profile(args.out, targets, args.timeout)
        print(summarize(args.out, name.group(1) if name else None))
        return 0
    if args.summarize:
        print(summarize(args.summarize))
        return 0
    ap.error("one of --out, --summarize")
    return 2


if __name__ == "__main__":
    sys.exit(main())
