"""Capture cuDNN's FP8 attention (forward with softmax stats, backward) on a Hopper GPU, bit for bit.

    python captures/capture_cudnn_fp8.py --out DIR [--name FILE.npz] [--seed S]
        [--shapes "B,H,HKV,N,D;..."] [--causal no|yes|both] [--grad-formats e4m3,e5m2]

Needs nvidia-cudnn-frontend (``pip install 'dmref[cudnn]'``, or the wheel on PYTHONPATH) and a
GPU of compute capability 9.x. For every problem (BF16 inputs with a wide exponent range,
outlier channels and peaked rows; fixed seed), causal flag and gradient format it runs
:func:`dmref.cudnn.target.cudnn_fp8_forward` and :func:`dmref.cudnn.target.cudnn_fp8_backward` and
writes everything cuDNN consumed and produced into ONE file, DIR/NAME (default
h200_cudnn_fp8_sdpa.npz; its ``about`` entry describes the layout), then prints the rel-L2 errors
of O, dQ, dK, dV against float64 attention of the dequantized FP8 inputs. A case that fails is
reported and recorded (``meta`` JSON, ``error``); the others go on. The file is rewritten after
every case, so a run stopped part-way leaves the cases it captured. Exit status 0 when every case
ran, 1 otherwise, 2 on bad arguments or when cuDNN's FP8 attention cannot run here at all (no
``import cudnn``, no Hopper GPU: one line on stderr, no file written).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch

import dmref.cudnn.target as targets

DEFAULT_SHAPES = "1,2,2,128,128;1,2,1,200,128;2,2,2,256,128"
FILE_NAME = "h200_cudnn_fp8_sdpa.npz"
SCALARS = ("scale_q", "descale_q", "amax_q", "scale_k", "descale_k", "amax_k", "scale_v", "descale_v", "amax_v",
           "scale_s", "descale_s", "amax_s", "scale_o", "descale_o", "amax_o", "amax_o_calibration",
           "scale_dO", "descale_dO", "amax_dO_input", "scale_dP", "descale_dP", "amax_dP", "amax_dP_calibration",
           "scale_dQ", "scale_dK", "scale_dV", "amax_dQ", "amax_dK", "amax_dV",
           "amax_dQ_calibration", "amax_dK_calibration", "amax_dV_calibration")
CODES = ("q_fp8", "k_fp8", "v_fp8", "o_fp8", "do_fp8", "dq_fp8", "dk_fp8", "dv_fp8")

ABOUT = f"""cuDNN FP8 scaled-dot-product attention (pygraph.sdpa_fp8 + sdpa_fp8_backward), per-tensor
current scaling as dmref.cudnn.target.cudnn_fp8 does it (read that module's docstring for the rules).
All tensors are in logical (batch, heads, seqlen, head_dim) order, C-contiguous (cuDNN ran on
BSHD storage of the same values). Keys:
  meta                JSON: versions, device, seed, problems, and per case: problem index, causal,
                      attn_scale, grad_format, ok, error, rel-L2 errors vs float64 attention of the
                      dequantized FP8 inputs.
  p<j>.q/k/v/do       problem j's inputs as stored, bfloat16 bit patterns (uint16); k, v have
                      kv_heads heads (GQA: query head h reads kv head h // (heads // kv_heads)).
  c<i>.problem        int, the problem index j of case i;  c<i>.causal bool (top-left, SDPA's
                      is_causal);  c<i>.attn_scale float64;  c<i>.grad_format str (dO, dQ, dK, dV).
  c<i>.<name>_fp8     FP8 codes (uint8) cuDNN consumed (q, k, v: E4M3; do: grad_format) and
                      produced (o: E4M3; dq, dk, dv: grad_format): {", ".join(CODES)}.
  c<i>.stats          float32 (B, H, Nq): the softmax stats cuDNN's forward returned and its backward
                      read (natural-log LSE of attn_scale * descale_q * descale_k * Q_fp8 K_fp8^T).
  c<i>.<scalar>       float32 scalars: what cuDNN was given (scale_*/descale_*) and returned (amax_*,
                      final run); *_calibration: the amax of the calibrating run that set a scale
                      (scale_o = 448 / amax_o_calibration, scale_dP = 448 / amax_dP_calibration,
                      scale_dX = fmax / amax_dX_calibration); amax_q/k/v/dO_input: of the inputs.
                      The calibrating runs had unit scales; amax_X == amax_X_calibration says cuDNN
                      takes amax before scaling (meta errors.amax_drift).
                      {", ".join(SCALARS)}.
Dequantize: value = code * descale (descale_dX = 1 / scale_dX)."""


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    shapes = []
    for item in filter(None, (s.strip() for s in text.split(";"))):
        try:
            shape = tuple(int(x) for x in item.split(","))
        except ValueError:
            shape = ()
        if len(shape) != 5 or min(shape) < 1 or shape[1] % shape[2] != 0:
            raise ValueError(f"shape {item!r} must be B,H,HKV,N,D: five positive integers with H a multiple of HKV")
        shapes.append(shape)
    if not shapes:
        raise ValueError(f"--shapes {text!r} names no shape")
    return shapes


def make_inputs(g: torch.Generator, b, h, hkv, n, d):
    """BF16 q, k, v, dO: per-token magnitudes spread over 2^-6..2^6 (log-normal), two outlier
    channels of K x16 (and Q's x1/4), every 5th query row x8 (peaked softmax rows), V with
    log-normal per-channel scales, every 7th row of dO 2^-10 smaller."""
    def lognormal(*shape, sigma):
        return torch.exp2((torch.randn(*shape, generator=g) * sigma).clamp_(-6, 6))

    q = torch.randn(b, h, n, d, generator=g) * lognormal(b, h, n, 1, sigma=1.5)
    k = torch.randn(b, hkv, n, d, generator=g) * lognormal(b, hkv, n, 1, sigma=1.0)
    ch = torch.randperm(d, generator=g)[:2]
    k[..., ch] *= 16
    q[..., ch] /= 4
    q[:, :, ::5] *= 8
    v = torch.randn(b, hkv, n, d, generator=g) * lognormal(1, 1, 1, d, sigma=1.5)
    do = torch.randn(b, h, n, d, generator=g) * lognormal(b, h, n, 1, sigma=1.0)
    do[:, :, 3::7] *= 2.0**-10
    return tuple(t.to(torch.bfloat16) for t in (q, k, v, do))


def reference(q, k, v, do, causal, attn_scale):
    """float64 attention and its gradients (autograd), GQA by repeat_interleave, top-left causal."""
    q, k, v = (t.double().requires_grad_(True) for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    kk, vv = (t.repeat_interleave(group, dim=1) for t in (k, v))
    s = (q @ kk.transpose(-1, -2)) * attn_scale
    if causal:
        nq, nk = s.shape[-2:]
        s = s.masked_fill(torch.ones(nq, nk, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    o = torch.softmax(s, dim=-1) @ vv
    o.backward(do.double())
    return o.detach(), q.grad, k.grad, v.grad, lse.detach()


def rel_l2(x, ref) -> float:
    ref = ref.double()
    den = ref.norm().item()
    return (x.double() - ref).norm().item() / den if den > 0 else float("nan")


def run_case(i, j, inputs, causal, grad_format, arrays) -> dict:
    """Run case i (problem j) on the GPU, store its arrays as c<i>.*, return its meta entry."""
    targets.require_cudnn_fp8()
    q, k, v, do = (t.cuda() for t in inputs)
    attn_scale = 1.0 / math.sqrt(q.shape[-1])
    fwd = targets.cudnn_fp8_forward(q, k, v, causal=causal, scale=attn_scale, grad_format=grad_format)
    bwd = targets.cudnn_fp8_backward(fwd, do)
    torch.cuda.synchronize()
    rec = {**fwd, **bwd}
    pre = f"c{i}."
    arrays[pre + "problem"] = np.int64(j)
    arrays[pre + "causal"] = np.bool_(causal)
    arrays[pre + "attn_scale"] = np.float64(attn_scale)
    arrays[pre + "grad_format"] = np.str_(grad_format)
    for name in CODES:
        arrays[pre + name] = rec[name].contiguous().view(torch.uint8).cpu().numpy()
    arrays[pre + "stats"] = rec["stats"][..., 0].cpu().numpy()
    for name in SCALARS:
        arrays[pre + name] = np.float32(rec[name].item())

    deq = {n: rec[f"{n}_fp8"].double() * rec[f"descale_{s}"].double().reshape(())
           for n, s in (("q", "q"), ("k", "k"), ("v", "v"), ("do", "dO"))}
    o_ref, dq_ref, dk_ref, dv_ref, lse_ref = reference(deq["q"], deq["k"], deq["v"], deq["do"], causal, attn_scale)
    got = {"o": rec["o_fp8"].double() * rec["descale_o"].double().reshape(())}
    for n in ("q", "k", "v"):
        got[f"d{n}"] = rec[f"d{n}_fp8"].double() / rec[f"scale_d{n.upper()}"].double().reshape(())
    errors = {"o": rel_l2(got["o"], o_ref), "dq": rel_l2(got["dq"], dq_ref), "dk": rel_l2(got["dk"], dk_ref),
              "dv": rel_l2(got["dv"], dv_ref),
              "stats_max_abs": (rec["stats"][..., 0].double() - lse_ref).abs().max().item()}
    # 0 when cuDNN's amax outputs are taken before scaling (dmref.cudnn.target's assumption) and the
    # runs repeat bit for bit
    pairs = [(rec[f"amax_{n}"].item(), rec[f"amax_{n}_calibration"].item()) for n in ("o", "dP", "dQ", "dK", "dV")]
    errors["amax_drift"] = max(abs(a / c - 1) if c else float(a != 0) for a, c in pairs)
    return {"case": i, "problem": j, "causal": causal, "attn_scale": attn_scale, "grad_format": grad_format,
            "ok": True, "error": "", "errors": errors}


def versions() -> dict:
    info = {"torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import cudnn

        info["cudnn_frontend"] = getattr(cudnn, "__version__", "?")
        info["cudnn_backend"] = cudnn.backend_version_string()
    except Exception as e:  # noqa: BLE001 - recorded, the cases then report the failure
        info["cudnn_frontend"] = f"unavailable: {type(e).__name__}: {e}"
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    return info


def _write(path: str, arrays: dict, meta: dict) -> None:
    arrays["meta"] = np.str_(json.dumps(meta))
    tmp = path[:-len(".npz")] + ".partial.npz"
    np.savez_compressed(tmp, **arrays)
    os.replace(tmp, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--name", default=FILE_NAME, help=f"output file name in --out (default {FILE_NAME})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"B,H,HKV,N,D;... (default {DEFAULT_SHAPES})")
    ap.add_argument("--causal", choices=("no", "yes", "both"), default="both")
    ap.add_argument("--grad-formats", default="e4m3,e5m2", help="formats of dO and dQ/dK/dV (default e4m3,e5m2)")
    args = ap.parse_args(argv)
    try:
        shapes = parse_shapes(args.shapes)
        formats = [f.strip() for f in args.grad_formats.split(",") if f.strip()]
        bad = [f for f in formats if f not in targets.GRAD_FORMATS]
        if bad or not formats:
            raise ValueError(f"--grad-formats {args.grad_formats!r}: accepted {', '.join(targets.GRAD_FORMATS)}")
        if not args.name.endswith(".npz") or os.sep in args.name:
            raise ValueError(f"--name {args.name!r} must be a file name ending in .npz")
    except ValueError as e:
        print(f"capture_cudnn_fp8: error: {e}", file=sys.stderr)
        return 2
    try:
        targets.require_cudnn_fp8()
    except targets.TargetUnavailable as e:
        print(f"capture_cudnn_fp8: error: cuDNN's FP8 attention cannot run here: {e}", file=sys.stderr)
        return 2
    causals = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
    os.makedirs(args.out, exist_ok=True)
    meta = {"versions": versions(), "seed": args.seed, "problems": [list(s) for s in shapes], "cases": []}
    print(json.dumps(meta["versions"]), flush=True)
    g = torch.Generator().manual_seed(args.seed)
    arrays = {"about": np.str_(ABOUT)}
    problems = []
    for j, (b, h, hkv, n, d) in enumerate(shapes):
        problems.append(make_inputs(g, b, h, hkv, n, d))
        for name, t in zip(("q", "k", "v", "do"), problems[-1]):
            arrays[f"p{j}.{name}"] = t.view(torch.uint16).numpy()
    path = os.path.join(args.out, args.name)
    i = 0
    for j, inputs in enumerate(problems):
        for causal in causals:
            for fmt in formats:
                t0 = time.perf_counter()
                label = f"case {i}: problem {j} {'x'.join(map(str, shapes[j]))} causal={causal} grad={fmt}"
                try:
                    entry = run_case(i, j, inputs, causal, fmt, arrays)
                    errs = entry["errors"]
                    print(f"{label}: rel-L2 O {errs['o']:.3e} dQ {errs['dq']:.3e} dK {errs['dk']:.3e} "
                          f"dV {errs['dv']:.3e}, |stats - LSE| <= {errs['stats_max_abs']:.2e}, "
                          f"amax final/calibration - 1 <= {errs['amax_drift']:.1e} "
                          f"({time.perf_counter() - t0:.1f} s)", flush=True)
                except Exception as e:  # noqa: BLE001 - report, record, go on
                    msg = f"{type(e).__name__}: " + " ".join(str(e).split())
                    entry = {"case": i, "problem": j, "causal": causal, "grad_format": fmt, "ok": False,
                             "error": msg[:2000]}
                    for key in [k for k in arrays if k.startswith(f"c{i}.")]:
                        del arrays[key]
                    print(f"{label}: FAILED {msg[:500]}", flush=True)
                meta["cases"].append(entry)
                i += 1
                _write(path, arrays, meta)  # after every case: a run stopped part-way keeps what it captured
    ok = sum(c["ok"] for c in meta["cases"])
    print(f"wrote {path} ({os.path.getsize(path) / 2**20:.2f} MiB): {ok} of {len(meta['cases'])} cases ran",
          flush=True)
    return 0 if ok == len(meta["cases"]) else 1


if __name__ == "__main__":
    sys.exit(main())
