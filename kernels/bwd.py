"""Backward FP8 attention kernels: preprocess, dq, dkdv, with the delta step visible.

All five backward matmuls run in FP8 (recomputed S = Q K^T, dP = dO V^T, dV = P^T dO,
dQ = dS K, dK = dS^T Q), each reading its operands K-major: row copies where the contraction is the
head dim, transposed copies where it is tokens (see ``config``).

The delta step, per strategy:

- ``stale``: ``D = rowsum(dO * O)`` from BF16 dO and O, computed by the preprocess (fused into the
  quantization of dO, ``quantize.quantize(..., delta_with=O)``). Then ``dkdv`` and ``dq`` form
  ``dS = P (dP - D)``.
- ``matched`` (Delta-Matching): ``D_i = sum_j P_ij dP_ij`` from exactly the float32 ``P`` and
  ``dP`` that dS uses (``dmref.recipes.DeltaKind.MATCHED``). No pre-sweep: the ``dq`` kernel runs
  *first*, and since it already recomputes S and dP over whole rows it accumulates
  ``sum_j P dP`` on the way.
  dQ cannot wait for D, so it is formed with the stale D as predictor and corrected at the end:

      dS_ij = P_ij (dP_ij - D_i) = P_ij (dP_ij - Dst_i) - (D_i - Dst_i) P_ij
      dQ_i  = tau [ sum_j Q8(P (dP - Dst))_ij K_j  -  (D_i - Dst_i) * kbar_i ],
      kbar_i = sum_j Q8(2**4 P_ij) K_j / 2**4         (one more FP8 matmul, same K tile)

  kbar is kept in units u of the head's largest K block scale (a convex combination of keys
  stays below 448 u), so its float16 accumulator cannot overflow however large K is; the
  reference models all of it (``dmref.recipes.DeferredDq``).

  The correction's factor ``D - Dst`` is small, so kbar's errors are second order: its FP8 P
  (scale 2**4), its float16 wgmma chain per tile and its float16 accumulator across tiles. dK needs
  ``sum_i D_i P_ij Q_i`` with every row's final D, which has no such deferred form: ``dkdv`` runs
  second and reads the matched D, forming ``dS = P (dP - D)`` exactly. The cost over stale is the
  kbar matmul, its accumulator and one row reduction in ``dq``; nothing is swept twice.

Registers (H200, D = 128, ``python -m dmref.kernels.compile_check``): with ``BwdTiles.split_head``
dQ, kbar, dK and dV are each kept as two halves of the head dim, so that the float32 result of one
accumulating matmul (the promotion temporary) is a quarter of the four accumulators; with TMA
loads (``BwdTiles.tma``) whole accumulators fit as well and are faster (the default); every FP8
operand of a tile is formed before its first accumulating matmul (P, dP and dS are dead by then);
each kernel has one loop with masks on every tile, and the dkdv kernel loops over GQA heads only
when there are several.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import dump_fp8, mul_rn, quantize_rows, quantize_tile, to_bf16, to_fp8
from ._runtime import interpreting, register_cap
from .config import KBAR_P_SCALE_LOG2, QUANT_BLOCK, KernelRecipe

#: P's scale at the kbar quantization point (see config.KBAR_P_SCALE_LOG2).
KBAR_P_SCALE = tl.constexpr(float(2**KBAR_P_SCALE_LOG2))


# --------------------------------------------------------------------------------------------
# dq: one program per BLOCK_M queries of one head, looping over BLOCK_N keys
# --------------------------------------------------------------------------------------------


@triton.jit
def _bwd_dq_kernel(
    Q8, Q_SCALE, K8, K_SCALE, V8, V_SCALE, KT8, KT_SCALE, K_UNIT,
    DO8, DO_SCALE, LSE2, DELTA_STALE, DELTA_MATCHED,
    DQ, DQ_ROWSUM,
    qk_scale, sm_scale, H, GROUP, N, NPAD,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QB: tl.constexpr,
    CAUSAL: tl.constexpr, MATCHED: tl.constexpr, P_SCALE: tl.constexpr,
    DS_ROWWISE: tl.constexpr, TMA: tl.constexpr, SPLIT: tl.constexpr,
    DEBUG: tl.constexpr, INTERPRET: tl.constexpr,
):
    tl.static_assert(QB % BLOCK_N == 0)
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    bh64 = bh.to(tl.int64)
    kv = ((bh // H) * (H // GROUP) + (bh % H) // GROUP).to(tl.int64)
    # per-head base pointers (64-bit scalars); the tiles use int32 offsets from them
    # with TMA, K8, V8 and KT8 are descriptors of the (B*Hkv, N, D) and (B*Hkv, D, NPAD) copies
    kv32 = kv.to(tl.int32)
    if not TMA:
        K8 += kv * N * HEAD_DIM
        V8 += kv * N * HEAD_DIM
        KT8 += kv * HEAD_DIM * NPAD
    K_SCALE += kv * N
    V_SCALE += kv * N
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
    # dQ and kbar whole, or with SPLIT in two halves of the head dim each (a matmul's float32
    # result, the promotion temporary, is then half as large: BwdTiles.split_head); without
    # SPLIT the *_hi halves are unused
    DH: tl.constexpr = HEAD_DIM // 2 if SPLIT else HEAD_DIM
    offs_h = tl.arange(0, DH)
    dq_lo = tl.zeros([BLOCK_M, DH], tl.float32)
    dq_hi = tl.zeros([BLOCK_M, DH], tl.float32)
    # kbar is second order (it is multiplied by D - D_stale): float16, in units u of the
    # largest K scale of this head (K_UNIT), so |kbar / u| <= 448 can never overflow float16
    kbar_lo = tl.zeros([BLOCK_M, DH], tl.float16)
    kbar_hi = tl.zeros([BLOCK_M, DH], tl.float16)
    if MATCHED:
        unit = tl.load(K_UNIT + kv)
        kb_c = tl.math.div_rn(1.0 / KBAR_P_SCALE, unit)  # powers of two: exact
    pdp = tl.zeros([BLOCK_M], tl.float32)
    psum = tl.zeros([BLOCK_M], tl.float32)
    rowsum = tl.zeros([BLOCK_M], tl.float32)
    if CAUSAL:
        hi = tl.minimum(start_m + BLOCK_M, N)
    else:
        hi = N
    # One loop with masks on every tile (two compares and a select per element): separate
    # masked and unmasked loops each kept their own pipelined state live and spilled.
    for start_n in range(0, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_in = offs_n < N
        # K and V row copies as (D, BLOCK_N) tiles: the head dim (the contraction) contiguous
        if TMA:  # rows past N read as zeros (the descriptor's bounds)
            k = tl.trans(K8.load([kv32, start_n, 0]).reshape(BLOCK_N, HEAD_DIM))
            v = tl.trans(V8.load([kv32, start_n, 0]).reshape(BLOCK_N, HEAD_DIM))
        else:
            kv_rows = offs_n[None, :] * HEAD_DIM + offs_d[:, None]
            k = tl.load(K8 + kv_rows, mask=k_in[None, :], other=0.0)
            v = tl.load(V8 + kv_rows, mask=k_in[None, :], other=0.0)
        k_scale = tl.load(K_SCALE + offs_n, mask=k_in, other=0.0)
        v_scale = tl.load(V_SCALE + offs_n, mask=k_in, other=0.0)
        # recompute: in the forward this was S2 = dot(Q8, K8^T) * scales; now P against LSE
        s = mul_rn(tl.dot(q, k), q_scale[:, None] * k_scale[None, :], INTERPRET)
        # rows past N are masked too: they must not move a dS tile scale
        valid = in_seq[:, None] & k_in[None, :]
        if CAUSAL:
            valid = valid & (offs_m[:, None] >= offs_n[None, :])
        p = tl.where(valid, tl.math.exp2(s - lse2[:, None]), 0.0)
        # S2 and dP rounded on their own (mul_rn), as the recipe and the model round them
        dp = mul_rn(tl.dot(do, v), do_scale[:, None] * v_scale[None, :], INTERPRET)
        if MATCHED:
            # delta step (matched): sum_j P dP from the very float32 P and dP that dS uses
            pdp += tl.sum(p * dp, axis=1)
        ds = p * (dp - d_stale[:, None])
        if DEBUG:
            psum += tl.sum(p, axis=1)
            rowsum += tl.sum(ds, axis=1)
        # Every FP8 operand exists before the first matmul below, so the float32 P, dP and dS
        # tiles are dead while a matmul's float32 result is live (registers).
        if DS_ROWWISE:
            # Q-point dS: float32 -> E4M3, one pow2_floor scale per query row and BLOCK_N keys
            ds8, ds_inv, _ = quantize_rows(ds, False, INTERPRET)
        else:
            # Q-point dS: float32 -> E4M3, one pow2_floor scale per BLOCK_M x BLOCK_N tile
            ds8, ds_inv_t, _ = quantize_tile(ds, False, INTERPRET)
            ds_inv = tl.full([BLOCK_M], 1.0, tl.float32) * ds_inv_t
        if MATCHED:
            # Q-point P (kbar): float32 -> E4M3, scale KBAR_P_SCALE against LSE: with codes of
            # P <= 2**4 and of K <= 448 a float16 wgmma chain cannot overflow, as sum_j P <= 1
            p8 = to_fp8(p * KBAR_P_SCALE, False, INTERPRET)
        # K transposed copy as (BLOCK_N, D/2) tiles: tokens (the contraction) contiguous,
        # padded to NPAD with zero codes, so no mask
        kt_lo = offs_h[None, :] * NPAD + offs_n[:, None]
        kt_hi = kt_lo + DH * NPAD
        sc_lo = (start_n // QB) * HEAD_DIM + offs_h
        sc_hi = sc_lo + DH
        if TMA:
            kt_tile_lo = tl.trans(KT8.load([kv32, 0, start_n]).reshape(DH, BLOCK_N))
            if SPLIT:
                kt_tile_hi = tl.trans(KT8.load([kv32, DH, start_n]).reshape(DH, BLOCK_N))
        else:
            kt_tile_lo = tl.load(KT8 + kt_lo)
            if SPLIT:
                kt_tile_hi = tl.load(KT8 + kt_hi)
        # promotion: one wgmma chain per tile and half head dim, then one float32 add
        dq_lo += tl.dot(ds8, kt_tile_lo) * tl.load(KT_SCALE + sc_lo)[None, :] * ds_inv[:, None]
        if SPLIT:
            dq_hi += tl.dot(ds8, kt_tile_hi) * tl.load(KT_SCALE + sc_hi)[None, :] * ds_inv[:, None]
        if MATCHED:
            # kbar: float16 wgmma chain per tile, scaled to units u in float32, added and
            # rounded to float16 (its 32 registers instead of 64 keep the loop from spilling)
            kb_lo = tl.dot(p8, kt_tile_lo, out_dtype=tl.float16).to(tl.float32)
            if SPLIT:
                kb_hi = tl.dot(p8, kt_tile_hi, out_dtype=tl.float16).to(tl.float32)
            kbar_lo = (kbar_lo.to(tl.float32) + kb_lo * (tl.load(KT_SCALE + sc_lo) * kb_c)[None, :]).to(tl.float16)
            if SPLIT:
                kbar_hi = (kbar_hi.to(tl.float32) + kb_hi * (tl.load(KT_SCALE + sc_hi) * kb_c)[None, :]).to(tl.float16)
    out_lo = offs_m[:, None] * HEAD_DIM + offs_h[None, :]
    if MATCHED:
        # delta step (matched): D = sum_j P dP, the reference's DeltaKind.MATCHED
        tl.store(DELTA_MATCHED + bh64 * N + offs_m, pdp, mask=in_seq)
        # deferred correction of dQ: dS K = (P (dP - Dst)) K - (D - Dst) (P K)
        corr = pdp - d_stale
        dq_lo -= corr[:, None] * (kbar_lo.to(tl.float32) * unit)
        if SPLIT:
            dq_hi -= corr[:, None] * (kbar_hi.to(tl.float32) * unit)
        if DEBUG:
            rowsum -= (pdp - d_stale) * psum
    tl.store(DQ + bh64 * N * HEAD_DIM + out_lo, to_bf16(dq_lo * sm_scale, INTERPRET), mask=in_seq[:, None])
    if SPLIT:
        tl.store(DQ + bh64 * N * HEAD_DIM + out_lo + DH, to_bf16(dq_hi * sm_scale, INTERPRET), mask=in_seq[:, None])
    if DEBUG:
        tl.store(DQ_ROWSUM + bh64 * N + offs_m, rowsum, mask=in_seq)


# --------------------------------------------------------------------------------------------
# dkdv: one program per BLOCK_N keys of one key/value head, looping over its query heads and
# BLOCK_M queries
# --------------------------------------------------------------------------------------------


@triton.jit
def _dkdv_head(
    dk_lo, dk_hi, dv_lo, dv_hi, k, k_scale, v, v_scale, offs_n, in_seq, bh64, lo,
    Q8, Q_SCALE, QT8, QT_SCALE, DO8, DO_SCALE, DOT8, DOT_SCALE, LSE2, DELTA,
    DS_ROWSUM, P_DUMP, DS_DUMP, DS_SCALE, qk_scale, N, NPAD,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QB: tl.constexpr,
    CAUSAL: tl.constexpr, P_SCALE: tl.constexpr, DS_ROWWISE: tl.constexpr,
    TMA: tl.constexpr, SPLIT: tl.constexpr, DEBUG: tl.constexpr, INTERPRET: tl.constexpr,
):
    """The query tiles of one query head, accumulated into this key block's dK and dV (halves
    of the head dim with SPLIT).
    With TMA, Q8, DO8 (rows, (B*H, N, D)) and QT8, DOT8 (cols, (B*H, D, NPAD)) are tensor
    descriptors."""
    DH: tl.constexpr = HEAD_DIM // 2 if SPLIT else HEAD_DIM
    offs_h = tl.arange(0, DH)
    offs_d = tl.arange(0, HEAD_DIM)
    # this query head's base offsets: 64-bit scalars; the tiles use int32 offsets
    head_rows = bh64 * N * HEAD_DIM
    head = bh64 * N
    head_cols = bh64 * HEAD_DIM * NPAD
    bh32 = bh64.to(tl.int32)  # the head's index into the descriptors (TMA)
    head_col_scale = bh64 * (NPAD // QB) * HEAD_DIM
    # masks on every tile (two compares and a select per element): one loop body; separate
    # masked and unmasked loops each kept their own pipelined state live and spilled
    for start_m in range(lo, N, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q_in = offs_m < N
        # Q and dO row copies as (D, BLOCK_M) tiles: the head dim (the contraction) contiguous
        if TMA:  # rows past N read as zeros (the descriptor's bounds)
            q_t = tl.trans(Q8.load([bh32, start_m, 0]).reshape(BLOCK_M, HEAD_DIM))
            do_t = tl.trans(DO8.load([bh32, start_m, 0]).reshape(BLOCK_M, HEAD_DIM))
        else:
            q_rows = offs_m[None, :] * HEAD_DIM + offs_d[:, None]
            q_t = tl.load(Q8 + head_rows + q_rows, mask=q_in[None, :], other=0.0)
            do_t = tl.load(DO8 + head_rows + q_rows, mask=q_in[None, :], other=0.0)
        q_scale = tl.load(Q_SCALE + head + offs_m, mask=q_in, other=0.0) * qk_scale
        lse2 = tl.load(LSE2 + head + offs_m, mask=q_in, other=0.0)
        # recompute, transposed: in the forward this was S2 = dot(Q8, K8^T) * scales, so now
        # S2^T = dot(K8, Q8^T) * scales and P^T against LSE
        s_t = mul_rn(tl.dot(k, q_t), k_scale[:, None] * q_scale[None, :], INTERPRET)
        valid = q_in[None, :] & in_seq[:, None]
        if CAUSAL:
            valid = valid & (offs_m[None, :] >= offs_n[:, None])
        p_t = tl.where(valid, tl.math.exp2(s_t - lse2[None, :]), 0.0)
        do_scale = tl.load(DO_SCALE + head + offs_m, mask=q_in, other=0.0)
        delta = tl.load(DELTA + head + offs_m, mask=q_in, other=0.0)
        dp_t = mul_rn(tl.dot(v, do_t), v_scale[:, None] * do_scale[None, :], INTERPRET)
        # Q-point P (dV): float32 -> E4M3, scale 2**8 against LSE
        p8_t = to_fp8(p_t * P_SCALE, False, INTERPRET)
        # dS = P (dP - D), with D stale or matched as the caller chose
        ds_t = p_t * (dp_t - delta[None, :])
        if DS_ROWWISE:
            # Q-point dS: float32 -> E4M3, one pow2_floor scale per key and BLOCK_M queries
            ds8_t, ds_inv, ds_scaled = quantize_rows(ds_t, False, INTERPRET)
        else:
            # Q-point dS: float32 -> E4M3, one pow2_floor scale per BLOCK_M x BLOCK_N tile
            ds8_t, ds_inv_t, ds_scaled = quantize_tile(ds_t, False, INTERPRET)
            ds_inv = tl.full([BLOCK_N], 1.0, tl.float32) * ds_inv_t
        if DEBUG:
            tl.atomic_add(DS_ROWSUM + head + offs_m, tl.sum(ds_t, axis=0), mask=q_in)
            dump = offs_m[None, :] * N + offs_n[:, None]
            dump_mask = q_in[None, :] & in_seq[:, None]
            dump_fp8(P_DUMP + bh64 * N * N + dump, p_t * P_SCALE, p8_t, dump_mask, DEBUG)
            dump_fp8(DS_DUMP + bh64 * N * N + dump, ds_scaled, ds8_t, dump_mask, DEBUG)
            # dequantization factor of dS[:, j] in this query tile: (B*H, cdiv(N, BLOCK_M), N)
            scale_ptrs = (start_m // BLOCK_M) * N + offs_n
            tl.store(DS_SCALE + bh64 * tl.cdiv(N, BLOCK_M) * N + scale_ptrs, ds_inv, mask=in_seq)
        # Both FP8 operands exist before the first of the two matmuls below, so the float32
        # P, dP and dS tiles are dead while a matmul's float32 result is live (registers).
        # dO and Q transposed copies as (BLOCK_M, D) tiles: tokens (the contraction) contiguous,
        # padded to NPAD with zero codes, so no mask
        # promotion: one wgmma chain per tile and half head dim, then one float32 add
        # (scales applied on the way)
        tok_lo = offs_h[None, :] * NPAD + offs_m[:, None]
        tok_hi = tok_lo + DH * NPAD
        sc_lo = head_col_scale + (start_m // QB) * HEAD_DIM + offs_h
        sc_hi = sc_lo + DH
        if TMA:
            dot_lo = tl.trans(DOT8.load([bh32, 0, start_m]).reshape(DH, BLOCK_M))
            if SPLIT:
                dot_hi = tl.trans(DOT8.load([bh32, DH, start_m]).reshape(DH, BLOCK_M))
            qt_lo = tl.trans(QT8.load([bh32, 0, start_m]).reshape(DH, BLOCK_M))
            if SPLIT:
                qt_hi = tl.trans(QT8.load([bh32, DH, start_m]).reshape(DH, BLOCK_M))
        else:
            dot_lo = tl.load(DOT8 + head_cols + tok_lo)
            if SPLIT:
                dot_hi = tl.load(DOT8 + head_cols + tok_hi)
            qt_lo = tl.load(QT8 + head_cols + tok_lo)
            if SPLIT:
                qt_hi = tl.load(QT8 + head_cols + tok_hi)
        dv_lo += tl.dot(p8_t, dot_lo) * tl.load(DOT_SCALE + sc_lo)[None, :]
        if SPLIT:
            dv_hi += tl.dot(p8_t, dot_hi) * tl.load(DOT_SCALE + sc_hi)[None, :]
        dk_lo += tl.dot(ds8_t, qt_lo) * tl.load(QT_SCALE + sc_lo)[None, :] * ds_inv[:, None]
        if SPLIT:
            dk_hi += tl.dot(ds8_t, qt_hi) * tl.load(QT_SCALE + sc_hi)[None, :] * ds_inv[:, None]
    return dk_lo, dk_hi, dv_lo, dv_hi


@triton.jit
def _bwd_dkdv_kernel(
    Q8, Q_SCALE, QT8, QT_SCALE, K8, K_SCALE, V8, V_SCALE,
    DO8, DO_SCALE, DOT8, DOT_SCALE, LSE2, DELTA,
    DK, DV, DS_ROWSUM, P_DUMP, DS_DUMP, DS_SCALE,
    qk_scale, sm_scale, H, HKV, N, NPAD,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QB: tl.constexpr,
    GROUP: tl.constexpr, CAUSAL: tl.constexpr, P_SCALE: tl.constexpr, DS_ROWWISE: tl.constexpr,
    TMA: tl.constexpr, SPLIT: tl.constexpr, DEBUG: tl.constexpr, INTERPRET: tl.constexpr,
):
    tl.static_assert(QB % BLOCK_M == 0)
    start_n = tl.program_id(0) * BLOCK_N
    bkv = tl.program_id(1)
    bkv64 = bkv.to(tl.int64)
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
    # dK and dV whole, or with SPLIT in two halves of the head dim each (as dq's); without SPLIT
    # the *_hi halves are unused
    DH: tl.constexpr = HEAD_DIM // 2 if SPLIT else HEAD_DIM
    offs_h = tl.arange(0, DH)
    dk_lo = tl.zeros([BLOCK_N, DH], tl.float32)
    dk_hi = tl.zeros([BLOCK_N, DH], tl.float32)
    dv_lo = tl.zeros([BLOCK_N, DH], tl.float32)
    dv_hi = tl.zeros([BLOCK_N, DH], tl.float32)
    if CAUSAL:
        # the first query tile that sees a key of this block (tiles divide one another)
        lo = (start_n // BLOCK_M) * BLOCK_M
    else:
        lo = 0
    # first query head of this key/value head; its GROUP heads are consecutive
    bh0 = ((bkv // HKV) * H + (bkv % HKV) * GROUP).to(tl.int64)
    if GROUP == 1:
        # no loop over heads: a run-time head loop keeps its per-head state live across the
        # tile loop (spills at D = 128, compile_check)
        dk_lo, dk_hi, dv_lo, dv_hi = _dkdv_head(
            dk_lo, dk_hi, dv_lo, dv_hi, k, k_scale, v, v_scale, offs_n, in_seq, bh0, lo,
            Q8, Q_SCALE, QT8, QT_SCALE, DO8, DO_SCALE, DOT8, DOT_SCALE, LSE2, DELTA,
            DS_ROWSUM, P_DUMP, DS_DUMP, DS_SCALE, qk_scale, N, NPAD,
            HEAD_DIM, BLOCK_M, BLOCK_N, QB, CAUSAL, P_SCALE, DS_ROWWISE, TMA, SPLIT, DEBUG, INTERPRET)
    else:
        # GQA: dK and dV sum over the GROUP query heads that read this key/value head
        for g in range(0, GROUP):
            dk_lo, dk_hi, dv_lo, dv_hi = _dkdv_head(
                dk_lo, dk_hi, dv_lo, dv_hi, k, k_scale, v, v_scale, offs_n, in_seq, bh0 + g, lo,
                Q8, Q_SCALE, QT8, QT_SCALE, DO8, DO_SCALE, DOT8, DOT_SCALE, LSE2, DELTA,
                DS_ROWSUM, P_DUMP, DS_DUMP, DS_SCALE, qk_scale, N, NPAD,
                HEAD_DIM, BLOCK_M, BLOCK_N, QB, CAUSAL, P_SCALE, DS_ROWWISE, TMA, SPLIT, DEBUG, INTERPRET)
    rows_lo = offs_n[:, None] * HEAD_DIM + offs_h[None, :]
    tl.store(DK + kv_rows + rows_lo, to_bf16(dk_lo * sm_scale, INTERPRET), mask=in_seq[:, None])
    if SPLIT:
        tl.store(DK + kv_rows + rows_lo + DH, to_bf16(dk_hi * sm_scale, INTERPRET), mask=in_seq[:, None])
    tl.store(DV + kv_rows + rows_lo, to_bf16(dv_lo * (1.0 / P_SCALE), INTERPRET), mask=in_seq[:, None])
    if SPLIT:
        tl.store(DV + kv_rows + rows_lo + DH, to_bf16(dv_hi * (1.0 / P_SCALE), INTERPRET), mask=in_seq[:, None])


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
    # kbar's unit per key/value head: the largest of its K block scales (a reduction over the
    # (B*Hkv, NPAD/128, D) scales, not over K); one scalar per program, as a per-channel vector
    # held across the dq loop spilled (and a precomputed per-tile factor cost a load per tile)
    k_unit = saved.k.col_scale.amax(dim=(1, 2)).contiguous() if matched else torch.empty(1, device=dev)
    dummy8 = torch.empty(1, device=dev, dtype=torch.uint8)
    dummy32 = torch.empty(1, device=dev, dtype=torch.float32)
    dbg = {}
    debug = int(debug)  # 1 (or True): FP8 dumps as float32 values; 2: as bytes (see dump_fp8)
    if debug:
        dump_dtype = torch.uint8 if debug == 2 else torch.float32
        dbg["dq_ds_rowsum"] = torch.zeros((batch * heads, n), device=dev, dtype=torch.float32)
        dbg["ds_rowsum"] = torch.zeros((batch * heads, n), device=dev, dtype=torch.float32)
        dbg["p_codes"] = torch.zeros((batch * heads, n, n), device=dev, dtype=dump_dtype)
        dbg["ds_codes"] = torch.zeros((batch * heads, n, n), device=dev, dtype=dump_dtype)
        dbg["ds_scale"] = torch.zeros((batch * heads, triton.cdiv(n, t.block_m1), n),
                                      device=dev, dtype=torch.float32)
    q8, k8, v8 = saved.q, saved.k, saved.v
    common = dict(HEAD_DIM=head_dim, QB=QUANT_BLOCK, CAUSAL=causal,
                  P_SCALE=float(2 ** recipe.p_scale_log2), DS_ROWWISE=recipe.ds_granularity == "rowwise",
                  TMA=t.tma, SPLIT=t.split_head, DEBUG=debug, INTERPRET=interpreting())
    dh = t.accumulator_width(head_dim)
    if t.tma:
        from triton.tools.tensor_descriptor import TensorDescriptor as TD

        # dq: K, V rows per block_n2 keys, K cols per half head dim; dkdv: Q, dO rows per
        # block_m1 queries, Q, dO cols per half head dim
        dq_ops = (TD.from_tensor(k8.rows, [1, t.block_n2, head_dim]),
                  TD.from_tensor(v8.rows, [1, t.block_n2, head_dim]),
                  TD.from_tensor(k8.cols, [1, dh, t.block_n2]))
        dkdv_ops = (TD.from_tensor(q8.rows, [1, t.block_m1, head_dim]), TD.from_tensor(q8.cols, [1, dh, t.block_m1]),
                    TD.from_tensor(do8.rows, [1, t.block_m1, head_dim]), TD.from_tensor(do_t.cols, [1, dh, t.block_m1]))
    else:
        dq_ops = (k8.rows, v8.rows, k8.cols)
        dkdv_ops = (q8.rows, q8.cols, do8.rows, do_t.cols)

    def run_dq():
        _bwd_dq_kernel[(triton.cdiv(n, t.block_m2), batch * heads)](
            q8.rows, q8.row_scale, dq_ops[0], k8.row_scale, dq_ops[1], v8.row_scale,
            dq_ops[2], k8.col_scale, k_unit, do8.rows, do8.row_scale, saved.lse2, delta_stale,
            delta_matched if matched else dummy32,
            dq, dbg.get("dq_ds_rowsum", dummy32),
            qk_scale, scale, heads, heads // kv_heads, n, npad,
            BLOCK_M=t.block_m2, BLOCK_N=t.block_n2, MATCHED=matched,
            num_warps=t.num_warps_dq, num_stages=t.num_stages_dq, **register_cap(t.maxnreg_dq), **common)

    def run_dkdv():
        _bwd_dkdv_kernel[(triton.cdiv(n, t.block_n1), batch * kv_heads)](
            dkdv_ops[0], q8.row_scale, dkdv_ops[1], q8.col_scale, k8.rows, k8.row_scale,
            v8.rows, v8.row_scale, dkdv_ops[2], do8.row_scale, dkdv_ops[3], do_t.col_scale,
            saved.lse2, delta_matched,
            dk, dv, dbg.get("ds_rowsum", dummy32), dbg.get("p_codes", dummy8),
            dbg.get("ds_codes", dummy8), dbg.get("ds_scale", dummy32),
            qk_scale, scale, heads, kv_heads, n, npad,
            BLOCK_M=t.block_m1, BLOCK_N=t.block_n1, GROUP=heads // kv_heads,
            num_warps=t.num_warps_dkdv, num_stages=t.num_stages_dkdv, **register_cap(t.maxnreg_dkdv), **common)

    order = (run_dq, run_dkdv) if matched else (run_dkdv, run_dq)  # matched: dq makes D first
    for run in order:
        if run.__name__[4:] in kernels:
            run()
    dbg["delta"] = delta_matched if matched else delta_stale
    if debug:
        from .fwd import fp8_codes

        dbg["p_codes"] = fp8_codes(dbg["p_codes"])
        dbg["ds_codes"] = fp8_codes(dbg["ds_codes"])
    return dq, dk, dv, dbg
