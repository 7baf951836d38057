"""What bounds the FP8 forward's softmax on a Hopper GPU: the throughput of its per-element
instructions, one at a time and together, ``python benchmarks/bench_softmax_pipes.py [--out DIR]``
writes ``<device>_softmax_pipes.json`` (default ``benchmarks/results/``).

Per element of P the forward runs one FFMA (exp2's argument), one ``MUFU.EX2`` (exp2), one FADD
(the row sum) and half an ``F2FP`` (the float32 -> E4M3 cast packs two values). Each variant below
is a Triton kernel whose loop applies its operations to the same float32 registers ``ITERS`` times,
every result feeding the next iteration (nothing is dead), on enough CTAs to fill every SM:

- ``ffma``: the argument and the sum alone (the baseline every other variant includes);
- ``exp2``: + exp2 (``MUFU.EX2``);
- ``cvt``: + the E4M3 cast (``F2FP``, its code added back as an integer);
- ``exp2_cvt``: + both, the softmax's mix;
- ``poly``: + exp2 computed on the FMA pipe (``dmref.kernels._common.exp2_poly``, what
  ``FwdTiles(exp2_poly=2 or 4)`` runs for part of P to take work off ``MUFU``).

Reported: giga-elements per second (medians of ``triton.testing.do_bench``) and each variant's time
per element above ``ffma``'s in SM clock cycles per warp instruction (the SM clock read by
``torch.cuda.clock_rate``; a ratio within one run is what the forward's docs read).

The lever itself, the forward kernel with ``FwdTiles(exp2_poly=2 or 4)``, is timed by
``bench_attention.py`` (``ours_fwd_ws_poly2_kernel``, ``ours_fwd_ws_poly4_kernel``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attention import RESULTS, bench, device_tag  # noqa: E402

from dmref.kernels._common import exp2_poly  # noqa: E402

ITERS = 512
BLOCK = 1024
WARPS = 4


@triton.jit
def _e4m3x2(a, b):
    """The E4M3 codes of a and b packed (one ``F2FP``: cvt.rn.satfinite.e4m3x2.f32), widened to 32 bits."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 c; cvt.rn.satfinite.e4m3x2.f32 c, $2, $1; cvt.u32.u16 $0, c; }", "=r,r,r", [a, b],
        dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _value(y, EXP: tl.constexpr, POLY: tl.constexpr):
    if POLY:
        return exp2_poly(y)  # the kernels' polynomial exp2, all on the FMA pipe
    elif EXP:
        return tl.exp2(y)
    else:
        return y


@triton.jit
def _pipes_kernel(X, OUT, ITERS: tl.constexpr, BLOCK: tl.constexpr, EXP: tl.constexpr, CVT: tl.constexpr,
                  POLY: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK // 2)
    a = tl.load(X + offs)
    b = tl.load(X + offs + BLOCK // 2)
    acc = tl.zeros_like(a)
    codes = tl.zeros([BLOCK // 2], tl.int32)
    for _ in range(ITERS):
        a = a * 0.9990234375 - 0.0009765625  # exp2's argument: one FFMA (stays in [-1, 1])
        b = b * 0.9990234375 - 0.0009765625
        ea = _value(a, EXP, POLY)
        eb = _value(b, EXP, POLY)
        if CVT:
            codes += _e4m3x2(ea, eb)
        acc += ea + eb  # the row sum: one FADD an element
    tl.store(OUT + offs, acc + codes.to(tl.float32))


VARIANTS = {"ffma": (False, False, False), "exp2": (True, False, False), "cvt": (False, True, False),
            "exp2_cvt": (True, True, False), "poly": (False, False, True), "poly_cvt": (False, True, True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ctas = sms * 16  # 16 CTAs of 4 warps an SM: every SM's four schedulers full
    n = ctas * BLOCK
    x = torch.rand(n, device="cuda") - 0.5
    out = torch.empty_like(x)
    ms = {}
    for name, (exp, cvt, poly) in VARIANTS.items():
        fn = lambda: _pipes_kernel[(ctas,)](x, out, ITERS=ITERS, BLOCK=BLOCK, EXP=exp, CVT=cvt, POLY=poly,  # noqa: E731
                                            num_warps=WARPS)
        fn()
        torch.cuda.synchronize()
        ms[name] = bench(fn)
    elems = n * ITERS
    try:  # the SM clock (MHz) through NVML; None where pynvml is missing
        clock_mhz = torch.cuda.clock_rate()
    except Exception:
        clock_mhz = None
    # cycles an SM spends per warp instruction's 32 elements above the baseline, per SM
    extra = {k: (ms[k] - ms["ffma"]) * 1e-3 * clock_mhz * 1e6 * sms / (elems / 32) for k in ms if k != "ffma"} \
        if clock_mhz else None
    result = {"meta": {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
                       "triton": triton.__version__, "sm_clock_mhz": clock_mhz,
                       "iters": ITERS, "elements": elems,
                       "method": "triton.testing.do_bench medians; cycles = extra time x SM clock x SMs / "
                                 "(elements / 32)"},
              "ms": ms, "gelem_per_s": {k: elems / (v * 1e-3) / 1e9 for k, v in ms.items()},
              "sm_cycles_per_32_elements_above_ffma": extra}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{device_tag()}_softmax_pipes.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
