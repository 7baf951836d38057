"""The five-GEMM FP8 backward (FlashAttention-3's structure) in Triton: one kernel for dK, dV and
dQ's partial products, then a postprocess of dQ.

One program per ``BLOCK_N`` keys of one key/value head keeps K, V and the dK, dV accumulators on
chip and loops over the ``BLOCK_M``-query tiles of each query head of its group (GQA). Per tile,
five FP8 matmuls: S^T = K Q^T, dP^T = V dO^T, dV += Q8(2**8 P^T) dO, dK += Q8(dS^T) Q, and dQ's
partial (Q8(dS) K)^T = K^T Q8(dS)^T over this program's keys, added into a float32 ``(B*H, N, D)`` buffer
(``tl.atomic_add``). The postprocess rounds ``dQ * scale`` to BF16.

What it computes is the spec's recipe with the backward tiling ``block_m1`` = the query tile and
``block_n2`` = the key block (:func:`launch`): dS is quantized twice from one float32 tile, per
key over ``block_m1`` queries for dK (``ds_dk``, as ``bwd``'s dkdv kernel) and per query over
``block_n2`` keys for dQ (``ds_dq``, as ``bwd``'s dq kernel); dV and dK are promoted to float32 per
query tile, dQ per key block (one wgmma chain each, then one float32 add). The delta D is read
from a buffer: the stale delta of the preprocess (``quantize(..., delta_with=O)``), so specs
with the stale delta run here; the matched D of the pre-pass (``bwd_prepass``), so the specs with
D from a pre-pass (``kernels_delta_prepass``, ``KernelSpec.prepass``) run here; or a D the caller
passes (``attention_backward(..., delta=)``, e.g. a matched delta computed ahead), with which the
kernel computes the spec's recipe with that delta (``dataclasses.replace(spec.recipe, delta=...)``).

Summation order of dQ: the float32 adds of the key blocks' partials into one element happen in
whatever order the programs reach them, so dQ may differ between runs in its last bits (within
the recipe: every order is a float32 sum of the same partials). ``deterministic=True`` orders
them: a counter per (query head, query tile) holds how many key blocks have added their
partial; key block ``j`` waits until it reads ``j`` (the blocks before ``j`` that see the tile are
exactly ``0 .. j-1``, causal or not, as the query tiles a key block sees start at or before those
of the next), adds, and raises it to ``j + 1``. So every element is ``((0 + t_0) + t_1) + ...`` in
key order, the order of ``bwd``'s dq kernel. Programs are dispatched in grid order with the key
block fastest, so block ``j - 1`` is resident or done when ``j`` waits. Triton's interpreter
runs programs one at a time in that order: there a program reads the counter without waiting.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import exp2_int, pow2_down_exponent, to_bf16, to_fp8
from ._runtime import Launch, interpreting
from .bwd import _dkdv_col_tiles, _dkdv_p_t, _dot_rn, _quantize_ds, _row_tile_t
from dmref.recipes import STALE

from .config import QUANT_BLOCK, KernelSpec


@dataclass(frozen=True)
class FusedBwdTiles:
    """The launch options of the fused backward; its query tile and key block are the spec's
    backward tiling's ``block_m1`` and ``block_n2`` (they decide the recipe's dS blocks)."""

    num_warps: int = 4
    num_stages: int = 2
    maxnreg: int | None = None


def default_fused_tiles(spec: KernelSpec, head_dim: int) -> FusedBwdTiles:
    """The fused backward's launch options at ``head_dim``, the fastest of 4 or 8 warps and 1 or 2
    pipeline stages on the H100 (docs/kernels.md, "The five-GEMM backward"): 4 warps at D = 64,
    8 at D = 128 (on 4, ptxas spills 2 KB a thread there: ``compile_usage``), two stages."""
    return FusedBwdTiles(num_warps=4 if head_dim == 64 else 8, num_stages=2)


@triton.jit
def _quantize_ds_cols(ds_t, amax, INTERPRET: tl.constexpr):
    """Q-point dS for dQ from the transposed tile ``(keys, queries)``: E4M3 with one POW2_DOWN
    scale per query (a column) from ``amax``: the column's amax over the tile's keys (the
    recipe's ``ds_dq``, 1 x ``BLOCK_N``), or with ``Recipe.ds_dq_bound`` the pre-pass's bound of
    the row's amax over all keys. Returns (codes, the dequantization factor of each query, the
    scaled float32 tile)."""
    k = pow2_down_exponent(amax, False)
    scaled = ds_t * exp2_int(k)[None, :]
    return to_fp8(scaled, False, INTERPRET), exp2_int(-k), scaled


@triton.jit
def _fused_debug_store(ds_scaled, ds_inv, dsq_scaled, dsq_inv, offs_m, offs_n, in_seq, q_in, bh64,
                       DSK_X, DSK_INV, DSQ_X, DSQ_INV, N):
    """Debug stores of one tile, at ``(query, key)`` of ``(B*H, N, N)`` dumps: the float32 values
    the two dS casts received (the host makes them codes: ``fwd.fp8_codes``) and each element's
    dequantization factor (dK: per key of the query tile; dQ: per query of the key block)."""
    dump = bh64 * N * N + offs_m[None, :] * N + offs_n[:, None]
    mask = q_in[None, :] & in_seq[:, None]
    tl.store(DSK_X + dump, ds_scaled, mask=mask)
    tl.store(DSK_INV + dump, tl.zeros_like(ds_scaled) + ds_inv[:, None], mask=mask)
    tl.store(DSQ_X + dump, dsq_scaled, mask=mask)
    tl.store(DSQ_INV + dump, tl.zeros_like(dsq_scaled) + dsq_inv[None, :], mask=mask)


@triton.jit
def _fused_head(
    dk, dv, k, k_scale, v, v_scale, kt_t, kt_scale, offs_n, in_seq, bh64, lo, j_block,
    Q8, Q_SCALE, QT8, QT_SCALE, DO8, DO_SCALE, DOT8, DOT_SCALE, LSE2, DELTA, DSQ_U, DQ_ACC, SEM,
    DSK_X, DSK_INV, DSQ_X, DSQ_INV, SEM_SEEN, qk_scale, N, NPAD, n_qtiles, n_kblocks,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QB: tl.constexpr,
    CAUSAL: tl.constexpr, P_SCALE: tl.constexpr, DETERMINISTIC: tl.constexpr,
    DSQ_GIVEN: tl.constexpr, DEBUG: tl.constexpr, INTERPRET: tl.constexpr,
):
    """The query tiles of one query head: dK and dV accumulated on chip, dQ's partials added to
    ``DQ_ACC``. Invariant at the top of each iteration, over the query tiles done so far:
    dk = sum of deq(Q8(dS^T)) Q, dv = sum of Q8(2**8 P^T) deq(dO) (float32, one add per tile)."""
    offs_d = tl.arange(0, HEAD_DIM)
    head_rows = bh64 * N * HEAD_DIM
    head = bh64 * N
    head_cols = bh64 * HEAD_DIM * NPAD
    bh32 = bh64.to(tl.int32)
    head_col_scale = bh64 * (NPAD // QB) * HEAD_DIM
    for start_m in range(lo, N, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q_in = offs_m < N
        # load: Q and dO row copies as (D, BLOCK_M) tiles
        q_t = _row_tile_t(Q8, head_rows, bh32, start_m, offs_m, offs_d, q_in, BLOCK_M, HEAD_DIM, False)
        do_t = _row_tile_t(DO8, head_rows, bh32, start_m, offs_m, offs_d, q_in, BLOCK_M, HEAD_DIM, False)
        q_scale = tl.load(Q_SCALE + head + offs_m, mask=q_in, other=0.0) * qk_scale
        lse2 = tl.load(LSE2 + head + offs_m, mask=q_in, other=0.0)
        # GEMM 1, S^T = K Q^T, and P^T against LSE
        p_t = _dkdv_p_t(_dot_rn(k, q_t, k_scale, q_scale, INTERPRET), lse2, offs_m, offs_n, in_seq, q_in, CAUSAL)
        do_scale = tl.load(DO_SCALE + head + offs_m, mask=q_in, other=0.0)
        delta = tl.load(DELTA + head + offs_m, mask=q_in, other=0.0)
        # GEMM 2, dP^T = V dO^T
        dp_t = _dot_rn(v, do_t, v_scale, do_scale, INTERPRET)
        # Q-point P (dV): float32 -> E4M3, scale 2**8 against LSE
        p8_t = to_fp8(p_t * P_SCALE, False, INTERPRET)
        # dS = P (dP - D), D read from the buffer; quantized per key (dK) and per query (dQ)
        ds_t = p_t * (dp_t - delta[None, :])
        ds8_t, ds_inv, ds_scaled = _quantize_ds(ds_t, INTERPRET)
        if DSQ_GIVEN:  # one scale per query over all keys, from the pre-pass's bound
            dsq_amax = tl.load(DSQ_U + head + offs_m, mask=q_in, other=0.0)
        else:
            dsq_amax = tl.max(tl.abs(ds_t), axis=0)
        dsq8_t, dsq_inv, dsq_scaled = _quantize_ds_cols(ds_t, dsq_amax, INTERPRET)
        if DEBUG:
            _fused_debug_store(ds_scaled, ds_inv, dsq_scaled, dsq_inv, offs_m, offs_n, in_seq, q_in, bh64,
                               DSK_X, DSK_INV, DSQ_X, DSQ_INV, N)
        # load: dO and Q transposed copies as (BLOCK_M, D) tiles
        dot, qt, sc = _dkdv_col_tiles(DOT8, QT8, head_cols, head_col_scale, bh32, start_m, offs_m, offs_d, NPAD,
                                      BLOCK_M, HEAD_DIM, QB, False)
        # GEMMs 3 and 4, P^T dO and dS^T Q, promoted per query tile
        dv += tl.dot(p8_t, dot) * tl.load(DOT_SCALE + sc)[None, :]
        dk += tl.dot(ds8_t, qt) * tl.load(QT_SCALE + sc)[None, :] * ds_inv[:, None]
        # GEMM 5, dQ's partial over this key block, transposed: dQ^T = K^T dS^T (K's transposed
        # copy as it lies, dS^T as it was formed: no transpose of an FP8 tile), promoted: one
        # chain, then a float32 add
        dq_t = tl.dot(kt_t, dsq8_t) * kt_scale[:, None] * dsq_inv[None, :]
        dq_ptrs = DQ_ACC + head_rows + offs_m[None, :] * HEAD_DIM + offs_d[:, None]
        if DETERMINISTIC:
            counter = SEM + bh64 * n_qtiles + start_m // BLOCK_M
            if INTERPRET:
                seen = tl.load(counter)  # programs run one at a time, in grid order
            else:
                seen = tl.atomic_add(counter, 0, sem="acquire")
                while seen < j_block:
                    seen = tl.atomic_add(counter, 0, sem="acquire")
            if DEBUG:
                tl.store(SEM_SEEN + (bh64 * n_qtiles + start_m // BLOCK_M) * n_kblocks + j_block, seen)
        tl.atomic_add(dq_ptrs, dq_t, mask=q_in[None, :], sem="relaxed")
        if DETERMINISTIC:
            # every thread's adds are issued before one thread's release raises the counter
            tl.debug_barrier()
            tl.atomic_add(counter, 1, sem="release")
    return dk, dv


@triton.jit
def _bwd_fused_kernel(
    Q8, Q_SCALE, QT8, QT_SCALE, K8, K_SCALE, KT8, KT_SCALE, V8, V_SCALE,
    DO8, DO_SCALE, DOT8, DOT_SCALE, LSE2, DELTA, DSQ_U,
    DK, DV, DQ_ACC, SEM, DSK_X, DSK_INV, DSQ_X, DSQ_INV, SEM_SEEN,
    qk_scale, sm_scale, H, HKV, N, NPAD,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QB: tl.constexpr,
    GROUP: tl.constexpr, CAUSAL: tl.constexpr, P_SCALE: tl.constexpr, DETERMINISTIC: tl.constexpr,
    DSQ_GIVEN: tl.constexpr, DEBUG: tl.constexpr, INTERPRET: tl.constexpr,
):
    tl.static_assert(QB % BLOCK_M == 0)
    tl.static_assert(QB % BLOCK_N == 0)
    j_block = tl.program_id(0)
    start_n = j_block * BLOCK_N
    bkv = tl.program_id(1)
    bkv64 = bkv.to(tl.int64)
    n_qtiles = tl.cdiv(N, BLOCK_M)
    n_kblocks = tl.cdiv(N, BLOCK_N)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    in_seq = offs_n < N
    rows = offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    kv_rows = bkv64 * N * HEAD_DIM
    # load: K and V row copies (S^T, dP^T) and K's transposed copy (dS K) stay on chip
    k = tl.load(K8 + kv_rows + rows, mask=in_seq[:, None], other=0.0)
    v = tl.load(V8 + kv_rows + rows, mask=in_seq[:, None], other=0.0)
    k_scale = tl.load(K_SCALE + bkv64 * N + offs_n, mask=in_seq, other=0.0)
    v_scale = tl.load(V_SCALE + bkv64 * N + offs_n, mask=in_seq, other=0.0)
    # K's transposed copy as a (D, BLOCK_N) tile, keys contiguous (padded to NPAD: no mask)
    kt_t = tl.load(KT8 + bkv64 * HEAD_DIM * NPAD + offs_d[:, None] * NPAD + offs_n[None, :])
    kt_scale = tl.load(KT_SCALE + bkv64 * (NPAD // QB) * HEAD_DIM + (start_n // QB) * HEAD_DIM + offs_d)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    if CAUSAL:
        lo = (start_n // BLOCK_M) * BLOCK_M  # the first query tile that sees a key of this block
    else:
        lo = 0
    bh0 = ((bkv // HKV) * H + (bkv % HKV) * GROUP).to(tl.int64)
    if GROUP == 1:
        dk, dv = _fused_head(
            dk, dv, k, k_scale, v, v_scale, kt_t, kt_scale, offs_n, in_seq, bh0, lo, j_block,
            Q8, Q_SCALE, QT8, QT_SCALE, DO8, DO_SCALE, DOT8, DOT_SCALE, LSE2, DELTA, DSQ_U, DQ_ACC, SEM,
            DSK_X, DSK_INV, DSQ_X, DSQ_INV, SEM_SEEN, qk_scale, N, NPAD, n_qtiles, n_kblocks,
            HEAD_DIM, BLOCK_M, BLOCK_N, QB, CAUSAL, P_SCALE, DETERMINISTIC, DSQ_GIVEN, DEBUG, INTERPRET)
    else:
        for g in range(0, GROUP):
            dk, dv = _fused_head(
                dk, dv, k, k_scale, v, v_scale, kt_t, kt_scale, offs_n, in_seq, bh0 + g, lo, j_block,
                Q8, Q_SCALE, QT8, QT_SCALE, DO8, DO_SCALE, DOT8, DOT_SCALE, LSE2, DELTA, DSQ_U, DQ_ACC, SEM,
                DSK_X, DSK_INV, DSQ_X, DSQ_INV, SEM_SEEN, qk_scale, N, NPAD, n_qtiles, n_kblocks,
                HEAD_DIM, BLOCK_M, BLOCK_N, QB, CAUSAL, P_SCALE, DETERMINISTIC, DSQ_GIVEN, DEBUG, INTERPRET)
    tl.store(DK + kv_rows + rows, to_bf16(dk * sm_scale, INTERPRET), mask=in_seq[:, None])
    tl.store(DV + kv_rows + rows, to_bf16(dv * (1.0 / P_SCALE), INTERPRET), mask=in_seq[:, None])


@triton.jit
def _dq_postprocess_kernel(DQ_ACC, DQ, DSQ_U, KT_SCALE, sm_scale, total, N, H, GROUP, KT_HEAD_STRIDE,
                           HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, TRANSPOSED: tl.constexpr,
                           FACTORS: tl.constexpr, INTERPRET: tl.constexpr):
    """dQ = BF16(dQ_acc * scale), round to nearest even, ``BLOCK`` elements a program;
    ``TRANSPOSED``: ``dQ_acc`` holds dQ^T, ``(B*H, D, N)``; ``FACTORS``: ``dQ_acc`` holds the
    unscaled sum of the partials, each element first multiplied by its key/value head's K^T
    factor (``KT_SCALE[kv * KT_HEAD_STRIDE]``) and then by its query's dS factor 2^-k, k the
    POW2_DOWN exponent of its bound ``DSQ_U`` (the order in which ``_fused_head`` scales a partial;
    both powers of two)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < total
    head, r = offs // (N * HEAD_DIM), offs % (N * HEAD_DIM)
    src = offs
    if TRANSPOSED:
        src = head * (N * HEAD_DIM) + (r % HEAD_DIM) * N + r // HEAD_DIM
    x = tl.load(DQ_ACC + src, mask=m, other=0.0)
    if FACTORS:
        kv = (head // H) * (H // GROUP) + (head % H) // GROUP
        ks = tl.load(KT_SCALE + kv * KT_HEAD_STRIDE, mask=m, other=1.0)
        u = tl.load(DSQ_U + head * N + r // HEAD_DIM, mask=m, other=0.0)
        x = x * ks * exp2_int(-pow2_down_exponent(u, False))
    tl.store(DQ + offs, to_bf16(x * sm_scale, INTERPRET), mask=m)


#: elements of dQ a postprocess program rounds
POSTPROCESS_BLOCK = 1024


@triton.jit
def _dsq_exponent_kernel(DSQ_U, K, total, BLOCK: tl.constexpr):
    """k = ``pow2_down_exponent(U)`` of each query's bound, int32, ``BLOCK`` queries a program."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < total
    tl.store(K + offs, pow2_down_exponent(tl.load(DSQ_U + offs, mask=m, other=0.0), False), mask=m)


def dsq_exponents(u: torch.Tensor) -> torch.Tensor:
    """The POW2_DOWN exponent of each query's dS-for-dQ scale, k = floor(log2(448 / U_i))
    clamped to [-126, 126] (0 where U_i = 0), from the pre-pass's bound ``u`` ``(B*H, N)``, as int32
    of ``u``'s shape (one kernel, ``_common.pow2_down_exponent``: what the five-GEMM kernels compute
    from U themselves). ``bwd_ws.fused`` hands these to its kernel with ``vec_tma`` instead of U, so
    that the kernel does not take each query's exponent once for every element of its column."""
    u = u.contiguous()
    k = torch.empty(u.shape, device=u.device, dtype=torch.int32)
    _dsq_exponent_kernel[(triton.cdiv(u.numel(), POSTPROCESS_BLOCK),)](u, k, u.numel(), BLOCK=POSTPROCESS_BLOCK)
    return k


def postprocess_dq(dq_acc: torch.Tensor, batch: int, heads: int, n: int, head_dim: int, scale: float,
                   transposed: bool = False, factors=None) -> torch.Tensor:
    """dQ ``(B, H, N, D)`` BF16 from the float32 sum of its partials ``dq_acc``: BF16(dq_acc * scale),
    round to nearest even (one kernel); ``transposed``: ``dq_acc`` is dQ^T's, ``(B*H, D, N)``;
    ``factors`` (the unscaled partials of a ``KernelSpec.dsq_row`` spec): ``(U, kt_scale, group)``,
    the pre-pass's bound ``(B*H, N)``, K's transposed copy's factors ``(B*HKV, NPAD / 128, D)``
    (the head's factor throughout) and the query heads per key/value head."""
    dq = torch.empty((batch, heads, n, head_dim), device=dq_acc.device, dtype=torch.bfloat16)
    total = dq.numel()
    u, kt_scale, group = factors if factors is not None else (dq_acc, dq_acc, 1)
    _dq_postprocess_kernel[(triton.cdiv(total, POSTPROCESS_BLOCK),)](
        dq_acc, dq, u, kt_scale, scale, total, n, heads, group, kt_scale[0].numel() if factors is not None else 0,
        HEAD_DIM=head_dim, BLOCK=POSTPROCESS_BLOCK, TRANSPOSED=bool(transposed), FACTORS=factors is not None,
        INTERPRET=interpreting())
    return dq


def refusal(spec: KernelSpec, head_dim: int) -> str | None:
    """None if the fused backward runs ``spec`` at ``head_dim``, else why not, one line: it runs
    the stale delta and the matched one from a pre-pass (``KernelSpec.prepass``), not the dq
    kernel's deferred dQ."""
    if spec.recipe.delta != STALE and not spec.prepass:
        return (f"the fused backward reads the stale delta of the preprocess or the matched D of the pre-pass "
                f"(bwd_prepass); recipe {spec.name!r} has the {spec.recipe.delta.name} delta")
    t = spec.bwd_tiles(head_dim)
    if head_dim * max(t.block_m1, t.block_n2) > 128 * 128:
        return f"tiles {t.block_m1}x{t.block_n2} at head dim {head_dim} do not fit the registers of one program"
    return None


def caller_delta(delta: torch.Tensor, batch: int, heads: int, n: int, device, name: str = "delta") -> torch.Tensor:
    """A caller's per-query vector (D, or ``name``: ``dsq_bound``) as the kernel reads it,
    ``(B*H, N)`` float32 contiguous; ValueError if it is not float32 (no silent rounding) of
    ``(B, H, N)`` or ``(B*H, N)`` on ``device``."""
    if not isinstance(delta, torch.Tensor) or delta.dtype != torch.float32:
        raise ValueError(f"{name} must be a float32 tensor, got {getattr(delta, 'dtype', type(delta).__name__)}")
    if tuple(delta.shape) not in ((batch, heads, n), (batch * heads, n)):
        raise ValueError(f"{name} shape {tuple(delta.shape)} must be (B, H, N) = {(batch, heads, n)}")
    if delta.device != torch.device(device) and not (delta.device.type == torch.device(device).type == "cuda"):
        raise ValueError(f"{name} is on {delta.device}, the gradients on {device}")
    return delta.reshape(batch * heads, n).contiguous()


def launch(spec: KernelSpec, *, head_dim: int, causal: bool, group: int = 1, deterministic: bool = False,
           debug: bool = False) -> Launch:
    """The launch of the fused backward for ``spec`` at ``head_dim`` (``group``: query heads per
    key/value head): query tiles of the spec's ``block_m1`` and key blocks of its ``block_n2``, the
    dS blocks, promotion points and P scale the recipe states (``config.fit_to_tiles``). The one
    description that :func:`backward` and ``compile_check`` read. A spec with dS for dQ scaled from
    the pre-pass's bound (``KernelSpec.dsq_row``) reads it (:func:`backward`'s ``dsq_bound``)."""
    why = refusal(spec, head_dim)
    if why:
        raise ValueError(why)
    t = spec.bwd_tiles(head_dim)
    f = default_fused_tiles(spec, head_dim)
    return Launch(dict(HEAD_DIM=head_dim, BLOCK_M=t.block_m1, BLOCK_N=t.block_n2, QB=QUANT_BLOCK, GROUP=group,
                       CAUSAL=causal, P_SCALE=float(2 ** spec.recipe.p_bwd.offset_log2),
                       DETERMINISTIC=bool(deterministic), DSQ_GIVEN=spec.dsq_row, DEBUG=bool(debug),
                       INTERPRET=interpreting()),
                  f.num_warps, f.num_stages, f.maxnreg, {}, kernel=_bwd_fused_kernel, block_m=t.block_n2)


def check_kt_head(spec: KernelSpec, saved) -> None:
    """ValueError, one line, where ``spec`` reads K's transposed copy with the head's factor
    (``KernelSpec.dsq_row``) and ``saved`` holds another (``saved.kt_head``: another recipe's
    forward wrote it)."""
    if spec.dsq_row and not getattr(saved, "kt_head", False):
        raise ValueError(f"recipe {spec.name!r} reads K's transposed copy with the head's factor: the saved state "
                         "comes from another recipe's forward")


def check_dsq(spec: KernelSpec, saved, dsq_bound, batch: int, heads: int, n: int, device):
    """``dsq_bound`` as the five-GEMM kernels read it (``caller_delta``), or None: given exactly
    for a spec whose dS for dQ is scaled from the pre-pass's bound (``KernelSpec.dsq_row``), on a
    saved state whose K^T copy holds K's row codes with the head's factor (:func:`check_kt_head`);
    else a one-line ValueError."""
    if spec.dsq_row and dsq_bound is None:
        raise ValueError(f"recipe {spec.name!r} scales dS for dQ from the pre-pass's bound: pass dsq_bound, the U of "
                         "bwd_prepass.delta(..., bound=True)")
    if dsq_bound is None:
        return None
    if not spec.dsq_row:
        raise ValueError(f"dsq_bound is read by the recipes with dS for dQ scaled from the pre-pass's bound "
                         f"(kernels_folded_delta_prepass_dsq_row); recipe {spec.name!r} scales it "
                         f"{spec.recipe.ds_dq.describe()}")
    check_kt_head(spec, saved)
    return caller_delta(dsq_bound, batch, heads, n, device, name="dsq_bound")


def backward(saved, do8, delta, *, batch: int, heads: int, kv_heads: int, n: int, head_dim: int,
             causal: bool, scale: float, recipe: KernelSpec, deterministic: bool = False, debug: bool = False,
             dsq_bound=None):
    """Run the fused backward and dQ's postprocess. ``saved``: the forward's ``SavedForward``;
    ``do8``: dO's row and transposed copies (one ``quantize.Quantized``); ``delta``: D per query row ``(B*H, N)``
    float32 (the preprocess's stale delta, or the pre-pass's matched D). Returns ``(dq, dk, dv,
    debug dict)``; the debug dict holds ``"delta"`` and with ``debug`` ``"ds_dk"`` and ``"ds_dq"``
    (``(B*H, N, N)`` float32: dS as each matmul sees it, codes times their dequantization factor; 0
    where a tile skipped), ``"ds_dq_inv"`` (the dequantization factor of each element of dQ's dS
    cast), ``"ds"`` (the float32 dS = P (dP - D) the casts received, before
    quantization: the dK cast's input times its power-of-two factor, exact unless the scaled value
    was subnormal) and, deterministic, ``"sem_seen"`` (``(B*H, n_qtiles, n_kblocks)`` int32: the counter each key block
    read before adding, -1 where it did not see the tile).

    ``dsq_bound``: with a spec whose dS for dQ is scaled from the pre-pass's bound
    (``KernelSpec.dsq_row``, ``kernels_folded_delta_prepass_dsq_row``), and only there, the
    pre-pass's bound U_i of each query's dS amax over all keys (``bwd_prepass.delta(...,
    bound=True)``, ``(B*H, N)`` float32): dS for dQ is then quantized with one POW2_DOWN scale per
    query from it, and K for dQ is the saved K^T copy with the head's scale (``check_dsq``)."""
    from .fwd import LOG2E

    dsq_bound = check_dsq(recipe, saved, dsq_bound, batch, heads, n, do8.rows.device)
    run = launch(recipe, head_dim=head_dim, causal=causal, group=heads // kv_heads,
                 deterministic=deterministic, debug=debug)
    c = run.constexprs
    dev = do8.rows.device
    n_qtiles, n_kblocks = triton.cdiv(n, c["BLOCK_M"]), triton.cdiv(n, c["BLOCK_N"])
    dq_acc = torch.zeros((batch * heads, n, head_dim), device=dev, dtype=torch.float32)
    dk = torch.empty((batch, kv_heads, n, head_dim), device=dev, dtype=torch.bfloat16)
    dv = torch.empty_like(dk)
    dummy32 = torch.empty(1, device=dev, dtype=torch.float32)
    dummy_i32 = torch.empty(1, device=dev, dtype=torch.int32)
    sem = torch.zeros((batch * heads, n_qtiles), device=dev, dtype=torch.int32) if deterministic else dummy_i32
    dumps = {}
    if debug:
        dumps = {name: torch.zeros((batch * heads, n, n), device=dev, dtype=torch.float32)
                 for name in ("dsk_x", "dsk_inv", "dsq_x", "dsq_inv")}
        dumps["sem_seen"] = torch.full((batch * heads, n_qtiles, n_kblocks), -1, device=dev, dtype=torch.int32)
    saved = saved.with_q_copies()  # where the forward left them to the backward
    q8, k8, v8 = saved.q, saved.k, saved.v
    kt, kt_scale = k8.cols, k8.col_scale
    run.kernel[run.grid(n, batch * kv_heads)](
        q8.rows, q8.row_scale, q8.cols, q8.col_scale, k8.rows, k8.row_scale, kt, kt_scale,
        v8.rows, v8.row_scale, do8.rows, do8.row_scale, do8.cols, do8.col_scale, saved.lse2, delta,
        dummy32 if dsq_bound is None else dsq_bound,
        dk, dv, dq_acc, sem, dumps.get("dsk_x", dummy32), dumps.get("dsk_inv", dummy32),
        dumps.get("dsq_x", dummy32), dumps.get("dsq_inv", dummy32), dumps.get("sem_seen", dummy_i32),
        scale * LOG2E, scale, heads, kv_heads, n, do8.npad, **c, **run.options())
    dq = postprocess_dq(dq_acc, batch, heads, n, head_dim, scale)
    dbg = {"delta": delta}
    if debug:
        from .fwd import fp8_codes

        def seen(x, inv):  # dS as its matmul sees it: E4M3 codes times their dequantization factor
            return fp8_codes(x).view(torch.float8_e4m3fn).float() * inv

        dbg["ds_dk"] = seen(dumps["dsk_x"], dumps["dsk_inv"])
        dbg["ds_dq"] = seen(dumps["dsq_x"], dumps["dsq_inv"])
        dbg["ds_dq_inv"] = dumps["dsq_inv"]  # each element's dequantization factor in dQ's cast
        dbg["ds"] = dumps["dsk_x"] * dumps["dsk_inv"]
        if deterministic:
            dbg["sem_seen"] = dumps["sem_seen"]
    return dq, dk, dv, dbg



def compile_usage(spec: "KernelSpec | str" = "kernels_naive_fp8", head_dims=(64, 128), causal=(False, True),
                  deterministic=(False, True), group: int = 1) -> list:
    """Registers, spill bytes and shared memory of the fused kernel compiled for sm_90a as
    :func:`launch` describes it (no GPU: ``compile_check``), one ``compile_check.Usage`` per
    variant. Must run with ``TRITON_INTERPRET`` unset."""
    from ._sm90 import Usage, compile_launch, resource_usage
    from .config import get_spec

    spec = get_spec(spec)
    out = []
    for d in head_dims:
        for c in causal:
            for det in deterministic:
                run = launch(spec, head_dim=d, causal=c, group=group, deterministic=det)
                regs, spills, shared = resource_usage(compile_launch(run, do_format=spec.recipe.do_dp.fmt.name))
                out.append(Usage("bwd_fused", regs, spills, shared,
                                 f"{spec.name} d={d} causal={c} deterministic={det} group={group} "
                                 f"warps={run.num_warps} stages={run.num_stages}"))
    return out


if __name__ == "__main__":  # pragma: no cover
    for u in compile_usage() + compile_usage(group=2):
        print(f"{u.variant}: {u.registers} registers, {u.spill_bytes} bytes spilled, {u.shared_bytes} bytes shared")
