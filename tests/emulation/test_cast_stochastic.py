"""Stochastic rounding near the smallest values, and the checks on ``rbits``.

The table route of :func:`dmref.emulation.encode` indexes by the top 16 bits of the input; the
inputs whose top 16 bits are all zero are the tiny ones (float32 below 2**-133, float64
subnormals below 2**-1026), and they share an index with +-0. E8M0 has no zero, so there the two
differ: zero is NaN, a tiny positive value rounds to the smallest value 2**-127 whatever the
random bits. These tests pin that, every route against :func:`encode_scalar`; the exhaustive
sweep over every float32 below 2**-126 and every 8-bit rbits is in test_exhaustive.py (slow).
"""

import numpy as np
import pytest
import torch

from dmref.emulation import FORMATS, Rounding, encode, encode_scalar, get_format
from dmref.emulation import cast

EIGHT_BIT = [n for n, f in FORMATS.items() if f.bits == 8]

#: float32 bit patterns (positive) at the edges of the classes the specification distinguishes
#: below 2**-126 for E8M0 with 8 random bits (mantissa >> 14: n and the top 8 fraction bits),
#: at 2**-127 (the smallest E8M0 value) and at 2**-126 (the smallest float32 normal).
TINY_BITS = [0x0, 0x1, 0x2, 0x188, 0x3FFF, 0x4000, 0x4001, 0xFFFF, 0x10000, 0x10001, 0x3FBFFF,
             0x3FC000, 0x3FFFFF, 0x400000, 0x400001, 0x403FFF, 0x404000, 0x5FFFFF, 0x600000,
             0x7FBFFF, 0x7FC000, 0x7FFFFF, 0x800000, 0x800001, 0x80FFFF, 0x810000, 0xFFFFFF,
             0x1000000]


def _float32(bits, negative=False):
    b = np.array(bits, np.uint32) | np.uint32(0x80000000 if negative else 0)
    return b.view(np.float32)


def _spec(x, fmt, rbits, width, saturate=False):
    return np.array([encode_scalar(float(v), fmt, rounding="stochastic", saturate=saturate,
                                   rbits=int(r), rbits_width=width)
                     for v, r in zip(x.ravel(), np.broadcast_to(rbits, x.shape).ravel())], np.int64)


def _arith(x, fmt, rbits, width):
    t = torch.from_numpy(np.ascontiguousarray(x))
    wide, src = cast._widen(t)
    rb = torch.from_numpy(np.broadcast_to(rbits, x.shape).astype(np.int64))
    return cast._encode_arith(cast._bits(wide, src), src, get_format(fmt), Rounding.STOCHASTIC,
                              False, rb, width).numpy()


def _all_routes(x, fmt, rbits, width):
    """{route: codes as int64} for the numpy (table) route, torch CPU and the arithmetic."""
    dtype = np.uint8 if width == 8 else np.uint16
    rb = np.broadcast_to(rbits, x.shape).astype(dtype)
    return {
        "numpy": encode(x, fmt, rounding="stochastic", rbits=rb).astype(np.int64),
        "torch": encode(torch.from_numpy(x), fmt, rounding="stochastic",
                        rbits=torch.from_numpy(rb)).numpy().view(np.uint8).astype(np.int64),
        "arith": _arith(x, fmt, rb, width),
    }


@pytest.mark.parametrize("negative", [False, True])
def test_e8m0_below_2_pow_minus_126_with_every_8_bit_rbits_equals_the_scalar_spec(negative):
    x = np.repeat(_float32(TINY_BITS, negative), 256)
    rbits = np.tile(np.arange(256), len(TINY_BITS))
    want = _spec(x, "float8_e8m0fnu", rbits, 8)
    for route, got in _all_routes(x, "float8_e8m0fnu", rbits, 8).items():
        assert np.array_equal(got, want), route
    if not negative:
        # below 2**-127 every rbits gives the smallest value 2**-127 (code 0), as nearest-even
        tiny = x < np.float32(2.0**-127)
        assert set(want[tiny & (x > 0)].tolist()) == {0} and set(want[x == 0].tolist()) == {0xFF}


def test_e8m0_the_reported_input_is_2_pow_minus_127_not_nan():
    x = np.float32(5.5e-43)
    assert int(encode(x, "float8_e8m0fnu", rounding="stochastic", rbits=np.uint8(0))) == 0
    assert int(encode(x, "float8_e8m0fnu", rounding="nearest_even")) == 0
    assert encode_scalar(float(x), "float8_e8m0fnu", rounding="stochastic", rbits=0, rbits_width=8) == 0


@pytest.mark.parametrize("name", EIGHT_BIT)
def test_tiny_float32_with_16_random_bits_round_like_the_scalar_spec(name):
    """The case test_cast.py's hypothesis test found as [float32-16]: float32 inputs whose top
    16 bits are zero, 16 random bits, every 8-bit format, both signs."""
    x = np.concatenate([_float32(TINY_BITS), _float32(TINY_BITS, negative=True)])
    x = np.repeat(x, 6)
    rbits = np.tile(np.array([0, 1, 0x7FFF, 0x8000, 0xFFFE, 0xFFFF]), x.size // 6)
    want = _spec(x, name, rbits, 16)
    for route, got in _all_routes(x, name, rbits, 16).items():
        assert np.array_equal(got, want), route


@pytest.mark.parametrize("name", EIGHT_BIT)
def test_tiny_float64_with_8_random_bits_round_like_the_scalar_spec(name):
    """The case found as [float64-8]: float64 subnormals (top 16 bits zero) and the values at
    2**-127 and 2**-126, 8 random bits, every 8-bit format, both signs."""
    bits = np.array([0x0, 0x1, 0x2, 0xFFFF, 0x1_0000_0000, 0x0000_FFFF_FFFF_FFFF,
                     0x0001_0000_0000_0000, 0x000F_FFFF_FFFF_FFFF], np.uint64)
    x = np.concatenate([bits.view(np.float64),
                        np.array([2.0**-1022, 2.0**-128, 2.0**-127, 2.0**-127 * (1 + 2.0**-52),
                                  2.0**-126 * (1 - 2.0**-53), 2.0**-126, 5.5e-43])])
    x = np.repeat(np.concatenate([x, -x]), 5)
    rbits = np.tile(np.array([0, 1, 0x7F, 0x80, 0xFF]), x.size // 5)
    want = _spec(x, name, rbits, 8)
    for route, got in _all_routes(x, name, rbits, 8).items():
        assert np.array_equal(got, want), route


@pytest.mark.parametrize("name", EIGHT_BIT)
def test_every_float32_with_top_16_bits_zero_agrees_across_routes(name):
    """All 2 x 2**16 float32 patterns of top16 = +-0 (zeros included), random rbits of both
    widths: the table route equals the arithmetic one."""
    low = np.arange(1 << 16, dtype=np.uint32)
    x = np.concatenate([low, low | 0x80000000]).view(np.float32)
    rng = np.random.default_rng(11)
    for width, dtype in ((8, np.uint8), (16, np.uint16)):
        rbits = rng.integers(0, 1 << width, x.shape).astype(dtype)
        got = encode(x, name, rounding="stochastic", rbits=rbits).astype(np.int64)
        assert np.array_equal(got, _arith(x, name, rbits, width))


# ---- rbits: kinds, widths and shapes ---------------------------------------------------------


@pytest.mark.parametrize(("rbits", "error", "match"), [
    (-1, ValueError, r"rbits=-1 must be 16 random bits, 0 <= rbits < 2\*\*16"),
    (1 << 16, ValueError, r"rbits=65536 must be"),
    (True, TypeError, "got bool"),
    (0.5, TypeError, "got float"),
    ([1, 2], TypeError, "got list"),
    (np.int32(3), TypeError, "must be uint8 .* or uint16 .*, got int32"),
    (np.zeros(3, np.int64), TypeError, "got int64"),
    (np.zeros(3, np.uint32), TypeError, "got uint32"),
    (torch.zeros(3, dtype=torch.int16), TypeError, "got torch.int16"),
    (np.zeros((4, 3), np.uint8), ValueError, r"rbits of shape \(4, 3\) does not broadcast to the shape of x, \(2, 3\)"),
    (torch.zeros(2, dtype=torch.uint8), ValueError, r"shape \(2,\) does not broadcast"),
])
def test_bad_rbits_are_clear_errors_naming_the_value(rbits, error, match):
    x = np.full((2, 3), 1.3, np.float32)
    with pytest.raises(error, match=match):
        encode(x, "e4m3", rounding="stochastic", rbits=rbits)
    with pytest.raises(error, match=match):
        encode(torch.from_numpy(x), "e4m3", rounding="stochastic", rbits=rbits)


def test_rbits_widths_and_kinds_that_are_accepted():
    """A Python int is 16 random bits; numpy scalars, arrays and tensors keep their width."""
    x = np.full((2, 3), 1.0 + 2.0**-4, np.float32)  # half a quantum of e4m3 above 1
    want = {0x7FFF: 0x38, 0x8000: 0x39}
    for r, code in want.items():
        assert encode(x, "e4m3", rounding="stochastic", rbits=r).tolist() == [[code] * 3] * 2
        assert encode(x, "e4m3", rounding="stochastic", rbits=np.uint16(r)).tolist() == [[code] * 3] * 2
    assert encode(x, "e4m3", rounding="stochastic", rbits=np.uint8(0x7F)).tolist() == [[0x38] * 3] * 2
    assert encode(x, "e4m3", rounding="stochastic", rbits=np.uint8(0x80)).tolist() == [[0x39] * 3] * 2
    row = torch.tensor([0x7F, 0x80, 0xFF], dtype=torch.uint8)
    assert encode(torch.from_numpy(x), "e4m3", rounding="stochastic", rbits=row).tolist() == [[0x38, 0x39, 0x39]] * 2


def test_a_scalar_input_gives_a_scalar_code():
    for rounding, rbits in (("nearest_even", None), ("stochastic", np.uint8(1))):
        for x in (np.float32(1.0), np.float64(1.0), np.array(1.0, np.float16)):
            codes = encode(x, "e4m3", rounding=rounding, rbits=rbits)
            assert codes.shape == () and int(codes) == 0x38
