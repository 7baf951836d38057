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
- ``poly``: + exp2 computed on the FMA pipe (a degree-6 polynomial after the integer split; what a
  kernel could run for part of P to take work off ``MUFU``).

Reported: giga-elements per second (medians of ``triton.testing.do_bench``) and each variant's time
per element above ``ffma``'s in SM clock cycles per warp instruction (the SM clock read by
``torch.cuda.clock_rate``; a ratio within one run is what the forward's docs read).

Then the lever itself (``forward``): the warp-specialized forward kernel alone (K and V quantized
ahead) with every exp2 on ``MUFU`` and with one in 2 or 4 on the FMA pipe
(``FwdTiles(exp2_poly=...)``), beside cuDNN BF16 SDPA's forward, at each shape of
``bench_attention.SHAPES``, causal and not (``--no-forward``: the pipes only).
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
        # 2**y = 2**j * 2**f: j = round(y) by the float32 adder (1.5 * 2**23 pushes the fraction out;
        # the sum's low bits are j, and shifted 23 up they are 2**j's exponent field), f in
        # [-0.5, 0.5], then a degree-6 Taylor-Horner polynomial, all on the FMA pipe
        t = y + 12582912.0
        f = y - (t - 12582912.0)
        p = 1.5403530393381606e-4
        p = p * f + 1.3333558146428443e-3
        p = p * f + 9.618129107628477e-3
        p = p * f + 5.550410866482158e-2
        p = p * f + 0.2402265069591007
        p = p * f + 0.6931471805599453
        p = p * f + 1.0
        return (p.to(tl.int32, bitcast=True) + (t.to(tl.int32, bitcast=True) << 23)).to(tl.float32, bitcast=True)
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


def forward_variants() -> list[dict]:
    """ms of the warp-specialized forward kernel (K and V quantized ahead) with ``exp2_poly`` 0, 2
    and 4, and of cuDNN BF16 SDPA's forward, at each shape, causal and not; ratios cuDNN / ours."""
    import math

    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from bench_attention import SHAPES
    from dmref.kernels import fwd_ws
    from dmref.kernels.quantize import quantize_kv_folded

    rows = []
    for b, h, n, d in SHAPES:
        for causal in (False, True):
            torch.manual_seed(0)
            q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            scale = 1 / math.sqrt(d)
            ms = {}
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                ms["cudnn_fwd"] = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
            kv = quantize_kv_folded(k, v)
            for one_in in (0, 2, 4):
                spec = fwd_ws.variant("kernels_folded_naive_fp8", exp2_poly=one_in)
                try:
                    ms[f"fwd_ws_poly{one_in}"] = bench(lambda: fwd_ws.forward(
                        q, kv.k8, kv.k_scale, kv.vt8, kv.v_scale, kv_heads=h, causal=causal, scale=scale, recipe=spec))
                except Exception as exc:  # recorded; the other variants still run
                    ms[f"fwd_ws_poly{one_in}_error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(dict(shape=[b, h, n, d], causal=causal, ms=ms,
                             speedup_vs_cudnn={k: ms["cudnn_fwd"] / t for k, t in ms.items()
                                               if k.startswith("fwd_ws") and isinstance(t, float)}))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--no-forward", action="store_true", help="the pipes only, not the forward's variants")
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
    if not args.no_forward:
        result["forward"] = forward_variants()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{device_tag()}_softmax_pipes.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
