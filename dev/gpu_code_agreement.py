"""Exact P and dS agreement of the kernels with the emulated reference, on the GPU test cases.

    PYTHONPATH=tests/kernels:benchmarks python dev/gpu_code_agreement.py [--out DIR] [--no-fp-fusion]

tests/kernels on PYTHONPATH for the test module whose cases and helpers it runs, benchmarks for
bench_attention's ``device_tag`` (dev/README.md).

For every GPU case of tests/kernels/test_kernels_intermediates.py: the fraction of FP8 codes
(forward P, dkdv P) equal to the reference's (``dmref.tiled`` on the kernels' recipe, read where it
casts: tests/kernels/reference_intermediates.py) and of dS values as the dK matmul sees them
(codes times scales, ``ds_dk``), the number of mismatches, how many of the code mismatches are one
code step apart (a value on the other side of a rounding boundary), and timings of the forward
and the matched backward at 4x16x4096x128. ``--no-fp-fusion`` sets TRITON_DEFAULT_FP_FUSION=0
before triton is imported: the compilers then keep every float32 multiply and add separately
rounded, as the reference computes them (no fused multiply-add). Result files written before
these tests compared with the reference compare with a plain-torch model of the recipe
(``kernel_model``, since removed) and call dS ``ds_codes``.
Writes DIR/<device>_code_agreement[_nofusion].json (<device>: the GPU's model in lower case,
``h200``; DIR: dev/results by default, the files docs/kernels.md cites).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="default: %(default)s")
    ap.add_argument("--no-fp-fusion", action="store_true")
    args = ap.parse_args()
    if args.no_fp_fusion:
        os.environ["TRITON_DEFAULT_FP_FUSION"] = "0"
    import torch
    import triton

    import test_kernels_intermediates as tm
    from dmref.emulation import decode

    rows = []
    for case in tm.CASES["gpu"]:
        r = tm.run_case("gpu", case)
        kern, mod = r["kernel"], r["ref"]
        valid = tm._valid(case, kern["o"].device).expand_as(mod["p_fwd"])
        row = {"case": str(case)}
        ds = tm._kernel_ds_dk(case, kern)
        diff = (ds != mod["ds_dk"]) & valid
        row["ds_dk"] = {"agreement": (~diff)[valid].double().mean().item(), "mismatches": int(diff.sum()),
                        "elements": int(valid.sum()), "kernel_larger": int((diff & (ds > mod["ds_dk"])).sum())}
        for name in ("p_fwd", "p_codes"):
            kc, mc = kern[name].view(torch.uint8), mod[name]
            diff = (kc != mc) & valid
            # adjacent codes: the same sign and magnitude codes one apart (0x7F masks the sign)
            step = ((kc.int() & 0x7F) - (mc.int() & 0x7F)).abs()
            same_sign = (kc & 0x80) == (mc & 0x80)
            kv, mv = decode(kc, "e4m3").double(), decode(mc, "e4m3").double()
            row[name] = {
                "agreement": (~diff)[valid].double().mean().item(),
                "mismatches": int(diff.sum()), "elements": int(valid.sum()),
                "one_step_apart": int((diff & same_sign & (step == 1)).sum()),
                "kernel_larger": int((diff & (kv > mv)).sum()),
            }
        rows.append(row)
        print(json.dumps(row), flush=True)
        tm._RUNS.clear()

    from dmref.kernels.api import attention_forward, attention_backward, Shape
    torch.manual_seed(0)
    b, h, n, d = 4, 16, 4096, 128
    q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale = 1 / math.sqrt(d)
    o, _, saved, _ = attention_forward(q, k, v, scale=scale)
    t_fwd = triton.testing.do_bench(lambda: attention_forward(q, k, v, scale=scale, for_backward=False))
    t_bwd = triton.testing.do_bench(lambda: attention_backward(saved, o, do, shape=Shape.of(q, k, v),
                                                               causal=False, scale=scale))
    result = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "triton": triton.__version__,
              "fp_fusion": not args.no_fp_fusion, "cases": rows,
              "ms_4x16x4096x128": {"forward_e2e": t_fwd, "backward_matched": t_bwd}}
    os.makedirs(args.out, exist_ok=True)
    from bench_attention import device_tag

    name = f"{device_tag()}_code_agreement{'_nofusion' if args.no_fp_fusion else ''}.json"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["ms_4x16x4096x128"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
