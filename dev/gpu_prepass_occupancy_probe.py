"""The Gluon pre-pass (``bwd_ws.prepass``: S, dP, D and, for the dsq-row recipe, the bound U) at
more CTAs an SM: its consumer needs few registers (no spills at a launch cap of 64 registers a
thread, 104 for the consumer after the producer's drop, where the kernels' ``LAUNCH_REGS`` is 128:
two CTAs an SM), so a lower cap lets three (80) or four (64) CTAs share an SM, more warps to hide
its wgmmas' and exp2s' latency; and a deeper K/V ring (``WsBwdTiles.dq_stages``). At the bench's
shapes (``bench_attention.SHAPES``), causal and not, beside cuDNN BF16's backward timed in the same
process: the pre-pass of ``kernels_folded_delta_prepass_dsq_row`` alone under each variant
(``prepass_<regs>_<stages>``) and that recipe's whole backward (``api.attention_backward``) with
its pre-pass under the first and the lowest cap (``bwd_<regs>_<stages>``). Prints one JSON line a
shape (``ratio``: cuDNN BF16's backward time over ours) and writes them to
``$OUT/h100_prepass_occupancy_probe.json`` (its log: dev/results/; ``PYTHONPATH=benchmarks python
dev/gpu_prepass_occupancy_probe.py``)."""
import dataclasses
import json
import math
import os

import torch
import torch.nn.functional as F
from bench_attention import SHAPES, bench  # the product benchmark's shapes and timing
from torch.nn.attention import SDPBackend, sdpa_kernel

from dmref.kernels import api, bwd_ws
from dmref.kernels.config import get_spec
from dmref.kernels.quantize import quantize_with

R = get_spec("kernels_folded_delta_prepass_dsq_row")
#: (launch register cap, K/V ring depth) of the pre-pass
VARIANTS = [(128, 2), (80, 2), (64, 2), (80, 3), (64, 3)]
WHOLE = [(128, 2), (64, 2)]
_launch = bwd_ws.launch


def patched(regs: int, stages: int):
    """``bwd_ws.launch`` with the pre-pass's launch under ``regs`` and ``stages`` (the other
    kernels' launches as they are)."""
    def launch(spec, **kw):
        if kw.get("kernel") != "prepass":
            return _launch(spec, **kw)
        spec = get_spec(spec)
        d = kw["head_dim"]
        spec = spec.with_tiles(ws_bwd=dataclasses.replace(spec.ws_bwd_tiles(d), dq_stages=stages))
        return dataclasses.replace(_launch(spec, **kw), maxnreg=regs)
    return launch


def main() -> None:
    out = []
    for b, h, n, d in SHAPES:
        for causal in (False, True):
            torch.manual_seed(0)
            q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            scale = 1 / math.sqrt(d)
            shape = api.Shape.of(q, k, v)
            ms = {}
            qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o_ref = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
                ms["cudnn_bwd"] = bench(lambda: o_ref.backward(do, retain_graph=True), grad_to_none=[qg, kg, vg])
            o, _, saved, _ = api.attention_forward(q, k, v, causal=causal, scale=scale, recipe=R)
            do8, _, q8 = quantize_with(do, "float8_e4m3fn", saved.q_pending, saved.q_fmt)
            sv = dataclasses.replace(saved, q=q8, q_pending=None)
            kw = dict(batch=b, heads=h, kv_heads=h, n=n, head_dim=d, causal=causal, scale=scale)
            want = bwd_ws.prepass(sv, do8, recipe=R, bound=True, **kw)
            same = True
            for regs, stages in VARIANTS:
                bwd_ws.launch = patched(regs, stages)
                try:
                    got = bwd_ws.prepass(sv, do8, recipe=R, bound=True, **kw)
                    same &= all(torch.equal(a, b_) for a, b_ in zip(got, want))
                    ms[f"prepass_{regs}_{stages}"] = bench(lambda: bwd_ws.prepass(sv, do8, recipe=R, bound=True, **kw))
                    if (regs, stages) in WHOLE:
                        ms[f"bwd_{regs}_{stages}"] = bench(lambda: api.attention_backward(
                            saved, o, do, shape=shape, causal=causal, scale=scale, recipe=R))
                finally:
                    bwd_ws.launch = _launch
            ratio = {key: round(ms["cudnn_bwd"] / t, 3) for key, t in ms.items() if key != "cudnn_bwd"}
            row = dict(shape=[b, h, n, d], causal=causal, same_bits=bool(same), ms=ms, ratio=ratio)
            print(json.dumps(row), flush=True)
            out.append(row)
    meta = dict(device=torch.cuda.get_device_name(),
                method="triton.testing.do_bench medians (bench_attention.bench); ratio = cuDNN BF16's backward time / "
                       "ours; same_bits: D and U of every variant equal the default launch's")
    with open(os.path.join(os.environ.get("OUT", "."), "h100_prepass_occupancy_probe.json"), "w") as f:
        json.dump(dict(meta=meta, rows=out), f, indent=1)


if __name__ == "__main__":
    main()
