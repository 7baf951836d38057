"""Every one of the 2**32 float32 bit patterns: encode equals ml_dtypes astype and torch .to(),
code for code, except in the documented disagreements (dmref/emulation/sweep.py, docs/casts.md).

Slow (about 5 minutes on 2 cores); the same sweep prints its counts and time with
``python benchmarks/exhaustive_casts.py``.

Stochastic rounding below 2**-126: every float32 there (2**23 - 1 per sign) with every 8-bit
rbits value, against the scalar specification, for every 8-bit format (slow; E8M0 alone, the
format whose zero and tiny values have different codes, is the first test).
"""

import numpy as np
import pytest

from dmref.emulation import encode, encode_scalar, sweep


@pytest.mark.slow
@pytest.mark.parametrize("fmt", sorted({c[0] for c in sweep.COMPARISONS}))
def test_encode_matches_ml_dtypes_and_torch_on_all_float32_bit_patterns(fmt):
    comparisons = [c for c in sweep.COMPARISONS if c[0] == fmt]
    for r in sweep.sweep_float32(comparisons):
        assert r.inputs == 1 << 32
        assert r.undocumented == 0, (r.fmt, r.saturate, r.library, r.examples)
        if r.allowed == "nan_code":
            # at most the float32 NaN patterns: 2 signs x (2**23 - 1) mantissas
            assert 0 < r.mismatches <= 2 * ((1 << 23) - 1)
        else:
            assert r.mismatches == 0


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"])
def test_float64_next_to_midpoints_is_rounded_once_where_the_libraries_round_twice(fmt):
    census = sweep.double_rounding_census(fmt)
    assert census.ours_wrong == 0
    # a library that rounds through float32 collapses the float64 just off each midpoint onto it
    # and ties to even, so about half come out wrong (docs/casts.md; torch, ml_dtypes < 0.7);
    # one that rounds once gets none wrong (ml_dtypes 0.7): either behaviour, nothing between
    for wrong in (census.ml_dtypes_wrong, census.torch_wrong):
        assert wrong == 0 or wrong > census.inputs // 4


def test_library_disagreements_are_pinned_on_a_few_inputs():
    """The documented table, one input each (docs/casts.md)."""
    import ml_dtypes
    import numpy as np
    import torch

    from dmref.emulation import encode

    x = np.array([500.0, np.inf, np.nan, -np.nan], np.float32)
    ml = x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    th = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert ml.tolist()[:2] == [0x7F, 0x7F] and th.tolist()[:2] == [0x7E, 0x7E]  # NaN vs saturate
    assert encode(x, "e4m3", saturate=False).tolist()[:2] == ml.tolist()[:2]
    assert encode(x, "e4m3", saturate=True).tolist()[:2] == th.tolist()[:2]
    e5_ml = x[2:].astype(ml_dtypes.float8_e5m2).view(np.uint8).tolist()
    e5_th = torch.from_numpy(x[2:]).to(torch.float8_e5m2).view(torch.uint8).numpy().tolist()
    assert e5_ml == [0x7E, 0xFE] and e5_th == [0x7F, 0xFF]
    assert encode(x[2:], "e5m2").tolist() == e5_th
    # e8m0fnu: 0 and negatives are NaN in ml_dtypes (and here), |x| / 0x00 in torch
    z = np.array([0.0, -1.0], np.float32)
    assert z.astype(ml_dtypes.float8_e8m0fnu).view(np.uint8).tolist() == [0xFF, 0xFF]
    assert torch.from_numpy(z).to(torch.float8_e8m0fnu).view(torch.uint8).tolist() == [0x00, 0x7F]
    assert encode(z, "e8m0").tolist() == [0xFF, 0xFF]


# ---- stochastic rounding below 2**-126 -------------------------------------------------------

#: float32 below 2**-126 are ``man * 2**-149``, man < 2**23. Every 8-bit format has a quantum
#: q >= 2**-127 there (E8M0: emin = -127, m = 0), so in the specification n = floor(a / q) and
#: floor(f * 2**8) are floor(man * 2**-k) for some k >= 14: both depend on man >> 14 only. So
#: the scalar specification is constant on each of these 512 classes; the table below takes it
#: at both ends of every class and checks that they agree.
_CLASS_SHIFT = 14


def _scalar_spec_per_class(fmt, negative: bool, rbits):
    """table[man >> 14, r]: encode_scalar of the float32 subnormals of that class, 8 random bits
    r (for r in ``rbits``; other columns 0)."""
    lo = np.arange(1 << (23 - _CLASS_SHIFT), dtype=np.uint32) << _CLASS_SHIFT
    hi = lo | ((1 << _CLASS_SHIFT) - 1)
    lo[0] = 1  # man = 0 is zero, not a positive value
    sign = np.uint32(0x80000000 if negative else 0)
    table = np.empty((lo.size, 256), np.uint8)
    for ends in (lo, hi):
        xs = (ends | sign).view(np.float32).tolist()
        codes = [[encode_scalar(x, fmt, rounding="stochastic", rbits=r, rbits_width=8)
                  if r in rbits else 0 for r in range(256)] for x in xs]
        if ends is lo:
            table[:] = codes
        else:
            assert np.array_equal(table, np.array(codes, np.uint8)), "the spec is not constant on a class"
    return table


def _sweep_stochastic_below_min_normal(fmt, negative: bool, rbits=range(256)) -> int:
    """Mismatches of encode against the scalar spec over every float32 of sign ``negative`` in
    (0, 2**-126) and every 8-bit rbits value in ``rbits``: 2**23 - 1 inputs each."""
    table = _scalar_spec_per_class(fmt, negative, set(rbits))
    man = np.arange(1, 1 << 23, dtype=np.uint32)
    x = (man | np.uint32(0x80000000 if negative else 0)).view(np.float32)
    cls = (man >> _CLASS_SHIFT).astype(np.intp)
    mismatches = 0
    for r in rbits:
        got = encode(x, fmt, rounding="stochastic", rbits=np.uint8(r))
        mismatches += int(np.count_nonzero(got != np.take(table[:, r], cls)))
    return mismatches


@pytest.mark.slow
def test_e8m0_stochastic_equals_the_scalar_spec_below_2_pow_minus_126_for_every_8_bit_rbits():
    """Every positive float32 below 2**-126 with every 8-bit rbits value (2**31 encodes)."""
    assert _sweep_stochastic_below_min_normal("float8_e8m0fnu", negative=False) == 0


@pytest.mark.slow
@pytest.mark.parametrize("negative", [False, True])
@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                                 "float8_e8m0fnu"])
def test_every_8_bit_format_stochastic_equals_the_scalar_spec_below_2_pow_minus_126(fmt, negative):
    """Both signs, every 8-bit format; rbits 0, 1, 128, 255. Below 2**-126 the specification
    gives the same code for every rbits in these formats but E8M0 (whose positive side the test
    above sweeps with all 256), and the table route rounds up iff the top discarded bits plus
    rbits carry, which is monotone in rbits: the ends and the middle catch a dependence on it."""
    assert _sweep_stochastic_below_min_normal(fmt, negative, rbits=(0, 1, 128, 255)) == 0
