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

Registers (sm_90a, ``python -m dmref.kernels.compile_check``): every FP8 operand of a tile is
formed before its first accumulating matmul (P, dP and dS are dead by then); each kernel has one
loop with masks on every tile, and the dkdv kernel loops over GQA heads only when there are
several.

Stages: each kernel's loop body is written as the stages of a FlashAttention-3 style pipeline,
named in comments and helpers: load (``_row_tile_t``, ``_col_tile_t``), QK^T + softmax
(``_dot_rn``, ``_dq_p``, ``_dkdv_p_t``), dP, dS (``_quantize_ds``), the matched delta (dq), the
accumulating matmuls and the stores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import mul_rn, quantize_rows, to_bf16, to_fp8
from ._runtime import Launch, interpreting
from .config import QUANT_BLOCK, KernelSpec


# --------------------------------------------------------------------------------------------
# stages shared by both kernels (Triton inlines @triton.jit helpers: the code is the same as
# written out in place)
# --------------------------------------------------------------------------------------------


@triton.jit
def _row_tile_t(X8, base, head, start, offs_t, offs_d, t_in,
                BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, TMA: tl.constexpr):
    """Load: ``BLOCK`` tokens of a row copy as a ``(HEAD_DIM, BLOCK)`` tile, the head dim (the
    contraction of QK^T and dO V^T) contiguous. With TMA ``X8`` is a descriptor of the
    ``(B*H, N, D)`` codes and ``head`` selects the head; else ``X8 + base`` points at this
    head's codes. Tokens past N read as zero codes (the descriptor's bounds, or the mask)."""
    if TMA:
        tile = tl.trans(X8.load([head, start, 0]).reshape(BLOCK, HEAD_DIM))
    else:
        rows = offs_t[None, :] * HEAD_DIM + offs_d[:, None]
        tile = tl.load(X8 + base + rows, mask=t_in[None, :], other=0.0)
    return tile


@triton.jit
def _col_tile_t(XT8, base, head, start, offs_t, offs_d, NPAD,
                BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, TMA: tl.constexpr):
    """Load: ``BLOCK`` tokens of a transposed copy as a ``(BLOCK, HEAD_DIM)`` tile, the tokens
    (the contraction of dS K, dS^T Q and P^T dO) contiguous. With TMA ``XT8`` is a descriptor of
    the ``(B*H, D, NPAD)`` codes; else ``XT8 + base`` points at this head's codes. The copy is
    padded to NPAD with zero codes, so no mask."""
    if TMA:
        tile = tl.trans(XT8.load([head, 0, start]).reshape(HEAD_DIM, BLOCK))
    else:
        cols = offs_d[None, :] * NPAD + offs_t[:, None]
        tile = tl.load(XT8 + base + cols)
    return tile


@triton.jit
def _dot_rn(a8, b8, a_scale, b_scale, INTERPRET: tl.constexpr):
    """QK^T or dP: one FP8 wgmma chain over the head dim, dequantized by the row and column
    scales and rounded on its own (``mul_rn``), as the recipe and the model round S2 and dP."""
    return mul_rn(tl.dot(a8, b8), a_scale[:, None] * b_scale[None, :], INTERPRET)


@triton.jit
def _quantize_ds(ds, INTERPRET: tl.constexpr):
    """Q-point dS: float32 -> E4M3 with one POW2_DOWN scale per row of the tile and its whole
    contraction (the recipe's ``ds_dq`` / ``ds_dk``: 1 x tile blocks). Returns (codes, the
    dequantization factor of each row, the scaled float32 tile the cast received)."""
    return quantize_rows(ds, False, INTERPRET)


# --------------------------------------------------------------------------------------------
# dq: one program per BLOCK_M queries of one head, looping over BLOCK_N keys
# --------------------------------------------------------------------------------------------


@triton.jit
def _dq_p(s, lse2, offs_m, offs_n, in_seq, k_in, CAUSAL: tl.constexpr):
    """Softmax: P = exp2(S2 - LSE2) from the recomputed S2 (the forward's, S * log2(e)), 0
    where masked. Rows past N are masked too: they must not move a dS tile scale."""
    valid = in_seq[:, None] & k_in[None, :]
    if CAUSAL:
        valid = valid & (offs_m[:, None] >= offs_n[None, :])
    return tl.where(valid, tl.math.exp2(s - lse2[:, None]), 0.0)


@triton.jit
def _pdp_step(pdp, p, dp):
    """The matched delta's sum over one key tile, added to the running float32 ``pdp``:
    ``pdp + sum_j P dP`` (the dq kernel's and the pre-pass's (``bwd_prepass``) one order)."""
    return pdp + tl.sum(p * dp, axis=1)


@triton.jit
def _dq_kbar_step(kbar, p8, kt, KT_SCALE, sc, kb_c):
    """kbar (matched delta's deferred correction): a float16 wgmma chain per tile, scaled to
    units u in float32, added and rounded to float16 (its 32 registers instead of 64 keep the
    loop from spilling)."""
    kb = tl.dot(p8, kt, out_dtype=tl.float16).to(tl.float32)
    return (kbar.to(tl.float32) + kb * (tl.load(KT_SCALE + sc) * kb_c)[None, :]).to(tl.float16)


@triton.jit
def _dq_kv_head(bh, H, GROUP):
    """The key/value head (int64, of B*HKV) query head ``bh`` (of B*H) reads: head ``h`` of a
    batch reads ``h // GROUP``, GROUP = H // HKV."""
    return ((bh // H) * (H // GROUP) + (bh % H) // GROUP).to(tl.int64)


@triton.jit
def _dq_keys_end(start_m, N, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """One past the last key the program of queries ``start_m ..`` sees (causal: its last query)."""
    if CAUSAL:
        hi = tl.minimum(start_m + BLOCK_M, N)
    else:
        hi = N
    return hi


@triton.jit
def _dq_load_rows(Q8, Q_SCALE, DO8, DO_SCALE, LSE2, bh64, rows, offs_m, in_seq, qk_scale, N,
                  HEAD_DIM: tl.constexpr):
    """Load: this program's Q and dO row copies (``(BLOCK_M, D)``, kept on chip for the whole
    loop), Q's scales times tau * log2(e), dO's scales and LSE2 of its rows."""
    q = tl.load(Q8 + bh64 * N * HEAD_DIM + rows, mask=in_seq[:, None], other=0.0)
    do = tl.load(DO8 + bh64 * N * HEAD_DIM + rows, mask=in_seq[:, None], other=0.0)
    q_scale = tl.load(Q_SCALE + bh64 * N + offs_m, mask=in_seq, other=0.0) * qk_scale
    do_scale = tl.load(DO_SCALE + bh64 * N + offs_m, mask=in_seq, other=0.0)
    lse2 = tl.load(LSE2 + bh64 * N + offs_m, mask=in_seq, other=0.0)
    return q, do, q_scale, do_scale, lse2


@triton.jit
def _dq_load_queries(Q8, Q_SCALE, DO8, DO_SCALE, LSE2, DELTA_STALE, bh64, rows, offs_m, in_seq, qk_scale, N,
                     HEAD_DIM: tl.constexpr):
    """Load: :func:`_dq_load_rows` and the stale D of this program's rows."""
    q, do, q_scale, do_scale, lse2 = _dq_load_rows(Q8, Q_SCALE, DO8, DO_SCALE, LSE2, bh64, rows, offs_m, in_seq,
                                                   qk_scale, N, HEAD_DIM)
    d_stale = tl.load(DELTA_STALE + bh64 * N + offs_m, mask=in_seq, other=0.0)
    return q, do, q_scale, do_scale, lse2, d_stale


@triton.jit
def _dq_p_dp(q, do, q_scale, do_scale, lse2, K8, V8, K_SCALE, V_SCALE, kv32, start_n, offs_m, offs_d, in_seq, N,
             BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, TMA: tl.constexpr,
             INTERPRET: tl.constexpr):
    """One key tile of the dq loop up to dP: load K and V row copies as ``(D, BLOCK_N)`` tiles
    (``K8``, ``V8``, ``K_SCALE``, ``V_SCALE`` at this key/value head, or descriptors with TMA),
    QK^T + softmax (the forward's S2 recomputed, P against LSE) and dP. Returns (the tile's key
    offsets, P, dP), float32 ``(BLOCK_M, BLOCK_N)``."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k_in = offs_n < N
    # load: K and V row copies as (D, BLOCK_N) tiles
    k = _row_tile_t(K8, 0, kv32, start_n, offs_n, offs_d, k_in, BLOCK_N, HEAD_DIM, TMA)
    v = _row_tile_t(V8, 0, kv32, start_n, offs_n, offs_d, k_in, BLOCK_N, HEAD_DIM, TMA)
    k_scale = tl.load(K_SCALE + offs_n, mask=k_in, other=0.0)
    v_scale = tl.load(V_SCALE + offs_n, mask=k_in, other=0.0)
    # QK^T + softmax: the forward's S2 recomputed, P against LSE
    p = _dq_p(_dot_rn(q, k, q_scale, k_scale, INTERPRET), lse2, offs_m, offs_n, in_seq, k_in, CAUSAL)
    # dP
    dp = _dot_rn(do, v, do_scale, v_scale, INTERPRET)
    return offs_n, p, dp


@triton.jit
def _dq_matched_delta(dq, kbar, unit, pdp, d_stale, psum, rowsum, DELTA_MATCHED, offs_m, in_seq,
                      DEBUG: tl.constexpr):
    """The matched delta, after the last key tile: stores D = sum_j P dP (the reference's
    ``DeltaKind.MATCHED``; ``DELTA_MATCHED`` points at this head's rows) and applies dQ's
    deferred correction dS K = (P (dP - Dst)) K - (D - Dst) (P K), with P K = kbar * u."""
    tl.store(DELTA_MATCHED + offs_m, pdp, mask=in_seq)
    corr = pdp - d_stale
    dq -= corr[:, None] * (kbar.to(tl.float32) * unit)
    if DEBUG:
        rowsum -= (pdp - d_stale) * psum
    return dq, rowsum


@triton.jit
def _bwd_dq_kernel(
    Q8, Q_SCALE, K8, K_SCALE, V8, V_SCALE, KT8, KT_SCALE, K_UNIT,
    DO8, DO_SCALE, LSE2, DELTA_STALE, DELTA_MATCHED,
    DQ, DQ_ROWSUM,
    qk_scale, sm_scale, H, GROUP, N, NPAD,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QB: tl.constexpr,
    CAUSAL: tl.constexpr, MATCHED: tl.constexpr, P_SCALE: tl.constexpr, KBAR_P_SCALE: tl.constexpr,
    TMA: tl.constexpr, DEBUG: tl.constexpr, INTERPRET: tl.constexpr,
):
    tl.static_assert(QB % BLOCK_N == 0)
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    bh64 = bh.to(tl.int64)
    kv = _dq_kv_head(bh, H, GROUP)
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
    q, do, q_scale, do_scale, lse2, d_stale = _dq_load_queries(
        Q8, Q_SCALE, DO8, DO_SCALE, LSE2, DELTA_STALE, bh64, rows, offs_m, in_seq, qk_scale, N, HEAD_DIM)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # kbar is second order (it is multiplied by D - D_stale): float16, in units u of the
    # largest K scale of this head (K_UNIT), so |kbar / u| <= 448 can never overflow float16
    kbar = tl.zeros([BLOCK_M, HEAD_DIM], tl.float16)
    if MATCHED:
        unit = tl.load(K_UNIT + kv)
        kb_c = tl.math.div_rn(1.0 / KBAR_P_SCALE, unit)  # powers of two: exact
    pdp = tl.zeros([BLOCK_M], tl.float32)
    psum = tl.zeros([BLOCK_M], tl.float32)
    rowsum = tl.zeros([BLOCK_M], tl.float32)
    hi = _dq_keys_end(start_m, N, BLOCK_M, CAUSAL)
    # One loop with masks on every tile (two compares and a select per element): separate
    # masked and unmasked loops each kept their own pipelined state live and spilled.
    # Invariant at the top of each iteration, over the key tiles done so far: dq = sum of
    # deq(Q8(P (dP - Dst))) K (float32, one add per tile); kbar (MATCHED) = the float16 sum of
    # Q8(2**4 P) K / (2**4 u); pdp (MATCHED) = sum_j P dP; psum, rowsum (DEBUG) = sum_j P, sum_j dS.
    for start_n in range(0, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        # load K and V, QK^T + softmax, dP
        offs_n, p, dp = _dq_p_dp(q, do, q_scale, do_scale, lse2, K8, V8, K_SCALE, V_SCALE, kv32, start_n, offs_m,
                                 offs_d, in_seq, N, BLOCK_N, HEAD_DIM, CAUSAL, TMA, INTERPRET)
        if MATCHED:
            # the matched delta: sum_j P dP from the very float32 P and dP that dS uses
            pdp = _pdp_step(pdp, p, dp)
        # dS, against the stale D (the matched D is not known yet: deferred correction below)
        ds = p * (dp - d_stale[:, None])
        if DEBUG:
            psum += tl.sum(p, axis=1)
            rowsum += tl.sum(ds, axis=1)
        # Every FP8 operand exists before the first matmul below, so the float32 P, dP and dS
        # tiles are dead while a matmul's float32 result is live (registers).
        ds8, ds_inv, _ = _quantize_ds(ds, INTERPRET)
        if MATCHED:
            # Q-point P (kbar): float32 -> E4M3, scale KBAR_P_SCALE against LSE: with codes of
            # P <= 2**4 and of K <= 448 a float16 wgmma chain cannot overflow, as sum_j P <= 1
            p8 = to_fp8(p * KBAR_P_SCALE, False, INTERPRET)
        # load: K transposed copy as a (BLOCK_N, D) tile
        sc = (start_n // QB) * HEAD_DIM + offs_d
        kt = _col_tile_t(KT8, 0, kv32, start_n, offs_n, offs_d, NPAD, BLOCK_N, HEAD_DIM, TMA)
        # dS K, promoted: one wgmma chain per tile, then one float32 add
        dq += tl.dot(ds8, kt) * tl.load(KT_SCALE + sc)[None, :] * ds_inv[:, None]
        if MATCHED:
            kbar = _dq_kbar_step(kbar, p8, kt, KT_SCALE, sc, kb_c)
    if MATCHED:
        dq, rowsum = _dq_matched_delta(dq, kbar, unit, pdp, d_stale, psum, rowsum, DELTA_MATCHED + bh64 * N,
                                       offs_m, in_seq, DEBUG)
    # stores
    tl.store(DQ + bh64 * N * HEAD_DIM + rows, to_bf16(dq * sm_scale, INTERPRET), mask=in_seq[:, None])
    if DEBUG:
        tl.store(DQ_ROWSUM + bh64 * N + offs_m, rowsum, mask=in_seq)


# --------------------------------------------------------------------------------------------
# dkdv: one program per BLOCK_N keys of one key/value head, looping over its query heads and
# BLOCK_M queries
# --------------------------------------------------------------------------------------------


@triton.jit
def _dkdv_p_t(s_t, lse2, offs_m, offs_n, in_seq, q_in, CAUSAL: tl.constexpr):
    """Softmax, transposed: P^T = exp2(S2^T - LSE2) (keys by queries), 0 where masked."""
    valid = q_in[None, :] & in_seq[:, None]
    if CAUSAL:
        valid = valid & (offs_m[None, :] >= offs_n[:, None])
    return tl.where(valid, tl.math.exp2(s_t - lse2[None, :]), 0.0)


@triton.jit
def _dkdv_debug_store(p_t, ds_t, ds_scaled, ds_inv, offs_m, offs_n, in_seq, q_in, start_m, head, bh64,
                      DS_ROWSUM, P_DUMP, DS_DUMP, DS_SCALE, N,
                      BLOCK_M: tl.constexpr, P_SCALE: tl.constexpr):
    """Debug stores of one tile: dS's row sums (before quantization), the float32 values the P
    and dS casts received (the host casts them: ``fwd.fp8_codes``) and dS's dequantization
    factors ``(B*H, cdiv(N, BLOCK_M), N)``, per query tile and key."""
    tl.atomic_add(DS_ROWSUM + head + offs_m, tl.sum(ds_t, axis=0), mask=q_in)
    dump = offs_m[None, :] * N + offs_n[:, None]
    dump_mask = q_in[None, :] & in_seq[:, None]
    tl.store(P_DUMP + bh64 * N * N + dump, p_t * P_SCALE, mask=dump_mask)
    tl.store(DS_DUMP + bh64 * N * N + dump, ds_scaled, mask=dump_mask)
    scale_ptrs = (start_m // BLOCK_M) * N + offs_n
    tl.store(DS_SCALE + bh64 * tl.cdiv(N, BLOCK_M) * N + scale_ptrs, ds_inv, mask=in_seq)


@triton.jit
def _dkdv_col_tiles(DOT8, QT8, head_cols, head_col_scale, bh32, start_m, offs_m, offs_d, NPAD,
                    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, QB: tl.constexpr, TMA: tl.constexpr):
    """Load: the dO and Q transposed copies' ``(BLOCK_M, D)`` tiles of this query tile (as
    ``_col_tile_t``; both from one offset tile) and the index of their scales in this head's
    ``(NPAD // QB, D)`` dequantization factors."""
    cols = offs_d[None, :] * NPAD + offs_m[:, None]
    sc = head_col_scale + (start_m // QB) * HEAD_DIM + offs_d
    if TMA:
        dot = tl.trans(DOT8.load([bh32, 0, start_m]).reshape(HEAD_DIM, BLOCK_M))
        qt = tl.trans(QT8.load([bh32, 0, start_m]).reshape(HEAD_DIM, BLOCK_M))
    else:
        dot = tl.load(DOT8 + head_cols + cols)
        qt = tl.load(QT8 + head_cols + cols)
    return dot, qt, sc


@triton.jit
def _dkdv_head(
    dk, dv, k, k_scale, v, v_scale, offs_n, in_seq, bh64, lo,
    Q8, Q_SCALE, QT8, QT_SCALE, DO8, DO_SCALE, DOT8, DOT_SCALE, LSE2, DELTA,
    DS_ROWSUM, P_DUMP, DS_DUMP, DS_SCALE, qk_scale, N, NPAD,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QB: tl.constexpr,
    CAUSAL: tl.constexpr, P_SCALE: tl.constexpr,
    TMA: tl.constexpr, DEBUG: tl.constexpr, INTERPRET: tl.constexpr,
):
    """The query tiles of one query head, accumulated into this key block's dK and dV.
    With TMA, Q8, DO8 (rows, (B*H, N, D)) and QT8, DOT8 (cols, (B*H, D, NPAD)) are tensor
    descriptors."""
    offs_d = tl.arange(0, HEAD_DIM)
    # this query head's base offsets: 64-bit scalars; the tiles use int32 offsets
    head_rows = bh64 * N * HEAD_DIM
    head = bh64 * N
    head_cols = bh64 * HEAD_DIM * NPAD
    bh32 = bh64.to(tl.int32)  # the head's index into the descriptors (TMA)
    head_col_scale = bh64 * (NPAD // QB) * HEAD_DIM
    # masks on every tile (two compares and a select per element): one loop body; separate
    # masked and unmasked loops each kept their own pipelined state live and spilled.
    # Invariant at the top of each iteration, over the query tiles (and query heads) done so
    # far: dk = sum of deq(Q8(dS^T)) Q, dv = sum of Q8(2**8 P^T) deq(dO) (float32, one add per
    # tile; dv carries P's 2**8, taken out at the store).
    for start_m in range(lo, N, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q_in = offs_m < N
        # load: Q and dO row copies as (D, BLOCK_M) tiles
        q_t = _row_tile_t(Q8, head_rows, bh32, start_m, offs_m, offs_d, q_in, BLOCK_M, HEAD_DIM, TMA)
        do_t = _row_tile_t(DO8, head_rows, bh32, start_m, offs_m, offs_d, q_in, BLOCK_M, HEAD_DIM, TMA)
        q_scale = tl.load(Q_SCALE + head + offs_m, mask=q_in, other=0.0) * qk_scale
        lse2 = tl.load(LSE2 + head + offs_m, mask=q_in, other=0.0)
        # QK^T + softmax, transposed: S2^T = dot(K8, Q8^T) * scales, P^T against LSE
        p_t = _dkdv_p_t(_dot_rn(k, q_t, k_scale, q_scale, INTERPRET), lse2, offs_m, offs_n, in_seq, q_in, CAUSAL)
        do_scale = tl.load(DO_SCALE + head + offs_m, mask=q_in, other=0.0)
        delta = tl.load(DELTA + head + offs_m, mask=q_in, other=0.0)
        # dP^T
        dp_t = _dot_rn(v, do_t, v_scale, do_scale, INTERPRET)
        # Q-point P (dV): float32 -> E4M3, scale 2**8 against LSE
        p8_t = to_fp8(p_t * P_SCALE, False, INTERPRET)
        # dS = P (dP - D), with D stale or matched (the dq kernel's) as the caller chose
        ds_t = p_t * (dp_t - delta[None, :])
        ds8_t, ds_inv, ds_scaled = _quantize_ds(ds_t, INTERPRET)
        if DEBUG:
            _dkdv_debug_store(p_t, ds_t, ds_scaled, ds_inv, offs_m, offs_n, in_seq, q_in, start_m, head, bh64,
                              DS_ROWSUM, P_DUMP, DS_DUMP, DS_SCALE, N, BLOCK_M, P_SCALE)
        # Both FP8 operands exist before the first of the two matmuls below, so the float32
        # P, dP and dS tiles are dead while a matmul's float32 result is live (registers).
        # load: dO and Q transposed copies as (BLOCK_M, D) tiles
        dot, qt, sc = _dkdv_col_tiles(DOT8, QT8, head_cols, head_col_scale, bh32, start_m, offs_m, offs_d, NPAD,
                                      BLOCK_M, HEAD_DIM, QB, TMA)
        # P^T dO and dS^T Q, promoted: one wgmma chain per tile, then one float32 add (scales
        # applied on the way)
        dv += tl.dot(p8_t, dot) * tl.load(DOT_SCALE + sc)[None, :]
        dk += tl.dot(ds8_t, qt) * tl.load(QT_SCALE + sc)[None, :] * ds_inv[:, None]
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(
    Q8, Q_SCALE, QT8, QT_SCALE, K8, K_SCALE, V8, V_SCALE,
    DO8, DO_SCALE, DOT8, DOT_SCALE, LSE2, DELTA,
    DK, DV, DS_ROWSUM, P_DUMP, DS_DUMP, DS_SCALE,
    qk_scale, sm_scale, H, HKV, N, NPAD,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QB: tl.constexpr,
    GROUP: tl.constexpr, CAUSAL: tl.constexpr, P_SCALE: tl.constexpr,
    TMA: tl.constexpr, DEBUG: tl.constexpr, INTERPRET: tl.constexpr,
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
    # load: K and V row copies stay on chip for the whole loop
    k = tl.load(K8 + kv_rows + rows, mask=in_seq[:, None], other=0.0)
    v = tl.load(V8 + kv_rows + rows, mask=in_seq[:, None], other=0.0)
    k_scale = tl.load(K_SCALE + bkv64 * N + offs_n, mask=in_seq, other=0.0)
    v_scale = tl.load(V_SCALE + bkv64 * N + offs_n, mask=in_seq, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
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
        dk, dv = _dkdv_head(
            dk, dv, k, k_scale, v, v_scale, offs_n, in_seq, bh0, lo,
            Q8, Q_SCALE, QT8, QT_SCALE, DO8, DO_SCALE, DOT8, DOT_SCALE, LSE2, DELTA,
            DS_ROWSUM, P_DUMP, DS_DUMP, DS_SCALE, qk_scale, N, NPAD,
            HEAD_DIM, BLOCK_M, BLOCK_N, QB, CAUSAL, P_SCALE, TMA, DEBUG, INTERPRET)
    else:
        # GQA: dK and dV sum over the GROUP query heads that read this key/value head
        for g in range(0, GROUP):
            dk, dv = _dkdv_head(
                dk, dv, k, k_scale, v, v_scale, offs_n, in_seq, bh0 + g, lo,
                Q8, Q_SCALE, QT8, QT_SCALE, DO8, DO_SCALE, DOT8, DOT_SCALE, LSE2, DELTA,
                DS_ROWSUM, P_DUMP, DS_DUMP, DS_SCALE, qk_scale, N, NPAD,
                HEAD_DIM, BLOCK_M, BLOCK_N, QB, CAUSAL, P_SCALE, TMA, DEBUG, INTERPRET)
    # stores
    tl.store(DK + kv_rows + rows, to_bf16(dk * sm_scale, INTERPRET), mask=in_seq[:, None])
    tl.store(DV + kv_rows + rows, to_bf16(dv * (1.0 / P_SCALE), INTERPRET), mask=in_seq[:, None])


# --------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------


#: The backward kernels by name; ``backward(..., kernels=...)`` runs a subset (to time one alone).
KERNELS = ("dq", "dkdv")


def launch(spec: KernelSpec, *, head_dim: int, causal: bool, kernel: str, group: int = 1,
           debug: bool = False) -> Launch:
    """The launch of the backward kernel ``kernel`` (``"dq"`` or ``"dkdv"``) for ``spec`` at
    ``head_dim``; ``group``: query heads per key/value head. P's fixed scale is
    ``2**recipe.p_bwd.offset_log2``, dq's deferred dQ runs where ``recipe.delta.deferred_dq`` is
    set (P scaled by :func:`kbar_p_scale` at kbar's point), and dS is quantized per row of the tile (the recipe's 1 x tile ``ds_dq``/``ds_dk``,
    which the tiling decides: ``config.fit_to_tiles``). The one description that
    :func:`backward` and ``compile_check`` read. A spec whose D comes from a pre-pass
    (``KernelSpec.prepass``) is a ValueError: :func:`prepass_refusal`."""
    why = prepass_refusal(spec)
    if why:
        raise ValueError(why)
    t = spec.bwd_tiles(head_dim)
    d = head_dim
    common = dict(HEAD_DIM=d, QB=QUANT_BLOCK, CAUSAL=causal, P_SCALE=float(2 ** spec.recipe.p_bwd.offset_log2),
                  TMA=t.tma, DEBUG=bool(debug), INTERPRET=interpreting())
    if kernel == "dq":
        bn = t.block_n2
        return Launch(dict(common, BLOCK_M=t.block_m2, BLOCK_N=bn, MATCHED=spec.matched,
                           KBAR_P_SCALE=kbar_p_scale(spec)),
                      t.num_warps_dq, t.num_stages_dq, t.maxnreg_dq,
                      {"K8": [1, bn, d], "V8": [1, bn, d], "KT8": [1, d, bn]} if t.tma else {},
                      kernel=_bwd_dq_kernel, block_m=t.block_m2)
    if kernel == "dkdv":
        bm = t.block_m1
        return Launch(dict(common, BLOCK_M=bm, BLOCK_N=t.block_n1, GROUP=group),
                      t.num_warps_dkdv, t.num_stages_dkdv, t.maxnreg_dkdv,
                      {"Q8": [1, bm, d], "DO8": [1, bm, d], "QT8": [1, d, bm], "DOT8": [1, d, bm]} if t.tma else {},
                      kernel=_bwd_dkdv_kernel, block_m=t.block_n1)
    raise ValueError(f"kernel={kernel!r} is not one of {KERNELS}")


def prepass_refusal(spec: KernelSpec) -> str | None:
    """Why the dq and dkdv kernels (these and ``bwd_ws``'s) do not run ``spec``, one line, or
    None: they compute the matched delta only with their deferred dQ, so a spec with D from a
    pre-pass (``KernelSpec.prepass``) runs ``bwd_prepass`` and the five-GEMM ``bwd_fused``."""
    if spec.prepass:
        return (f"the dq and dkdv kernels compute the matched delta only with their deferred dQ; recipe "
                f"{spec.name!r} takes D from a pre-pass (bwd_prepass, then the five-GEMM bwd_fused)")
    return None


def kbar_p_scale(spec: KernelSpec) -> float:
    """P's fixed scale at kbar's quantization point, ``2**recipe.delta.deferred_dq.p_offset_log2``
    (1 where the delta is stale: no kbar)."""
    deferred = spec.recipe.delta.deferred_dq
    return 1.0 if deferred is None else float(2 ** deferred.p_offset_log2)


def backward(
    saved, do8, do_t, delta_stale, *, batch: int, heads: int, kv_heads: int, n: int,
    head_dim: int, causal: bool, scale: float, recipe: KernelSpec, debug: bool = False,
    kernels: tuple[str, ...] = KERNELS,
):
    """Run the backward kernels in the order the delta strategy needs.

    ``saved``: the forward's ``SavedForward`` (quantized Q, K, V copies and LSE2). ``do8`` /
    ``do_t``: row and transposed copies of dO; ``delta_stale``: the preprocess's rowsum(dO * O).
    Returns ``(dq, dk, dv, debug dict)``; dk and dv have the key/value heads' shape.
    ``kernels`` names the kernels to run, of ``KERNELS`` (both; one alone only to time it).
    """
    unknown = sorted(set(kernels) - set(KERNELS))
    if unknown:
        raise ValueError(f"kernels={kernels!r}: {unknown} not among {KERNELS}")
    from .fwd import LOG2E

    t = recipe.bwd_tiles(head_dim)
    dev = do8.rows.device
    dq = torch.empty((batch, heads, n, head_dim), device=dev, dtype=torch.bfloat16)
    dk = torch.empty((batch, kv_heads, n, head_dim), device=dev, dtype=torch.bfloat16)
    dv = torch.empty_like(dk)
    dq_run = launch(recipe, head_dim=head_dim, causal=causal, kernel="dq", debug=debug)
    dkdv_run = launch(recipe, head_dim=head_dim, causal=causal, kernel="dkdv", group=heads // kv_heads, debug=debug)
    matched = dq_run.constexprs["MATCHED"]
    delta_matched = torch.empty_like(delta_stale) if matched else delta_stale
    dbg = _debug_buffers(batch * heads, n, t.block_m1, dev) if debug else {}
    dummy32 = torch.empty(1, device=dev, dtype=torch.float32)
    saved = saved.with_q_copies()  # where the forward left them to the backward
    q8, k8, v8 = saved.q, saved.k, saved.v
    dq_ops, dkdv_ops = _operands(q8, k8, v8, do8, do_t, dq_run, dkdv_run)
    scalars = (scale * LOG2E, scale)

    def run_dq():
        k_unit = kbar_unit(k8) if matched else dummy32
        dq_run.start(dq_run.grid(n, batch * heads),
            q8.rows, q8.row_scale, dq_ops[0], k8.row_scale, dq_ops[1], v8.row_scale,
            dq_ops[2], k8.col_scale, k_unit, do8.rows, do8.row_scale, saved.lse2, delta_stale,
            delta_matched if matched else dummy32,
            dq, dbg.get("dq_ds_rowsum", dummy32),
            *scalars, heads, heads // kv_heads, n, do_t.npad)

    def run_dkdv():
        dkdv_run.start(dkdv_run.grid(n, batch * kv_heads),
            dkdv_ops[0], q8.row_scale, dkdv_ops[1], q8.col_scale, k8.rows, k8.row_scale,
            v8.rows, v8.row_scale, dkdv_ops[2], do8.row_scale, dkdv_ops[3], do_t.col_scale,
            saved.lse2, delta_matched,
            dk, dv, dbg.get("ds_rowsum", dummy32), dbg.get("p_codes", dummy32),
            dbg.get("ds_codes", dummy32), dbg.get("ds_scale", dummy32),
            *scalars, heads, kv_heads, n, do_t.npad)

    runs = {"dq": run_dq, "dkdv": run_dkdv}
    # matched: dq runs first and makes D; stale: either order
    for name in ("dq", "dkdv") if matched else ("dkdv", "dq"):
        if name in kernels:
            runs[name]()
    dbg["delta"] = delta_matched if matched else delta_stale
    if debug:
        from .fwd import fp8_codes

        dbg["p_codes"] = fp8_codes(dbg["p_codes"])
        dbg["ds_codes"] = fp8_codes(dbg["ds_codes"])
    return dq, dk, dv, dbg


def _debug_buffers(rows: int, n: int, block_m1: int, dev) -> dict:
    """The debug outputs (see ``api.attention_backward``): the P and dS dumps hold the float32
    values the casts received, made codes on the host (``fwd.fp8_codes``)."""
    def zeros(*shape):
        return torch.zeros(shape, device=dev, dtype=torch.float32)

    return dict(dq_ds_rowsum=zeros(rows, n), ds_rowsum=zeros(rows, n), p_codes=zeros(rows, n, n),
                ds_codes=zeros(rows, n, n), ds_scale=zeros(rows, triton.cdiv(n, block_m1), n))


def kbar_unit(k8) -> torch.Tensor:
    """kbar's unit u per key/value head, as a matched dq kernel (this module's or ``bwd_ws``'s)
    reads it: the largest of the head's K block scales (a reduction over the (B*Hkv, NPAD/128, D)
    scales, not over K); one scalar per program, as a per-channel vector held across the dq loop
    spilled (and a precomputed per-tile factor cost a load per tile)."""
    return k8.col_scale.amax(dim=(1, 2)).contiguous()


def _operands(q8, k8, v8, do8, do_t, dq_run: Launch, dkdv_run: Launch):
    """The FP8 operand copies each kernel loads tiles from: TMA tensor descriptors of the
    launches' block shapes where they take descriptors (dq: K, V rows per ``block_n2`` keys, K
    cols; dkdv: Q, dO rows per ``block_m1`` queries, Q, dO cols), else the tensors themselves.
    Returns (dq's K, V, K^T; dkdv's Q, Q^T, dO, dO^T)."""
    dq_ops = (k8.rows, v8.rows, k8.cols)
    dkdv_ops = (q8.rows, q8.cols, do8.rows, do_t.cols)
    return (described(dq_run, ("K8", "V8", "KT8"), dq_ops),
            described(dkdv_run, ("Q8", "QT8", "DO8", "DOT8"), dkdv_ops))


def described(run: Launch, names, tensors) -> tuple:
    """``tensors`` (the arguments ``names`` of ``run.kernel``) as the kernel takes them: a TMA
    tensor descriptor of the launch's block shape where it takes one, else the tensor itself."""
    if not run.descriptors:
        return tuple(tensors)
    from triton.tools.tensor_descriptor import TensorDescriptor as TD

    return tuple(TD.from_tensor(x, run.descriptors[name]) if name in run.descriptors else x
                 for name, x in zip(names, tensors))
