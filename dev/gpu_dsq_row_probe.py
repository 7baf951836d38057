"""The dsq-row recipe's backward (``kernels_folded_delta_prepass_dsq_row``) part by part at the
bench's shapes (``bench_attention.SHAPES``), causal and not, beside cuDNN BF16's backward timed in
the same process: the whole backward as ``api.attention_backward`` runs it (``dsq_bwd``), its Gluon
pre-pass with the bound (``prepass``), and its Gluon five-GEMM kernel incl. dQ's postprocess with
one consumer warp group a CTA (``f1``), two (``f2``), each with dQ^T's partial placed otherwise
among dV and dK or with the per-query vectors through the ring (``NEW``: ``bwd_ws.fused(dq_order=,
vec_tma=)``), and two adding dQ^T's partial over their 128 keys together (``f2s``,
``bwd_ws.fused(dq_shared=True)``: only where ``fused`` takes it, the kernels as committed in
df6f3e8; it left the tree). Prints one JSON line a shape (``ratio``: cuDNN BF16's time over ours)
and writes them to ``$OUT/<device>_dsq_row_probe.json`` (its log: dev/results/h100_dsq_row_probe.json,
run at df6f3e8 on an H100: ``PYTHONPATH=benchmarks python dev/gpu_dsq_row_probe.py``)."""
import dataclasses
import inspect
import json
import math
import os

import torch
import torch.nn.functional as F
from bench_attention import SHAPES, bench, device_tag  # the product benchmark's shapes, timing, file prefix
from torch.nn.attention import SDPBackend, sdpa_kernel

from dmref.kernels import api, bwd_ws
from dmref.kernels.quantize import quantize_with

R = "kernels_folded_delta_prepass_dsq_row"
VARIANTS = {"f1": dict(consumers=1), "f2": dict(consumers=2)}
if "dq_shared" in inspect.signature(bwd_ws.fused).parameters:
    VARIANTS["f2s"] = dict(consumers=2, dq_shared=True)
#: name -> (consumers, dq_order, vec_tma) at each head dim: dQ^T's partial placed among dV and dK
#: otherwise (``WsBwdTiles.fused_dq_order``, ``o<order>``) and the per-query vectors through the ring
#: (``fused_vec_tma``, ``v``; at D = 128 with two consumers only: with one its 116 KB of shared
#: memory a CTA leave one CTA an SM)
NEW = {128: {"f1o1": (1, 1, False), "f2o1": (2, 1, False), "f2o3": (2, 3, False), "f2v": (2, 0, True),
             "f2o3v": (2, 3, True)},
       64: {"f1o2": (1, 2, False), "f2o2": (2, 2, False), "f1v": (1, 0, True), "f2v": (2, 0, True),
            "f1o2v": (1, 2, True), "f2o2v": (2, 2, True)}}


def variants(d: int) -> dict:
    """The five-GEMM kernel's variants timed at head dim ``d``."""
    out = dict(VARIANTS)
    if "vec_tma" in inspect.signature(bwd_ws.fused).parameters:
        out.update({name: dict(consumers=c, dq_order=o, vec_tma=v) for name, (c, o, v) in NEW[d].items()})
    return out


def problem(b: int, h: int, n: int, d: int, causal: bool):
    """The inputs at one shape (randn, BF16, seed 0), cuDNN BF16's backward time on them
    (``{"cudnn_bwd": ms}``), the dsq-row recipe's forward state, its backward through the API as
    a function (of the spec, R or one of R's with another backward tiling), and the kernels' operands (the saved state with Q's copies, dO's copies, the
    problem's dims)."""
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale = 1 / math.sqrt(d)
    shape = api.Shape.of(q, k, v)
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o_ref = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
        ms = {"cudnn_bwd": bench(lambda: o_ref.backward(do, retain_graph=True), grad_to_none=[qg, kg, vg])}
    o, _, saved, _ = api.attention_forward(q, k, v, causal=causal, scale=scale, recipe=R)
    # any spec of R's recipe (another backward tiling) runs its backward on R's forward state
    backward = lambda recipe=R: api.attention_backward(saved, o, do, shape=shape, causal=causal,  # noqa: E731
                                                       scale=scale, recipe=recipe)
    do8, _, q8 = quantize_with(do, "float8_e4m3fn", saved.q_pending, saved.q_fmt)
    sv = dataclasses.replace(saved, q=q8, q_pending=None)
    kw = dict(batch=b, heads=h, kv_heads=h, n=n, head_dim=d, causal=causal, scale=scale)
    return ms, backward, sv, do8, kw


def main() -> None:
    out = []
    for b, h, n, d in SHAPES:
        for causal in (False, True):
            ms, backward, sv, do8, kw = problem(b, h, n, d, causal)
            ms["dsq_bwd"] = bench(backward)
            delta, u = bwd_ws.prepass(sv, do8, recipe=R, bound=True, **kw)
            ms["prepass"] = bench(lambda: bwd_ws.prepass(sv, do8, recipe=R, bound=True, **kw))
            ref = bwd_ws.fused(sv, do8, delta, recipe=R, dsq_bound=u, **kw)
            same = {}
            for name, extra in variants(d).items():
                got = bwd_ws.fused(sv, do8, delta, recipe=R, dsq_bound=u, **extra, **kw)
                same[name] = bool(torch.equal(got[1], ref[1]) and torch.equal(got[2], ref[2]))
                ms[name] = bench(lambda extra=extra: bwd_ws.fused(sv, do8, delta, recipe=R, dsq_bound=u, **extra,
                                                                  **kw))
            ratio = {key: round(ms["cudnn_bwd"] / t, 3) for key, t in ms.items() if key != "cudnn_bwd"}
            row = dict(shape=[b, h, n, d], causal=causal, dkdv_bits_equal=same, ms=ms, ratio=ratio)
            print(json.dumps(row), flush=True)
            out.append(row)
    meta = dict(device=torch.cuda.get_device_name(),
                method="triton.testing.do_bench medians (bench_attention.bench); ratio = cuDNN BF16's backward time / "
                       "ours; dkdv_bits_equal: each variant's dK and dV equal f1's bit for bit")
    with open(os.path.join(os.environ.get("OUT", "."), f"{device_tag()}_dsq_row_probe.json"), "w") as f:
        json.dump(dict(meta=meta, rows=out), f, indent=1)


if __name__ == "__main__":
    main()
