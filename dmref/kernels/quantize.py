"""Fused quantization: one read of a BF16 tensor, block-scaled FP8 row and transposed copies.

Each program reads a ``QUANT_BLOCK x D`` tile of ``X: (B, H, N, D)`` once and writes

- the *row copy*: codes scaled per token (amax over the head dim), and
- the *transposed copy*: codes scaled per channel over the tile's ``QUANT_BLOCK`` tokens, stored
  ``(D, NPAD)`` with tokens contiguous, the K-major layout FP8 wgmma needs when a matmul contracts
  over tokens.

For dO it also computes the stale delta ``D_i = sum_d O_id dO_id`` (float32) from the same read:
the backward's preprocess step.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dmref.emulation import get_format

from ._common import exp2_int, from_bf16, pow2_down_exponent, to_fp8
from ._runtime import Launch, interpreting
from .config import QUANT_BLOCK

#: The FP8 formats of the kernels' casts (``_common.to_fp8``); their torch dtypes are the formats'
#: own (``Format.torch_dtype``).
FORMATS = ("float8_e4m3fn", "float8_e5m2")


@dataclass
class Quantized:
    """FP8 copies of one ``(B, H, N, D)`` tensor (see ``config`` for the layouts)."""

    n: int
    rows: torch.Tensor | None = None  #: (B*H, N, D) codes
    row_scale: torch.Tensor | None = None  #: (B*H, N) dequantization factors
    cols: torch.Tensor | None = None  #: (B*H, D, NPAD) codes, tokens contiguous
    col_scale: torch.Tensor | None = None  #: (B*H, NPAD // QUANT_BLOCK, D) dequantization factors

    @property
    def npad(self) -> int:
        return triton.cdiv(self.n, QUANT_BLOCK) * QUANT_BLOCK

    @classmethod
    def empty(cls, programs: int, n: int, d: int, dtype: torch.dtype, device, *, rows: bool = True,
              cols: bool = True) -> Quantized:
        """Unwritten buffers of ``programs`` heads' copies in the layouts above (codes of ``dtype``,
        float32 factors): the row copy and/or the transposed copy."""
        out = cls(n=n)
        if rows:
            out.rows = torch.empty((programs, n, d), device=device, dtype=dtype)
            out.row_scale = torch.empty((programs, n), device=device, dtype=torch.float32)
        if cols:
            out.cols = torch.empty((programs, d, out.npad), device=device, dtype=dtype)
            out.col_scale = torch.empty((programs, out.npad // QUANT_BLOCK, d), device=device, dtype=torch.float32)
        return out


@triton.jit
def _store_row_copy(x, offs_t, offs_d, in_seq, XR, XR_SCALE, HEAD_DIM: tl.constexpr, IS_E5M2: tl.constexpr,
                    INTERPRET: tl.constexpr):
    """Q-point row copy of the float32 tile ``x`` (tokens ``offs_t``): one POW2_DOWN scale per
    token over the head dim; codes at ``XR`` ``(N, D)``, factors 2**-k at ``XR_SCALE``."""
    k_row = pow2_down_exponent(tl.max(tl.abs(x), axis=1), IS_E5M2)
    codes = to_fp8(x * exp2_int(k_row)[:, None], IS_E5M2, INTERPRET)
    tl.store(XR + offs_t[:, None] * HEAD_DIM + offs_d[None, :], codes, mask=in_seq[:, None])
    tl.store(XR_SCALE + offs_t, exp2_int(-k_row), mask=in_seq)


@triton.jit
def _store_col_copy(x, pid_t, offs_t, offs_d, XT, XT_SCALE, NPAD, HEAD_DIM: tl.constexpr, IS_E5M2: tl.constexpr,
                    INTERPRET: tl.constexpr):
    """Q-point transposed copy of the float32 tile ``x`` (token block ``pid_t``, padding tokens
    0): one POW2_DOWN scale per channel over the block's tokens; codes at ``XT`` ``(D, NPAD)``
    (padding written as 0), factors at ``XT_SCALE`` ``(NPAD // BLOCK_T, D)``."""
    k_col = pow2_down_exponent(tl.max(tl.abs(x), axis=0), IS_E5M2)
    codes_t = to_fp8(x * exp2_int(k_col)[None, :], IS_E5M2, INTERPRET)
    tl.store(XT + offs_d[None, :] * NPAD + offs_t[:, None], codes_t)
    tl.store(XT_SCALE + pid_t * HEAD_DIM + offs_d, exp2_int(-k_col))


@triton.jit
def _quantize_kernel(
    X, stride_xb, stride_xh, stride_xn, stride_xd,
    XR, XR_SCALE, XT, XT_SCALE,
    O, stride_ob, stride_oh, stride_on, stride_od, DELTA,
    Y, stride_yb, stride_yh, stride_yn, stride_yd, YR, YR_SCALE, YT, YT_SCALE,
    H, N, NPAD,
    HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr,
    EMIT_ROWS: tl.constexpr, EMIT_COLS: tl.constexpr, WITH_DELTA: tl.constexpr,
    IS_E5M2: tl.constexpr, WITH_Y: tl.constexpr, Y_E5M2: tl.constexpr, INTERPRET: tl.constexpr,
):
    pid_t = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, HEAD_DIM)
    in_seq = offs_t < N
    # per-head base pointers (64-bit scalars); tiles use int32 offsets from them
    X += b.to(tl.int64) * stride_xb + h.to(tl.int64) * stride_xh
    bh64 = bh.to(tl.int64)
    XR += bh64 * N * HEAD_DIM
    XR_SCALE += bh64 * N
    XT += bh64 * HEAD_DIM * NPAD
    XT_SCALE += bh64 * (NPAD // BLOCK_T) * HEAD_DIM
    DELTA += bh64 * N
    x_ptrs = X + offs_t[:, None] * stride_xn + offs_d[None, :] * stride_xd
    # padding tokens read as 0: they get code 0 in the transposed copy and do not move its amax
    x = from_bf16(tl.load(x_ptrs, mask=in_seq[:, None], other=0.0), INTERPRET)
    if EMIT_ROWS:
        _store_row_copy(x, offs_t, offs_d, in_seq, XR, XR_SCALE, HEAD_DIM, IS_E5M2, INTERPRET)
    if EMIT_COLS:
        # NPAD is a multiple of BLOCK_T: padding is written as 0
        _store_col_copy(x, pid_t, offs_t, offs_d, XT, XT_SCALE, NPAD, HEAD_DIM, IS_E5M2, INTERPRET)
    if WITH_DELTA:
        # stale delta, the backward's preprocess: D_i = sum_d O_id dO_id from BF16 O and dO
        O += b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
        o_ptrs = O + offs_t[:, None] * stride_on + offs_d[None, :] * stride_od
        o = from_bf16(tl.load(o_ptrs, mask=in_seq[:, None], other=0.0), INTERPRET)
        tl.store(DELTA + offs_t, tl.sum(o * x, axis=1), mask=in_seq)
    if WITH_Y:
        # a second tensor of the same shape, its row and transposed copies (the backward's Q)
        Y += b.to(tl.int64) * stride_yb + h.to(tl.int64) * stride_yh
        y = from_bf16(tl.load(Y + offs_t[:, None] * stride_yn + offs_d[None, :] * stride_yd, mask=in_seq[:, None],
                              other=0.0), INTERPRET)
        _store_row_copy(y, offs_t, offs_d, in_seq, YR + bh64 * N * HEAD_DIM, YR_SCALE + bh64 * N, HEAD_DIM, Y_E5M2,
                        INTERPRET)
        _store_col_copy(y, pid_t, offs_t, offs_d, YT + bh64 * HEAD_DIM * NPAD,
                        YT_SCALE + bh64 * (NPAD // BLOCK_T) * HEAD_DIM, NPAD, HEAD_DIM, Y_E5M2, INTERPRET)


def launch(head_dim: int, fmt: str, *, rows: bool = True, cols: bool = True, with_delta: bool = False,
           second_fmt: str | None = None) -> Launch:
    """The quantization kernel's launch for ``head_dim`` and the FP8 format ``fmt``: the copies
    it writes, whether it computes the stale delta, and the format of a second tensor whose row
    and transposed copies it writes too (None: none). The one description that :func:`quantize`
    and ``compile_check`` read."""
    consts = dict(HEAD_DIM=head_dim, BLOCK_T=QUANT_BLOCK, EMIT_ROWS=bool(rows), EMIT_COLS=bool(cols),
                  WITH_DELTA=bool(with_delta), IS_E5M2=fmt == "float8_e5m2", WITH_Y=second_fmt is not None,
                  Y_E5M2=second_fmt == "float8_e5m2", INTERPRET=interpreting())
    return Launch(consts, num_warps=8, num_stages=3, kernel=_quantize_kernel, block_m=QUANT_BLOCK)


def quantize(
    x: torch.Tensor,
    fmt: str = "float8_e4m3fn",
    *,
    rows: bool = True,
    cols: bool = True,
    delta_with: torch.Tensor | None = None,
) -> tuple[Quantized, torch.Tensor | None]:
    """Quantize ``x: (B, H, N, D)`` (BF16, any strides) in one pass.

    Returns the copies asked for and, when ``delta_with`` (O, same shape) is given, the stale delta
    ``rowsum(x * O)`` as ``(B*H, N)`` float32.
    """
    out, delta, _ = _quantize(x, fmt, rows=rows, cols=cols, delta_with=delta_with)
    return out, delta


def quantize_with(x: torch.Tensor, fmt: str, second: torch.Tensor, second_fmt: str, *,
                  delta_with: torch.Tensor | None = None) -> tuple[Quantized, torch.Tensor | None, Quantized]:
    """:func:`quantize` of ``x`` (both copies) and of ``second`` (same shape, any strides, both
    copies in ``second_fmt``) in one launch: the backward's preprocess quantizes dO (and its stale
    delta) and Q together. Returns ``(x's copies, the delta or None, second's copies)``, the codes
    and factors that :func:`quantize` gives each."""
    if second.shape != x.shape:
        raise ValueError(f"second shape {tuple(second.shape)} != x shape {tuple(x.shape)}")
    if second_fmt not in FORMATS:
        raise ValueError(f"second_fmt={second_fmt!r} must be one of {list(FORMATS)}")
    return _quantize(x, fmt, rows=True, cols=True, delta_with=delta_with, second=second, second_fmt=second_fmt)


def _quantize(x, fmt, *, rows, cols, delta_with, second=None, second_fmt=None):
    if x.ndim != 4:
        raise ValueError(f"x must be (B, H, N, D), got shape {tuple(x.shape)}")
    if fmt not in FORMATS:
        raise ValueError(f"fmt={fmt!r} must be one of {list(FORMATS)}")
    bsz, heads, n, d = x.shape
    if d not in (64, 128):
        raise ValueError(f"head dim {d=} must be 64 or 128")
    npad = triton.cdiv(n, QUANT_BLOCK) * QUANT_BLOCK
    dtype = get_format(fmt).torch_dtype
    dev = x.device
    out = Quantized.empty(bsz * heads, n, d, dtype, dev, rows=rows, cols=cols)
    dummy8, dummy32 = _placeholder(dev, dtype), _placeholder(dev, torch.float32)
    delta = None
    o = x
    if delta_with is not None:
        if delta_with.shape != x.shape:
            raise ValueError(f"delta_with shape {tuple(delta_with.shape)} != x shape {tuple(x.shape)}")
        delta = torch.empty((bsz * heads, n), device=dev, dtype=torch.float32)
        o = delta_with
    y8 = None
    y_args = (dummy8, 0, 0, 0, 0, dummy8, dummy32, dummy8, dummy32)
    if second is not None:
        y8 = Quantized.empty(bsz * heads, n, d, get_format(second_fmt).torch_dtype, dev)
        y_args = (second, *second.stride(), y8.rows, y8.row_scale, y8.cols, y8.col_scale)
    run = launch(d, fmt, rows=rows, cols=cols, with_delta=delta is not None, second_fmt=second_fmt)
    grid = (npad // QUANT_BLOCK, bsz * heads)
    run.start(grid, x, *x.stride(),
              out.rows if rows else dummy8, out.row_scale if rows else dummy32,
              out.cols if cols else dummy8, out.col_scale if cols else dummy32,
              o, *o.stride(), delta if delta is not None else dummy32, *y_args,
              heads, n, npad)
    return out, delta, y8


# ---------------------------------------------------------------------------------------------
# Folded scales (the warp-specialized forward, fwd_ws): K per head, V per head and channel
# ---------------------------------------------------------------------------------------------


@triton.jit
def _kv_tile(stride_b, stride_h, stride_n, stride_d, H, HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr):
    """This program's head and token tile of K and V (same strides): (bh, token offsets, channel
    offsets, the head's element offset, the tile's element offsets)."""
    bh = tl.program_id(1)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, HEAD_DIM)
    off = (bh // H).to(tl.int64) * stride_b + (bh % H).to(tl.int64) * stride_h
    return bh, offs_t, offs_d, off, offs_t[:, None] * stride_n + offs_d[None, :] * stride_d


@triton.jit
def _kv_amax_kernel(K, V, stride_b, stride_h, stride_n, stride_d, AMAX, H, N,
                    HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, INTERPRET: tl.constexpr):
    """Per head: max |K| over all tokens and channels (``AMAX[bh, 0]``) and max |V| of each
    channel over all tokens (``AMAX[bh, 1 + d]``), as int32 bit patterns. Each program reduces one
    tile of BLOCK_T tokens and merges with atomic_max (AMAX starts at 0; for |x| >= 0 integer
    order is float order, and NaN, the largest pattern, wins)."""
    bh, offs_t, offs_d, off, ptrs = _kv_tile(stride_b, stride_h, stride_n, stride_d, H, HEAD_DIM, BLOCK_T)
    in_seq = (offs_t < N)[:, None]
    k = tl.abs(from_bf16(tl.load(K + off + ptrs, mask=in_seq, other=0.0), INTERPRET)).to(tl.int32, bitcast=True)
    v = tl.abs(from_bf16(tl.load(V + off + ptrs, mask=in_seq, other=0.0), INTERPRET)).to(tl.int32, bitcast=True)
    AMAX += bh.to(tl.int64) * (1 + HEAD_DIM)
    tl.atomic_max(AMAX, tl.max(tl.max(k, axis=1), axis=0))
    tl.atomic_max(AMAX + 1 + offs_d, tl.max(v, axis=0))


@triton.jit
def _kv_quantize_folded_kernel(K, V, stride_b, stride_h, stride_n, stride_d, AMAX, K8, K_SCALE, VT8, V_SCALE,
                               KT8, KT_SCALE, V8, V8_SCALE, K8_SCALE, H, N, NPAD, HEAD_DIM: tl.constexpr,
                               BLOCK_T: tl.constexpr, FOR_BWD: tl.constexpr, KT_HEAD: tl.constexpr,
                               INTERPRET: tl.constexpr):
    """Codes under the amaxes of ``_kv_amax_kernel`` (POW2_DOWN, E4M3): K's row copy with one
    scale per head, V's transposed copy with one per head and channel; the first tile of each
    head writes the dequantization factors 2**-k. ``FOR_BWD``: from the same tiles, the copies the
    backward reads, as :func:`quantize` writes them (E4M3): K's transposed copy (``KT8``,
    ``KT_SCALE``) and V's row copy (``V8``, ``V8_SCALE``), and K's head factor once a token
    (``K8_SCALE``, ``(B*H, N)``: the row copy's scales as the backward reads them). ``KT_HEAD``:
    K's transposed copy is the row copy's codes transposed, with the head's factor for every
    channel of every token block (K for dQ scaled per head: ``KernelSpec.dsq_row``)."""
    bh, offs_t, offs_d, off, ptrs = _kv_tile(stride_b, stride_h, stride_n, stride_d, H, HEAD_DIM, BLOCK_T)
    pid_t = tl.program_id(0)
    in_seq = offs_t < N
    bh64 = bh.to(tl.int64)
    AMAX += bh64 * (1 + HEAD_DIM)
    # Q-point K (QK^T): one POW2_DOWN scale per head
    k_head = pow2_down_exponent(tl.load(AMAX).to(tl.float32, bitcast=True), False)
    k = from_bf16(tl.load(K + off + ptrs, mask=in_seq[:, None], other=0.0), INTERPRET)
    k8 = to_fp8(k * exp2_int(k_head), False, INTERPRET)
    tl.store(K8 + bh64 * N * HEAD_DIM + offs_t[:, None] * HEAD_DIM + offs_d[None, :], k8, mask=in_seq[:, None])
    if FOR_BWD and KT_HEAD:  # K's transposed copy: the row codes (padding tokens 0: code 0), the head's factor
        tl.store(KT8 + bh64 * HEAD_DIM * NPAD + offs_d[None, :] * NPAD + offs_t[:, None], k8)
        tl.store(KT_SCALE + (bh64 * (NPAD // BLOCK_T) + pid_t) * HEAD_DIM + offs_d,
                 tl.zeros([HEAD_DIM], tl.float32) + exp2_int(-k_head))
    elif FOR_BWD:  # K's transposed copy, before K's tile dies
        _store_col_copy(k, pid_t, offs_t, offs_d, KT8 + bh64 * HEAD_DIM * NPAD,
                        KT_SCALE + bh64 * (NPAD // BLOCK_T) * HEAD_DIM, NPAD, HEAD_DIM, False, INTERPRET)
    # Q-point V (PV): one POW2_DOWN scale per head and channel; padding tokens (0) get code 0
    k_chan = pow2_down_exponent(tl.load(AMAX + 1 + offs_d).to(tl.float32, bitcast=True), False)
    v = from_bf16(tl.load(V + off + ptrs, mask=in_seq[:, None], other=0.0), INTERPRET)
    tl.store(VT8 + bh64 * HEAD_DIM * NPAD + offs_d[None, :] * NPAD + offs_t[:, None],
             to_fp8(v * exp2_int(k_chan)[None, :], False, INTERPRET))
    if FOR_BWD:  # V's row copy, from the tile just quantized
        _store_row_copy(v, offs_t, offs_d, in_seq, V8 + bh64 * N * HEAD_DIM, V8_SCALE + bh64 * N, HEAD_DIM, False,
                        INTERPRET)
        # K's head factor for each token of the tile
        tl.store(K8_SCALE + bh64 * N + offs_t, tl.zeros([BLOCK_T], tl.float32) + exp2_int(-k_head), mask=in_seq)
    if pid_t == 0:
        tl.store(K_SCALE + bh, exp2_int(-k_head))
        tl.store(V_SCALE + bh64 * HEAD_DIM + offs_d, exp2_int(-k_chan))


@functools.lru_cache(maxsize=None)
def _placeholder(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A one-element tensor for a pointer argument the launch does not use (one a device and
    dtype, made once)."""
    return torch.empty(1, device=device, dtype=dtype)


@dataclass
class FoldedKV:
    """K and V with folded scales (the warp-specialized forward's operands)."""

    k8: torch.Tensor  #: (B*HKV, N, D) E4M3 codes
    k_scale: torch.Tensor  #: (B*HKV,) dequantization factor of each head
    vt8: torch.Tensor  #: (B*HKV, D, NPAD) E4M3 codes, tokens contiguous
    v_scale: torch.Tensor  #: (B*HKV, D) dequantization factor of each head and channel
    #: ``for_backward``: K's transposed copy and V's row copy, :func:`quantize`'s (``cols`` / ``rows``)
    k_cols: Quantized | None = None
    v_rows: Quantized | None = None
    #: ``for_backward``: K's row copy as the backward reads it, ``k8`` with its head's factor
    #: for every token (``row_scale``, ``(B*HKV, N)``)
    k_rows: Quantized | None = None
    #: whether ``k_cols`` holds ``k8``'s codes transposed with the head's factor (``kt_head``)
    #: rather than one factor per channel and 128-token block
    kt_head: bool = False


def quantize_kv_folded(k: torch.Tensor, v: torch.Tensor, *, for_backward: bool = False,
                       kt_head: bool = False) -> FoldedKV:
    """Quantize ``k, v: (B, HKV, N, D)`` (BF16, the same strides) to E4M3 with folded scales, in
    two launches: the amaxes of both, then the codes of both; ``for_backward``: the second
    launch also writes K's transposed copy and V's row copy (E4M3), the codes and factors of
    ``quantize(k, rows=False)`` and ``quantize(v, cols=False)``, and K's head factor for each
    token (``k_rows``); with ``kt_head`` (a spec whose K for dQ is scaled per head,
    ``KernelSpec.dsq_row``) K's transposed copy is the row codes transposed, the head's factor
    for every channel and block."""
    if k.shape != v.shape or k.stride() != v.stride() or k.ndim != 4:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be (B, HKV, N, D) of one shape and strides")
    bsz, heads, n, d = k.shape
    npad = triton.cdiv(n, QUANT_BLOCK) * QUANT_BLOCK
    dev = k.device
    e4m3 = torch.float8_e4m3fn
    amax = torch.zeros((bsz * heads, 1 + d), device=dev, dtype=torch.int32)
    grid = (npad // QUANT_BLOCK, bsz * heads)
    _kv_amax_kernel[grid](k, v, *k.stride(), amax, heads, n, HEAD_DIM=d, BLOCK_T=QUANT_BLOCK,
                          INTERPRET=interpreting(), num_warps=8)
    out = FoldedKV(k8=torch.empty((bsz * heads, n, d), device=dev, dtype=e4m3),
                   k_scale=torch.empty(bsz * heads, device=dev, dtype=torch.float32),
                   vt8=torch.empty((bsz * heads, d, npad), device=dev, dtype=e4m3),
                   v_scale=torch.empty((bsz * heads, d), device=dev, dtype=torch.float32))
    dummy8, dummy32 = _placeholder(dev, e4m3), _placeholder(dev, torch.float32)
    bwd = (dummy8, dummy32, dummy8, dummy32, dummy32)
    if for_backward:
        out.k_cols = Quantized.empty(bsz * heads, n, d, e4m3, dev, rows=False)
        out.v_rows = Quantized.empty(bsz * heads, n, d, e4m3, dev, cols=False)
        out.k_rows = Quantized(n=n, rows=out.k8, row_scale=torch.empty((bsz * heads, n), device=dev,
                                                                       dtype=torch.float32))
        bwd = (out.k_cols.cols, out.k_cols.col_scale, out.v_rows.rows, out.v_rows.row_scale, out.k_rows.row_scale)
    _kv_quantize_folded_kernel[grid](k, v, *k.stride(), amax, out.k8, out.k_scale, out.vt8, out.v_scale, *bwd, heads,
                                     n, npad, HEAD_DIM=d, BLOCK_T=QUANT_BLOCK, FOR_BWD=bool(for_backward),
                                     KT_HEAD=bool(kt_head), INTERPRET=interpreting(), num_warps=8)
    out.kt_head = bool(for_backward and kt_head)
    return out
