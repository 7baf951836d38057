"""Triton helpers shared by the kernels: FP8 casts and power-of-two block scales.

Importing this module imports triton; only the kernel modules do that.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dmref.emulation import get_format

_E4M3 = get_format("float8_e4m3fn")
_E5M2 = get_format("float8_e5m2")
_FLOAT32_MANTISSA_BITS = 23


def _max_fraction_field(fmt) -> int:
    """The float32 mantissa field of the format's largest finite value (``max / 2**emax - 1``
    in units of 2**-23)."""
    return int((fmt.max / 2.0**fmt.emax - 1.0) * 2**_FLOAT32_MANTISSA_BITS)


# pow2_down_exponent compares every amax's mantissa field against one value: both formats'
# max is 1.75 * 2**EMAX (field 0x600000)
if _max_fraction_field(_E4M3) != _max_fraction_field(_E5M2):  # pragma: no cover - format tables
    raise RuntimeError(f"E4M3 max {_E4M3.max} and E5M2 max {_E5M2.max} differ in their mantissa")

# Format constants of the two FP8 formats, from dmref.emulation's tables (the model's formats),
# passed to the jitted helpers as constexprs: smallest normal, largest finite value, exponent of
# the largest finite value, float32 mantissa bits the cast drops (23 - mantissa bits), and the
# subnormal rounding constant 2**(emin - mantissa bits + 23): x + C - C rounds |x| < smallest
# normal to a multiple of the subnormal spacing 2**(emin - mantissa bits).
E4M3_MIN_NORMAL = tl.constexpr(_E4M3.min_normal)  # 2**-6
E4M3_MAX = tl.constexpr(_E4M3.max)  # 448
E4M3_EMAX = tl.constexpr(_E4M3.emax)  # 8
E4M3_DROP = tl.constexpr(_FLOAT32_MANTISSA_BITS - _E4M3.mantissa_bits)  # 20
E4M3_SUB_MAGIC = tl.constexpr(2.0 ** (_E4M3.emin - _E4M3.mantissa_bits + _FLOAT32_MANTISSA_BITS))  # 2**14
E5M2_MIN_NORMAL = tl.constexpr(_E5M2.min_normal)  # 2**-14
E5M2_MAX = tl.constexpr(_E5M2.max)  # 57344
E5M2_EMAX = tl.constexpr(_E5M2.emax)  # 15
E5M2_DROP = tl.constexpr(_FLOAT32_MANTISSA_BITS - _E5M2.mantissa_bits)  # 21
E5M2_SUB_MAGIC = tl.constexpr(2.0 ** (_E5M2.emin - _E5M2.mantissa_bits + _FLOAT32_MANTISSA_BITS))  # 2**7
#: float32 mantissa field of 1.75, the significand of both formats' max
MAX_FRACTION_FIELD = tl.constexpr(_max_fraction_field(_E4M3))


@triton.jit
def _round_to_grid(x, DROP: tl.constexpr, MIN_NORMAL: tl.constexpr, FMAX: tl.constexpr,
                   SUB_MAGIC: tl.constexpr):
    """Round float32 ``x`` to the FP8 grid: nearest-even, saturating to +-FMAX (finite x only).
    ``DROP`` = 23 - mantissa bits of the format.

    Used under the interpreter only, whose own FP8 cast rounds half up and drops the carry into the
    exponent; the hardware cast (``cvt.rn.satfinite``) computes the same values.
    """
    LOW: tl.constexpr = 2**DROP - 1
    HALF_MINUS_ONE: tl.constexpr = 2**(DROP - 1) - 1
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
            x = _round_to_grid(x, E5M2_DROP, E5M2_MIN_NORMAL, E5M2_MAX, E5M2_SUB_MAGIC)
        y = x.to(tl.float8e5)
    else:
        if INTERPRET:
            x = _round_to_grid(x, E4M3_DROP, E4M3_MIN_NORMAL, E4M3_MAX, E4M3_SUB_MAGIC)
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
def pow2_down_exponent(amax, IS_E5M2: tl.constexpr):
    """k = floor(log2(fmax / amax)) exactly, from the bits of amax >= 0; 0 where amax == 0.

    With amax = m * 2**e (1 <= m < 2) and fmax = 1.75 * 2**EMAX: k = EMAX - e, less one when
    m > 1.75. Clamped to [-126, 126] so that 2**k and 2**-k are normal float32 numbers.
    """
    bits = amax.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    over = ((bits & 0x7FFFFF) > MAX_FRACTION_FIELD).to(tl.int32)
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
def quantize_rows(x, IS_E5M2: tl.constexpr, INTERPRET: tl.constexpr):
    """One POW2_DOWN scale per row of the 2-D tile: returns (codes, dequantization factors,
    the scaled float32 tile the cast received)."""
    k = pow2_down_exponent(tl.max(tl.abs(x), axis=1), IS_E5M2)
    scaled = x * exp2_int(k)[:, None]
    return to_fp8(scaled, IS_E5M2, INTERPRET), exp2_int(-k), scaled


@triton.jit
def from_bf16(x, INTERPRET: tl.constexpr):
    """bfloat16 -> float32, exact. Triton 3.6's interpreter decodes bfloat16 subnormals wrongly
    (its generic float conversion clamps their exponent), so there the bits are widened instead."""
    if INTERPRET:
        bits = x.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        return (bits << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def to_bf16(x, INTERPRET: tl.constexpr):
    """float32 -> bfloat16, round to nearest even (the interpreter's own cast truncates)."""
    if INTERPRET:
        bits = x.to(tl.int32, bitcast=True)
        # bfloat16 keeps float32's exponent field, so one integer RNE on the low 16 bits suffices
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        x = (bits - (bits & 0xFFFF)).to(tl.float32, bitcast=True)
    return x.to(tl.bfloat16)
