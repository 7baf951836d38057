"""Block scaling (dmref.emulation.blocked) against an independent exact computation.

The reference below works one block at a time in exact rationals (``fractions.Fraction``): the
amax, the scale of every rule written straight from docs/block_scaling.md, and each element
through the readable specification ``encode_scalar(Fraction(x) / s)``. Codes are compared as
integers, scales exactly (float32 values as rationals, E8M0 as codes).
"""

from __future__ import annotations

import math
import zlib
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dmref.emulation import Rounding, decode, encode, encode_scalar, get_format
from dmref.emulation.blocked import (
    Block,
    BlockQuantized,
    ScaleRule,
    block_amax,
    dequantize_blocked,
    quantize_blocked,
    scales_from_amax,
)

E4M3 = get_format("float8_e4m3fn")
E5M2 = get_format("float8_e5m2")
E8M0 = get_format("float8_e8m0fnu")
FP8_FORMATS = ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"]

F32 = np.finfo(np.float32)
F32_MAX = Fraction(float(F32.max))
F32_MIN_NORMAL = Fraction(float(F32.tiny))
F32_UNIT_ROUNDOFF = float(F32.eps) / 2  # 2**-24: relative error of one float32 rounding
E8M0_BIAS = -E8M0.emin  # 127: code of 2**0
E8M0_EXP_MIN, E8M0_EXP_MAX = E8M0.emin, E8M0.emax  # -127, 127
E8M0_NAN = E8M0.nan_code


# ----------------------------------------------------------------------------------------------
# The exact reference
# ----------------------------------------------------------------------------------------------
def floor_log2(a: Fraction) -> int:
    e = a.numerator.bit_length() - a.denominator.bit_length()
    while Fraction(2) ** e > a:
        e -= 1
    while Fraction(2) ** (e + 1) <= a:
        e += 1
    return e


def ceil_log2(a: Fraction) -> int:
    e = floor_log2(a)
    return e if Fraction(2) ** e == a else e + 1


def rn32(a: Fraction) -> Fraction | float:
    """Round a non-negative rational to float32, nearest-even (subnormals; inf on overflow)."""
    if a == 0:
        return Fraction(0)
    e = max(floor_log2(a), F32.minexp)
    quantum = Fraction(2) ** (e - (F32.nmant))
    n, frac = divmod(a / quantum, 1)
    n += frac > Fraction(1, 2) or (frac == Fraction(1, 2) and n % 2 == 1)
    value = n * quantum
    return math.inf if value >= Fraction(2) ** F32.maxexp else value


NAN = None  # the reference's NaN scale


def reference_scale(amax, fmt, rule: ScaleRule, margin: int):
    """(exact scale or NAN, stored form: Fraction for float scales, E8M0 code for MX)."""
    scale = _reference_scale(amax, fmt, rule, margin)
    if rule.is_e8m0:
        return scale, E8M0_NAN if scale is NAN else E8M0_BIAS + floor_log2(scale)
    return scale, scale


def _reference_scale(amax, fmt, rule, margin):
    if rule is ScaleRule.FIXED:  # whatever the data, specials included
        return Fraction(2) ** min(max(margin, E8M0_EXP_MIN), E8M0_EXP_MAX)
    if amax is NAN:
        return NAN
    if amax == 0:
        return Fraction(1)
    fmax = Fraction(fmt.max)
    if rule is ScaleRule.AMAX:
        s = rn32(amax / fmax)
        s = F32_MAX if s == math.inf else s * Fraction(2) ** margin
        return min(max(s, F32_MIN_NORMAL), F32_MAX)
    if rule in (ScaleRule.POW2_DOWN, ScaleRule.POW2_UP):
        m = rn32(fmax / amax)
        m = F32_MAX if m == math.inf else m
        if m == 0:
            e = E8M0_EXP_MAX
        else:
            e = -(floor_log2(m) if rule is ScaleRule.POW2_DOWN else ceil_log2(m)) + margin
        return Fraction(2) ** min(max(e, E8M0_EXP_MIN), E8M0_EXP_MAX)
    if rule is ScaleRule.MX_OCP:
        e = floor_log2(amax) - fmt.emax + margin
        return NAN if e > E8M0_EXP_MAX else Fraction(2) ** max(e, E8M0_EXP_MIN)
    v = rn32(amax / fmax)  # MX_NVIDIA
    if v == 0:
        return Fraction(2) ** E8M0_EXP_MIN
    k = E8M0_EXP_MAX if v == math.inf else ceil_log2(v) + margin
    return Fraction(2) ** min(max(k, E8M0_EXP_MIN), E8M0_EXP_MAX)


def reference_blocks(shape, block: Block):
    """Yield (scale index, element index list) for every block, in plain Python."""
    if block.spans_batch:
        yield (), list(np.ndindex(*shape))
        return
    *batch, rows, cols = shape
    br, bc = block.extent(rows, cols)
    for b in np.ndindex(*batch):
        for i0 in range(0, rows, br):
            for j0 in range(0, cols, bc):
                members = [(*b, i, j) for i in range(i0, min(i0 + br, rows)) for j in range(j0, min(j0 + bc, cols))]
                yield (*b, i0 // br, j0 // bc), members


def reference_quantize(x: np.ndarray, fmt, block: Block, rule: ScaleRule, *, margin=0,
                       rounding="nearest_even", saturate=True, rbits=None):
    """Codes (int array), stored scales (object array) and dequantized values (float64)."""
    fmt = get_format(fmt)
    values = x.astype(np.float64)
    codes = np.zeros(x.shape, dtype=np.int64)
    dequant = np.zeros(x.shape, dtype=np.float64)
    scale_shape = block.scale_shape(x.shape)
    stored = np.empty(scale_shape, dtype=object)
    for scale_index, members in reference_blocks(x.shape, block):
        elems = [float(values[i]) for i in members]
        if any(math.isnan(v) or math.isinf(v) for v in elems):
            amax = NAN
        else:
            amax = max((abs(Fraction(v)) for v in elems), default=Fraction(0))
        scale, stored[scale_index] = reference_scale(amax, fmt, rule, margin)
        for i, v in zip(members, elems):
            negative = math.copysign(1.0, v) < 0
            if scale is NAN:
                codes[i] = fmt.nan_code_for(negative)
                dequant[i] = math.nan
                continue
            kw = {} if rbits is None else {"rbits": int(rbits[i]), "rbits_width": 8}
            # a float zero keeps its sign; a NaN or inf element (FIXED only) is encoded as it is
            quotient = v if v == 0 or not math.isfinite(v) else Fraction(v) / scale
            codes[i] = encode_scalar(quotient, fmt, rounding=rounding, saturate=saturate, **kw)
            element = fmt.value(int(codes[i]))
            dequant[i] = element if not math.isfinite(element) else float(Fraction(element) * scale)
    return codes, stored, dequant


def assert_scales_equal(got, want, rule: ScaleRule):
    got = np.asarray(got)
    assert got.shape == want.shape
    if rule.is_e8m0:
        assert got.dtype == np.uint8
        np.testing.assert_array_equal(got.astype(np.int64), want.astype(np.int64))
        return
    assert got.dtype == np.float32
    for g, w in zip(got.reshape(-1), want.reshape(-1)):
        if w is NAN:
            assert math.isnan(g)
        else:
            assert Fraction(float(g)) == w, (float(g), float(w))


def to_numpy(a):
    """numpy view of a result; torch holds 16-bit codes as int16, numpy as uint16."""
    if isinstance(a, torch.Tensor):
        a = a.cpu().numpy()
    return a.view(np.uint16) if a.dtype == np.int16 else a


def check_against_reference(x, fmt, block, rule, **kw):
    block = Block.get(block)
    rule = ScaleRule.get(rule)
    codes, scales = quantize_blocked(x, fmt, block=block, scale_rule=rule, **kw)
    x_np = x.numpy() if isinstance(x, torch.Tensor) else x
    want_codes, want_scales, want_dequant = reference_quantize(x_np, fmt, block, rule, **kw)
    dequant = to_numpy(dequantize_blocked(codes, scales, fmt, block=block))
    codes, scales = to_numpy(codes), to_numpy(scales)
    np.testing.assert_array_equal(codes.astype(np.int64), want_codes)
    assert_scales_equal(scales, want_scales, rule)
    np.testing.assert_array_equal(dequant, want_dequant)
    return codes, scales, dequant


# ----------------------------------------------------------------------------------------------
# Data: wide exponent ranges, outliers, zero blocks, specials
# ----------------------------------------------------------------------------------------------
def wide_range_data(rng: np.random.Generator, shape, *, lo_exp=-40, hi_exp=40, dtype=np.float32,
                    zero_fraction=0.1, outliers=2):
    mant = rng.uniform(1.0, 2.0, size=shape)
    exps = rng.integers(lo_exp, hi_exp + 1, size=shape)
    x = np.where(rng.random(shape) < 0.5, -1.0, 1.0) * np.ldexp(mant, exps)
    x[rng.random(shape) < zero_fraction] = 0.0
    flat = x.reshape(-1)
    if flat.size:
        idx = rng.integers(0, flat.size, size=outliers)
        flat[idx] *= 2.0 ** rng.integers(20, 60, size=outliers)
    return x.astype(dtype)


RULES = list(ScaleRule)
#: The rules whose scale follows from the data: the special-block rules (zero, NaN, inf) are theirs.
DYNAMIC_RULES = [r for r in ScaleRule if r.is_dynamic]


# ----------------------------------------------------------------------------------------------
# Agreement with the exact reference
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.value)
@pytest.mark.parametrize(
    "block, shape",
    [("1x128", (5, 259)), ("128x128", (129, 131)), ("mx32", (3, 2, 77)), ("mx32_col", (70, 9)),
     ("row", (6, 203)), ("col", (113, 5)), ("tensor", (3, 4, 11)), ((7, 13), (2, 30, 41))],
    ids=str,
)
def test_every_rule_matches_exact_reference_with_tail_tiles(rule, block, shape):
    rng = np.random.default_rng(zlib.crc32(f"{rule.value} {block}".encode()))
    x = wide_range_data(rng, shape, lo_exp=-20, hi_exp=20)
    check_against_reference(x, "float8_e4m3fn", block, rule)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.value)
@pytest.mark.parametrize("fmt", FP8_FORMATS)
def test_every_rule_matches_exact_reference_over_wide_exponent_range(rule, fmt):
    """Blocks spanning 2**-140 .. 2**120 (float32 subnormals, FP8 underflow to zero, outliers)."""
    rng = np.random.default_rng(7)
    x = wide_range_data(rng, (4, 24, 40), lo_exp=-140, hi_exp=60, outliers=4)
    check_against_reference(x, fmt, "4x16", rule)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.value)
def test_bfloat16_elements_match_exact_reference(rule):
    """A 16-bit element format (codes uint16) through the same path; small, since the exact
    reference reads fmt.max, which scans all 2**16 codes."""
    rng = np.random.default_rng(8)
    x = wide_range_data(rng, (2, 3, 20), lo_exp=-140, hi_exp=60)
    codes, _, _ = check_against_reference(x, "bfloat16", "1x8", rule)
    assert codes.dtype == np.uint16


@st.composite
def blocked_cases(draw):
    ndim_batch = draw(st.integers(0, 2))
    batch = tuple(draw(st.integers(0 if ndim_batch else 1, 2)) for _ in range(ndim_batch))
    rows, cols = draw(st.integers(1, 24)), draw(st.integers(1, 40))
    shape = (*batch, rows, cols)
    block = draw(st.one_of(
        st.sampled_from(["tensor", "matrix", "row", "col", "mx32", "mx32_col", "1x128", "128x128"]).map(Block.get),
        st.builds(Block.tile, st.integers(1, 30), st.integers(1, 45)),
        st.builds(Block.mx, st.integers(1, 40), st.sampled_from([-1, -2])),
    ))
    rule = draw(st.sampled_from(RULES))
    fmt = draw(st.sampled_from(FP8_FORMATS))
    dtype = draw(st.sampled_from([np.float32, np.float64, np.float16, ml_dtypes.bfloat16]))
    seed = draw(st.integers(0, 2**32 - 1))
    lo = draw(st.integers(-150, 10))
    hi = draw(st.integers(lo, lo + 80))
    rng = np.random.default_rng(seed)
    x = wide_range_data(rng, shape, lo_exp=lo, hi_exp=hi, dtype=np.float64,
                        zero_fraction=draw(st.sampled_from([0.0, 0.2, 1.0])))
    # a few hand-picked values at drawn positions: extremes, signed zeros, specials
    picks = draw(st.lists(st.floats(allow_nan=True, allow_infinity=True, width=64), max_size=3))
    flat = x.reshape(-1)
    for v in picks:
        if flat.size:
            flat[draw(st.integers(0, flat.size - 1))] = v
    with np.errstate(over="ignore"):
        x = x.astype(dtype)
    margin = draw(st.sampled_from([0, 0, 1, -2]))
    rounding = draw(st.sampled_from(list(Rounding)))
    saturate = draw(st.booleans()) if not rule.is_e8m0 else True
    rbits = rng.integers(0, 256, size=shape, dtype=np.uint8) if rounding is Rounding.STOCHASTIC else None
    backend = draw(st.sampled_from(["numpy", "torch"]))
    return x, fmt, block, rule, dict(margin=margin, rounding=rounding, saturate=saturate, rbits=rbits), backend


@given(blocked_cases())
def test_quantize_blocked_matches_exact_reference_on_random_shapes_and_blocks(case):
    x, fmt, block, rule, kw, backend = case
    if backend == "torch" and x.dtype != ml_dtypes.bfloat16:
        xin = torch.from_numpy(x)
        kw_in = dict(kw, rbits=None if kw["rbits"] is None else torch.from_numpy(kw["rbits"]))
    else:
        xin, kw_in = x, kw
    codes, scales = quantize_blocked(xin, fmt, block=block, scale_rule=rule, **kw_in)
    want_codes, want_scales, want_dequant = reference_quantize(x.astype(np.float64), fmt, block, rule, **kw)
    np.testing.assert_array_equal(to_numpy(dequantize_blocked(codes, scales, fmt, block=block)), want_dequant)
    codes, scales = to_numpy(codes), to_numpy(scales)
    np.testing.assert_array_equal(codes.astype(np.int64), want_codes)
    assert_scales_equal(scales, want_scales, rule)
    # the K-major copy holds the same quantized values, transposed
    if x.ndim >= 2:
        codes_t, scales_t = quantize_blocked(xin, fmt, block=block, scale_rule=rule, transposed=True, **kw_in)
        np.testing.assert_array_equal(to_numpy(codes_t), np.swapaxes(codes, -1, -2))
        np.testing.assert_array_equal(
            to_numpy(dequantize_blocked(codes_t, scales_t, fmt, block=block.t())), np.swapaxes(want_dequant, -1, -2)
        )


# ----------------------------------------------------------------------------------------------
# Special blocks
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rule", DYNAMIC_RULES, ids=lambda r: r.value)
def test_zero_block_gets_scale_one_and_signed_zero_codes(rule):
    x = np.array([[0.0, -0.0, 0.0, 0.0, 3.0, -5.0, 0.25, 7.0]], dtype=np.float32)
    codes, scales = quantize_blocked(x, E4M3, block="1x4", scale_rule=rule, margin=3)
    one = E8M0_BIAS if rule.is_e8m0 else np.float32(1.0)
    assert scales[0, 0] == one
    np.testing.assert_array_equal(codes[0, :4], [0, E4M3.sign_bit, 0, 0])
    assert scales[0, 1] != one  # the margin applies to the non-zero block


@pytest.mark.parametrize("rule", DYNAMIC_RULES, ids=lambda r: r.value)
@pytest.mark.parametrize("special", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("fmt", FP8_FORMATS)
def test_nan_or_inf_in_block_makes_scale_and_block_nan(rule, special, fmt):
    fmt = get_format(fmt)
    x = np.array([[1.0, -2.0, special, 4.0, 1.0, -2.0, 3.0, 4.0]], dtype=np.float32)
    codes, scales = quantize_blocked(x, fmt, block="mx4", scale_rule=rule)
    if rule.is_e8m0:
        assert scales[0, 0] == E8M0_NAN  # OCP MX 5.4.1: 0xFF is the E8M0 NaN
        assert scales[0, 1] != E8M0_NAN
    else:
        assert np.isnan(scales[0, 0]) and np.isfinite(scales[0, 1])
    negative = np.signbit(x[0, :4])
    np.testing.assert_array_equal(codes[0, :4], [fmt.nan_code_for(bool(n)) for n in negative])
    dq = dequantize_blocked(codes, scales, fmt, block="mx4")
    assert np.isnan(dq[0, :4]).all() and np.isfinite(dq[0, 4:]).all()


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.value)
def test_no_finite_input_gives_infinite_or_nan_scale(rule):
    """Extremes of float32 and float64 amaxes, including ones whose ideal scale is far outside
    the float32 / E8M0 range, all give finite scales (clamped) or the documented NaN."""
    amax = np.array([float(F32.smallest_subnormal), float(F32.tiny), 1.0, float(F32.max),
                     5e-324, 1e-300, 1e300, float(np.finfo(np.float64).max)])
    scales = scales_from_amax(amax, E4M3, rule)
    if rule.is_e8m0:
        # only MX_OCP may overflow, to the NaN of clause 6.3 / microxcaling, for huge float64 amax
        overflow = (scales == E8M0_NAN)
        if rule is ScaleRule.MX_OCP:
            np.testing.assert_array_equal(overflow, amax >= 2.0 ** (E8M0_EXP_MAX + 1 + E4M3.emax))
        else:
            assert not overflow.any()
    else:
        assert np.isfinite(scales).all() and (scales > 0).all()


# ----------------------------------------------------------------------------------------------
# The rules, clause by clause
# ----------------------------------------------------------------------------------------------
def _log2_trap_amax():
    """511.99997: float32 log2 rounds it up to exactly 9.0 (docs/block_scaling.md)."""
    a = np.nextafter(np.float32(512.0), np.float32(0.0))
    assert np.log2(a) == np.float32(9.0)
    return a


def test_mx_ocp_shared_exponent_is_floor_log2_amax_minus_emax_elem():
    """OCP MX v1.0 6.3, Algorithm 1 line 1: shared_exp = floor(log2(max|V_i|)) - emax_elem, the
    exponent read from the bits (the float log2 trap gives 9 for 511.99997; floor is 8)."""
    trap = _log2_trap_amax()
    amax = np.array([448.0, 256.0, trap, 512.0, 1.0, 2.0 ** -20], dtype=np.float32)
    want = np.array([8, 8, 8, 9, 0, -20]) - E4M3.emax + E8M0_BIAS
    np.testing.assert_array_equal(scales_from_amax(amax, E4M3, "mx_ocp").astype(np.int64), want)
    want_e5m2 = np.array([8, 8, 8, 9, 0, -20]) - E5M2.emax + E8M0_BIAS
    np.testing.assert_array_equal(scales_from_amax(amax, E5M2, "mx_ocp").astype(np.int64), want_e5m2)


def test_mx_ocp_elements_above_max_clamp_to_max():
    """OCP MX 6.3 Algorithm 1 line 4: V_i / X is quantized with normal numbers clamped to the
    element format's max (sign kept): amax 511.99997 gives X = 2**(8 - 8) = 1 and saturates."""
    trap = _log2_trap_amax()
    x = np.array([[trap, -trap, 465.0, 463.9, 1.0]], dtype=np.float32)
    codes, scales = quantize_blocked(x, E4M3, block="mx32", scale_rule="mx_ocp")
    assert int(scales[0, 0]) == E8M0_BIAS
    max_code = E4M3.max_code
    np.testing.assert_array_equal(codes[0, :3], [max_code, max_code | E4M3.sign_bit, max_code])
    assert decode(codes, E4M3)[0, 3] == E4M3.max  # rounds (not clamps) to max


def test_mx_ocp_scale_exponent_range():
    """E8M0 holds 2**-127 .. 2**127 (OCP MX 5.4.1). A shared exponent below -127 is raised to
    -127 (the elements then underflow as they may); above 127 the scale is NaN (as microxcaling's
    reference does; reachable only from float64 input)."""
    amax = np.array([2.0 ** -149, 2.0 ** (E8M0_EXP_MAX + E4M3.emax), 2.0 ** (E8M0_EXP_MAX + E4M3.emax + 1)])
    got = scales_from_amax(amax, E4M3, "mx_ocp").astype(np.int64)
    np.testing.assert_array_equal(got, [0, E8M0_BIAS + E8M0_EXP_MAX, E8M0_NAN])


def test_mx_nvidia_rounds_amax_over_max_up_to_a_power_of_two():
    """amax / M exactly 2**k gives code 127 + k; one float32 ulp more gives 127 + k + 1."""
    k = np.arange(-20, 21)
    amax = (np.float32(E4M3.max) * np.exp2(k)).astype(np.float32)
    above = np.nextafter(amax, np.float32(np.inf))
    np.testing.assert_array_equal(scales_from_amax(amax, E4M3, "mx_nvidia").astype(np.int64), E8M0_BIAS + k)
    np.testing.assert_array_equal(scales_from_amax(above, E4M3, "mx_nvidia").astype(np.int64), E8M0_BIAS + k + 1)


def te_float_to_e8m0(v: np.ndarray) -> np.ndarray:
    """Transformer Engine's software float_to_e8m0 (the non-Blackwell path of utils.cuh), on the
    float32 bits: round the exponent up when any mantissa bit is set, saturating at 0xFE."""
    u = v.view(np.uint32)
    exponent = (u >> 23).astype(np.int64)
    mantissa = u & 0x7FFFFF
    up = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
    return exponent + up


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
def test_mx_nvidia_matches_transformer_engine_float_to_e8m0(fmt):
    fmt = get_format(fmt)
    rng = np.random.default_rng(11)
    amax = np.ldexp(rng.uniform(1, 2, 20000), rng.integers(-140, 127, 20000)).astype(np.float32)
    amax = amax[(amax > 0) & np.isfinite(amax)]
    want = te_float_to_e8m0((amax / np.float32(fmt.max)).astype(np.float32))
    np.testing.assert_array_equal(scales_from_amax(amax, fmt, "mx_nvidia").astype(np.int64), want)


def te_pow2_scale_inv(amax: torch.Tensor, fmax: float) -> torch.Tensor:
    """Transformer Engine's reference (tests/pytorch/references/quantize_scale_calc.py): scale =
    max / amax in float32, inf -> float32 max, rounded down to a power of two via frexp; the
    decode scale is its reciprocal."""
    scale = torch.div(fmax, amax)
    scale = torch.where(scale == torch.inf, torch.finfo(torch.float32).max, scale)
    _, exp = torch.frexp(scale)
    scale = torch.ldexp(torch.ones_like(scale), exp - 1)
    return 1.0 / scale


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
def test_pow2_down_is_transformer_engine_scale_inv(fmt):
    fmt = get_format(fmt)
    rng = np.random.default_rng(12)
    amax = np.ldexp(rng.uniform(1, 2, 20000), rng.integers(-126, 127, 20000)).astype(np.float32)
    boundary = (np.float32(fmt.max) * np.exp2(np.arange(-30, 30))).astype(np.float32)
    amax = np.concatenate([amax, boundary, np.nextafter(boundary, 0), np.nextafter(boundary, np.inf)])
    want = te_pow2_scale_inv(torch.from_numpy(amax), fmt.max).numpy()
    np.testing.assert_array_equal(scales_from_amax(amax, fmt, "pow2_down"), want)


@pytest.mark.parametrize("fmt", FP8_FORMATS)
def test_pow2_down_never_overflows_and_pow2_up_fills_the_top_binade(fmt):
    """pow2_down: the decode scale is amax/M rounded up, so amax/s <= M(1 + u32) (u32 from the
    one float32 rounding of M/amax) and > M/2 (1 - u32); pow2_up: rounded down, M(1 - u32) <=
    amax/s < 2M(1 + u32)."""
    fmt = get_format(fmt)
    rng = np.random.default_rng(13)
    amax = np.ldexp(rng.uniform(1, 2, 5000), rng.integers(-100, 100, 5000)).astype(np.float32)
    m, u = fmt.max, F32_UNIT_ROUNDOFF
    ratio_down = amax.astype(np.float64) / scales_from_amax(amax, fmt, "pow2_down").astype(np.float64)
    ratio_up = amax.astype(np.float64) / scales_from_amax(amax, fmt, "pow2_up").astype(np.float64)
    assert (ratio_down <= m * (1 + u)).all() and (ratio_down > m / 2 * (1 - u)).all()
    assert (ratio_up >= m * (1 - u)).all() and (ratio_up < 2 * m * (1 + u)).all()


def test_amax_rule_is_float32_division():
    rng = np.random.default_rng(14)
    amax = np.ldexp(rng.uniform(1, 2, 5000), rng.integers(-100, 127, 5000)).astype(np.float32)
    np.testing.assert_array_equal(scales_from_amax(amax, E4M3, "amax"), amax / np.float32(E4M3.max))


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.value)
@pytest.mark.parametrize("margin", [-3, 2])
def test_margin_multiplies_scale_by_power_of_two(rule, margin):
    rng = np.random.default_rng(15)
    amax = np.ldexp(rng.uniform(1, 2, 1000), rng.integers(-40, 40, 1000)).astype(np.float32)
    base = scales_from_amax(amax, E4M3, rule)
    shifted = scales_from_amax(amax, E4M3, rule, margin=margin)
    if rule.is_e8m0:
        np.testing.assert_array_equal(shifted.astype(np.int64), base.astype(np.int64) + margin)
    else:
        np.testing.assert_array_equal(shifted, base * np.float32(2.0 ** margin))


# ----------------------------------------------------------------------------------------------
# float64 input: one rounding of x / s
# ----------------------------------------------------------------------------------------------
def test_float64_input_is_rounded_once():
    """The double-rounding examples of docs/casts.md, in a block whose pow2_down scale is 1: the
    float64 values land on the right side of the midpoint (float32 first would not)."""
    x = np.array([[E4M3.max, 0.0029296874999999996, -431.99999999999994, 1.0]])
    codes, scales = quantize_blocked(x, E4M3, block="row", scale_rule="pow2_down")
    assert scales[0, 0] == 1.0
    want = [encode_scalar(Fraction(v), E4M3, saturate=True) for v in x[0]]
    np.testing.assert_array_equal(codes[0], want)
    assert decode(codes, E4M3)[0, 1] == 0.001953125 and decode(codes, E4M3)[0, 2] == -416.0


def test_float64_input_with_amax_scale_matches_exact_quotient():
    """A non-power-of-two scale s0 (the row's amax is 448 s0) and, for every rounding midpoint
    m of e4m3, the float64 values nearest to m * s0 and two ulps either side: their float64
    quotients by s0 often land exactly on m although the exact quotient does not, so a plain
    float64 division would round some of them the wrong way."""
    s0 = Fraction(float(np.float32(3 / 7)))
    values = [Fraction(E4M3.value(c)) for c in range(E4M3.max_code + 1)]
    midpoints = [(a + b) / 2 for a, b in zip(values, values[1:])]
    near = np.array([float(m * s0) for m in midpoints])
    x = np.concatenate([near, np.nextafter(near, 0), np.nextafter(near, np.inf),
                        np.nextafter(np.nextafter(near, 0), 0), np.nextafter(np.nextafter(near, np.inf), np.inf)])
    x = np.concatenate([[float(Fraction(E4M3.max) * s0)], x])[None, :]
    assert (x[0, 1:] / float(s0) == np.tile([float(m) for m in midpoints], 5)).any()
    codes, scales, _ = check_against_reference(x, E4M3, "row", "amax")
    assert Fraction(float(scales[0, 0])) == s0


@pytest.mark.parametrize("rounding", ["toward_positive", "nearest_even", "stochastic"])
def test_float64_quotients_below_float64_range_keep_their_sign(rounding):
    """x / s for x = 5e-324 and s = 2**127 underflows float64; rounding toward +inf must still
    give the smallest subnormal (the exact quotient is positive), nearest-even zero."""
    x = np.array([[5e-324, -5e-324, 1e-310, 1e60]])  # max / 1e60 underflows float32: s = 2**127
    rbits = np.full(x.shape, 255, dtype=np.uint8) if rounding == "stochastic" else None
    codes, scales, _ = check_against_reference(x, E4M3, "row", "pow2_down", rounding=rounding, rbits=rbits)
    assert float(scales[0, 0]) == 2.0 ** E8M0_EXP_MAX


# ----------------------------------------------------------------------------------------------
# Layout, kinds and the K-major copy
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block", ["1x128", "128x128", "mx32", "mx32_col", "row", "col", "tensor"])
def test_transposed_copy_is_contiguous_and_dequantizes_to_the_transpose(block):
    rng = np.random.default_rng(17)
    x = torch.from_numpy(wide_range_data(rng, (2, 130, 67)))
    q = BlockQuantized.quantize(x, E4M3, block=block, scale_rule="mx_nvidia")
    qt = q.t()
    codes_t, scales_t = quantize_blocked(x, E4M3, block=block, scale_rule="mx_nvidia", transposed=True)
    assert torch.equal(codes_t, qt.codes) and torch.equal(scales_t, qt.scales)
    assert qt.codes.is_contiguous() and qt.codes.shape == (2, 67, 130)
    assert qt.scales.shape == qt.block.scale_shape(qt.codes.shape)
    assert torch.equal(qt.dequantize(), q.dequantize().transpose(-1, -2))


def test_numpy_and_torch_inputs_give_the_same_codes_and_scales():
    rng = np.random.default_rng(18)
    x = wide_range_data(rng, (3, 40, 50))
    for rule in RULES:
        c_np, s_np = quantize_blocked(x, E5M2, block="8x16", scale_rule=rule)
        c_t, s_t = quantize_blocked(torch.from_numpy(x), E5M2, block="8x16", scale_rule=rule)
        assert isinstance(c_np, np.ndarray) and isinstance(c_t, torch.Tensor)
        np.testing.assert_array_equal(c_np, c_t.numpy())
        np.testing.assert_array_equal(s_np, s_t.numpy())


def test_non_contiguous_tensor_input_equals_its_contiguous_copy():
    rng = np.random.default_rng(19)
    x = torch.from_numpy(wide_range_data(rng, (60, 45))).transpose(0, 1)[:, ::2]
    assert not x.is_contiguous()
    a = quantize_blocked(x, E4M3, block="1x16", scale_rule="pow2_down")
    b = quantize_blocked(x.contiguous(), E4M3, block="1x16", scale_rule="pow2_down")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_block_amax_is_the_largest_magnitude_of_each_block():
    x = np.array([[1.0, -7.0, 2.0], [3.0, 0.5, -9.0]], dtype=np.float32)
    np.testing.assert_array_equal(block_amax(x, "1x2"), [[7.0, 2.0], [3.0, 9.0]])
    np.testing.assert_array_equal(block_amax(x, "col"), [[3.0, 7.0, 9.0]])
    assert block_amax(x, "tensor") == 9.0


def test_block_shorthands_parse_to_the_documented_blocks():
    assert Block.get("tensor") == Block.tensor()
    assert Block.get("row") == Block.rows() == Block(1, None)
    assert Block.get("col") == Block.cols() == Block(None, 1)
    assert Block.get("1x128") == Block.tile(1, 128)
    assert Block.get("128x128") == Block.tile(128, 128)
    assert Block.get("mx32") == Block.mx(32, axis=-1) == Block.tile(1, 32)
    assert Block.get("mx32_col") == Block.mx(32, axis=-2) == Block.tile(32, 1)
    assert Block.tile(1, 128).t() == Block.tile(128, 1)
    assert Block.tensor().scale_shape((3, 4, 5)) == ()
    assert ScaleRule.get("pow2_down") is ScaleRule.POW2_DOWN
    assert Block.tile(128, 128).scale_shape((2, 129, 5)) == (2, 2, 1)


# ----------------------------------------------------------------------------------------------
# Bad input and empty arrays
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["0x128", "1x0", "128x", "ax3", "mx0", "mx32_diag", "", (0, 4), (4, -1)])
def test_bad_block_shapes_raise_naming_the_value(bad):
    with pytest.raises(ValueError, match="block"):
        Block.get(bad)


def test_bad_block_constructor_arguments_raise():
    with pytest.raises(ValueError, match="rows=0"):
        Block.tile(0, 4)
    with pytest.raises(ValueError, match="axis=0"):
        Block.mx(32, axis=0)
    with pytest.raises(ValueError, match="True"):
        Block.tile(True, 4)


@pytest.mark.parametrize("x", [np.arange(8, dtype=np.int32).reshape(2, 4), np.ones((2, 4), np.complex64),
                               torch.ones(2, 4, dtype=torch.int64), np.ones((2, 4), dtype=bool)], ids=str)
def test_integer_and_complex_input_raise_type_error(x):
    with pytest.raises(TypeError, match="float"):
        quantize_blocked(x, E4M3, block="row", scale_rule="amax")


def test_other_bad_arguments_raise_clear_errors():
    x = np.ones((2, 4), np.float32)
    with pytest.raises(ValueError, match="at least 2 dims"):
        quantize_blocked(np.ones(5, np.float32), E4M3, block="row", scale_rule="amax")
    with pytest.raises(ValueError, match="scale_rule"):
        quantize_blocked(x, E4M3, block="row", scale_rule="max")
    with pytest.raises(TypeError, match="margin"):
        quantize_blocked(x, E4M3, block="row", scale_rule="amax", margin=1.5)
    with pytest.raises(ValueError, match="scale format"):
        quantize_blocked(x, "e8m0", block="row", scale_rule="amax")
    with pytest.raises(ValueError, match="unknown format"):
        quantize_blocked(x, "e3m4", block="row", scale_rule="amax")
    codes, scales = quantize_blocked(x, E4M3, block="1x2", scale_rule="amax")
    with pytest.raises(ValueError, match=r"expected \(2, 2\)"):
        dequantize_blocked(codes, scales[:, :1], E4M3, block="1x2")
    with pytest.raises(TypeError, match="E8M0"):
        dequantize_blocked(codes, scales.astype(np.int32), E4M3, block="1x2")


@pytest.mark.parametrize("shape, block, scale_shape",
                         [((0, 5), "1x4", (0, 2)), ((3, 0), "row", (3, 0)), ((0, 2, 3), "mx32", (0, 2, 1)),
                          ((0,), "tensor", ())])
def test_empty_arrays_give_empty_codes_and_documented_scales(shape, block, scale_shape):
    for rule in RULES:
        codes, scales = quantize_blocked(np.zeros(shape, np.float32), E4M3, block=block, scale_rule=rule)
        assert codes.shape == shape and codes.dtype == np.uint8
        assert scales.shape == scale_shape
        if scale_shape == ():  # Block.tensor(): an empty block has amax 0, so scale 1
            assert scales == (E8M0_BIAS if rule.is_e8m0 else 1.0)
        assert dequantize_blocked(codes, scales, E4M3, block=block).shape == shape


# ----------------------------------------------------------------------------------------------
# Slow and GPU
# ----------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("fmt", FP8_FORMATS)
def test_mx_nvidia_division_equals_transformer_engine_reciprocal_product(fmt):
    """TE computes float_to_e8m0(amax * RN32(1/M)); the rule here is RN32(amax / M). For every
    float32 amax of the binade [1, 2) their E8M0 codes agree, and so for every binade whose
    quotient is normal (doubling amax doubles both, exactly); likewise for every amax whose
    quotient lies in [2**-128, 2**-125), across the subnormal boundary where the codes change."""
    fmax = np.float32(get_format(fmt).max)
    rcp = np.float32(1.0) / fmax

    def every_float32(lo, hi):
        return np.arange(np.float32(lo).view(np.uint32), np.float32(hi).view(np.uint32),
                         dtype=np.uint32).view(np.float32)

    binade = every_float32(1.0, 2.0)
    np.testing.assert_array_equal(scales_from_amax(binade, fmt, "mx_nvidia").astype(np.int64),
                                  te_float_to_e8m0(binade / fmax))
    for amax in (binade, every_float32(fmax * np.float32(2.0**-128), fmax * np.float32(2.0**-125))):
        np.testing.assert_array_equal(te_float_to_e8m0(amax / fmax), te_float_to_e8m0(amax * rcp))


@pytest.mark.gpu
@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.value)
def test_cuda_results_equal_cpu_results(rule):
    rng = np.random.default_rng(20)
    x = torch.from_numpy(wide_range_data(rng, (2, 130, 260), lo_exp=-140, hi_exp=60))
    for block in ["1x128", "128x128", "mx32", "tensor"]:
        c_cpu, s_cpu = quantize_blocked(x, E4M3, block=block, scale_rule=rule)
        c_gpu, s_gpu = quantize_blocked(x.cuda(), E4M3, block=block, scale_rule=rule)
        assert c_gpu.is_cuda and torch.equal(c_gpu.cpu(), c_cpu)
        assert torch.equal(s_gpu.cpu(), s_cpu)
