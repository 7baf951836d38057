"""The pre-pass of the seven-GEMM backward (``kernels_delta_prepass``): the matched delta
D_i = sum_j P_ij dP_ij before the five-GEMM backward (``bwd_fused``) runs.

One program per ``BLOCK_M`` queries of one query head loops over ``BLOCK_N``-key tiles exactly as
``bwd``'s dq kernel does, with its own helpers (``bwd._dq_load_rows``, ``bwd._dq_p_dp``,
``bwd._pdp_step``) and its tiling (the spec's ``block_m2``, ``block_n2``, warps, stages, loads and
register cap): S = Q K^T and dP = dO V^T as two FP8 matmuls over the head dim, P against LSE2, and
D_i += sum_j P_ij dP_ij once per key tile, stored as float32 ``(B*H, N)``. Two GEMMs a tile and no
FP8 operand formed, so the seven GEMMs are these two and the fused backward's five.

Its D is the dq kernel's matched D bit for bit on the same inputs (the same operations in the same
order; ``tests/kernels/test_bwd_prepass.py`` compares them with ``torch.equal`` in Triton's
interpreter and on the GPU), and so the D of the recipe with the matched delta that a pre-pass
computes (``dmref.recipes.with_prepass_delta``): the main pass's dP are the same wgmma chains
over the same codes (Theorem 1′ of dmref/proofs/delta_matching.md).

    python -m dmref.kernels.bwd_prepass     # registers, spills, shared memory for sm_90a (no GPU)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import mul_rn
from ._runtime import Launch, interpreting
from .bwd import _dq_keys_end, _dq_kv_head, _dq_load_rows, _dq_p_dp, _pdp_step, described
from .config import KernelSpec


@triton.jit
def _bwd_prepass_kernel(
    Q8, Q_SCALE, K8, K_SCALE, V8, V_SCALE, DO8, DO_SCALE, LSE2, DELTA, DSQ_U,
    qk_scale, H, GROUP, N,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    TMA: tl.constexpr, BOUND: tl.constexpr, INTERPRET: tl.constexpr,
):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    bh64 = bh.to(tl.int64)
    kv = _dq_kv_head(bh, H, GROUP)
    # per-head base pointers (64-bit scalars), as the dq kernel's; with TMA, K8 and V8 are
    # descriptors of the (B*Hkv, N, D) row copies
    kv32 = kv.to(tl.int32)
    if not TMA:
        K8 += kv * N * HEAD_DIM
        V8 += kv * N * HEAD_DIM
    K_SCALE += kv * N
    V_SCALE += kv * N
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    in_seq = offs_m < N
    rows = offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    q, do, q_scale, do_scale, lse2 = _dq_load_rows(Q8, Q_SCALE, DO8, DO_SCALE, LSE2, bh64, rows, offs_m, in_seq,
                                                   qk_scale, N, HEAD_DIM)
    # Invariant at the top of each iteration: pdp = sum_j P dP over the key tiles done so far
    pdp = tl.zeros([BLOCK_M], tl.float32)
    # BOUND: and pdp_max = max_j P |dP|, p_max = max_j P over the same tiles
    pdp_max = tl.zeros([BLOCK_M], tl.float32)
    p_max = tl.zeros([BLOCK_M], tl.float32)
    for start_n in range(0, _dq_keys_end(start_m, N, BLOCK_M, CAUSAL), BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        # load K and V, QK^T + softmax, dP: the dq kernel's
        _, p, dp = _dq_p_dp(q, do, q_scale, do_scale, lse2, K8, V8, K_SCALE, V_SCALE, kv32, start_n, offs_m, offs_d,
                            in_seq, N, BLOCK_N, HEAD_DIM, CAUSAL, TMA, INTERPRET)
        pdp = _pdp_step(pdp, p, dp)
        if BOUND:
            pdp_max = tl.maximum(pdp_max, tl.max(p * tl.abs(dp), axis=1))
            p_max = tl.maximum(p_max, tl.max(p, axis=1))
    tl.store(DELTA + bh64 * N + offs_m, pdp, mask=in_seq)
    if BOUND:
        # U_i = (max_j P|dP| + |D_i| max_j P) (1 + 2^-21), each product rounded on its own
        # (dmref.tiled's order; dmref/proofs/delta_study.md, Lemma 2)
        u = mul_rn(pdp_max + mul_rn(tl.abs(pdp), p_max, INTERPRET), 1.0 + 2.0**-21, INTERPRET)
        tl.store(DSQ_U + bh64 * N + offs_m, u, mask=in_seq)


def launch(spec: KernelSpec, *, head_dim: int, causal: bool, bound: bool = False) -> Launch:
    """The launch of the pre-pass for ``spec`` at ``head_dim``: the dq kernel's tiles and options
    of the spec's backward tiling (``block_m2`` queries a program, ``block_n2`` keys a tile,
    ``num_warps_dq``, ``num_stages_dq``, ``maxnreg_dq``, TMA loads of K and V where ``tma``).
    The one description that :func:`delta` and ``compile_check`` read. ``bound``: also U_i, the
    bound of each query's dS amax (:func:`delta`)."""
    t = spec.bwd_tiles(head_dim)
    bn = t.block_n2
    return Launch(dict(HEAD_DIM=head_dim, BLOCK_M=t.block_m2, BLOCK_N=bn, CAUSAL=causal, TMA=t.tma,
                       BOUND=bool(bound), INTERPRET=interpreting()),
                  t.num_warps_dq, t.num_stages_dq, t.maxnreg_dq,
                  {"K8": [1, bn, head_dim], "V8": [1, bn, head_dim]} if t.tma else {},
                  kernel=_bwd_prepass_kernel, block_m=t.block_m2)


def delta(saved, do8, *, batch: int, heads: int, kv_heads: int, n: int, head_dim: int, causal: bool,
          scale: float, recipe: KernelSpec, bound: bool = False):
    """The matched D, ``(B*H, N)`` float32, from ``saved`` (the forward's ``SavedForward``: Q, K,
    V row copies and LSE2) and ``do8`` (dO's row copy, ``quantize.Quantized``). ``bound`` (not
    the default): ``(D, U)``, U_i = (max_j P_ij |dP_ij| + |D_i| max_j P_ij)(1 + 2^-21) from the same
    P and dP, the bound of the row's dS amax that ``Recipe.ds_dq_bound`` scales dS for dQ by
    (``bwd_fused.backward(..., dsq_bound=U)``)."""
    from .fwd import LOG2E

    run = launch(recipe, head_dim=head_dim, causal=causal, bound=bound)
    saved = saved.with_q_copies()  # where the forward left them to the backward
    q8, k8, v8 = saved.q, saved.k, saved.v
    k_rows, v_rows = described(run, ("K8", "V8"), (k8.rows, v8.rows))
    out = torch.empty((batch * heads, n), device=do8.rows.device, dtype=torch.float32)
    u = torch.empty_like(out) if bound else out[:1, :1]
    run.start(run.grid(n, batch * heads),
        q8.rows, q8.row_scale, k_rows, k8.row_scale, v_rows, v8.row_scale, do8.rows, do8.row_scale, saved.lse2,
        out, u, scale * LOG2E, heads, heads // kv_heads, n)
    return (out, u) if bound else out


def compile_usage(spec: "KernelSpec | str" = "kernels_delta_prepass", head_dims=(64, 128),
                  causal=(False, True)) -> list:
    """Registers, spill bytes and shared memory of the pre-pass compiled for sm_90a as
    :func:`launch` describes it (no GPU: ``compile_check``), one ``compile_check.Usage`` per
    variant. Must run with ``TRITON_INTERPRET`` unset."""
    from ._sm90 import Usage, compile_launch, resource_usage
    from .config import get_spec

    spec = get_spec(spec)
    out = []
    for d in head_dims:
        for c in causal:
            run = launch(spec, head_dim=d, causal=c)
            regs, spills, shared = resource_usage(compile_launch(run, do_format=spec.recipe.do_dp.fmt.name))
            cap = "" if run.maxnreg is None else f" maxnreg={run.maxnreg}"
            out.append(Usage("prepass", regs, spills, shared,
                             f"{spec.name} d={d} causal={c} warps={run.num_warps} stages={run.num_stages} "
                             f"tma={run.constexprs['TMA']}{cap}"))
    return out


if __name__ == "__main__":  # pragma: no cover
    for u in compile_usage():
        print(f"{u.variant}: {u.registers} registers, {u.spill_bytes} bytes spilled, {u.shared_bytes} bytes shared")
