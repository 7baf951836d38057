"""H200: the warp-specialized Gluon dkdv and dq kernels (dmref/kernels/bwd_ws.py) against the Triton ones,
bit for bit and in time, beside cuDNN BF16's backward. One JSON line per result, in
$OUT/bwd_ws_probe.jsonl (the current directory without $OUT).

    PYTHONPATH=benchmarks python dev/gpu_bwd_ws_probe.py   # bench_attention's timing (dev/README.md)

A smoke test runs each Gluon kernel first on two small problems (45 s limit each; the kernel whose
smoke test fails is not run afterwards, the Triton kernels and cuDNN still are), then each shape
runs in a process of its own with a time limit (a pipeline deadlock in a new kernel must not stop
the probe), both causal and not, on the wide-range inputs of the tests (outlier channels, per-head
magnitudes 2**-6 .. 2**6). Lines:

- ``check="correct"``: dK and dV of ``bwd_ws.dkdv`` against the Triton kernel's (``bwd.backward``,
  recipe delta_matching, on the same matched D): max |diff|, the fraction of equal values and of
  equal bits (BF16), dQ and D equal between ``bwd.backward`` and ``bwd_ws.backward_ws``; dQ and D of
  ``bwd_ws.dq`` against the Triton dq kernel's (delta_matching, and dQ for naive_fp8), the same
  fractions, and the whole backward with both Gluon kernels (``backward_ws(kernels=("dq", "dkdv"))``)
  equal to ``bwd.backward``;
- ``check="speed"``: ``triton.testing.do_bench`` medians in ms (bench_attention's ``bench``) of
  the Triton dkdv alone, the Gluon dkdv alone (and its overlapped, 3-stage and device-side
  descriptor forms), the Triton dq and the Gluon dq alone (delta_matching, with kbar, and
  naive_fp8), the whole ``bwd.backward``, ``bwd_ws.backward_ws`` (``ws_bwd``: Triton dq, Gluon
  dkdv; ``ws2_bwd``: both Gluon; delta_matching: dq then dkdv; ``ws2_bwd_stale``: both Gluon,
  naive_fp8), and cuDNN BF16 SDPA's backward;
  TFLOP/s with the backward's 2.5 x 4·B·H·N²·D FLOPs (dkdv alone: its four matmuls, 8·B·H·N²·D;
  dq alone: its three, 6·B·H·N²·D, kbar's not counted; its overlapped schedules ``gluon_dq_ov1``,
  ``gluon_dq_ov3`` (and stale), ``gluon_dq_ov2`` at D = 64), halved when causal.
"""
import json
import math
import os
import subprocess
import sys
import time

import torch

OUT = os.environ.get("OUT", ".")
PATH = os.path.join(OUT, "bwd_ws_probe.jsonl")
SHAPES = [(4, 16, 16, 4096, 128), (1, 16, 16, 16384, 128), (4, 32, 32, 4096, 64), (1, 32, 8, 8192, 128)]
#: seconds for the whole probe (DMREF_PROBE_BUDGET_S overrides), and for one shape's process
BUDGET_S, SHAPE_S = int(os.environ.get("DMREF_PROBE_BUDGET_S", 230)), 110


def emit(**r):
    line = json.dumps(r)
    print(line, flush=True)
    with open(PATH, "a") as f:
        f.write(line + "\n")


def inputs(b, h, hkv, n, d, seed=0):
    """randn with every 16th channel of q and k 3x, and per-head magnitudes 2**-6 .. 2**6."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, h, n, d, device="cuda", generator=g)
    k = torch.randn(b, hkv, n, d, device="cuda", generator=g)
    v = torch.randn(b, hkv, n, d, device="cuda", generator=g)
    do = torch.randn(b, h, n, d, device="cuda", generator=g)
    q[..., ::16] *= 3
    k[..., ::16] *= 3

    def spread(x, heads):
        return x * torch.exp2(torch.randint(-6, 7, (1, heads, 1, 1), device="cuda", generator=g).float())

    return [t.bfloat16() for t in (spread(q, h), spread(k, hkv), spread(v, hkv), spread(do, h))]


def smoke(kernel="dkdv"):
    """The Gluon ``kernel`` (dkdv or dq) on two small problems (a tail with GQA at D = 128,
    causal; D = 64): it returns, and equals the Triton kernel."""
    from dmref.kernels import api, bwd, bwd_ws
    from dmref.kernels.config import SPECS
    from dmref.kernels.quantize import quantize

    r = SPECS["kernels_delta_matching"]
    for (b, h, hkv, n, d, causal) in [(1, 2, 1, 203, 128, True), (1, 4, 4, 777, 64, False)]:
        q, k, v, do = inputs(b, h, hkv, n, d)
        o, _, saved, _ = api.attention_forward(q, k, v, causal=causal, recipe=r)
        do8, d_stale = quantize(do, r.recipe.do_dp.fmt.name, rows=True, cols=True, delta_with=o)
        dims = dict(batch=b, heads=h, kv_heads=hkv, n=n, head_dim=d, causal=causal, scale=d ** -0.5)
        dq, dk, dv, dbg = bwd.backward(saved, do8, do8, d_stale, recipe=r, **dims)
        if kernel == "dq":
            dq2, delta2 = bwd_ws.dq(saved, do8, d_stale, recipe=r, **dims)
            torch.cuda.synchronize()
            emit(check="smoke", kernel="dq", shape=[b, h, hkv, n, d], causal=causal,
                 dq_equal=bool(torch.equal(dq, dq2)), delta_equal=bool(torch.equal(dbg["delta"], delta2)),
                 dq_max_abs_diff=(dq.float() - dq2.float()).abs().max().item())
            continue
        dk2, dv2 = bwd_ws.dkdv(saved, do8, do8, dbg["delta"], recipe=r, **dims)
        torch.cuda.synchronize()
        emit(check="smoke", kernel="dkdv", shape=[b, h, hkv, n, d], causal=causal, dk_equal=bool(torch.equal(dk, dk2)),
             dv_equal=bool(torch.equal(dv, dv2)),
             dk_max_abs_diff=(dk.float() - dk2.float()).abs().max().item(),
             dv_max_abs_diff=(dv.float() - dv2.float()).abs().max().item())


def _compare(c, name, got, want, int_view):
    """Into ``c``: max |diff|, equal values' and equal bits' fractions, finiteness of ``got``."""
    c[name + "_max_abs_diff"] = (got.float() - want.float()).abs().max().item()
    c[name + "_equal_fraction"] = (got == want).float().mean().item()
    c[name + "_bit_equal_fraction"] = (got.view(int_view) == want.view(int_view)).float().mean().item()
    c[name + "_finite"] = bool(torch.isfinite(got).all())


def run_shape(b, h, hkv, n, d, gluon=True, gluon_dq=True):
    from bench_attention import bench  # the product benchmark's timing

    from dmref.kernels import api, bwd, bwd_ws
    from dmref.kernels.config import SPECS
    from dmref.kernels.quantize import quantize

    r_m, r_s = SPECS["kernels_delta_matching"], SPECS["kernels_naive_fp8"]
    scale = 1.0 / math.sqrt(d)
    for causal in (False, True):
        t0 = time.time()
        shape = dict(shape=[b, h, hkv, n, d], causal=causal)
        q, k, v, do = inputs(b, h, hkv, n, d)
        o, _, saved, _ = api.attention_forward(q, k, v, causal=causal, scale=scale, recipe=r_m)
        do8, d_stale = quantize(do, r_m.recipe.do_dp.fmt.name, rows=True, cols=True, delta_with=o)
        dims = dict(batch=b, heads=h, kv_heads=hkv, n=n, head_dim=d, causal=causal, scale=scale)
        dq, dk, dv, dbg = bwd.backward(saved, do8, do8, d_stale, recipe=r_m, **dims)
        delta = dbg["delta"]
        c = dict(check="correct", **shape)
        try:
            if not gluon:
                raise RuntimeError("the smoke test of the Gluon kernel failed: not run")
            dk_ws, dv_ws = bwd_ws.dkdv(saved, do8, do8, delta, recipe=r_m, **dims)
            torch.cuda.synchronize()
            for name, got, want in (("dk", dk_ws, dk), ("dv", dv_ws, dv)):
                _compare(c, name, got, want, torch.int16)
            dq2, dk2, dv2, dbg2 = bwd_ws.backward_ws(saved, do8, do8, d_stale, recipe=r_m, **dims)
            c["backward_ws_dq_equal"] = bool(torch.equal(dq2, dq))
            c["backward_ws_delta_equal"] = bool(torch.equal(dbg2["delta"], delta))
            c["backward_ws_dkdv_equal"] = bool(torch.equal(dk2, dk) and torch.equal(dv2, dv))
            for name, kw in (("ov1", dict(overlap=1)), ("ov2", dict(overlap=2)), ("s3", dict(stages=3)),
                             ("devdesc", dict(host_descriptors=False))):
                if name == "ov2" and d == 128:
                    continue
                dk3, dv3 = bwd_ws.dkdv(saved, do8, do8, delta, recipe=r_m, **kw, **dims)
                c[f"{name}_equal"] = bool(torch.equal(dk3, dk) and torch.equal(dv3, dv))
        except Exception as e:
            c["error"] = f"{type(e).__name__}: {e}"[:400]
        try:
            if not gluon_dq:
                raise RuntimeError("the smoke test of the Gluon dq kernel failed: not run")
            dq_ws, delta_ws = bwd_ws.dq(saved, do8, d_stale, recipe=r_m, **dims)
            torch.cuda.synchronize()
            _compare(c, "dq", dq_ws, dq, torch.int16)
            _compare(c, "delta", delta_ws, delta, torch.int32)
            dq_st, _, _, _ = bwd.backward(saved, do8, do8, d_stale, recipe=r_s, kernels=("dq",), **dims)
            dq_st_ws, _ = bwd_ws.dq(saved, do8, d_stale, recipe=r_s, **dims)
            _compare(c, "dq_stale", dq_st_ws, dq_st, torch.int16)
            for ov in (1, 2, 3):
                dq_ov, delta_ov = bwd_ws.dq(saved, do8, d_stale, recipe=r_m, overlap=ov, **dims)
                c[f"dq_ov{ov}_equal"] = bool(torch.equal(dq_ov, dq) and torch.equal(delta_ov, delta))
            del dq_ws, dq_st, dq_st_ws
            if gluon:
                dq2, dk2, dv2, dbg2 = bwd_ws.backward_ws(saved, do8, do8, d_stale, recipe=r_m, kernels=("dq", "dkdv"),
                                                         **dims)
                c["ws2_bwd_equal"] = bool(torch.equal(dq2, dq) and torch.equal(dbg2["delta"], delta)
                                          and torch.equal(dk2, dk) and torch.equal(dv2, dv))
                del dq2, dk2, dv2
        except Exception as e:
            c["dq_error"] = f"{type(e).__name__}: {e}"[:400]
        c["seconds"] = round(time.time() - t0, 1)
        emit(**c)
        del dq, dk, dv

        fl = 4 * b * h * n * n * d / (2 if causal else 1)
        s = dict(check="speed", **shape)
        timers = {
            # the naive_fp8 recipe's dkdv is the same kernel as delta_matching's (bwd.launch); it reads
            # the stale D, which kernels=("dkdv",) alone leaves valid
            "triton_dkdv": lambda: bwd.backward(saved, do8, do8, d_stale, recipe=r_s, kernels=("dkdv",), **dims),
            "gluon_dkdv": lambda: bwd_ws.dkdv(saved, do8, do8, delta, recipe=r_m, **dims),
            "gluon_dkdv_s3": lambda: bwd_ws.dkdv(saved, do8, do8, delta, recipe=r_m, stages=3, **dims),
            "gluon_dkdv_ov1": lambda: bwd_ws.dkdv(saved, do8, do8, delta, recipe=r_m, overlap=1, **dims),
            "gluon_dkdv_devdesc": lambda: bwd_ws.dkdv(saved, do8, do8, delta, recipe=r_m, host_descriptors=False,
                                                      **dims),
            "triton_dq": lambda: bwd.backward(saved, do8, do8, d_stale, recipe=r_m, kernels=("dq",), **dims),
            "gluon_dq": lambda: bwd_ws.dq(saved, do8, d_stale, recipe=r_m, **dims),
            "gluon_dq_ov1": lambda: bwd_ws.dq(saved, do8, d_stale, recipe=r_m, overlap=1, **dims),
            "gluon_dq_ov3": lambda: bwd_ws.dq(saved, do8, d_stale, recipe=r_m, overlap=3, **dims),
            "triton_dq_stale": lambda: bwd.backward(saved, do8, do8, d_stale, recipe=r_s, kernels=("dq",), **dims),
            "gluon_dq_stale": lambda: bwd_ws.dq(saved, do8, d_stale, recipe=r_s, **dims),
            "gluon_dq_stale_ov3": lambda: bwd_ws.dq(saved, do8, d_stale, recipe=r_s, overlap=3, **dims),
            "triton_bwd": lambda: bwd.backward(saved, do8, do8, d_stale, recipe=r_m, **dims),
            "ws_bwd": lambda: bwd_ws.backward_ws(saved, do8, do8, d_stale, recipe=r_m, **dims),
            "ws2_bwd": lambda: bwd_ws.backward_ws(saved, do8, do8, d_stale, recipe=r_m, kernels=("dq", "dkdv"),
                                                  **dims),
            "ws2_bwd_stale": lambda: bwd_ws.backward_ws(saved, do8, do8, d_stale, recipe=r_s,
                                                        kernels=("dq", "dkdv"), **dims),
        }
        if d == 64:  # at D = 128 it spills 0.9 KB (bwd_ws docstring)
            timers["gluon_dkdv_ov2"] = lambda: bwd_ws.dkdv(saved, do8, do8, delta, recipe=r_m, overlap=2, **dims)
            # the dq kernel's OVERLAP 2 spills about 60 B at D = 128
            timers["gluon_dq_ov2"] = lambda: bwd_ws.dq(saved, do8, d_stale, recipe=r_m, overlap=2, **dims)
        for name, fn in timers.items():
            if not gluon and name.startswith(("gluon_dkdv", "ws")):
                continue
            if not gluon_dq and name.startswith(("gluon_dq", "ws2")):
                continue
            try:
                s[name + "_ms"] = bench(fn)
            except Exception as e:
                s[name + "_error"] = f"{type(e).__name__}: {e}"[:300]
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel
            import torch.nn.functional as F

            g = h // hkv
            qg = q.detach().clone().requires_grad_()
            kg = k.repeat_interleave(g, 1).detach().requires_grad_()
            vg = v.repeat_interleave(g, 1).detach().requires_grad_()
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
                s["cudnn_bf16_bwd_ms"] = bench(lambda: out.backward(do, retain_graph=True), grad_to_none=[qg, kg, vg])
            del out, qg, kg, vg
        except Exception as e:
            s["cudnn_error"] = f"{type(e).__name__}: {e}"[:300]
        for key in list(s):
            if key.endswith("_ms"):
                name = key[:-3]
                work = 2 * fl if "dkdv" in name else 1.5 * fl if "_dq" in name else 2.5 * fl
                s[name + "_tflops"] = work / s[key] / 1e9
        s["seconds"] = round(time.time() - t0, 1)
        emit(**s)
        del saved, do8, o
        torch.cuda.empty_cache()


def summary():
    rows = [json.loads(line) for line in open(PATH)] if os.path.exists(PATH) else []
    start = max((i for i, r in enumerate(rows) if r.get("check") == "env"), default=0)
    print("\nshape causal | dkdv: triton ms, gluon ms (x) | dq: triton ms, gluon ms (x) | bwd: triton ms, ws ms (x), "
          "ws2 ms (x) | ws2 bwd vs cuDNN BF16 | dK/dV equal | dQ/D equal")
    correct = {(tuple(r["shape"]), r["causal"]): r for r in rows[start:] if r.get("check") == "correct"}
    for r in rows[start:]:
        if r.get("check") != "speed":
            continue
        c = correct.get((tuple(r["shape"]), r["causal"]), {})

        def f(key):
            return f"{r[key]:.3f}" if key in r else "-"

        def ratio(a, b):
            return f"{r[a] / r[b]:.2f}x" if a in r and b in r else "-"

        eq = (f"{c.get('dk_equal_fraction', float('nan')):.6f}/{c.get('dv_equal_fraction', float('nan')):.6f}"
              if "dk_equal_fraction" in c else c.get("error", "-")[:60])
        eq_dq = (f"{c.get('dq_equal_fraction', float('nan')):.6f}/{c.get('delta_equal_fraction', float('nan')):.6f}"
                 if "dq_equal_fraction" in c else c.get("dq_error", "-")[:60])
        print(f"{r['shape']} {r['causal']!s:5} | {f('triton_dkdv_ms')}, {f('gluon_dkdv_ms')} "
              f"({ratio('triton_dkdv_ms', 'gluon_dkdv_ms')}) | {f('triton_dq_ms')}, {f('gluon_dq_ms')} "
              f"({ratio('triton_dq_ms', 'gluon_dq_ms')}) | {f('triton_bwd_ms')}, {f('ws_bwd_ms')} "
              f"({ratio('triton_bwd_ms', 'ws_bwd_ms')}), {f('ws2_bwd_ms')} ({ratio('triton_bwd_ms', 'ws2_bwd_ms')}) | "
              f"{ratio('cudnn_bf16_bwd_ms', 'ws2_bwd_ms')} | {eq} | {eq_dq}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--shape":
        run_shape(*map(int, sys.argv[2].split(",")), gluon=sys.argv[3] == "1", gluon_dq=sys.argv[4] == "1")
        raise SystemExit(0)
    if len(sys.argv) > 1 and sys.argv[1] == "--smoke":
        smoke(sys.argv[2])
        raise SystemExit(0)
    import triton

    t0 = time.time()
    emit(check="env", torch=torch.__version__, triton=triton.__version__, gpu=torch.cuda.get_device_name())
    ok = {}
    for kernel in ("dkdv", "dq"):
        ok[kernel] = False
        try:
            p = subprocess.run([sys.executable, __file__, "--smoke", kernel], timeout=45, capture_output=True,
                               text=True)
            ok[kernel] = p.returncode == 0
            if not ok[kernel]:
                emit(check="error", smoke=kernel, rc=p.returncode, stderr=p.stderr[-2000:])
        except subprocess.TimeoutExpired:
            emit(check="error", smoke=kernel, error="timed out after 45 s (deadlock?)")
    for shape in SHAPES:
        left = BUDGET_S - (time.time() - t0)
        if left < 20:
            emit(check="skipped", shape=list(shape), reason=f"probe budget of {BUDGET_S} s spent")
            continue
        arg = ",".join(map(str, shape))
        try:
            p = subprocess.run([sys.executable, __file__, "--shape", arg, str(int(ok["dkdv"])), str(int(ok["dq"]))],
                               timeout=min(SHAPE_S, left), capture_output=True, text=True)
            if p.returncode:
                emit(check="error", shape=list(shape), rc=p.returncode, stderr=p.stderr[-1500:])
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            emit(check="error", shape=list(shape), error=f"timed out after {e.timeout:.0f} s (deadlock?)",
                 stdout_tail=out[-600:])
    emit(check="time", seconds=round(time.time() - t0, 1))
    summary()
