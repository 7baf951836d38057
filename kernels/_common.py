"""Triton helpers shared by the kernels: FP8 casts and power-of-two block scales.

Importing this module imports triton; only the kernel modules do that.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._runtime import patch_interpreter_scalar_index

patch_interpreter_scalar_index()

# Format constants, per FP8 format: (smallest normal, max,
# 2**(emin - mantissa_bits + 23), exponent of max). Both formats' max is 1.75 * 2**EMAX.
E4M3_MIN_NORMAL = tl.constexpr(0.015625)  # 2**-6
E4M3_MAX = tl.constexpr(448.0)
E4M3_SUB_MAGIC = tl.constexpr(16384.0)  # 2**14: x + C rounds x to a multiple of 2**-9
E4M3_EMAX = tl.constexpr(8)
E5M2_MIN_NORMAL = tl.constexpr(6.103515625e-05)  # 2**-14
E5M2_MAX = tl.constexpr(57344.0)
E5M2_SUB_MAGIC = tl.constexpr(128.0)  # 2**7: x + C rounds x to a multiple of 2**-16
E5M2_EMAX = tl.constexpr(15)


@triton.jit
def _round_to_grid(x, DROP: tl.constexpr, MIN_NORMAL: tl.constexpr, FMAX: tl.constexpr,
                   SUB_MAGIC: tl.constexpr):
    """Round float32 ``x`` to the FP8 grid: nearest-even, saturating to +-FMAX (finite x only).
    ``DROP`` = 23 - mantissa bits of the format.

    Used under the interpreter only, whose own FP8 cast rounds half up and drops the carry into the
    exponent; the hardware cast (``cvt.rn.satfinite``) computes the same values.
    """
    LOW: tl.constexpr = (1 << DROP) - 1
    HALF_MINUS_ONE: tl.constexpr = (1 << (DROP - 1)) - 1
    bits = x.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    # normal range: add half an ulp minus one plus the lowest kept bit (ties to even), truncate
    mag = mag + HALF_MINUS_ONE + ((mag >> DROP) & 1)
    mag = mag - (mag & LOW)
    normal = mag.to(tl.float32, bitcast=True)
    a = tl.abs(x)
    # subnormal range: a float32 add of 2**(emin - mant + 23) rounds to the subnormal spacing
    sub = (a + SUB_MAGIC) - SUB_MAGIC
    y = tl.where(a < MIN_NORMAL, sub, normal)
    y = tl.minimum(y, FMAX)
    # put the sign back with a bit operation: a negation would turn -0.0 into +0.0 there
    return (y.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def to_fp8(x, IS_E5M2: tl.constexpr, INTERPRET: tl.constexpr):
    """float32 -> FP8 (E4M3 or E5M2), round to nearest even, saturating."""
    if IS_E5M2:
        if INTERPRET:
            x = _round_to_grid(x, 21, E5M2_MIN_NORMAL, E5M2_MAX, E5M2_SUB_MAGIC)
        y = x.to(tl.float8e5)
    else:
        if INTERPRET:
            x = _round_to_grid(x, 20, E4M3_MIN_NORMAL, E4M3_MAX, E4M3_SUB_MAGIC)
        y = x.to(tl.float8e4nv)
    return y


@triton.jit
def mul_rn(a, b, INTERPRET: tl.constexpr):
    """float32 ``a * b`` rounded on its own: neither LLVM nor ptxas may fuse it into a following
    add. The recipe rounds S2 = S * scale before m or LSE is subtracted; fused, exp2 would see
    the unrounded product, and where |S2| > 2**24 a float32 ulp of S2 exceeds 1, so P at a row's
    maximum would be exp2(rounding error) instead of 1 (tests/kernels, large logits)."""
    if INTERPRET:
        return a * b  # numpy rounds every operation
    return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32,
                                     is_pure=True, pack=1)


@triton.jit
def pow2_floor_exponent(amax, IS_E5M2: tl.constexpr):
    """k = floor(log2(fmax / amax)) exactly, from the bits of amax >= 0; 0 where amax == 0.

    With amax = m * 2**e (1 <= m < 2) and fmax = 1.75 * 2**EMAX: k = EMAX - e, less one when
    m > 1.75. Clamped to [-126, 126] so that 2**k and 2**-k are normal float32 numbers.
    """
    bits = amax.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    over = ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    if IS_E5M2:
        k = E5M2_EMAX - e - over
    else:
        k = E4M3_EMAX - e - over
    k = tl.where(amax > 0, k, 0)
    return tl.minimum(tl.maximum(k, -126), 126)


@triton.jit
def exp2_int(k):
    """2**k as float32 for integer k in [-126, 127], built from the exponent bits."""
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def quantize_tile(x, IS_E5M2: tl.constexpr, INTERPRET: tl.constexpr):
    """One pow2_floor scale for the whole 2-D tile: returns (codes, dequantization factor,
    the scaled float32 tile the cast received)."""
    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    k = pow2_floor_exponent(amax, IS_E5M2)
    scaled = x * exp2_int(k)
    return to_fp8(scaled, IS_E5M2, INTERPRET), exp2_int(-k), scaled


@triton.jit
def quantize_rows(x, IS_E5M2: tl.constexpr, INTERPRET: tl.constexpr):
    """One pow2_floor scale per row of the 2-D tile: returns (codes, dequantization factors,
    the scaled float32 tile the cast received)."""
    k = pow2_floor_exponent(tl.max(tl.abs(x), axis=1), IS_E5M2)
    scaled = x * exp2_int(k)[:, None]
    return to_fp8(scaled, IS_E5M2, INTERPRET), exp2_int(-k), scaled


@triton.jit
def to_bf16(x, INTERPRET: tl.constexpr):
    """float32 -> bfloat16, round to nearest even (the interpreter's own cast truncates)."""
    if INTERPRET:
        bits = x.to(tl.int32, bitcast=True)
        # bfloat16 keeps float32's exponent field, so one integer RNE on the low 16 bits suffices
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        x = (bits - (bits & 0xFFFF)).to(tl.float32, bitcast=True)
    return x.to(tl.bfloat16)


@triton.jit
def dump_fp8(ptrs, x, x8, mask, DEBUG: tl.constexpr):
    """Debug store of a tile quantized to FP8: ``x`` is the float32 value the cast received
    (scale included), ``x8`` the FP8 tile it gave (which also feeds a register-operand wgmma).

    ``DEBUG == 1``: ``x``; the host casts it with the model's RNE satfinite cast
    (``fwd.fp8_codes``). The hardware cast is ``cvt.rn.satfinite`` (checked against the model on
    its own in tests/kernels), and the test that recomputes O from the dumped codes checks that
    the matmul consumed exactly these. ``DEBUG == 2``: the codes ``x8`` as bytes (bitcast): the
    first version's store, which on the H200 does not show the codes the matmul consumed;
    kept for the test that documents it. (Storing ``x8.to(float32)`` instead is no way around:
    the compiler moves the layout conversion of the store before the widening, onto the 8-bit
    tile, and the values came back with NaNs on the H200, 2026-11-29.)
    """
    if DEBUG == 2:
        tl.store(ptrs, x8.to(tl.uint8, bitcast=True), mask=mask)
    else:
        tl.store(ptrs, x, mask=mask)
