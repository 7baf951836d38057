"""FP8 attention (dmref.kernels) against torch SDPA (cuDNN, flash; BF16), in one process on a GPU.

    python benchmarks/bench_attention.py --no-sweep      # writes benchmarks/results/<device>_bench_attention.json
    python benchmarks/bench_attention.py --accuracy      # also <device>_accuracy.json
    python benchmarks/bench_attention.py --sweep-only --head-dim 64   # <device>_sweep_d64.json
    ncu --clock-control none -k regex:'_fwd_kernel|_bwd_dq_kernel' ... \
        python benchmarks/bench_attention.py --profile-one            # one launch each, for ncu

<device> is the GPU's model in lower case (``h200``); ``--out DIR`` writes elsewhere. A rerun
replaces the file that docs/kernels_speed.md cites.

Measures, per shape B·H·N·D and causal or not, medians of ``triton.testing.do_bench``:

- ours: forward kernel alone (pre-quantized operands); forward incl. its fused quantization;
  end to end also with ``kernels_folded_delta_matching`` (the warp-specialized forward, the same
  backward); backward with stale delta (``kernels_naive_fp8``) and with matched delta
  (``kernels_delta_matching``), each incl. the preprocess (dO quantization + stale delta), as
  ``api.attention_backward`` runs it (the Gluon kernels ``bwd_ws`` where they run the recipe:
  ``bwd_kernels``) and with the Triton kernels (``_triton``), and that backward's kernels without
  the preprocess: both, the dq alone, the dkdv alone (``_kernels``, ``_dq``, ``_dkdv``); the
  five-GEMM backward (``bwd_fused``, stale delta) incl. the preprocess and dQ's postprocess, with
  atomic and with deterministic dQ sums (``ours_bwd_fused_stale``, ``_det``); the Gluon five-GEMM
  kernel alone on the stale D incl. dQ's postprocess (``ours_bwd_prepass_gluon_fused``), and with
  two consumer warp groups a CTA sharing its ring of query tiles (``WsBwdTiles.fused_consumers=2``,
  not the default: ``ours_bwd_fused_2cons``; an error is recorded as ``bwd_fused_2cons_error``) and
  adding dQ's partials by TMA reduce-adds (``dq_tma``, N a multiple of 64: ``ours_bwd_fused_tma``),
  and as dQ^T with dS's codes the wgmma's shared operand (``dq_t``, the default with ``dq_tma``:
  ``ours_bwd_fused_t``);
  end to end (quantization + forward + backward through ``torch.autograd``);
- the warp-specialized Gluon forward (``dmref.kernels.fwd_ws``, the ``folded`` scales): kernel
  alone and incl. its quantization of K and V (it quantizes Q inside), with host-built TMA
  descriptors (its default) and device-side ones (``_dev``), and with two consumer warp groups a
  CTA sharing one K/V ring (``FwdTiles(consumers=2)``, not the default: ``_2cons``; an error is
  recorded as ``fwd_ws_2cons_error``);
- what ``dmref.kernels.attention`` runs by default (``config.DEFAULT_RECIPE``): its forward with
  its quantization (K's and V's copies for the backward included), the same given K and V quantized by the caller
  (``api.quantize_kv``, ``kv_fp8``; that quantization alone is ``ours_default_quantize_kv``), its
  backward incl. the preprocess, end to end through autograd (``ours_default_*``;
  ``default_fwd_incl_quant``, ``default_fwd_given_kv``, ``default_bwd`` and ``default_e2e`` among
  the speed-ups), and the host's share of the default's calls: CPU milliseconds a call takes to
  issue its launches (``_host``) and the forward replayed from a CUDA graph (``_graph``);
- the seven-GEMM recipe with dS for dQ scaled per query from the pre-pass's bound
  (``kernels_folded_delta_prepass_dsq_row``, ``_time_dsq_row``): its backward incl. dO's
  quantization (the Gluon pre-pass with the bound, then the five-GEMM kernel adding dQ's partials
  unscaled), end to end through autograd, and its two kernels alone: the pre-pass and the
  five-GEMM kernel with one and two consumer warp groups (``ours_dsq_row_*``; ``dsq_row_bwd``,
  ``dsq_row_bwd_det`` (dQ's partials added in key order), ``dsq_row_e2e``, ``dsq_row_bwd_fused``, ``dsq_row_bwd_fused_2cons`` among the speed-ups; an error
  is recorded as ``dsq_row_error``);
- SDPA cuDNN and flash backends, BF16: forward, backward, end to end;
- grouped-query shapes (``GQA_SHAPES``, ``run_gqa_shape``): the default recipe's forward,
  backward and end to end against cuDNN BF16 SDPA with ``enable_gqa`` (rows with ``kv_heads``);
- cuDNN's FP8 attention (per-tensor scales, stale delta; ``dmref.targets``' frontend graphs,
  built once and re-executed on fixed FP8 inputs, so its quantization is not timed) at head dim
  128, where its Hopper backward runs: forward, backward, end to end;
- registers, spills and shared memory of every compiled kernel variant (``compiled``).

Without ``--no-sweep`` the tilings of ``FWD_CANDIDATES`` and ``BWD_CANDIDATES`` are timed first on
the first shape of each head dim and the fastest is used; ``--no-sweep`` runs the recipes' shipped
tilings. ``--sweep-only`` times the candidates alone, causal and not (the register caps' evidence).
FLOPs: forward 4·B·H·N²·D, halved when causal; backward 2.5 × forward.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import re
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor

import torch
import torch.nn.functional as F

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SHAPES = [(4, 16, 4096, 128), (1, 16, 16384, 128), (4, 32, 4096, 64)]
#: grouped-query shapes (B, H, HKV, N, D), Llama-3-8B's heads (32 query, 8 key/value) at 4k tokens:
#: what dmref.kernels.attention runs by default against cuDNN BF16 (``run_gqa_shape``)
GQA_SHAPES = [(2, 32, 8, 4096, 128)]

# Candidate tilings, tried on the first shape of each head dim (the winner is used for the rest).
FWD_CANDIDATES = [  # block_m, num_warps, num_stages[, tma[, maxnreg]] (key tiles: the recipe's 128)
    (64, 4, 3, True), (64, 4, 3, True, 168),  # the defaults at D = 128 and D = 64
]
# per head dim; dkdv: block_m1, block_n1, warps, stages; dq: block_m2, block_n2, warps, stages
# [, tma[, maxnreg_dq[, maxnreg_dkdv]]]; every candidate keeps whole accumulators
BWD_CANDIDATES = {
    128: [
        (64, 128, 8, 2, 128, 64, 8, 2, True),  # the default: dS blocks 1x64, TMA loads
        (64, 128, 8, 2, 128, 64, 8, 3, True),  # dq: 3 stages
    ],
    64: [
        # the default: pointer loads, dq capped at 168 registers (3 CTAs per SM)
        (64, 64, 4, 2, 64, 64, 4, 2, False, 168, None),
        (64, 64, 4, 2, 64, 64, 4, 2, False),  # no register caps
        (64, 64, 4, 2, 64, 64, 4, 2, False, 160, None),  # dq capped at 160
        (64, 64, 4, 2, 64, 64, 4, 2, False, 168, 168),  # dkdv capped too
    ],
}


def _tiles(fwd_c, bwd_c):
    from dmref.kernels.config import BwdTiles, FwdTiles

    if fwd_c is None:
        fwd_c = FWD_CANDIDATES[0]
    if bwd_c is None:
        bwd_c = BWD_CANDIDATES[128][0]
    fwd = FwdTiles(*fwd_c)
    bm1, bn1, w1, s1, bm2, bn2, w2, s2, *flags = bwd_c
    tma, cap_dq, cap_dkdv = (list(flags) + [False, None, None][len(flags):])[:3]
    bwd = BwdTiles(block_m1=bm1, block_n1=bn1, block_m2=bm2, block_n2=bn2, num_warps_dkdv=w1, num_stages_dkdv=s1,
                   num_warps_dq=w2, num_stages_dq=s2, tma=bool(tma), maxnreg_dq=cap_dq, maxnreg_dkdv=cap_dkdv)
    return fwd, bwd


def _recipe(name, fwd_c, bwd_c):
    """A kernel recipe with these tilings; ``None`` keeps the recipe's defaults."""
    from dmref.kernels.config import SPECS

    if fwd_c is None and bwd_c is None:
        return SPECS[name]
    fwd, bwd = _tiles(fwd_c, bwd_c)
    spec = SPECS[name]
    # the forward candidates are the Triton forward's: a folded spec keeps its Gluon forward's tiling
    return spec.with_tiles(None if spec.folded else fwd, bwd)


def _describe_tiles(recipe, head_dim):
    import dataclasses as dc

    return dict(fwd=dc.asdict(recipe.fwd_tiles(head_dim)), bwd=dc.asdict(recipe.bwd_tiles(head_dim)))


def _flops(b, h, n, d, causal):
    f = 4.0 * b * h * n * n * d
    return f / 2 if causal else f


def bench(fn, grad_to_none=None):
    """Median milliseconds of ``fn`` (``triton.testing.do_bench``, 25 ms warm-up, 100 ms of runs): the
    timing of every figure here and of the experiments in dev/."""
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none,
                                   return_mode="median")


# ---------------------------------------------------------------------------------------------
# compile ahead in parallel: one tiny problem per (head dim, causal, tiling, recipe)
# ---------------------------------------------------------------------------------------------


def _warm_one(job):
    d, causal, fwd_c, bwd_c, heads = job
    try:
        from dmref.kernels import api

        torch.manual_seed(0)
        q, k, v, do = (torch.randn(1, heads, 512, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        for name in ("kernels_naive_fp8", "kernels_delta_matching"):
            r = _recipe(name, fwd_c, bwd_c)
            o, _, saved, _ = api.attention_forward(q, k, v, causal=causal, recipe=r, for_backward=True)
            api.attention_forward(q, k, v, causal=causal, recipe=r, for_backward=False)
            api.attention_backward(saved, o, do, shape=api.Shape.of(q, k, v), causal=causal,
                                   scale=1 / math.sqrt(d), recipe=r)
        if "dsq_row" not in SKIP:
            o, _, saved, _ = api.attention_forward(q, k, v, causal=causal, recipe=DSQ_ROW)
            api.attention_backward(saved, o, do, shape=api.Shape.of(q, k, v), causal=causal,
                                   scale=1 / math.sqrt(d), recipe=DSQ_ROW)
        torch.cuda.synchronize()
        return None
    except Exception as exc:  # reported, the config is then skipped
        return f"{job}: {type(exc).__name__}: {exc}"


def warm(jobs, workers):
    t0 = time.time()
    ctx = __import__("multiprocessing").get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as ex:
        errors = [e for e in ex.map(_warm_one, jobs) if e]
    print(f"compiled {len(jobs)} variants in {time.time() - t0:.1f} s; {len(errors)} failed", flush=True)
    for e in errors:
        print("  ", e[:400], flush=True)
    return errors


# ---------------------------------------------------------------------------------------------


def _kernel_stats(fn_kernel):
    """Registers, spills and shared memory of the compiled variants of one jitted kernel."""
    out = []
    try:
        compiled = [ck for dc in fn_kernel.device_caches.values() for ck in dc[0].values()]
    except Exception as exc:  # the cache layout is Triton-version specific
        return [f"unavailable: {type(exc).__name__}: {exc}"]
    for ck in compiled:
        if True:
            meta = ck.metadata
            out.append(dict(n_regs=getattr(ck, "n_regs", None), n_spills=getattr(ck, "n_spills", None),
                            shared=getattr(meta, "shared", None), num_warps=getattr(meta, "num_warps", None),
                            constants={k2: str(v2) for k2, v2 in (getattr(meta, "constants", None) or {}).items()}
                            if isinstance(getattr(meta, "constants", None), dict) else None))
    return out


def cudnn_fp8_timers(q, k, v, do, causal):
    """(forward, backward) closures that re-execute cuDNN's FP8 graphs (``dmref.targets``) on the
    FP8 inputs, scales and output buffers of one calibrated call."""
    from dmref.cudnn import target as targets

    fwd = targets.cudnn_fp8_forward(q, k, v, causal=causal)
    bwd = targets.cudnn_fp8_backward(fwd, do)
    g = fwd["graphs"]
    f_in = {"q": fwd["q_fp8"], "k": fwd["k_fp8"], "v": fwd["v_fp8"], "o": fwd["o_fp8"], "stats": fwd["stats"],
            "amax_s": fwd["amax_s"], "amax_o": fwd["amax_o"], **{n: fwd[n] for n in targets.FWD_SCALARS}}
    b_in = {"q": fwd["q_fp8"], "k": fwd["k_fp8"], "v": fwd["v_fp8"], "o": fwd["o_fp8"], "dO": bwd["do_fp8"],
            "stats": fwd["stats"], "dQ": bwd["dq_fp8"], "dK": bwd["dk_fp8"], "dV": bwd["dv_fp8"],
            **{n: fwd[n] for n in ("descale_q", "descale_k", "descale_v", "descale_o", "descale_s", "scale_s")},
            **{n: bwd[n] for n in ("descale_dO", "descale_dP", "scale_dP", "scale_dQ", "scale_dK", "scale_dV",
                                   "amax_dQ", "amax_dK", "amax_dV", "amax_dP")}}
    return (lambda: g.run("fwd", f_in)), (lambda: g.run("bwd", b_in))


def _default_speedups(ms: dict, anchor: str) -> dict:
    """The anchor's time over that of what ``dmref.kernels.attention`` runs by default
    (``config.DEFAULT_RECIPE``, ``_time_default``): the forward with its quantization (K's and V's
    copies for the backward included; Q's are the backward preprocess's), the same given K and V
    quantized by the caller (``kv_fp8``: the kernel, which quantizes Q's rows itself), the
    backward incl. its preprocess (dO's and Q's copies), and quantization, forward and backward
    through autograd; and the forward with its
    quantization replayed from a CUDA graph (its GPU time, no host: ``_graph``)."""
    return {"default_fwd_incl_quant": ms[f"{anchor}_fwd"] / ms["ours_default_fwd_incl_quant_for_bwd"],
            **({"default_fwd_incl_quant_graph": ms[f"{anchor}_fwd"] / ms["ours_default_fwd_incl_quant_graph"]}
               if "ours_default_fwd_incl_quant_graph" in ms else {}),
            **({"default_fwd_given_kv": ms[f"{anchor}_fwd"] / ms["ours_default_fwd_given_kv_for_bwd"]}
               if "ours_default_fwd_given_kv_for_bwd" in ms else {}),
            "default_bwd": ms[f"{anchor}_bwd"] / ms["ours_default_bwd"],
            "default_e2e": ms[f"{anchor}_e2e"] / ms["ours_default_e2e"],
            **{f"dsq_row_{k}": ms[f"{anchor}_{k.split('_')[0]}"] / ms[f"ours_dsq_row_{k}"]
               for k in ("bwd", "bwd_det", "e2e", "bwd_fused", "bwd_fused_2cons") if f"ours_dsq_row_{k}" in ms}}


def _speedups(ms: dict, anchor: str) -> dict:
    """The anchor's time over ours for each of our measurements (``<anchor>_fwd``, ``_bwd``,
    ``_e2e`` in ``ms``)."""
    fwd, bwd, e2e = (ms[f"{anchor}_{part}"] for part in ("fwd", "bwd", "e2e"))
    return {
        "fwd_kernel": fwd / ms["ours_fwd_kernel"],
        "fwd_incl_quant": fwd / ms["ours_fwd_incl_quant"],
        **_default_speedups(ms, anchor),
        "bwd_matched": bwd / ms["ours_bwd_matched"],
        "bwd_stale": bwd / ms["ours_bwd_stale"],
        "e2e_matched": e2e / ms["ours_e2e_matched"],
        "fwd_ws_kernel": fwd / ms["ours_fwd_ws_kernel"],
        "fwd_ws_incl_quant": fwd / ms["ours_fwd_ws_incl_quant"],
        "fwd_ws_kernel_dev": fwd / ms["ours_fwd_ws_kernel_dev"],
        "fwd_ws_incl_quant_dev": fwd / ms["ours_fwd_ws_incl_quant_dev"],
        # two consumer warp groups a CTA sharing one K/V ring (fwd_ws's consumers=2)
        **{k: fwd / ms[f"ours_{k}"] for k in ("fwd_ws_2cons_kernel", "fwd_ws_2cons_incl_quant") if f"ours_{k}" in ms},
        # the seven-GEMM matched recipe in Gluon (pre-pass + five-GEMM kernel), and end to end
        **{k: bwd / ms[f"ours_{k}"] for k in ("bwd_prepass_gluon",) if f"ours_{k}" in ms},
        # the Gluon five-GEMM kernel alone (stale D), one and two consumer warp groups a CTA
        **{k: bwd / ms[f"ours_{k}"] for k in ("bwd_prepass_gluon_fused", "bwd_fused_2cons", "bwd_fused_tma",
                                              "bwd_fused_t") if f"ours_{k}" in ms},
        **{k: e2e / ms[f"ours_{k}"] for k in ("e2e_prepass_gluon", "e2e_prepass_gluon_folded") if f"ours_{k}" in ms},
        "e2e_matched_folded": e2e / ms["ours_e2e_matched_folded"],
        "bwd_matched_triton": bwd / ms["ours_bwd_matched_triton"],
        # the five-GEMM backward (bwd_fused, stale delta), atomic and deterministic dQ sums
        **{k: bwd / ms[f"ours_{k}"] for k in ("bwd_fused_stale", "bwd_fused_stale_det", "bwd_fused_stale_triton")
           if f"ours_{k}" in ms},
    }


def _bwd_parts(r, gluon: bool, saved, do8, d_stale, kw) -> dict:
    """The backward's kernels without the preprocess, by part: both, the dq alone, the dkdv alone
    (on the dq's D); the Gluon ones (``bwd_ws``) or the Triton ones (``bwd``)."""
    from dmref.kernels import bwd as bwd_mod, bwd_ws

    if gluon:
        delta = bwd_ws.dq(saved, do8, d_stale, recipe=r, **kw)[1]
        return {"kernels": lambda: bwd_ws.backward_ws(saved, do8, do8, d_stale, recipe=r, kernels=("dq", "dkdv"),
                                                      **kw),
                "dq": lambda: bwd_ws.dq(saved, do8, d_stale, recipe=r, **kw),
                "dkdv": lambda: bwd_ws.dkdv(saved, do8, do8, delta, recipe=r, **kw)}
    return {part: (lambda kernels=kernels: bwd_mod.backward(saved, do8, do8, d_stale, recipe=r, kernels=kernels,
                                                            **kw))
            for part, kernels in (("kernels", ("dq", "dkdv")), ("dq", ("dq",)), ("dkdv", ("dkdv",)))}


#: groups of variants not to time (``--skip``): ``two_consumers`` (the two-consumer forward),
#: ``gluon_fused`` (the Gluon five-GEMM kernel and pre-pass), ``bwd_two_consumers`` (its
#: two-consumer form), ``dsq_row`` (``_time_dsq_row``), for a kernel that hangs or faults
SKIP: set = set()


def _time_default(q, k, v, do, causal, scale, shape) -> dict:
    """Times of what ``dmref.kernels.attention`` runs by default (``config.DEFAULT_RECIPE``): its
    forward with its quantization for the backward, its backward (incl. the preprocess), both
    through autograd (``ours_default_*``)."""
    from dmref.kernels import api
    from dmref.kernels.config import DEFAULT_RECIPE

    o, _, saved, _ = api.attention_forward(q, k, v, causal=causal, scale=scale, recipe=DEFAULT_RECIPE)
    ms = {"ours_default_fwd_incl_quant_for_bwd": bench(lambda: api.attention_forward(
              q, k, v, causal=causal, scale=scale, recipe=DEFAULT_RECIPE, for_backward=True)),
          "ours_default_bwd": bench(lambda: api.attention_backward(
              saved, o, do, shape=shape, causal=causal, scale=scale, recipe=DEFAULT_RECIPE))}
    # K and V quantized by the caller (api.quantize_kv, once), the forward given them (kv_fp8), and
    # that quantization alone
    kv = api.quantize_kv(k, v, recipe=DEFAULT_RECIPE)
    ms["ours_default_fwd_given_kv_for_bwd"] = bench(lambda: api.attention_forward(
        q, k, v, causal=causal, scale=scale, recipe=DEFAULT_RECIPE, for_backward=True, kv_fp8=kv))
    ms["ours_default_quantize_kv"] = bench(lambda: api.quantize_kv(k, v, recipe=DEFAULT_RECIPE))
    del kv
    qd, kd, vd = (t.detach().clone().requires_grad_() for t in (q, k, v))

    def step():
        api.attention(qd, kd, vd, causal=causal, scale=scale, recipe=DEFAULT_RECIPE).backward(do)
    ms["ours_default_e2e"] = bench(step, grad_to_none=[qd, kd, vd])
    # the host's share: CPU milliseconds a call takes to issue its launches (no synchronization:
    # the GPU runs behind), and the forward's GPU time replayed from a CUDA graph (no host at all)
    fwd = lambda: api.attention_forward(q, k, v, causal=causal, scale=scale, recipe=DEFAULT_RECIPE,  # noqa: E731
                                        for_backward=True)
    ms["ours_default_fwd_host"] = host_ms(fwd)
    ms["ours_default_bwd_host"] = host_ms(lambda: api.attention_backward(
        saved, o, do, shape=shape, causal=causal, scale=scale, recipe=DEFAULT_RECIPE))
    graphed = graph_ms(fwd)
    if graphed is not None:
        ms["ours_default_fwd_incl_quant_graph"] = graphed
    return ms


DSQ_ROW = "kernels_folded_delta_prepass_dsq_row"


def _time_dsq_row(q, k, v, do, causal, scale, shape) -> tuple[dict, dict]:
    """Times of ``kernels_folded_delta_prepass_dsq_row`` (``ours_dsq_row_*``): its backward incl.
    dO's quantization as ``api.attention_backward`` runs it (and with ``deterministic=True``,
    ``_bwd_det``: dQ's partials added in key order), quantization, forward and backward
    through autograd, and on the same copies its Gluon pre-pass with the bound alone
    (``_bwd_prepass``) and its five-GEMM kernel alone incl. dQ's postprocess, one consumer warp
    group a CTA and two (``_bwd_fused``, ``_bwd_fused_2cons``). Returns (times, errors)."""
    from dmref.kernels import api, bwd_ws
    from dmref.kernels.quantize import quantize_with

    ms, err = {}, {}
    try:
        if "dsq_row" in SKIP:
            raise RuntimeError("not timed (--skip dsq_row)")
        o, _, saved, _ = api.attention_forward(q, k, v, causal=causal, scale=scale, recipe=DSQ_ROW)
        ms["ours_dsq_row_bwd"] = bench(lambda: api.attention_backward(
            saved, o, do, shape=shape, causal=causal, scale=scale, recipe=DSQ_ROW))
        ms["ours_dsq_row_bwd_det"] = bench(lambda: api.attention_backward(
            saved, o, do, shape=shape, causal=causal, scale=scale, recipe=DSQ_ROW, deterministic=True))
        qd, kd, vd = (t.detach().clone().requires_grad_() for t in (q, k, v))

        def step():
            api.attention(qd, kd, vd, causal=causal, scale=scale, recipe=DSQ_ROW).backward(do)
        ms["ours_dsq_row_e2e"] = bench(step, grad_to_none=[qd, kd, vd])
        do8, _, q8 = quantize_with(do, "float8_e4m3fn", saved.q_pending, saved.q_fmt)
        saved = dataclasses.replace(saved, q=q8, q_pending=None)
        kw = dict(batch=shape.batch, heads=shape.heads, kv_heads=shape.kv_heads, n=shape.n,
                  head_dim=shape.head_dim, causal=causal, scale=scale)
        d, u = bwd_ws.prepass(saved, do8, recipe=DSQ_ROW, bound=True, **kw)
        ms["ours_dsq_row_bwd_prepass"] = bench(lambda: bwd_ws.prepass(saved, do8, recipe=DSQ_ROW, bound=True, **kw))
        ms["ours_dsq_row_bwd_fused"] = bench(lambda: bwd_ws.fused(saved, do8, d, recipe=DSQ_ROW, dsq_bound=u, **kw))
        ms["ours_dsq_row_bwd_fused_2cons"] = bench(lambda: bwd_ws.fused(saved, do8, d, recipe=DSQ_ROW, dsq_bound=u,
                                                                         consumers=2, **kw))
    except Exception as exc:
        err["dsq_row_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return ms, err


def host_ms(fn, calls: int = 20) -> float:
    """CPU milliseconds per call of ``fn`` issuing its work, the GPU left running behind (median of
    5 rounds of ``calls`` calls, each round after a synchronization): above the call's GPU time,
    ``bench``'s time is the host's."""
    import statistics

    fn()
    rounds = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - t0) * 1e3 / calls)
    torch.cuda.synchronize()
    return statistics.median(rounds)


def graph_ms(fn) -> float | None:
    """``bench``'s median of ``fn`` captured once in a CUDA graph and replayed (its GPU time alone),
    or None where the capture fails (recorded on stderr)."""
    try:
        fn()
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        torch.cuda.synchronize()
        return bench(g.replay)
    except Exception as e:  # noqa: BLE001 - a capture that fails is a missing cell, not a failed run
        print(f"graph capture failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
              file=sys.stderr)
        return None


def _tflops(ms: dict, fl: float) -> dict:
    """TFLOP/s of each time in ``ms`` (milliseconds) for a forward of ``fl`` FLOPs: end to end
    3.5x, backward 2.5x (a ``*_for_bwd`` key is a forward's time, the copies for the backward
    included)."""
    tf = {}
    for key, t in ms.items():
        part = key.removesuffix("_for_bwd")
        f = 3.5 * fl if "_e2e" in part else 2.5 * fl if "_bwd" in part else fl
        tf[key] = f / (t * 1e-3) / 1e12
    return tf


def run_gqa_shape(b, h, hkv, n, d, causal):
    """A grouped-query shape (``GQA_SHAPES``): cuDNN BF16 SDPA (``enable_gqa``) and what
    ``dmref.kernels.attention`` runs by default (``config.DEFAULT_RECIPE``): the forward with its
    quantization for the backward, the backward, both through autograd; the same ``ours_default_*``
    keys and speed-ups as ``run_shape``'s, the shape with ``kv_heads``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from dmref.kernels import api

    torch.manual_seed(0)
    q, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    scale = 1 / math.sqrt(d)
    shape = api.Shape.of(q, k, v)
    fl = _flops(b, h, n, d, causal)
    res = dict(shape=[b, h, n, d], kv_heads=hkv, causal=causal)
    ms = _time_default(q, k, v, do, causal, scale, shape)
    dsq_ms, dsq_err = _time_dsq_row(q, k, v, do, causal, scale, shape)
    ms.update(dsq_ms)
    res.update(dsq_err)
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        ms["cudnn_fwd"] = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True))
        out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal, enable_gqa=True)
        ms["cudnn_bwd"] = bench(lambda: out.backward(do, retain_graph=True), grad_to_none=[qg, kg, vg])

        def cudnn_step():
            F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal, enable_gqa=True).backward(do)
        ms["cudnn_e2e"] = bench(cudnn_step, grad_to_none=[qg, kg, vg])
        del out
    res["ms"] = ms
    res["tflops"] = _tflops(ms, fl)
    res["speedup_vs_cudnn"] = _default_speedups(ms, "cudnn")
    return res


def run_shape(b, h, n, d, causal, fwd_c, bwd_c):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from dmref.kernels import api, fwd as fwd_mod
    from dmref.kernels.quantize import quantize, quantize_with

    torch.manual_seed(0)
    q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale = 1 / math.sqrt(d)
    shape = api.Shape.of(q, k, v)
    fl = _flops(b, h, n, d, causal)
    r_st = _recipe("kernels_naive_fp8", fwd_c, bwd_c)
    r_dm = _recipe("kernels_delta_matching", fwd_c, bwd_c)
    res = dict(shape=[b, h, n, d], causal=causal, tiles=_describe_tiles(r_dm, d))
    ms = {}

    # --- ours: forward
    o, lse, saved, _ = api.attention_forward(q, k, v, causal=causal, scale=scale, recipe=r_dm)
    dims = dict(batch=b, heads=h, kv_heads=h, n=n, head_dim=d)
    ms["ours_fwd_kernel"] = bench(lambda: fwd_mod.forward(saved.q, saved.k, saved.v, causal=causal,
                                                           scale=scale, recipe=r_dm, **dims))
    ms["ours_fwd_incl_quant"] = bench(lambda: api.attention_forward(
        q, k, v, causal=causal, scale=scale, recipe=r_dm, for_backward=False))
    ms["ours_fwd_incl_quant_for_bwd"] = bench(lambda: api.attention_forward(
        q, k, v, causal=causal, scale=scale, recipe=r_dm, for_backward=True))
    # --- what dmref.kernels.attention runs by default (config.DEFAULT_RECIPE)
    ms.update(_time_default(q, k, v, do, causal, scale, shape))
    dsq_ms, dsq_err = _time_dsq_row(q, k, v, do, causal, scale, shape)
    ms.update(dsq_ms)
    res.update(dsq_err)
    ms["ours_quant_qkv_for_bwd"] = bench(lambda: [quantize(t, "float8_e4m3fn") for t in (q, k, v)])
    # --- ours: the warp-specialized forward (folded scales)
    from dmref.kernels import fwd_ws

    _, _, kv = fwd_ws.attention_forward(q, k, v, causal=causal, scale=scale)
    ms["ours_fwd_ws_kernel"] = bench(lambda: fwd_ws.forward(q, kv.k8, kv.k_scale, kv.vt8, kv.v_scale, kv_heads=h,
                                                             causal=causal, scale=scale))
    ms["ours_fwd_ws_incl_quant"] = bench(lambda: fwd_ws.attention_forward(q, k, v, causal=causal, scale=scale))
    # the same with K's and V's TMA descriptors built by every CTA instead of on the host
    ms["ours_fwd_ws_kernel_dev"] = bench(lambda: fwd_ws.forward(
        q, kv.k8, kv.k_scale, kv.vt8, kv.v_scale, kv_heads=h, causal=causal, scale=scale, host_descriptors=False))
    ms["ours_fwd_ws_incl_quant_dev"] = bench(lambda: fwd_ws.attention_forward(
        q, k, v, causal=causal, scale=scale, host_descriptors=False))
    # two consumer warp groups a CTA sharing one K/V ring (FwdTiles(consumers=2), 128 queries a CTA)
    try:
        if "two_consumers" in SKIP:
            raise RuntimeError("not timed (--skip two_consumers)")
        two = fwd_ws.variant("kernels_folded_naive_fp8", consumers=2)
        ms["ours_fwd_ws_2cons_kernel"] = bench(lambda: fwd_ws.forward(
            q, kv.k8, kv.k_scale, kv.vt8, kv.v_scale, kv_heads=h, causal=causal, scale=scale, recipe=two))
        ms["ours_fwd_ws_2cons_incl_quant"] = bench(lambda: fwd_ws.attention_forward(
            q, k, v, causal=causal, scale=scale, consumers=2))
    except Exception as exc:
        res["fwd_ws_2cons_error"] = f"{type(exc).__name__}: {exc}"[:300]
    del kv
    # --- ours: backward
    do8, d_stale = quantize(do, "float8_e4m3fn", rows=True, cols=True, delta_with=o)
    ms["ours_bwd_preprocess"] = bench(lambda: quantize(do, "float8_e4m3fn", rows=True, cols=True,
                                                        delta_with=o))
    kw = dict(causal=causal, scale=scale, **dims)
    for tag, r in (("stale", r_st), ("matched", r_dm)):
        # what the API runs (the Gluon kernels where they run the recipe), and the Triton kernels
        gluon = api.gluon_backward_refusal(r, d) is None
        res.setdefault("bwd_kernels", {})[tag] = "gluon" if gluon else "triton"
        ms[f"ours_bwd_{tag}"] = bench(lambda r=r: api.attention_backward(
            saved, o, do, shape=shape, causal=causal, scale=scale, recipe=r))
        ms[f"ours_bwd_{tag}_triton"] = bench(lambda r=r: api.attention_backward(
            saved, o, do, shape=shape, causal=causal, scale=scale, recipe=r, gluon=False))
        # its kernels without the preprocess: both, the dq alone, the dkdv alone (on the dq's D)
        for part, fn in _bwd_parts(r, gluon, saved, do8, d_stale, kw).items():
            ms[f"ours_bwd_{tag}_{part}"] = bench(fn)
    # the five-GEMM backward (stale delta), incl. the preprocess and dQ's postprocess: what the API
    # runs (the Gluon kernel where it runs the recipe) and the Triton one
    res["bwd_kernels"]["fused"] = "gluon" if api.gluon_backward_refusal(r_st, d, fused=True) is None else "triton"
    gluon_fused = None if "gluon_fused" not in SKIP else False
    for key, det, gl_ in (("ours_bwd_fused_stale", False, gluon_fused), ("ours_bwd_fused_stale_det", True, gluon_fused),
                          ("ours_bwd_fused_stale_triton", False, False)):
        ms[key] = bench(lambda det=det, gl_=gl_: api.attention_backward(
            saved, o, do, shape=shape, causal=causal, scale=scale, recipe=r_st, fused=True, deterministic=det,
            gluon=gl_))
    # the seven-GEMM matched recipe in Gluon (kernels_delta_prepass's schedule): dO's quantization,
    # the pre-pass's D, the five-GEMM kernel on that D; its parts; and end to end with the Triton
    # forward (its recipe's) and with the warp-specialized one (folded), without autograd
    from dmref.kernels import bwd_ws

    def seven(saved=saved, o=o):
        if saved.q is None:  # the warp-specialized forward's: Q's copies from dO's launch, as the API makes them
            do8_, _, q8_ = quantize_with(do, "float8_e4m3fn", saved.q_pending, "float8_e4m3fn", delta_with=o)
            saved = dataclasses.replace(saved, q=q8_, q_pending=None)
        else:
            do8_, _ = quantize(do, "float8_e4m3fn", rows=True, cols=True, delta_with=o)
        return bwd_ws.fused(saved, do8_, bwd_ws.prepass(saved, do8_, recipe=r_dm, **kw), recipe=r_st, **kw)

    try:
        if "gluon_fused" in SKIP:
            raise RuntimeError("not timed (--skip gluon_fused)")
        ms["ours_bwd_prepass_gluon"] = bench(seven)
        ms["ours_bwd_prepass_gluon_prepass"] = bench(lambda: bwd_ws.prepass(saved, do8, recipe=r_dm, **kw))
        ms["ours_bwd_prepass_gluon_fused"] = bench(lambda: bwd_ws.fused(saved, do8, d_stale, recipe=r_st,
                                                                        dq_tma=False, **kw))
        # the same kernel adding dQ's partials by TMA reduce-adds (dq_tma, its default where N is a
        # multiple of 64), as dQ's own tiles (dq_t=False) and as dQ^T's, dS's codes the wgmma's shared
        # operand (dq_t, the default with dq_tma)
        if n % 64 == 0:
            ms["ours_bwd_fused_tma"] = bench(lambda: bwd_ws.fused(saved, do8, d_stale, recipe=r_st, dq_tma=True,
                                                                   dq_t=False, **kw))
            ms["ours_bwd_fused_t"] = bench(lambda: bwd_ws.fused(saved, do8, d_stale, recipe=r_st, dq_tma=True,
                                                                 dq_t=True, **kw))
        # the same kernel with two consumer warp groups a CTA sharing the ring of query tiles
        # (WsBwdTiles.fused_consumers=2, 128 keys a CTA; not the default)
        try:
            if "bwd_two_consumers" in SKIP:
                raise RuntimeError("not timed (--skip bwd_two_consumers)")
            ms["ours_bwd_fused_2cons"] = bench(lambda: bwd_ws.fused(saved, do8, d_stale, recipe=r_st, consumers=2,
                                                                     dq_tma=False, **kw))
        except Exception as exc:
            res["bwd_fused_2cons_error"] = f"{type(exc).__name__}: {exc}"[:300]
        r_ffdm = _recipe("kernels_folded_delta_matching", fwd_c, bwd_c)
        for tag, r in (("prepass_gluon", r_dm), ("prepass_gluon_folded", r_ffdm)):
            def e2e(r=r):
                o_, _, saved_, _ = api.attention_forward(q, k, v, causal=causal, scale=scale, recipe=r)
                return seven(saved_, o_)
            ms[f"ours_e2e_{tag}"] = bench(e2e)
    except Exception as exc:
        res["prepass_gluon_error"] = f"{type(exc).__name__}: {exc}"[:300]
    # --- ours: end to end through autograd
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    r_fdm = _recipe("kernels_folded_delta_matching", fwd_c, bwd_c)
    for tag, r in (("stale", r_st), ("matched", r_dm), ("matched_folded", r_fdm)):
        def step(r=r):
            out = api.attention(qg, kg, vg, causal=causal, scale=scale, recipe=r)
            out.backward(do)
        ms[f"ours_e2e_{tag}"] = bench(step, grad_to_none=[qg, kg, vg])
    del saved, o
    # --- SDPA
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                ms[f"{name}_fwd"] = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
                out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
                ms[f"{name}_bwd"] = bench(lambda: out.backward(do, retain_graph=True),
                                           grad_to_none=[qg, kg, vg])

                def step():
                    F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal).backward(do)
                ms[f"{name}_e2e"] = bench(step, grad_to_none=[qg, kg, vg])
                del out
        except Exception as exc:
            res[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:300]
    # --- cuDNN FP8 (head dim 128: its Hopper backward's only one)
    if d == 128:
        try:
            f8, b8 = cudnn_fp8_timers(q, k, v, do, causal)
            ms["cudnn_fp8_fwd"] = bench(f8)
            ms["cudnn_fp8_bwd"] = bench(b8)
            ms["cudnn_fp8_e2e"] = ms["cudnn_fp8_fwd"] + ms["cudnn_fp8_bwd"]
        except Exception as exc:
            res["cudnn_fp8_error"] = f"{type(exc).__name__}: {exc}"[:300]
    res["ms"] = ms
    res["tflops"] = _tflops({k: t for k, t in ms.items() if k not in ("ours_quant_qkv_for_bwd", "ours_bwd_preprocess")},
                            fl)
    # the same keys against each anchor present (cudnn: BF16 SDPA; cudnn_fp8: cuDNN's FP8 graphs)
    for anchor, key in (("cudnn", "speedup_vs_cudnn"), ("cudnn_fp8", "speedup_vs_cudnn_fp8")):
        if ms.get(f"{anchor}_fwd"):
            res[key] = _speedups(ms, anchor)
    res["matched_over_stale"] = ms["ours_bwd_matched"] / ms["ours_bwd_stale"] - 1
    res["matched_over_stale_kernels"] = ms["ours_bwd_matched_kernels"] / ms["ours_bwd_stale_kernels"] - 1
    return res


def sweep(d, causal, h, n, b):
    """Pick the fastest forward and backward tilings for one (head dim, causal) on one shape."""
    from dmref.kernels import api, bwd as bwd_mod, fwd as fwd_mod
    from dmref.kernels.quantize import quantize

    torch.manual_seed(0)
    q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale = 1 / math.sqrt(d)
    dims = dict(batch=b, heads=h, kv_heads=h, n=n, head_dim=d)
    out = {"fwd": {}, "bwd": {}}
    base_bwd = BWD_CANDIDATES[d][0]
    r0 = _recipe("kernels_delta_matching", FWD_CANDIDATES[0], base_bwd)
    o, _, saved, _ = api.attention_forward(q, k, v, causal=causal, scale=scale, recipe=r0)
    for fc in FWD_CANDIDATES:
        try:
            r = _recipe("kernels_delta_matching", fc, base_bwd)
            out["fwd"][str(fc)] = bench(lambda: fwd_mod.forward(saved.q, saved.k, saved.v, causal=causal,
                                                                scale=scale, recipe=r, **dims))
        except Exception as exc:
            out["fwd"][str(fc)] = f"{type(exc).__name__}: {exc}"[:200]
    do8, d_stale = quantize(do, "float8_e4m3fn", rows=True, cols=True, delta_with=o)
    for bc in BWD_CANDIDATES[d]:
        for name in ("kernels_delta_matching", "kernels_naive_fp8"):
            try:
                r = _recipe(name, FWD_CANDIDATES[0], bc)
                out["bwd"][f"{name}{bc}"] = bench(lambda: bwd_mod.backward(
                    saved, do8, do8, d_stale, causal=causal, scale=scale, recipe=r, **dims))
            except Exception as exc:
                out["bwd"][f"{name}{bc}"] = f"{type(exc).__name__}: {exc}"[:200]
    ok_f = {k2: v2 for k2, v2 in out["fwd"].items() if isinstance(v2, float)}
    best_f = eval(min(ok_f, key=ok_f.get)) if ok_f else FWD_CANDIDATES[0]
    # backward: the tiling whose matched backward is fastest
    ok_b = {k2: v2 for k2, v2 in out["bwd"].items() if isinstance(v2, float) and k2.startswith("kernels_delta")}
    best_b = eval(min(ok_b, key=ok_b.get)[len("kernels_delta_matching"):]) if ok_b else base_bwd
    return tuple(best_f), tuple(best_b), out


#: The accuracy inputs: ``channels`` (randn, every 16th channel of q and k x4) and ``dc`` (q, k of
#: that x0.1, so that each row's mass spreads over all keys; v and dO = 1 + randn / 4, channels of
#: one sign: the long sums a tensor-core chain without promotion loses, docs/kernels_speed.md)
ACCURACY_CASES = [((1, 8, 2048, 128), True, "channels"), ((1, 8, 2048, 64), False, "channels"),
                  ((1, 8, 4096, 128), False, "dc")]


def accuracy(out_dir):
    """Errors against float64 attention: ours (the six recipes of both forwards and both backward
    schedules), cuDNN's FP8
    attention (head dim 128), SDPA cuDNN and flash in BF16, on the same inputs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from dmref.cudnn import target as targets
    from dmref.kernels import attention

    res = []
    for (b, h, n, d), causal, kind in ACCURACY_CASES:
        g = torch.Generator(device="cuda").manual_seed(0)
        outlier = torch.ones(d, device="cuda")
        outlier[::16] = 4.0
        q = torch.randn(b, h, n, d, device="cuda", generator=g) * outlier
        k = torch.randn(b, h, n, d, device="cuda", generator=g) * outlier
        v = torch.randn(b, h, n, d, device="cuda", generator=g)
        do = torch.randn(b, h, n, d, device="cuda", generator=g)
        if kind == "dc":
            q, k, v, do = q * 0.1, k * 0.1, 1 + v / 4, 1 + do / 4
        q, k, v, do = (t.bfloat16() for t in (q, k, v, do))
        q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
        o64 = F.scaled_dot_product_attention(q64, k64, v64, is_causal=causal)
        o64.backward(do.double())
        ref = dict(o=o64.detach(), dq=q64.grad, dk=k64.grad, dv=v64.grad)
        row = dict(shape=[b, h, n, d], causal=causal, inputs=kind)

        def errs(fn):
            qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
            o = fn(qg, kg, vg)
            o.backward(do)
            got = dict(o=o.detach(), dq=qg.grad, dk=kg.grad, dv=vg.grad)
            return {x: ((got[x].double() - ref[x]).norm() / ref[x].norm()).item() for x in ref}

        for name in ("kernels_delta_matching", "kernels_naive_fp8", "kernels_folded_delta_matching",
                     "kernels_folded_naive_fp8", "kernels_delta_prepass", "kernels_folded_delta_prepass"):
            try:
                row[f"ours_{name}"] = errs(lambda a, b_, c, name=name: attention(a, b_, c, causal=causal, recipe=name))
            except Exception as exc:  # the pre-pass recipes' Gluon kernels: recorded, not fatal
                row[f"ours_{name}"] = f"{type(exc).__name__}: {exc}"[:200]
        if d == 128:
            try:
                row["cudnn_fp8"] = errs(lambda a, b_, c: targets.cudnn_fp8(a, b_, c, causal=causal))
            except Exception as exc:
                row["cudnn_fp8"] = f"{type(exc).__name__}: {exc}"[:200]
        for name, backend in (("cudnn_bf16", SDPBackend.CUDNN_ATTENTION), ("flash_bf16", SDPBackend.FLASH_ATTENTION)):
            try:
                with sdpa_kernel(backend):
                    row[name] = errs(lambda a, b_, c: F.scaled_dot_product_attention(a, b_, c, is_causal=causal))
            except Exception as exc:
                row[name] = f"{type(exc).__name__}: {exc}"[:200]
        res.append(row)
        print(json.dumps(row), flush=True)
        with open(os.path.join(out_dir, f"{device_tag()}_accuracy.json"), "w") as f:
            json.dump(res, f, indent=1)


def profile_one(head_dims):
    """Per head dim, at 1x16x4096xD: one forward, one stale and one matched backward with the
    default tilings, for ncu (its kernels in that order: fwd, dq, dkdv, dq, dkdv)."""
    from dmref.kernels import api

    for d in head_dims:
        torch.manual_seed(0)
        q, k, v, do = (torch.randn(1, 16, 4096, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        o, _, saved, _ = api.attention_forward(q, k, v, recipe="kernels_delta_matching")
        for name in ("kernels_naive_fp8", "kernels_delta_matching"):
            api.attention_backward(saved, o, do, shape=api.Shape.of(q, k, v), causal=False,
                                   scale=1 / math.sqrt(d), recipe=name)
        torch.cuda.synchronize()


def device_tag() -> str:
    """The GPU's model in lower case (``NVIDIA H200`` -> ``h200``), the prefix of result files."""
    name = torch.cuda.get_device_name()
    found = re.search(r"\b([A-Z]+[0-9]+[A-Z]*)\b", name)
    return (found.group(1) if found else name.split()[-1]).lower()


def _write(out_dir, results, name="bench_attention"):
    with open(os.path.join(out_dir, f"{device_tag()}_{name}.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)


def sweep_only(shapes, out_dir):
    """The tiling sweep alone, per head dim, non-causal and causal: <device>_sweep_d<D>.json."""
    for b, h, n, d in shapes:
        table = {}
        for causal in (False, True):
            bf, bb, ms = sweep(d, causal, h, n, b)
            table[str(causal)] = dict(best_fwd=bf, best_bwd=bb, ms=ms)
            print(f"sweep d={d} causal={causal}: fwd {bf} bwd {bb}", flush=True)
        _write(out_dir, table, f"sweep_d{d}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=RESULTS, help="directory for the JSON results (default: %(default)s)")
    ap.add_argument("--quick", action="store_true", help="first shape only, non-causal")
    ap.add_argument("--no-sweep", action="store_true", help="use the first candidate tilings")
    ap.add_argument("--accuracy", action="store_true", help="also measure errors vs float64")
    ap.add_argument("--workers", type=int, default=8, help="processes compiling ahead")
    ap.add_argument("--skip", default="", help="comma-separated groups not to time: two_consumers, gluon_fused, "
                    "bwd_two_consumers, dsq_row")
    ap.add_argument("--warm-only", action="store_true", help="compile every variant, then stop")
    ap.add_argument("--profile-one", action="store_true",
                    help="run forward, stale and matched backward once at 1x16x4096xD (for ncu)")
    ap.add_argument("--sweep-only", action="store_true", help="time the candidate tilings only")
    ap.add_argument("--head-dim", type=int, choices=sorted({s[3] for s in SHAPES}), default=None,
                    help="only the shapes of this head dim (default: all)")
    args = ap.parse_args(argv)
    SKIP.update(g for g in args.skip.split(",") if g)
    unknown = SKIP - {"two_consumers", "gluon_fused", "bwd_two_consumers"}
    if unknown:
        ap.error(f"--skip: unknown groups {sorted(unknown)}")
    os.makedirs(args.out, exist_ok=True)
    if not torch.cuda.is_available():
        sys.exit("bench_attention.py needs a CUDA GPU")
    import triton

    shapes = [s for s in SHAPES if args.head_dim in (None, s[3])]
    if args.profile_one:
        return profile_one(sorted({s[3] for s in shapes}, reverse=True))
    if args.sweep_only:
        firsts = {}
        for s in shapes:
            firsts.setdefault(s[3], s)
        return sweep_only(list(firsts.values()), args.out)
    shapes = shapes[:1] if args.quick else shapes
    causals = (False,) if args.quick else (False, True)
    meta = dict(date=datetime.date.today().isoformat(), device=torch.cuda.get_device_name(),
                torch=torch.__version__, triton=triton.__version__,
                cudnn=torch.backends.cudnn.version(), method="triton.testing.do_bench medians, "
                "warmup 25 ms, rep 100 ms; FLOPs fwd 4BHN^2D (/2 causal), bwd 2.5x, e2e 3.5x")
    print(json.dumps(meta), flush=True)
    t_start = time.time()
    # compile every variant ahead, in parallel
    ds = sorted({s[3] for s in shapes})
    fwd_cands = [None] if args.no_sweep else FWD_CANDIDATES
    jobs = []
    for d in ds:
        bwd_cands = [None] if args.no_sweep else BWD_CANDIDATES[d]
        heads = [s[1] for s in shapes if s[3] == d][0]
        for causal in causals:
            # every backward candidate is swept on the non-causal case; causal ones run with
            # whichever wins, so compile them all for both
            for i, fc in enumerate(fwd_cands):
                jobs.append((d, causal, fc, bwd_cands[min(i, len(bwd_cands) - 1)], heads))
            for bc in bwd_cands[len(fwd_cands):]:
                jobs.append((d, causal, fwd_cands[0], bc, heads))
    meta["compile_errors"] = warm(jobs, args.workers)
    if args.warm_only:
        return
    results = dict(meta=meta, sweep={}, cases=[])
    best = {}
    for d in ds:
        b, h, n, _ = [s for s in shapes if s[3] == d][0]
        if args.no_sweep:
            for causal in causals:
                best[(d, causal)] = (None, None)  # the recipes' default tilings
            continue
        # one sweep per head dim (non-causal); the causal cases use its winner
        bf, bb, table = sweep(d, False, h, n, b)
        for causal in causals:
            best[(d, causal)] = (bf, bb)
        results["sweep"][f"d{d}_full"] = dict(best_fwd=bf, best_bwd=bb, ms=table)
        print(f"sweep d={d}: fwd {bf} bwd {bb}", flush=True)
    for (b, h, hkv, n, d) in ([] if args.quick else [s for s in GQA_SHAPES if args.head_dim in (None, s[4])]):
        for causal in causals:
            try:
                r = run_gqa_shape(b, h, hkv, n, d, causal)
            except Exception as exc:
                r = dict(shape=[b, h, n, d], kv_heads=hkv, causal=causal, error=traceback.format_exc()[-1500:])
            results["cases"].append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "ms"}), flush=True)
            torch.cuda.empty_cache()
            _write(args.out, results)
    for (b, h, n, d) in shapes:
        for causal in causals:
            fc, bc = best[(d, causal)]
            try:
                r = run_shape(b, h, n, d, causal, fc, bc)
            except Exception as exc:
                r = dict(shape=[b, h, n, d], causal=causal, error=traceback.format_exc()[-1500:])
            results["cases"].append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "ms"}), flush=True)
            torch.cuda.empty_cache()
            _write(args.out, results)  # after every case: a time limit keeps what was measured
    from dmref.kernels.compile_check import jitted_kernels

    results["compiled"] = {name: _kernel_stats(kernel) for name, kernel in jitted_kernels().items()}
    results["meta"]["wall_s"] = time.time() - t_start
    _write(args.out, results)
    if args.accuracy:
        accuracy(args.out)


if __name__ == "__main__":
    main()
