"""encode / decode / quantize: the vectorised routes equal the scalar specification.

Fast, exhaustive where the domain is small (all codes; all 65,536 float16 and bfloat16 inputs),
boundary-complete (midpoints and +-1 ulp around every rounding boundary), and hypothesis-sampled
over float32 and float64.
"""

import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dmref.emulation import FORMATS, Rounding, decode, encode, encode_scalar, get_format, quantize
from dmref.emulation import cast, sweep

EIGHT_BIT = [n for n, f in FORMATS.items() if f.bits == 8]
MODES = [r for r in Rounding if r is not Rounding.STOCHASTIC]


def _spec(x, fmt, rounding, saturate, rbits=None, width=16):
    return np.array(
        [encode_scalar(float(v), fmt, rounding=rounding, saturate=saturate,
                       rbits=None if rbits is None else int(rbits[i]), rbits_width=width)
         for i, v in enumerate(np.asarray(x).ravel())],
        dtype=np.int64,
    )


def _arith(x, fmt, rounding, saturate, rbits=None, width=16):
    """The integer-arithmetic route, called directly (whatever encode dispatches to)."""
    t = torch.from_numpy(np.ascontiguousarray(x))
    wide, src = cast._widen(t)
    rb = None if rbits is None else torch.from_numpy(rbits.astype(np.int64))
    return cast._encode_arith(cast._bits(wide, src), src, get_format(fmt), Rounding(rounding),
                              saturate, rb, width).numpy()


def boundary_inputs(fmt_name, dtype):
    """Every representable value, every midpoint between neighbours (and the overflow
    threshold), and the float +-1 ulp around each, in both signs."""
    fmt = get_format(fmt_name)
    values = sorted({abs(fmt.value(c)) for c in range(fmt.n_codes) if math.isfinite(fmt.value(c))})
    mids = [(a + b) / 2 for a, b in zip(values, values[1:])]
    mids.append(values[-1] + (values[-1] - values[-2]) / 2)
    mids.append(values[-1] + (values[-1] - values[-2]))  # first value past the top binade
    with np.errstate(over="ignore"):  # points past float32's range become inf, also a case
        pts = np.array(values + mids, dtype=np.float64).astype(dtype)
    pts = np.concatenate([pts, np.nextafter(pts, dtype(-np.inf)), np.nextafter(pts, dtype(np.inf))])
    specials = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0], dtype=dtype)
    return np.concatenate([pts, -pts, specials])


# ---- codes -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(FORMATS))
def test_decode_of_every_code_equals_scalar_spec(name):
    fmt = get_format(name)
    codes = np.arange(fmt.n_codes, dtype=np.uint8 if fmt.bits == 8 else np.uint16)
    ours = decode(codes, fmt)
    spec = np.array([fmt.value(int(c)) for c in codes], dtype=np.float32)
    assert ours.dtype == np.float32
    assert np.array_equal(ours.view(np.uint32), spec.view(np.uint32))


@pytest.mark.parametrize("name", EIGHT_BIT)
@pytest.mark.parametrize("saturate", [False, True])
@pytest.mark.parametrize("rounding", MODES)
def test_round_trip_of_every_code_is_the_identity(name, saturate, rounding):
    fmt = get_format(name)
    codes = np.arange(256, dtype=np.uint8)
    back = encode(decode(codes, fmt), fmt, rounding=rounding, saturate=saturate)
    nan = np.isin(codes, list(fmt.nan_codes))
    inf = np.isinf(decode(codes, fmt))
    finite = ~nan & ~inf
    assert np.array_equal(back[finite], codes[finite])
    # infinities stay infinite, or become +-max when saturating
    want_inf = np.where(codes[inf] & fmt.sign_bit, fmt.max_code | fmt.sign_bit, fmt.max_code)
    assert np.array_equal(back[inf], want_inf if saturate else codes[inf])
    # NaN codes come back as the documented NaN code of their sign
    want = [fmt.nan_code_for(bool(c & fmt.sign_bit)) for c in codes[nan]]
    assert back[nan].tolist() == want


# ---- all 16-bit inputs -----------------------------------------------------------------------


@pytest.mark.parametrize("src", [np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2"])
def test_all_16bit_inputs_match_the_scalar_spec_under_nearest_even(src, name):
    x = np.arange(1 << 16, dtype=np.uint16).view(src)
    ours = encode(x, name, saturate=True)
    assert np.array_equal(ours.astype(np.int64), _spec(x, name, "nearest_even", True))


@pytest.mark.parametrize("src", [np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("name", EIGHT_BIT)
def test_all_16bit_inputs_match_ml_dtypes_and_torch_up_to_documented_differences(src, name):
    """16-bit inputs are exact in float32, so the libraries round once here too."""
    x = np.arange(1 << 16, dtype=np.uint16).view(src).astype(np.float32)
    ml = sweep._library_cast(x, name, "ml_dtypes")
    th = sweep._library_cast(x, name, "torch")
    for saturate, theirs, lib in ((False, ml, "ml_dtypes"), (True, th, "torch"), (False, th, "torch")):
        allowed = [c[3] for c in sweep.COMPARISONS if c[:3] == (name, saturate, lib)]
        if not allowed:
            continue
        ours = encode(x, name, saturate=saturate)
        differ = ours != theirs
        assert not (differ & ~sweep._documented(allowed[0], x, ours, theirs, name)).any()


@pytest.mark.parametrize("src", [np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("name", EIGHT_BIT)
@pytest.mark.parametrize("rounding", MODES)
def test_all_16bit_inputs_table_route_equals_arithmetic_in_every_mode(src, name, rounding):
    x = np.arange(1 << 16, dtype=np.uint16).view(src)
    for saturate in (False, True):
        ours = encode(x, name, rounding=rounding, saturate=saturate)
        assert np.array_equal(ours.astype(np.int64), _arith(x.astype(np.float32), name, rounding, saturate))


# ---- boundaries ------------------------------------------------------------------------------


BOUNDARY_CASES = [(n, r) for n in EIGHT_BIT for r in Rounding] + [
    (n, Rounding.NEAREST_EVEN) for n, f in FORMATS.items() if f.bits == 16
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("name", "rounding"), BOUNDARY_CASES)
@pytest.mark.parametrize("saturate", [False, True])
def test_midpoints_and_neighbours_match_scalar_spec(dtype, name, rounding, saturate):
    """All boundaries for 8-bit formats; for the 16-bit formats (2**16 codes, where the scalar
    spec is slow) every 61st boundary point, a fixed sample spread over all binades."""
    fmt = get_format(name)
    x = boundary_inputs(name, dtype)
    if fmt.bits == 16:
        x = x[::61]
    rbits = None
    if rounding is Rounding.STOCHASTIC:
        rbits = np.random.default_rng(7).integers(0, 1 << 16, x.shape).astype(np.uint16)
    ours = encode(x, fmt, rounding=rounding, saturate=saturate, rbits=rbits)
    assert np.array_equal(ours.astype(np.int64), _spec(x, fmt, rounding, saturate, rbits))
    torch_ours = encode(torch.from_numpy(x), fmt, rounding=rounding, saturate=saturate,
                        rbits=None if rbits is None else torch.from_numpy(rbits.astype(np.uint8)))
    if rbits is None:  # torch input goes the same way as numpy input
        assert np.array_equal(torch_ours.numpy().view(ours.dtype), ours)


# ---- hypothesis ------------------------------------------------------------------------------

_FLOATS = {
    np.float32: st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True),
    np.float64: st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True),
}


@pytest.mark.parametrize(("dtype", "width"), [(np.float32, 16), (np.float64, 8)])
@given(data=st.data(), name=st.sampled_from(list(FORMATS)), rounding=st.sampled_from(list(Rounding)),
       saturate=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_float_inputs_are_rounded_once_like_the_scalar_spec(dtype, width, data, name, rounding, saturate, seed):
    """float32 and float64 (rounded from their own bits, never through float32); stochastic
    rounding with 16 and 8 random bits."""
    x = np.array(data.draw(st.lists(_FLOATS[dtype], min_size=1, max_size=64)), dtype=dtype)
    rbits = None
    if rounding is Rounding.STOCHASTIC:
        rbits = np.random.default_rng(seed).integers(0, 1 << width, x.shape)
        rbits = rbits.astype(np.uint16 if width == 16 else np.uint8)
    ours = encode(x, name, rounding=rounding, saturate=saturate, rbits=rbits)
    assert np.array_equal(ours.astype(np.int64), _spec(x, name, rounding, saturate, rbits, width))


@given(x=st.fractions(min_value=-1000, max_value=1000, max_denominator=1 << 20))
def test_scalar_spec_rounds_rationals_to_a_neighbour(x):
    """The spec itself: nearest-even picks a representable neighbour no farther than half a
    quantum (the quantum of the result's binade) from the exact rational."""
    fmt = get_format("float8_e4m3fn")
    v = fmt.value(encode_scalar(x, fmt, saturate=True))
    if abs(x) <= fmt.max:
        e = max(math.floor(math.log2(abs(x))) if x else fmt.emin, fmt.emin)
        quantum = Fraction(2) ** (e - fmt.mantissa_bits)
        assert abs(Fraction(v) - x) <= quantum / 2


# ---- stochastic rounding ---------------------------------------------------------------------


def test_stochastic_rounding_is_unbiased_by_a_z_test():
    """Values at fractions k/16 of a quantum; 2**16 rbits draws each (fixed seed). The mean of
    the rounded values differs from x by at most the 2**-16-quantum truncation bias plus
    five standard errors (binomial variance f(1-f) quantum**2 / n): a z-test at 5 sigma."""
    fmt = get_format("float8_e4m3fn")
    n = 1 << 16
    rng = np.random.default_rng(2026)
    quantum = 2.0 ** (0 - fmt.mantissa_bits)  # values in [1, 2)
    for k in range(17):
        f = k / 16
        x = np.full(n, 1.0 + f * quantum, dtype=np.float32)
        rbits = rng.integers(0, 1 << 16, n).astype(np.uint16)
        mean = quantize(x, fmt, rounding="stochastic", rbits=rbits).astype(np.float64).mean()
        se = math.sqrt(f * (1 - f) / n) * quantum
        assert abs(mean - float(x[0])) <= 5 * se + quantum * 2.0**-16


def test_stochastic_rounding_is_reproducible_and_device_independent_on_cpu_routes():
    x = (np.random.default_rng(3).standard_normal(4096) * 37).astype(np.float32)
    rbits = np.random.default_rng(4).integers(0, 1 << 16, x.shape).astype(np.uint16)
    a = encode(x, "e4m3", rounding="stochastic", rbits=rbits)
    b = _arith(x, "e4m3", "stochastic", False, rbits)
    assert np.array_equal(a.astype(np.int64), b)


# ---- kinds, shapes and bad input -------------------------------------------------------------


def test_numpy_in_numpy_out_and_torch_in_torch_out_with_shape():
    x = np.linspace(-3, 3, 24, dtype=np.float32).reshape(2, 3, 4)
    c = encode(x, "e4m3")
    assert isinstance(c, np.ndarray) and c.dtype == np.uint8 and c.shape == x.shape
    t = encode(torch.from_numpy(x), "e4m3")
    assert isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.shape == x.shape
    assert np.array_equal(t.numpy(), c)
    q = quantize(torch.from_numpy(x), "e4m3")
    assert q.dtype == torch.float32


def test_non_contiguous_tensor_is_read_through_a_copy():
    x = torch.linspace(-500, 500, 64).reshape(8, 8)
    assert np.array_equal(encode(x.t(), "e4m3").numpy(), encode(x.t().contiguous(), "e4m3").numpy())


def test_empty_input_gives_empty_codes_of_the_same_shape():
    for x in (np.zeros((0, 5), np.float32), torch.zeros(3, 0)):
        c = encode(x, "e5m2")
        assert tuple(c.shape) == tuple(x.shape)


def test_sixteen_bit_formats_round_like_numpy_and_torch():
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(10000) * np.exp(rng.uniform(-40, 40, 10000))).astype(np.float32)
    with np.errstate(over="ignore"):
        assert np.array_equal(encode(x, "float16"), x.astype(np.float16).view(np.uint16))
    assert np.array_equal(encode(x, "bfloat16"), x.astype(ml_dtypes.bfloat16).view(np.uint16))


@pytest.mark.parametrize("bad", [np.arange(4), np.arange(4, dtype=np.int8), np.ones(3, np.complex64),
                                 torch.arange(4), torch.ones(2, dtype=torch.complex64), [1.0, 2.0]])
def test_integer_complex_and_non_array_inputs_are_type_errors(bad):
    with pytest.raises(TypeError, match="must be"):
        encode(bad, "e4m3")


def test_bad_rounding_and_rbits_are_clear_errors():
    x = np.ones(4, np.float32)
    with pytest.raises(ValueError, match="unknown rounding"):
        encode(x, "e4m3", rounding="nearest")
    with pytest.raises(ValueError, match="rbits must be given exactly"):
        encode(x, "e4m3", rounding="stochastic")
    with pytest.raises(ValueError, match="rbits must be given exactly"):
        encode(x, "e4m3", rbits=np.zeros(4, np.uint16))
    with pytest.raises(TypeError, match="rbits must be uint8"):
        encode(x, "e4m3", rounding="stochastic", rbits=np.zeros(4, np.int32))


def test_decode_rejects_codes_of_the_wrong_width():
    with pytest.raises(TypeError, match="must be"):
        decode(np.zeros(3, np.int32), "e4m3")


@pytest.mark.parametrize("rounding", list(Rounding))
@pytest.mark.parametrize("name", EIGHT_BIT)
def test_nan_payloads_below_the_top_16_bits_stay_nan(rounding, name):
    """A NaN whose top 16 bits read like inf (payload in the low bits only) is still NaN."""
    bits = np.array([0x7F800001, 0xFF800001, 0x7F80FFFF, 0x7FC00000, 0x7F800000, 0xFF800000], np.uint32)
    x = bits.view(np.float32)
    rbits = np.full(x.shape, 0xFFFF, np.uint16) if rounding is Rounding.STOCHASTIC else None
    ours = encode(x, name, rounding=rounding, rbits=rbits)
    assert np.array_equal(ours.astype(np.int64), _spec(x, name, rounding, False, rbits))


def _torch_2_11_cast(x, fmt_name):
    """torch 2.11's float32 -> e4m3fn cast on the H200: nearest-even,
    but |x| past the overflow threshold (> 464, and 464 + anything) to NaN, not to 448."""
    codes = x.to(get_format(fmt_name).torch_dtype).view(torch.uint8)
    if fmt_name == "float8_e4m3fn":
        over = (x.abs() > 464) & ~torch.isnan(x)
        codes = torch.where(over, (codes & 0x80) | 0x7F, codes)
    return codes


def test_native_cast_is_used_only_where_this_torch_computes_the_specification(monkeypatch):
    """A torch whose e4m3fn cast maps overflow to NaN (2.11) must not serve saturate=True:
    the probe falls back to the table/arithmetic route, and serves saturate=False instead."""
    monkeypatch.setattr(cast, "_native_cast", _torch_2_11_cast)
    cast._torch_native_is_spec.cache_clear()
    try:
        assert not cast._torch_native_is_spec("float8_e4m3fn", True, "cpu")
        assert cast._torch_native_is_spec("float8_e4m3fn", False, "cpu")
        x = torch.tensor([448.0, 464.0, 464.00003, 480.0, 1e4, math.inf, -1e4])
        sat = encode(x, "e4m3", saturate=True)
        assert sat.tolist() == [0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE]
        assert encode(x, "e4m3", saturate=False).tolist() == [0x7E, 0x7E, 0x7F, 0x7F, 0x7F, 0x7F, 0xFF]
    finally:
        cast._torch_native_is_spec.cache_clear()


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("saturate", [False, True])
def test_native_route_when_taken_equals_the_arithmetic_route_on_the_probe_inputs(name, saturate):
    fmt = get_format(name)
    x = cast._probe_inputs(fmt)
    arith = cast._encode_arith(cast._bits(x, cast._FLOAT32), cast._FLOAT32, fmt, Rounding.NEAREST_EVEN, saturate)
    assert torch.equal(encode(x, fmt, saturate=saturate), arith.to(torch.uint8))
