"""The fast blocked quantizer (dmref.emulation.blocked_fast) against the specification it
replaces, dmref.emulation.blocked.quantize_blocked, on the same inputs.

Domain: every ScaleRule, every Block kind (tensor, matrix, row, col, tiles, MX, with tails),
every element format (the four FP8 formats, bfloat16, float16), the four deterministic rounding
modes, both saturation settings, margins that reach the scale clamps; float16, bfloat16, float32
and float64 inputs whose exponents span their dtype's whole range (subnormals included), zero
blocks, -0, NaN and +-inf. Codes are compared as integers, stored scales as bits (float32 viewed
as int32, E8M0 codes as uint8); dequantized values bit for bit with NaN at the same places.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dmref.emulation import FORMATS, Block, Rounding, ScaleRule, decode, get_format
from dmref.emulation.blocked import block_amax, dequantize_blocked, quantize_blocked
from dmref.emulation.blocked_fast import _decode, fake_quantize_blocked, quantize_blocked_fast

ELEMENT_FORMATS = ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "bfloat16", "float16"]
ROUNDINGS = [Rounding.NEAREST_EVEN, Rounding.TOWARD_ZERO, Rounding.TOWARD_POSITIVE, Rounding.TOWARD_NEGATIVE]
BLOCKS = ["tensor", "matrix", "row", "col", "1x32", "16x16", "mx32", "mx32_col", (3, 5), "1x128"]
#: margins: none, FA3's P offset (2^-8), and ones that push every scale past the E8M0 clamps
MARGINS = [0, 0, -8, 3, -200, 200]
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def _min_exponent(dtype: torch.dtype) -> int:
    """Exponent of the dtype's smallest subnormal."""
    info = torch.finfo(dtype)
    mantissa_bits = -int(math.log2(info.eps))
    return (math.frexp(info.smallest_normal)[1] - 1) - mantissa_bits


@st.composite
def inputs(draw):
    """x (*batch, rows, cols): rows of random significands at exponents spread over the dtype's
    whole range, with zero blocks, -0, NaN and +-inf where drawn."""
    dtype = draw(st.sampled_from(DTYPES))
    batch = draw(st.sampled_from([(), (2,), (1, 2)]))
    rows, cols = draw(st.integers(1, 40)), draw(st.integers(1, 150))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    lo, hi = _min_exponent(dtype), math.frexp(torch.finfo(dtype).max)[1]
    row_exp = torch.randint(lo, hi + 1, (*batch, rows, 1), generator=g)
    elem_exp = row_exp + torch.randint(-6, 7, (*batch, rows, cols), generator=g)
    x = torch.ldexp(torch.randn(*batch, rows, cols, generator=g, dtype=torch.float64),
                    elem_exp.clamp(-1074, 1023).to(torch.float64))
    flat = x.view(-1, rows, cols)
    for special in draw(st.sets(st.sampled_from(["zero_rows", "zero_cols", "neg_zero", "nan", "inf", "-inf"]))):
        i, j = draw(st.integers(0, rows - 1)), draw(st.integers(0, cols - 1))
        if special == "zero_rows":
            flat[:, : rows // 2 + 1] = 0
        elif special == "zero_cols":
            flat[:, :, : cols // 2 + 1] = 0
        elif special == "neg_zero":
            flat[0, i, j] = -0.0
        else:
            flat[-1, i, j] = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}[special]
    return x.to(dtype)  # out-of-range values become +-inf or zero: more specials


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Integer bits of codes (uint8 / int16) or of float32 scales."""
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical float32 values, NaN (any payload) where the other has NaN."""
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


@settings(max_examples=100)
@given(x=inputs(), fmt=st.sampled_from(ELEMENT_FORMATS), rule=st.sampled_from(list(ScaleRule)),
       block=st.sampled_from(BLOCKS), margin=st.sampled_from(MARGINS), rounding=st.sampled_from(ROUNDINGS),
       saturate=st.booleans())
def test_fast_quantizer_gives_the_specification_codes_and_scales(x, fmt, rule, block, margin, rounding, saturate):
    kw = dict(block=block, scale_rule=rule, margin=margin, rounding=rounding, saturate=saturate)
    want_codes, want_scales = quantize_blocked(x, fmt, **kw)
    codes, scales = quantize_blocked_fast(x, fmt, **kw)
    assert codes.dtype == want_codes.dtype and scales.dtype == want_scales.dtype
    assert torch.equal(_bits(codes), _bits(want_codes))
    assert torch.equal(_bits(scales), _bits(want_scales))
    # the block amaxes given from outside (a sweep's) are the block's own: the same codes
    given = quantize_blocked_fast(x, fmt, amax=block_amax(x, block), **kw)
    assert torch.equal(_bits(given[0]), _bits(want_codes)) and torch.equal(_bits(given[1]), _bits(want_scales))
    values = fake_quantize_blocked(x, fmt, **kw)
    assert values.dtype == torch.float32
    assert _same_values(values, dequantize_blocked(want_codes, want_scales, fmt, block=block).to(torch.float32))


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2", "float16", "bfloat16"])
@pytest.mark.parametrize("saturate", [True, False])
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_quotient_past_the_input_dtype_range_gives_the_specification_codes(fmt, saturate, rounding, dtype):
    """The plain quotients' edges: x / s overflowing to +-inf (FIXED scale 2^-127 of the largest
    inputs) and underflowing below the dtype's normal range (scale 2^127 of the smallest, its
    subnormals included), in every rounding mode (nearest-even takes the float32 route)."""
    info = torch.finfo(dtype)
    big = torch.tensor([[info.max, -info.max, info.max / 3, 1.0, -0.0]], dtype=dtype)
    tiny = torch.tensor([[info.smallest_normal, -info.smallest_normal, info.smallest_normal * info.eps,
                          -info.smallest_normal * info.eps, 0.0, 1.0]], dtype=dtype)
    for x, margin in ((big, -127), (tiny, 127), (tiny, 120)):
        for rule in (ScaleRule.FIXED, ScaleRule.POW2_DOWN):
            kw = dict(block="tensor", scale_rule=rule, margin=margin, rounding=rounding, saturate=saturate)
            want = quantize_blocked(x, fmt, **kw)
            got = quantize_blocked_fast(x, fmt, **kw)
            assert torch.equal(got[0], want[0]) and torch.equal(_bits(got[1]), _bits(want[1]))


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e8m0fnu", "bfloat16"])
def test_table_decode_equals_decode_on_every_code(fmt):
    f = get_format(fmt)
    codes = torch.arange(f.n_codes, dtype=torch.int32).to(torch.uint8 if f.bits <= 8 else torch.int16)
    assert _same_values(_decode(codes, f), decode(codes, f))
    if f.bits == 8:  # every pair of codes through the two-codes-per-gather path, odd sizes too
        pairs = torch.stack(torch.meshgrid(codes, codes, indexing="ij"), -1).reshape(-1)
        assert _same_values(_decode(pairs, f), decode(pairs, f))
        assert _same_values(_decode(pairs[1:], f, 0.25), decode(pairs[1:], f) * 0.25)


@pytest.mark.parametrize("fmt", [f for f in FORMATS if get_format(f).is_fp8])
def test_torch_widening_that_cuda_decoding_uses_equals_decode(fmt):
    f = get_format(fmt)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    assert _same_values(codes.view(f.torch_dtype).to(torch.float32), decode(codes, f))


def test_fast_quantizer_refuses_what_it_does_not_do():
    x = torch.ones(4, 4)
    with pytest.raises(NotImplementedError, match="stochastic"):
        quantize_blocked_fast(x, "e4m3", block="row", scale_rule="pow2_down", rounding="stochastic")
    with pytest.raises(TypeError, match="float64 torch tensor"):
        quantize_blocked_fast(np.ones((4, 4)), "e4m3", block="row", scale_rule="pow2_down")
    for dtype in (torch.int32, torch.float8_e4m3fn):
        with pytest.raises(TypeError, match="float64 torch tensor"):
            quantize_blocked_fast(torch.ones(4, 4).to(dtype), "e4m3", block="row", scale_rule="pow2_down")
    with pytest.raises(ValueError, match="shape of the scales"):
        quantize_blocked_fast(x, "e4m3", block="row", scale_rule="pow2_down", amax=torch.ones(4))
    with pytest.raises(ValueError, match="scale format"):
        quantize_blocked_fast(x, "e8m0", block="row", scale_rule="pow2_down")
    with pytest.raises(ValueError, match="at least 2 dims"):
        quantize_blocked_fast(torch.ones(4), "e4m3", block=Block.rows(), scale_rule="pow2_down")
