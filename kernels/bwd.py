"""Backward FP8 attention kernels: preprocess, dq, dkdv, with the delta step visible.

All five backward matmuls run in FP8 (recomputed S = Q K^T, dP = dO V^T, dV = P^T dO,
dQ = dS K, dK = dS^T Q), each reading its operands K-major: row copies where the contraction is the
head dim, transposed copies where it is tokens (see ``config``).

The delta step, per strategy:

- ``stale``: ``D = rowsum(dO * O)`` from BF16 dO and O, computed by the preprocess (fused into the
  quantization of dO, ``quantize.quantize(..., delta_with=O)``). Then ``dkdv`` and ``dq`` form
  ``dS = P (dP - D)``.
- ``matched`` (Delta-Matching): ``D_i = sum_j P_ij dP_ij / sum_j P_ij`` from exactly the float32
  ``P`` and ``dP`` that dS uses. No pre-sweep: the ``dq`` kernel runs *first*, and since it already
  recomputes S and dP over whole rows it accumulates ``sum_j P dP`` and ``sum_j P`` on the way.
  dQ cannot wait for D, so it is formed with the stale D as predictor and corrected at the end:

      dS_ij = P_ij (dP_ij - D_i) = P_ij (dP_ij - Dst_i) - (D_i - Dst_i) P_ij
      dQ_i  = tau [ sum_j Q8(P (dP - Dst))_ij K_j  -  (D_i - Dst_i) * kbar_i ],
      kbar_i = sum_j Q8(2**8 P_ij) K_j / 2**8         (one more FP8 matmul, same K tile)

  The correction's factor ``D - Dst`` is small, so kbar's FP8 error is second order. dK needs
  ``sum_i D_i P_ij Q_i`` with every row's final D, which has no such deferred form: ``dkdv`` runs
  second and reads the matched D, forming ``dS = P (dP - D)`` exactly. The cost over stale is the
  kbar matmul and two row reductions in ``dq``; nothing is swept twice.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import quantize_rows, quantize_tile, to_bf16, to_fp8
from ._runtime import interpreting
from .config import QUANT_BLOCK, KernelRecipe


# --------------------------------------------------------------------------------------------
# dq: one program per BLOCK_M queries of one head, looping over BLOCK_N keys
# --------------------------------------------------------------------------------------------


@triton.jit
def _dq_inner(
    dq, kbar, pdp, psum, rowsum,
    q, q_scale, do, do_scale, lse2, d_stale, offs_m,
    K8, K_SCALE, V8, V_SCALE, KT8, KT_SCALE, lo, hi, N, NPAD,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, QB: tl.constexpr,
    MASK: tl.constexpr, CAUSAL: tl.constexpr, MATCHED: tl.constexpr, P_SCALE: tl.constexpr,
    DS_ROWWISE: tl.constexpr, DEBUG: tl.constexpr, INTERPRET: tl.constexpr,
):
    # every pointer points at this program's key/value head: offsets stay int32
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_rows = offs_n[None, :] * HEAD_DIM + offs_d[:, None]
        if MASK:
            k = tl.load(K8 + kv_rows, mask=offs_n[None, :] < N, other=0.0)
            v = tl.load(V8 + kv_rows, mask=offs_n[None, :] < N, other=0.0)
            k_scale = tl.load(K_SCALE + offs_n, mask=offs_n < N, other=0.0)
            v_scale = tl.load(V_SCALE + offs_n, mask=offs_n < N, other=0.0)
        else:
            k = tl.load(K8 + kv_rows)
            v = tl.load(V8 + kv_rows)
            k_scale = tl.load(K_SCALE + offs_n)
            v_scale = tl.load(V_SCALE + offs_n)
        # recompute: in the forward this was S2 = dot(Q8, K8^T) * scales; now P against LSE
        s = tl.dot(q, k) * (q_scale[:, None] * k_scale[None, :])
        p = tl.math.exp2(s - lse2[:, None])
        if MASK:
            valid = (offs_m[:, None] < N) & (offs_n[None, :] < N)
            if CAUSAL:
                valid = valid & (offs_m[:, None] >= offs_n[None, :])
            p = tl.where(valid, p, 0.0)
        dp = tl.dot(do, v) * (do_scale[:, None] * v_scale[None, :])
        if MATCHED:
            # delta step (matched): the same float32 P and dP that dS uses
            pdp += tl.sum(p * dp, axis=1)
            psum += tl.sum(p, axis=1)
        ds = p * (dp - d_stale[:, None])
        if DEBUG:
            rowsum += tl.sum(ds, axis=1)
        # K transposed copy as a (BLOCK_N, D) tile, tokens contiguous; padding codes are zero
        kt = tl.load(KT8 + offs_d[None, :] * NPAD + offs_n[:, None])
        kt_scale = tl.load(KT_SCALE + (start_n // QB) * HEAD_DIM + offs_d)
        if DS_ROWWISE:
            # Q-point dS: float32 -> E4M3, one pow2_floor scale per query row and BLOCK_N keys
            ds8, ds_inv = quantize_rows(ds, False, INTERPRET)
            dq += tl.dot(ds8, kt) * kt_scale[None, :] * ds_inv[:, None]
        else:
            # Q-point dS: float32 -> E4M3, one pow2_floor scale per BLOCK_M x BLOCK_N tile
            ds8, ds_inv = quantize_tile(ds, False, INTERPRET)
            dq += tl.dot(ds8, kt) * (kt_scale * ds_inv)[None, :]
        if MATCHED:
            # Q-point P (kbar): float32 -> E4M3, scale 2**8 against LSE
            p8 = to_fp8(p * P_SCALE, False, INTERPRET)
            kbar += tl.dot(p8, kt) * kt_scale[None, :]
    return dq, kbar, pdp, psum, rowsum


@triton.jit
def _bwd_dq_kernel(
    Q8, Q_SCALE, K8, K_SCALE, V8, V_SCALE, KT8, KT_SCALE,
    DO8, DO_SCALE, LSE2, DELTA_STALE, DELTA_MATCHED,
    DQ, DQ_ROWSUM,
    qk_scale, sm_scale, H, GROUP, N, NPAD,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QB: tl.constexpr,
    CAUSAL: tl.constexpr, MATCHED: tl.constexpr, P_SCALE: tl.constexpr,
    DS_ROWWISE: tl.constexpr, DEBUG: tl.constexpr, INTERPRET: tl.constexpr,
):
    tl.static_assert(QB % BLOCK_N == 0)
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    bh64 = bh.to(tl.int64)
    kv = ((bh // H) * (H // GROUP) + (bh % H) // GROUP).to(tl.int64)
    # per-head base pointers (64-bit scalars); the tiles use int32 offsets from them
    K8 += kv * N * HEAD_DIM
    V8 += kv * N * HEAD_DIM
    K_SCALE += kv * N
    V_SCALE += kv * N
    KT8 += kv * HEAD_DIM * NPAD
    KT_SCALE += kv * (NPAD // QB) * HEAD_DIM
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    in_seq = offs_m < N
    rows = offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    q = tl.load(Q8 + bh64 * N * HEAD_DIM + rows, mask=in_seq[:, None], other=0.0)
    do = tl.load(DO8 + bh64 * N * HEAD_DIM + rows, mask=in_seq[:, None], other=0.0)
    q_scale = tl.load(Q_SCALE + bh64 * N + offs_m, mask=in_seq, other=0.0) * qk_scale
    do_scale = tl.load(DO_SCALE + bh64 * N + offs_m, mask=in_seq, other=0.0)
    lse2 = tl.load(LSE2 + bh64 * N + offs_m, mask=in_seq, other=0.0)
    d_stale = tl.load(DELTA_STALE + bh64 * N + offs_m, mask=in_seq, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    kbar = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    pdp = tl.zeros([BLOCK_M], tl.float32)
    psum = tl.zeros([BLOCK_M], tl.float32)
    rowsum = tl.zeros([BLOCK_M], tl.float32)
    if start_m + BLOCK_M <= N:
        if CAUSAL:
            lo_diag = (start_m // BLOCK_N) * BLOCK_N
        else:
            lo_diag = (N // BLOCK_N) * BLOCK_N
        # keys below the diagonal (causal) or in full tiles: no mask
        dq, kbar, pdp, psum, rowsum = _dq_inner(
            dq, kbar, pdp, psum, rowsum, q, q_scale, do, do_scale, lse2, d_stale, offs_m,
            K8, K_SCALE, V8, V_SCALE, KT8, KT_SCALE, 0, lo_diag, N, NPAD,
            HEAD_DIM, BLOCK_N, QB, False, CAUSAL, MATCHED, P_SCALE, DS_ROWWISE, DEBUG, INTERPRET)
        if CAUSAL:
            hi_diag = tl.minimum(start_m + BLOCK_M, N)
        else:
            hi_diag = N
        dq, kbar, pdp, psum, rowsum = _dq_inner(
            dq, kbar, pdp, psum, rowsum, q, q_scale, do, do_scale, lse2, d_stale, offs_m,
            K8, K_SCALE, V8, V_SCALE, KT8, KT_SCALE, lo_diag, hi_diag, N, NPAD,
            HEAD_DIM, BLOCK_N, QB, True, CAUSAL, MATCHED, P_SCALE, DS_ROWWISE, DEBUG, INTERPRET)
    else:
        # the last, partial query block: rows past N must not move the dS tile scales
        dq, kbar, pdp, psum, rowsum = _dq_inner(
            dq, kbar, pdp, psum, rowsum, q, q_scale, do, do_scale, lse2, d_stale, offs_m,
            K8, K_SCALE, V8, V_SCALE, KT8, KT_SCALE, 0, N, N, NPAD,
            HEAD_DIM, BLOCK_N, QB, True, CAUSAL, MATCHED, P_SCALE, DS_ROWWISE, DEBUG, INTERPRET)
    if MATCHED:
        # delta step (matched), normalized by the same P's mass: sum_j dS_ij = 0 up to rounding
        d_matched = pdp / tl.where(psum > 0, psum, 1.0)  # psum = 0 only on rows past N
        tl.store(DELTA_MATCHED + bh64 * N + offs_m, d_matched, mask=in_seq)
        # deferred correction of dQ: dS K = (P (dP - Dst)) K - (D - Dst) (P K)
        dq -= (d_matched - d_stale)[:, None] * (kbar * (1.0 / P_SCALE))
        if DEBUG:
            rowsum -= (d_matched - d_stale) * psum
    tl.store(DQ + bh64 * N * HEAD_DIM + rows, to_bf16(dq * sm_scale, INTERPRET), mask=in_seq[:, None])
    if DEBUG:
        tl.store(DQ_ROWSUM + bh64 * N + offs_m, rowsum, mask=in_seq)


# --------------------------------------------------------------------------------------------
# dkdv: one program per BLOCK_N keys of one key/value head, looping over its query heads and
# BLOCK_M queries
# --------------------------------------------------------------------------------------------


@triton.jit
def _dkdv_inner(
    dk, dv, k, k_scale, v, v_scale, start_n, offs_n,
    Q8, Q_SCALE, QT8, QT_SCALE, DO8, DO_SCALE, DOT8, DOT_SCALE, LSE2, DELTA,
    DS_ROWSUM, P_DUMP, DS_DUMP, DS_SCALE,
    lo, hi, qk_scale, N, NPAD,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QB: tl.constexpr,
    MASK: tl.constexpr, CAUSAL: tl.constexpr, P_SCALE: tl.constexpr,
    DS_ROWWISE: tl.constexpr, DEBUG: tl.constexpr, INTERPRET: tl.constexpr,
):
    # every pointer points at this query head: offsets stay int32
    offs_d = tl.arange(0, HEAD_DIM)
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        # Q and dO row copies as (D, BLOCK_M) tiles: the head dim (the contraction) contiguous
        q_rows = offs_m[None, :] * HEAD_DIM + offs_d[:, None]
        if MASK:
            in_seq = offs_m < N
            q_t = tl.load(Q8 + q_rows, mask=in_seq[None, :], other=0.0)
            do_t = tl.load(DO8 + q_rows, mask=in_seq[None, :], other=0.0)
            q_scale = tl.load(Q_SCALE + offs_m, mask=in_seq, other=0.0)
            do_scale = tl.load(DO_SCALE + offs_m, mask=in_seq, other=0.0)
            lse2 = tl.load(LSE2 + offs_m, mask=in_seq, other=0.0)
            delta = tl.load(DELTA + offs_m, mask=in_seq, other=0.0)
        else:
            q_t = tl.load(Q8 + q_rows)
            do_t = tl.load(DO8 + q_rows)
            q_scale = tl.load(Q_SCALE + offs_m)
            do_scale = tl.load(DO_SCALE + offs_m)
            lse2 = tl.load(LSE2 + offs_m)
            delta = tl.load(DELTA + offs_m)
        q_scale = q_scale * qk_scale
        # recompute, transposed: S2^T = dot(K8, Q8^T) * scales, P^T against LSE
        s_t = tl.dot(k, q_t) * (k_scale[:, None] * q_scale[None, :])
        p_t = tl.math.exp2(s_t - lse2[None, :])
        if MASK:
            valid = (offs_m[None, :] < N) & (offs_n[:, None] < N)
            if CAUSAL:
                valid = valid & (offs_m[None, :] >= offs_n[:, None])
            p_t = tl.where(valid, p_t, 0.0)
        dp_t = tl.dot(v, do_t) * (v_scale[:, None] * do_scale[None, :])
        # Q-point P (dV): float32 -> E4M3, scale 2**8 against LSE
        p8_t = to_fp8(p_t * P_SCALE, False, INTERPRET)
        # dO transposed copy as a (BLOCK_M, D) tile: tokens (the contraction) contiguous
        tok_ptrs = offs_d[None, :] * NPAD + offs_m[:, None]
        tok_scale = (start_m // QB) * HEAD_DIM + offs_d
        do_tok = tl.load(DOT8 + tok_ptrs)
        dv += tl.dot(p8_t, do_tok) * tl.load(DOT_SCALE + tok_scale)[None, :]
        # dS = P (dP - D), with D stale or matched as the caller chose
        ds_t = p_t * (dp_t - delta[None, :])
        if DS_ROWWISE:
            # Q-point dS: float32 -> E4M3, one pow2_floor scale per key and BLOCK_M queries
            ds8_t, ds_inv = quantize_rows(ds_t, False, INTERPRET)
        else:
            # Q-point dS: float32 -> E4M3, one pow2_floor scale per BLOCK_M x BLOCK_N tile
            ds8_t, ds_inv = quantize_tile(ds_t, False, INTERPRET)
            ds_inv = tl.full([BLOCK_N], 1.0, tl.float32) * ds_inv
        if DEBUG:
            tl.atomic_add(DS_ROWSUM + offs_m, tl.sum(ds_t, axis=0), mask=offs_m < N)
            dump = offs_m[None, :] * N + offs_n[:, None]
            dump_mask = (offs_m[None, :] < N) & (offs_n[:, None] < N)
            tl.store(P_DUMP + dump, p8_t.to(tl.uint8, bitcast=True), mask=dump_mask)
            tl.store(DS_DUMP + dump, ds8_t.to(tl.uint8, bitcast=True), mask=dump_mask)
            # dequantization factor of dS[:, j] in this query tile: (B*H, cdiv(N, BLOCK_M), N)
            scale_ptrs = (start_m // BLOCK_M) * N + offs_n
            tl.store(DS_SCALE + scale_ptrs, ds_inv, mask=offs_n < N)
        q_tok = tl.load(QT8 + tok_ptrs)
        dk += tl.dot(ds8_t, q_tok) * tl.load(QT_SCALE + tok_scale)[None, :] * ds_inv[:, None]
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(
    Q8, Q_SCALE, QT8, QT_SCALE, K8, K_SCALE, V8, V_SCALE,
    DO8, DO_SCALE, DOT8, DOT_SCALE, LSE2, DELTA,
    DK, DV, DS_ROWSUM, P_DUMP, DS_DUMP, DS_SCALE,
    qk_scale, sm_scale, H, HKV, N, NPAD,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QB: tl.constexpr,
    CAUSAL: tl.constexpr, P_SCALE: tl.constexpr, DS_ROWWISE: tl.constexpr,
    DEBUG: tl.constexpr, INTERPRET: tl.constexpr,
):
    tl.static_assert(QB % BLOCK_M == 0)
    start_n = tl.program_id(0) * BLOCK_N
    bkv = tl.program_id(1)
    bkv64 = bkv.to(tl.int64)
    group = H // HKV
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    in_seq = offs_n < N
    rows = offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    kv_rows = bkv64 * N * HEAD_DIM
    # K and V row copies stay on chip for the whole loop
    k = tl.load(K8 + kv_rows + rows, mask=in_seq[:, None], other=0.0)
    v = tl.load(V8 + kv_rows + rows, mask=in_seq[:, None], other=0.0)
    k_scale = tl.load(K_SCALE + bkv64 * N + offs_n, mask=in_seq, other=0.0)
    v_scale = tl.load(V_SCALE + bkv64 * N + offs_n, mask=in_seq, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    if CAUSAL:
        # query tiles that touch the diagonal [start_n, start_n + BLOCK_N): causal mask; tiles
        # divide one another, so these are whole query tiles
        lo = (start_n // BLOCK_M) * BLOCK_M
        hi_diag = tl.cdiv(start_n + BLOCK_N, BLOCK_M) * BLOCK_M
    else:
        lo = 0
        hi_diag = 0
    n_full = (N // BLOCK_M) * BLOCK_M
    for g in range(0, group):
        bh64 = ((bkv // HKV) * H + (bkv % HKV) * group + g).to(tl.int64)
        # this query head's base pointers (64-bit scalars)
        q8_h = Q8 + bh64 * N * HEAD_DIM
        do8_h = DO8 + bh64 * N * HEAD_DIM
        qt8_h = QT8 + bh64 * HEAD_DIM * NPAD
        dot8_h = DOT8 + bh64 * HEAD_DIM * NPAD
        qt_scale_h = QT_SCALE + bh64 * (NPAD // QB) * HEAD_DIM
        dot_scale_h = DOT_SCALE + bh64 * (NPAD // QB) * HEAD_DIM
        q_scale_h = Q_SCALE + bh64 * N
        do_scale_h = DO_SCALE + bh64 * N
        lse2_h = LSE2 + bh64 * N
        delta_h = DELTA + bh64 * N
        rowsum_h = DS_ROWSUM + bh64 * N
        p_dump_h = P_DUMP + bh64 * N * N
        ds_dump_h = DS_DUMP + bh64 * N * N
        ds_scale_h = DS_SCALE + bh64 * tl.cdiv(N, BLOCK_M) * N
        if start_n + BLOCK_N <= N:
            if CAUSAL:
                dk, dv = _dkdv_inner(
                    dk, dv, k, k_scale, v, v_scale, start_n, offs_n,
                    q8_h, q_scale_h, qt8_h, qt_scale_h, do8_h, do_scale_h, dot8_h, dot_scale_h,
                    lse2_h, delta_h, rowsum_h, p_dump_h, ds_dump_h, ds_scale_h,
                    lo, tl.minimum(hi_diag, N), qk_scale, N, NPAD,
                    HEAD_DIM, BLOCK_M, BLOCK_N, QB, True, CAUSAL, P_SCALE, DS_ROWWISE, DEBUG, INTERPRET)
            # full query tiles past the diagonal: no mask
            dk, dv = _dkdv_inner(
                dk, dv, k, k_scale, v, v_scale, start_n, offs_n,
                q8_h, q_scale_h, qt8_h, qt_scale_h, do8_h, do_scale_h, dot8_h, dot_scale_h,
                lse2_h, delta_h, rowsum_h, p_dump_h, ds_dump_h, ds_scale_h,
                hi_diag, n_full, qk_scale, N, NPAD,
                HEAD_DIM, BLOCK_M, BLOCK_N, QB, False, CAUSAL, P_SCALE, DS_ROWWISE, DEBUG, INTERPRET)
            # the partial query tile at the end
            dk, dv = _dkdv_inner(
                dk, dv, k, k_scale, v, v_scale, start_n, offs_n,
                q8_h, q_scale_h, qt8_h, qt_scale_h, do8_h, do_scale_h, dot8_h, dot_scale_h,
                lse2_h, delta_h, rowsum_h, p_dump_h, ds_dump_h, ds_scale_h,
                tl.maximum(n_full, hi_diag), N, qk_scale, N, NPAD,
                HEAD_DIM, BLOCK_M, BLOCK_N, QB, True, CAUSAL, P_SCALE, DS_ROWWISE, DEBUG, INTERPRET)
        else:
            # the last, partial key block: keys past N must not move the dS scales
            dk, dv = _dkdv_inner(
                dk, dv, k, k_scale, v, v_scale, start_n, offs_n,
                q8_h, q_scale_h, qt8_h, qt_scale_h, do8_h, do_scale_h, dot8_h, dot_scale_h,
                lse2_h, delta_h, rowsum_h, p_dump_h, ds_dump_h, ds_scale_h,
                lo, N, qk_scale, N, NPAD,
                HEAD_DIM, BLOCK_M, BLOCK_N, QB, True, CAUSAL, P_SCALE, DS_ROWWISE, DEBUG, INTERPRET)
    tl.store(DK + kv_rows + rows, to_bf16(dk * sm_scale, INTERPRET), mask=in_seq[:, None])
    tl.store(DV + kv_rows + rows, to_bf16(dv * (1.0 / P_SCALE), INTERPRET), mask=in_seq[:, None])


# --------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------


def backward(
    saved, do8, do_t, delta_stale, *, batch: int, heads: int, kv_heads: int, n: int,
    head_dim: int, causal: bool, scale: float, recipe: KernelRecipe, debug: bool = False,
    kernels: tuple[str, ...] = ("dq", "dkdv"),
):
    """Run the backward kernels in the order the delta strategy needs.

    ``saved``: the forward's ``SavedForward`` (quantized Q, K, V copies and LSE2). ``do8`` /
    ``do_t``: row and transposed copies of dO; ``delta_stale``: the preprocess's rowsum(dO * O).
    Returns ``(dq, dk, dv, debug dict)``; dk and dv have the key/value heads' shape.
    ``kernels`` names the kernels to run (both; one alone only to time it).
    """
    from .fwd import LOG2E

    t = recipe.bwd_tiles(head_dim)
    dev = do8.rows.device
    qk_scale = scale * LOG2E
    npad = do_t.npad
    dq = torch.empty((batch, heads, n, head_dim), device=dev, dtype=torch.bfloat16)
    dk = torch.empty((batch, kv_heads, n, head_dim), device=dev, dtype=torch.bfloat16)
    dv = torch.empty_like(dk)
    matched = recipe.delta == "matched"
    delta_matched = torch.empty_like(delta_stale) if matched else delta_stale
    dummy8 = torch.empty(1, device=dev, dtype=torch.uint8)
    dummy32 = torch.empty(1, device=dev, dtype=torch.float32)
    dbg = {}
    if debug:
        dbg["dq_ds_rowsum"] = torch.zeros((batch * heads, n), device=dev, dtype=torch.float32)
        dbg["ds_rowsum"] = torch.zeros((batch * heads, n), device=dev, dtype=torch.float32)
        dbg["p_codes"] = torch.zeros((batch * heads, n, n), device=dev, dtype=torch.uint8)
        dbg["ds_codes"] = torch.zeros((batch * heads, n, n), device=dev, dtype=torch.uint8)
        dbg["ds_scale"] = torch.zeros((batch * heads, triton.cdiv(n, t.block_m1), n),
                                      device=dev, dtype=torch.float32)
    q8, k8, v8 = saved.q, saved.k, saved.v
    common = dict(HEAD_DIM=head_dim, QB=QUANT_BLOCK, CAUSAL=causal,
                  P_SCALE=float(2 ** recipe.p_scale_log2), DS_ROWWISE=recipe.ds_granularity == "rowwise",
                  DEBUG=debug, INTERPRET=interpreting())

    def run_dq():
        _bwd_dq_kernel[(triton.cdiv(n, t.block_m2), batch * heads)](
            q8.rows, q8.row_scale, k8.rows, k8.row_scale, v8.rows, v8.row_scale,
            k8.cols, k8.col_scale, do8.rows, do8.row_scale, saved.lse2, delta_stale,
            delta_matched if matched else dummy32,
            dq, dbg.get("dq_ds_rowsum", dummy32),
            qk_scale, scale, heads, heads // kv_heads, n, npad,
            BLOCK_M=t.block_m2, BLOCK_N=t.block_n2, MATCHED=matched,
            num_warps=t.num_warps_dq, num_stages=t.num_stages_dq, **common)

    def run_dkdv():
        _bwd_dkdv_kernel[(triton.cdiv(n, t.block_n1), batch * kv_heads)](
            q8.rows, q8.row_scale, q8.cols, q8.col_scale, k8.rows, k8.row_scale,
            v8.rows, v8.row_scale, do8.rows, do8.row_scale, do_t.cols, do_t.col_scale,
            saved.lse2, delta_matched,
            dk, dv, dbg.get("ds_rowsum", dummy32), dbg.get("p_codes", dummy8),
            dbg.get("ds_codes", dummy8), dbg.get("ds_scale", dummy32),
            qk_scale, scale, heads, kv_heads, n, npad,
            BLOCK_M=t.block_m1, BLOCK_N=t.block_n1,
            num_warps=t.num_warps_dkdv, num_stages=t.num_stages_dkdv, **common)

    order = (run_dq, run_dkdv) if matched else (run_dkdv, run_dq)  # matched: dq makes D first
    for run in order:
        if run.__name__[4:] in kernels:
            run()
    dbg["delta"] = delta_matched if matched else delta_stale
    return dq, dk, dv, dbg
