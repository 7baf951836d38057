"""Speed of the emulated FP8 GEMM (dmref.emulation.gemm.matmul) on this machine, in one run:

    python benchmarks/bench_gemm.py [--size 1024] [--json FILE]   # default: benchmarks/results/cpu_bench_gemm.json

- the ``hopper`` model on a size**3 E4M3 x E4M3 problem (randn inputs), in multiply-accumulates
  per second (the issue's goal: >= 200 million on the project's 2-core CPU at 1024**3);
- the ``exact`` and ``fp32`` models on the same problem, beside a float64 torch matmul of the
  same shape (the hardware's own speed for the same arithmetic volume);
- for scale, a plain NumPy vectorisation of the hopper model (one (M, N, 32) array per k-step)
  on a 256**3 problem.

The machine is shared: the load average and the process's CPU seconds are printed next to the
wall-clock rates, so that a slow run can be told from a busy machine. docs/gemm.md ("Speed") cites
the result file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

from dmref.emulation import decode
from dmref.emulation.gemm import matmul


def _timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def numpy_hopper_baseline(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The straightforward NumPy vectorisation of the chained hopper model (E4M3, c = 0)."""
    va, vb = decode(a, "e4m3").astype(np.float64), decode(b, "e4m3").astype(np.float64)
    ea = np.maximum(np.frexp(np.abs(va))[1] - 1, -6)
    eb = np.maximum(np.frexp(np.abs(vb))[1] - 1, -6)
    acc = np.zeros((a.shape[0], b.shape[0]))
    for k0 in range(0, a.shape[1], 32):
        p = va[:, None, k0:k0 + 32] * vb[None, :, k0:k0 + 32]
        e = np.where(p != 0, ea[:, None, k0:k0 + 32] + eb[None, :, k0:k0 + 32], -999).max(-1)
        e = np.maximum(e, np.where(acc != 0, np.frexp(np.abs(acc))[1] - 1, -999))
        q = np.ldexp(1.0, e - 13)
        s = np.trunc(p / q[..., None]).sum(-1) + np.trunc(acc / q)
        acc = (s.astype(np.float32).view(np.uint32) & 0xFFFFFC00).view(np.float32) * q
    return acc.astype(np.float32)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "cpu_bench_gemm.json",
                   help="result file (default: %(default)s)")
    args = p.parse_args(argv)
    n = args.size
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, generator=g).to(torch.float8_e4m3fn)
    macs = n ** 3
    results = {"shape": [n, n, n], "formats": "e4m3 x e4m3", "dist": "randn",
               "torch": torch.__version__, "threads": torch.get_num_threads(),
               "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count()}
    warm_a, warm_b = a[:128, :256].contiguous(), b[:128, :256].contiguous()
    for model in ("hopper", "exact", "fp32"):
        matmul(warm_a, warm_b, model=model)
        load = os.getloadavg()[0]
        wall, cpu = _timed(lambda: matmul(a, b, model=model))
        results[model] = {"seconds": round(wall, 3), "mac_per_s": macs / wall,
                          "cpu_seconds": round(cpu, 3), "load_average_before": load}
    a64, b64 = a.double(), b.double()
    a64[:64] @ b64[:64].t()
    wall, cpu = _timed(lambda: a64 @ b64.t())
    results["torch_float64_matmul"] = {"seconds": round(wall, 4), "mac_per_s": macs / wall,
                                       "cpu_seconds": round(cpu, 3)}
    small_a, small_b = a[:256, :256].view(torch.uint8).numpy(), b[:256, :256].view(torch.uint8).numpy()
    wall, _ = _timed(lambda: numpy_hopper_baseline(small_a, small_b))
    results["numpy_baseline_256"] = {"seconds": round(wall, 3), "mac_per_s": 256 ** 3 / wall}
    # the baseline is the model: it must agree with matmul on its problem (chained, c = 0)
    agree = np.array_equal(numpy_hopper_baseline(small_a[:64], small_b[:64]).view(np.uint32),
                           matmul(small_a[:64], small_b[:64], fa="e4m3", fb="e4m3").view(np.uint32))
    results["numpy_baseline_256"]["agrees_with_matmul"] = bool(agree)
    results["load_average_after"] = os.getloadavg()[0]

    f64 = results["torch_float64_matmul"]["mac_per_s"]
    print(f"{n}x{n}x{n} E4M3, {results['threads']} threads, load average {os.getloadavg()[0]:.1f}")
    for key in ("hopper", "exact", "fp32"):
        r = results[key]
        print(f"  {key:7s} {r['mac_per_s'] / 1e6:9.0f} MMAC/s  ({r['seconds']:.2f} s wall, "
              f"{r['cpu_seconds']:.2f} s CPU; {r['mac_per_s'] / f64:.3f} x float64 torch matmul)")
    print(f"  torch float64 matmul {f64 / 1e6:9.0f} MMAC/s")
    print(f"  NumPy vectorisation of the hopper model (256^3): "
          f"{results['numpy_baseline_256']['mac_per_s'] / 1e6:.0f} MMAC/s")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
