"""Dump torch SDPA's BF16 outputs and gradients on the oracle's cases, for analysis on the CPU.

    python captures/gpu_dump_sdpa.py --out DIR [--cases peaked_rows,realistic] [--size standard]

For each case (dmref.oracle.make_cases, BF16) and each backend (flash, cuDNN, math) writes the
inputs and out, dQ, dK, dV (and flash's and cuDNN's LSE from their aten ops, where they run)
into DIR/sdpa_dump.pt. Its flash ``peaked_rows`` entries are tests/data/h200_sdpa_flash_peaked_rows.pt,
which tests/oracle/test_flash_h200_replay.py replays on the CPU to explain the flash backend's dQ
there (docs/oracle.md).
"""

from __future__ import annotations

import argparse
import os

import torch


def _run(backend, c):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    q, k, v = (t.detach().cuda().requires_grad_() for t in (c.q, c.k, c.v))
    with sdpa_kernel(getattr(SDPBackend, backend)):
        out = scaled_dot_product_attention(q, k, v, is_causal=c.causal, scale=c.scale)
    out.backward(c.dout.cuda())
    return {"out": out.detach().cpu(), "dq": q.grad.cpu(), "dk": k.grad.cpu(), "dv": v.grad.cpu()}


def _lse(backend, c):
    q, k, v = (t.cuda() for t in (c.q, c.k, c.v))
    if backend == "FLASH_ATTENTION":
        res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, c.causal, False, scale=c.scale)
        return res[1].cpu()
    if backend == "CUDNN_ATTENTION":
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, c.causal, False,
                                                                 scale=c.scale)
        return res[1].cpu()
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="peaked_rows,realistic,flat_rows")
    ap.add_argument("--size", default="standard")
    args = ap.parse_args()
    from dmref.oracle import make_cases

    cases = make_cases(args.size, dtype=torch.bfloat16, names=args.cases.split(","))
    dump = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "cases": {}}
    for c in cases:
        entry = {"q": c.q, "k": c.k, "v": c.v, "dout": c.dout, "causal": c.causal, "scale": c.scale}
        for backend in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "MATH"):
            try:
                entry[backend] = _run(backend, c)
                lse = _lse(backend, c)
                if lse is not None:
                    entry[backend]["lse"] = lse
            except Exception as e:  # noqa: BLE001 - record and go on
                entry[backend] = {"error": f"{type(e).__name__}: {e}"}
            print(c.name, backend, "error" in entry[backend] and entry[backend]["error"] or "ok")
        dump["cases"][c.name] = entry
    os.makedirs(args.out, exist_ok=True)
    torch.save(dump, os.path.join(args.out, "sdpa_dump.pt"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
