"""H200: where the folded K/V quantization's time goes (``quantize.quantize_kv_folded``): each of
its two launches alone at several tilings, the amax buffer's zeroing, and the whole call, against
the bytes it moves. One JSON line per shape to ``$OUT/quant_probe.jsonl``.

    PYTHONPATH=benchmarks python dev/gpu_quant_probe.py   # bench_attention's timing (dev/README.md)
"""
import json
import os

import torch
import triton

from bench_attention import bench  # the product benchmark's timing

from dmref.kernels import quantize as qm
from dmref.kernels._runtime import interpreting

OUT = os.environ.get("OUT", ".")


def run(b, hkv, n, d):
    g = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(b, hkv, n, d, device="cuda", generator=g).bfloat16()
    v = torch.randn(b, hkv, n, d, device="cuda", generator=g).bfloat16()
    npad = triton.cdiv(n, qm.QUANT_BLOCK) * qm.QUANT_BLOCK
    ref = qm.quantize_kv_folded(k, v)
    amax = torch.zeros((b * hkv, 1 + d), device="cuda", dtype=torch.int32)
    qm._kv_amax_kernel[(npad // qm.QUANT_BLOCK, b * hkv)](k, v, *k.stride(), amax, hkv, n, HEAD_DIM=d,
                                                          BLOCK_T=qm.QUANT_BLOCK, INTERPRET=False, num_warps=8)
    r = dict(shape=[b, hkv, n, d], bytes_moved=2 * k.numel() * 2 * 2 + 2 * k.numel(),
             whole_ms=bench(lambda: qm.quantize_kv_folded(k, v)),
             zeros_ms=bench(lambda: torch.zeros((b * hkv, 1 + d), device="cuda", dtype=torch.int32)))
    for bt in (32, 64, 128):
        for w in (2, 4, 8):
            grid = (npad // bt, b * hkv)
            try:
                r[f"amax_t{bt}_w{w}_ms"] = bench(lambda: qm._kv_amax_kernel[grid](
                    k, v, *k.stride(), amax, hkv, n, HEAD_DIM=d, BLOCK_T=bt, INTERPRET=False, num_warps=w))
                out = qm.FoldedKV(k8=torch.empty_like(ref.k8), k_scale=torch.empty_like(ref.k_scale),
                                  vt8=torch.empty_like(ref.vt8), v_scale=torch.empty_like(ref.v_scale))
                f = lambda: qm._kv_quantize_folded_kernel[grid](
                    k, v, *k.stride(), amax, out.k8, out.k_scale, out.vt8, out.v_scale, hkv, n, npad, HEAD_DIM=d,
                    BLOCK_T=bt, INTERPRET=False, num_warps=w)
                r[f"quant_t{bt}_w{w}_ms"] = bench(f)
                r[f"same_t{bt}_w{w}"] = bool(torch.equal(out.k8.view(torch.uint8), ref.k8.view(torch.uint8))
                                             and torch.equal(out.vt8.view(torch.uint8), ref.vt8.view(torch.uint8)))
            except Exception as e:
                r[f"error_t{bt}_w{w}"] = repr(e)[:200]
    best = {kind: min((v, key) for key, v in r.items() if key.startswith(kind + "_t") and key.endswith("_ms"))
            for kind in ("amax", "quant")}
    r["best"] = {kind: dict(ms=ms, config=key) for kind, (ms, key) in best.items()}
    r["tb_per_s_whole"] = r["bytes_moved"] / r["whole_ms"] / 1e9
    line = json.dumps(r)
    print(line, flush=True)
    with open(os.path.join(OUT, "quant_probe.jsonl"), "a") as fh:
        fh.write(line + "\n")


if __name__ == "__main__":
    assert not interpreting()
    for shape in [(4, 16, 4096, 128), (1, 16, 16384, 128), (4, 32, 4096, 64), (1, 8, 8192, 128)]:
        run(*shape)
