"""Where the Gluon five-GEMM backward's time goes, and the forward with two consumer warp groups:
``python benchmarks/bench_bwd_fused_parts.py [--out DIR]`` on a Hopper GPU writes
``<device>_bwd_fused_parts.json`` (default ``benchmarks/results/``).

At each shape of ``bench_attention.SHAPES``, causal and not, beside cuDNN BF16 SDPA's forward and
backward timed in the same process (``triton.testing.do_bench`` medians, ``bench_attention.bench``):

- ``fused1`` / ``fused2``: ``bwd_ws.fused`` on the stale D with one or two consumer warp groups a
  CTA (dQ's partials by float32 atomics), ``fused1_tma`` / ``fused2_tma`` with them added by TMA
  reduce-adds of dQ's own tiles (``dq_tma=True, dq_t=False``, a process of their own; ``fused1_t``,
  ``fused2_t``: dQ^T with dS's codes the wgmma's shared operand, ``dq_t=True``, the default with
  ``dq_tma``), and ``dkdv``, the Gluon dkdv kernel alone (the four GEMMs without dQ's);
- the same kernel built under each ``bwd_ws.DQ_PROBE`` (a process each: the probe is read at
  import): 1 dQ's partial computed, not added; 2 added by plain stores; 3 no fifth GEMM (the
  kernel of dS for dQ scaled from the pre-pass's bound, which an earlier probe 4 stood in for, is
  timed by ``bench_attention.py``: ``ours_dsq_row_bwd_fused``);
- ``fwd1_*`` / ``fwd2_*``: the warp-specialized forward with one or two consumer warp groups, the
  kernel alone (K and V quantized ahead) and with K's and V's quantization (``incl_quant``), and
  ``kv_quant``, that quantization alone.

``ratio_vs_cudnn_bf16`` is cuDNN BF16's time over ours (its forward's for ``fwd*``, its backward's
for the rest); the kernels' time excludes dO's quantization and the stale delta (the preprocess)
and includes dQ's zeroed buffer and postprocess. Variants compile in parallel processes first,
then each process times its variants alone on the GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attention import RESULTS, SHAPES, bench, device_tag  # noqa: E402

#: (what, probe): the processes, each timing its variants at every shape
RUNS = (("fwd", 0), ("bwd", 0), ("tma", 0), ("bwd", 1), ("bwd", 2), ("bwd", 3))
FWD_KEYS = ("fwd1_kernel", "fwd1_incl_quant", "fwd2_kernel", "fwd2_incl_quant", "kv_quant")


def _cases():
    return [(b, h, n, d, causal) for b, h, n, d in SHAPES for causal in (False, True)]


def child(what: str, warm: bool) -> None:
    """Time (or with ``warm`` run once, compiling) ``what``'s variants at every shape; one JSON
    line per shape on stdout."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from dmref.kernels import api, bwd_ws, fwd_ws
    from dmref.kernels.config import SPECS
    from dmref.kernels.quantize import quantize, quantize_kv_folded

    def timed(fn, grad_to_none=None):
        if warm:
            fn()
            torch.cuda.synchronize()
            return float("nan")
        return bench(fn, grad_to_none)

    probe = bwd_ws.DQ_PROBE.value
    for b, h, n, d, causal in _cases():
        torch.manual_seed(0)
        q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        scale = 1 / math.sqrt(d)
        ms = {}
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            ms["cudnn_fwd"] = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
            qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
            out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
            ms["cudnn_bwd"] = timed(lambda: out.backward(do, retain_graph=True), grad_to_none=[qg, kg, vg])
            del out
        if what == "fwd":
            _, _, kv = fwd_ws.attention_forward(q, k, v, causal=causal, scale=scale)
            two = fwd_ws.variant("kernels_folded_naive_fp8", consumers=2)
            fwd_args = (q, kv.k8, kv.k_scale, kv.vt8, kv.v_scale)
            for tag, kw in (("fwd1", {}), ("fwd2", dict(consumers=2))):
                rk = dict(recipe=two) if kw else {}
                ms[f"{tag}_kernel"] = timed(lambda rk=rk: fwd_ws.forward(*fwd_args, kv_heads=h, causal=causal,
                                                                         scale=scale, **rk))
                ms[f"{tag}_incl_quant"] = timed(lambda kw=kw: fwd_ws.attention_forward(q, k, v, causal=causal,
                                                                                       scale=scale, **kw))
            ms["kv_quant"] = timed(lambda: quantize_kv_folded(k, v))
        else:
            r_dm, r_st = SPECS["kernels_delta_matching"], SPECS["kernels_naive_fp8"]
            o, _, saved, _ = api.attention_forward(q, k, v, causal=causal, scale=scale, recipe=r_dm)
            do8, d_stale = quantize(do, "float8_e4m3fn", rows=True, cols=True, delta_with=o)
            kw = dict(batch=b, heads=h, kv_heads=h, n=n, head_dim=d, causal=causal, scale=scale)
            if what == "tma":
                variants = dict(fused1_tma=dict(dq_tma=True, dq_t=False), fused2_tma=dict(consumers=2, dq_tma=True,
                                                                                          dq_t=False),
                                fused1_t=dict(dq_tma=True, dq_t=True), fused2_t=dict(consumers=2, dq_tma=True, dq_t=True))
            else:
                variants = {"fused1": dict(dq_tma=False), "fused2": dict(consumers=2, dq_tma=False)}
            for key, extra in variants.items():
                ms[key] = timed(lambda extra=extra: bwd_ws.fused(saved, do8, d_stale, recipe=r_st, **extra, **kw))
            if what == "bwd" and probe == 0:
                ms["dkdv"] = timed(lambda: bwd_ws.dkdv(saved, do8, do8, d_stale, recipe=r_st, **kw))
        ratio = {key: ms["cudnn_fwd" if key in FWD_KEYS else "cudnn_bwd"] / t
                 for key, t in ms.items() if not key.startswith("cudnn")}
        print(json.dumps(dict(what=what, probe=probe, shape=[b, h, n, d], causal=causal, ms=ms,
                              ratio_vs_cudnn_bf16=ratio)), flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=RESULTS, help="directory for the JSON result (default: %(default)s)")
    ap.add_argument("--runs", default=",".join(f"{w}:{p}" for w, p in RUNS),
                    help="the processes, WHAT:PROBE comma-separated (default: %(default)s)")
    ap.add_argument("--warm-timeout", type=float, default=200, help="seconds for the parallel compile")
    ap.add_argument("--child", nargs=2, metavar=("WHAT", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child[0], args.child[1] == "warm")
        return
    runs = [(w, int(p)) for w, p in (r.split(":") for r in args.runs.split(","))]
    t0 = time.time()

    def cmd(what, mode):
        return [sys.executable, os.path.abspath(__file__), "--child", what, mode]

    def env(probe):
        return dict(os.environ, DMREF_FUSED_DQ_PROBE=str(probe))

    warm = [subprocess.Popen(cmd(what, "warm"), env=env(probe), stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True) for what, probe in runs]
    errors = {}
    for (what, probe), p in zip(runs, warm):
        try:
            _, err = p.communicate(timeout=max(1.0, args.warm_timeout - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            err = "compile/warm-up timed out"
        if p.returncode:
            errors[f"{what}_{probe}_warm"] = (err or "")[-600:]
    rows = []
    for what, probe in runs:
        try:
            r = subprocess.run(cmd(what, "time"), env=env(probe), capture_output=True, text=True, timeout=90)
            out, err, rc = r.stdout, r.stderr, r.returncode
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            err, rc = "timed out", -1
        rows += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        if rc:
            errors[f"{what}_{probe}"] = (err or "")[-600:]
        print(what, probe, "rc", rc, f"{time.time() - t0:.0f} s", flush=True)
    meta = dict(date=datetime.date.today().isoformat(), device=torch.cuda.get_device_name(),
                torch=torch.__version__, triton=__import__("triton").__version__,
                cudnn=torch.backends.cudnn.version(), method="triton.testing.do_bench medians, warmup 25 ms, "
                "rep 100 ms; ratio = cuDNN BF16's time / ours, same process", wall_s=time.time() - t0,
                errors=errors)
    path = os.path.join(args.out, f"{device_tag()}_bwd_fused_parts.json")
    with open(path, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print("wrote", path, "errors:", sorted(errors))


if __name__ == "__main__":
    main()
