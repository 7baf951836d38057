"""H200: the warp-specialized forward (dmref/kernels/fwd_ws.py) against float64 and the Triton forward,
and its speed beside cuDNN BF16 and cuDNN FP8 in one process. One JSON line per result, in
``$OUT/fwd_ws_probe.jsonl`` (appended; ``OUT`` defaults to this folder):

    PYTHONPATH=benchmarks python dev/gpu_fwd_ws_probe.py            # variants' checks, accuracy, speed, length
    PYTHONPATH=benchmarks python dev/gpu_fwd_ws_probe.py --length   # only the speed against the sequence length

benchmarks/ on PYTHONPATH: the timing and the cuDNN FP8 anchors are bench_attention's (dev/README.md).
"""
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench_attention import bench, cudnn_fp8_timers  # the product benchmark's timing and anchors

from dmref.kernels import api, fwd as fwd_mod, fwd_ws
from dmref.kernels.config import SPECS

OUT = os.environ.get("OUT", ".")
LOG = open(os.path.join(OUT, "fwd_ws_probe.jsonl"), "a")


def emit(**r):
    line = json.dumps(r)
    print(line, flush=True)
    LOG.write(line + "\n")
    LOG.flush()


def inputs(b, h, hkv, n, d, seed=0, wide=True):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, h, n, d, device="cuda", generator=g)
    k = torch.randn(b, hkv, n, d, device="cuda", generator=g)
    v = torch.randn(b, hkv, n, d, device="cuda", generator=g)
    if wide:  # outlier channels and per-head magnitudes over a wide exponent range
        q[..., ::16] *= 8
        k[..., 3::16] *= 8
        q *= torch.exp2(torch.randint(-6, 6, (1, h, 1, 1), device="cuda", generator=g).float())
        v *= torch.exp2(torch.randint(-10, 10, (1, hkv, 1, 1), device="cuda", generator=g).float())
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def speed(shapes, variants):
    for (b, h, hkv, n, d) in shapes:
        for causal in (False, True):
            fl = 4 * b * h * n * n * d / (2 if causal else 1)
            tf = lambda ms: fl / ms / 1e9
            q, k, v = inputs(b, h, hkv, n, d, wide=False)
            r = dict(check="speed", shape=[b, h, hkv, n, d], causal=causal)
            g = h // hkv
            try:
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
                    r["cudnn_bf16_fwd"] = tf(bench(lambda: F.scaled_dot_product_attention(q, kk, vv, is_causal=causal)))
            except Exception as e:
                r["cudnn_bf16_error"] = repr(e)[:200]
            if d == 128 and g == 1:
                try:
                    ff, fb = cudnn_fp8_timers(q, k, v, torch.randn_like(q), causal)
                    r["cudnn_fp8_fwd"] = tf(bench(ff))
                    r["cudnn_fp8_bwd"] = 2.5 * tf(bench(fb))
                except Exception as e:
                    r["cudnn_fp8_error"] = repr(e)[:300]
            try:
                o, lse, saved, _ = api.attention_forward(q, k, v, causal=causal, recipe="kernels_delta_matching")
                dims = dict(batch=b, heads=h, kv_heads=hkv, n=n, head_dim=d)
                r["triton_fwd_kernel"] = tf(bench(lambda: fwd_mod.forward(saved.q, saved.k, saved.v, causal=causal,
                                                                         scale=d ** -0.5, recipe=SPECS["kernels_delta_matching"], **dims)))
                r["triton_fwd_incl_quant"] = tf(bench(lambda: api.attention_forward(
                    q, k, v, causal=causal, recipe="kernels_delta_matching", for_backward=False)))
            except Exception as e:
                r["triton_error"] = repr(e)[:200]
            from dmref.kernels.quantize import quantize_kv_folded
            r["quantize_kv_folded_ms"] = bench(lambda: quantize_kv_folded(k, v))
            for vname in variants:
                tiles = VARIANTS[vname]
                tag = vname
                try:
                    o, lse2, kv = fwd_ws.attention_forward(q, k, v, causal=causal, **tiles)
                    r[tag + "_kernel"] = tf(bench(lambda: fwd_ws.forward(
                        q, kv.k8, kv.k_scale, kv.vt8, kv.v_scale, kv_heads=hkv, causal=causal, scale=d ** -0.5,
                        **tiles)))
                    r[tag + "_incl_quant"] = tf(bench(lambda: fwd_ws.attention_forward(q, k, v, causal=causal, **tiles)))
                except Exception as e:
                    r[tag + "_error"] = f"{type(e).__name__}: {e}"[:300]
            emit(**r)
            torch.cuda.empty_cache()


VARIANTS = {
    "serial_promoted": dict(chain=False, overlap=False),
    # the folded recipes' schedule (at D = 128 PV's tile in the registers of the S tile it follows)
    "ov_promoted": dict(chain=False, overlap=True),
    "serial_chained": dict(chain=True, overlap=False),
    "ov_chained": dict(chain=True, overlap=True),
    # K's and V's TMA descriptors built on the host once a launch instead of in every CTA
    "ov_chained_host": dict(chain=True, overlap=True, host_descriptors=True),
    "ov_promoted_host": dict(chain=False, overlap=True, host_descriptors=True),
}


def check_variant(name):
    """Outputs of one variant against serial_promoted (the `vs_v1` keys) and float64 on small cases (run in a process of its own)."""
    for (b, h, hkv, n, d, causal) in [(2, 4, 4, 1000, 128, False), (1, 8, 2, 777, 64, True),
                                      (1, 2, 1, 203, 128, True), (1, 4, 4, 4096, 128, True), (1, 2, 2, 64, 64, False)]:
        q, k, v = inputs(b, h, hkv, n, d)
        o1, l1, _ = fwd_ws.attention_forward(q, k, v, causal=causal, **VARIANTS["serial_promoted"])
        o, l2, _ = fwd_ws.attention_forward(q, k, v, causal=causal, **VARIANTS[name])
        torch.cuda.synchronize()
        g = h // hkv
        ref = F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(g, 1),
                                             v.double().repeat_interleave(g, 1), is_causal=causal)
        emit(check="variant", variant=name, shape=[b, h, hkv, n, d], causal=causal, vs_v1=rel(o, o1),
             lse_vs_v1=(l1 - l2).abs().max().item(), o_err=rel(o, ref), o_err_v1=rel(o1, ref),
             finite=bool(torch.isfinite(o).all()))


def accuracy():
    """O against float64: promoted and chained PV, the Triton forward, cuDNN FP8, on the same
    inputs: outlier channels (``channels``) and long averages of a V whose channels have one sign
    (``dc``)."""
    from dmref.cudnn import target as targets

    for (b, h, n, d, causal, kind) in [(1, 8, 4096, 128, False, "channels"), (1, 4, 16384, 128, True, "channels"),
                                       (1, 4, 16384, 128, False, "channels"), (1, 4, 4096, 128, False, "dc"),
                                       (1, 4, 16384, 128, False, "dc")]:
        q, k, v = inputs(b, h, h, n, d, wide=False)
        if kind == "dc":  # logits near zero and V's channels of one sign (cpu_pv_accuracy.py's dc)
            q, k, v = q * 0.1, k * 0.1, 1 + v / 4
        else:
            q[..., ::16] *= 4
            k[..., ::16] *= 4
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)
        r = dict(check="accuracy", shape=[b, h, n, d], causal=causal, inputs=kind)
        for name in ("serial_promoted", "ov_promoted", "ov_chained"):
            o, _, _ = fwd_ws.attention_forward(q, k, v, causal=causal, **VARIANTS[name])
            r[name] = rel(o, ref)
            r[name + "_mean_ratio"] = (o.double() * ref).sum().item() / (ref * ref).sum().item()
        o, _, _, _ = api.attention_forward(q, k, v, causal=causal, recipe="kernels_delta_matching", for_backward=False)
        r["triton_fine"] = rel(o, ref)
        try:
            f = targets.cudnn_fp8_forward(q, k, v, causal=causal)
            o = targets.dequantize(f["o_fp8"], f["descale_o"], torch.float32)
            r["cudnn_fp8"] = rel(o, ref)
            r["cudnn_fp8_mean_ratio"] = (o.double() * ref).sum().item() / (ref * ref).sum().item()
        except Exception as e:
            r["cudnn_fp8_error"] = repr(e)[:200]
        emit(**r)


def length():
    """The shipped kernel's speed against the sequence length at a fixed token count (B·N =
    16,384, non-causal): every shape launches the same number of CTAs (B·H·N/64), each over N/128
    key tiles, so the time per key tile is ``ms / (B·H·N/64 · N/128)`` and what does not shrink with
    N is what each CTA spends outside its loop (Q's quantization, the pipeline's fill, the
    epilogue). Also with the TMA descriptors built on the host."""
    for d, h in ((128, 16), (64, 32)):
        for n in (1024, 2048, 4096, 8192, 16384):
            b = 16384 // n
            q, k, v = inputs(b, h, h, n, d, wide=False)
            fl = 4 * b * h * n * n * d
            _, _, kv = fwd_ws.attention_forward(q, k, v)
            r = dict(check="length", shape=[b, h, h, n, d], causal=False, ctas=b * h * n // fwd_ws.BLOCK_M.value,
                     tiles_per_cta=n // 128)  # forward's default 128-key tiles
            for tag, kw in (("shipped", {}), ("host", dict(host_descriptors=True))):
                ms = bench(lambda: fwd_ws.forward(q, kv.k8, kv.k_scale, kv.vt8, kv.v_scale, kv_heads=h, causal=False,
                                                  scale=d ** -0.5, **kw))
                r[tag + "_ms"] = ms
                r[tag + "_tflops"] = fl / ms / 1e9
            emit(**r)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    import subprocess

    if len(sys.argv) > 2 and sys.argv[1] == "--check":
        check_variant(sys.argv[2])
        raise SystemExit(0)
    if len(sys.argv) > 1 and sys.argv[1] == "--length":  # only length(), its rows appended to the file
        length()
        raise SystemExit(0)
    t0 = time.time()
    emit(check="env", torch=torch.__version__, triton=triton.__version__, gpu=torch.cuda.get_device_name())
    ok = []
    # each variant's check in a process of its own (a deadlocked variant cannot stall the rest),
    # all at once: their compilations fill the kernel cache for the timing below
    procs = {name: subprocess.Popen([sys.executable, __file__, "--check", name], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for name in VARIANTS}
    for name, p in procs.items():
        try:
            out, err = p.communicate(timeout=150)
            print(out[-3000:], err[-1500:] if p.returncode else "", flush=True)
            if p.returncode == 0:
                ok.append(name)
            else:
                emit(check="variant", variant=name, error=err[-800:])
        except subprocess.TimeoutExpired:
            p.kill()
            emit(check="variant", variant=name, error="timed out (deadlock?)")
    LOG.close()
    LOG = open(os.path.join(OUT, "fwd_ws_probe.jsonl"), "a")
    emit(check="time", seconds=time.time() - t0, ok=ok)
    accuracy()
    emit(check="time", seconds=time.time() - t0)
    speed([(4, 16, 16, 4096, 128), (1, 16, 16, 16384, 128), (4, 32, 32, 4096, 64), (1, 32, 8, 8192, 128)],
          ok)
    length()
    emit(check="time", seconds=time.time() - t0)
