"""``dmref cast`` rounds the decimal text it is given once, exactly, in every rounding mode.

The oracle is exact rational arithmetic (fractions.Fraction) over every finite value of the
format; inputs are decimals a relative 10^-30 off a midpoint or off a value of the format, where
reading the text into the nearest float64 first would round twice.
"""

from __future__ import annotations

import bisect
import contextlib
import decimal
import io
import json
from fractions import Fraction

import numpy as np
import pytest

from dmref import cli
from dmref.cli.formats import parse_value, round_to_odd
from dmref.emulation import decode, encode, get_format

_DIRECTED = ("toward_zero", "toward_positive", "toward_negative")
#: Relative offset of the test decimals: far below float64's resolution (2^-53 ~ 1.1e-16).
_OFFSET = Fraction(1, 10**30)


def _decimal_text(x: Fraction) -> str:
    """The exact decimal of ``x`` (its denominator has no prime factor other than 2 and 5)."""
    with decimal.localcontext() as ctx:
        ctx.prec = 2000
        text = str(decimal.Decimal(x.numerator) / decimal.Decimal(x.denominator))
    assert Fraction(text) == x
    return text


def _positive_grid(fmt) -> tuple[list[Fraction], list[int]]:
    """Every finite value >= 0 of ``fmt`` and its code, ascending."""
    codes = np.arange(1 << fmt.bits, dtype=np.uint8 if fmt.bits == 8 else np.uint16)
    values = decode(codes, fmt)
    pairs = sorted((Fraction(float(v)), int(c)) for v, c in zip(values, codes.tolist())
                   if np.isfinite(v) and v >= 0 and not (v == 0 and np.signbit(v)))
    return [v for v, _ in pairs], [c for _, c in pairs]


def _exact_code(d: Fraction, fmt, grid, rounding: str) -> int:
    """The code of ``d`` (|d| between two finite values of ``fmt``) rounded once under ``rounding``."""
    values, codes = grid
    sign = (1 << (fmt.bits - 1)) if d < 0 else 0
    a = abs(d)
    if d < 0:
        rounding = {"toward_positive": "toward_negative", "toward_negative": "toward_positive"}.get(rounding, rounding)
    hi = bisect.bisect_left(values, a)
    if values[hi] == a:
        return sign | codes[hi]
    lo = hi - 1
    if rounding == "nearest_even":
        lo_dist, hi_dist = a - values[lo], values[hi] - a
        pick = lo if lo_dist < hi_dist or (lo_dist == hi_dist and codes[lo] % 2 == 0) else hi
    else:
        pick = hi if rounding == "toward_positive" else lo
    if codes[pick] == 0 and not fmt.has_negative_zero:  # fnuz: a negative value rounds to +0
        return 0
    return sign | codes[pick]


def _cases(fmt, grid, stride: int) -> list[Fraction]:
    """Decimals just off the midpoints and just off the values of ``fmt``, both signs."""
    values = grid[0]
    out = []
    for a, b in list(zip(values, values[1:]))[::stride]:
        for x in ((a + b) / 2, b):
            out += [x * (1 - _OFFSET), x * (1 + _OFFSET)]
    out = [x for x in out if x < values[-1]]  # overflow has its own rules, tested in emulation
    return out + [-x for x in out]


@pytest.mark.parametrize("fmt_name, stride", [("float8_e4m3fn", 1), ("float8_e5m2", 1),
                                              ("float8_e4m3fnuz", 1), ("bfloat16", 37), ("float16", 41)])
@pytest.mark.parametrize("rounding", ["nearest_even", *_DIRECTED])
def test_cast_rounds_decimal_text_once(fmt_name, stride, rounding):
    fmt = get_format(fmt_name)
    grid = _positive_grid(fmt)
    cases = _cases(fmt, grid, stride)
    texts = [_decimal_text(d) for d in cases]
    x = np.array([parse_value(t)[0] for t in texts])
    got = encode(x, fmt, rounding=rounding).tolist()
    want = [_exact_code(d, fmt, grid, rounding) for d in cases]
    assert got == want
    # the cases are ones where reading the nearest float64 first rounds twice
    naive = encode(np.array([float(t) for t in texts]), fmt, rounding=rounding).tolist()
    assert naive != want


def test_cast_stochastic_rounding_sees_the_exact_discarded_bits():
    """With zero random bits stochastic rounding truncates: 1.9999...9 (30 nines) gives 1.875 in
    E4M3, while its nearest float64, 2.0, would give 2."""
    text = "1." + "9" * 30
    x = np.array([parse_value(text)[0]])
    code = encode(x, "e4m3", rounding="stochastic", rbits=np.zeros(1, np.uint16))
    assert decode(code, "e4m3").tolist() == [1.875]


def test_round_to_odd_keeps_float64s_and_marks_the_others_odd():
    for f in (0.1, 1.0, -2.5, 5e-324, 1.7976931348623157e308):
        assert round_to_odd(Fraction(f)) == f
    d = Fraction(1) + Fraction(1, 2**60)  # between 1 and 1 + 2^-52
    assert round_to_odd(d) == 1 + 2.0**-52
    assert round_to_odd(-d) == -(1 + 2.0**-52)
    assert round_to_odd(Fraction(2**1024 - 2**971 + 2**969)) == 1.7976931348623157e308  # above max: max (odd)
    assert round_to_odd(-Fraction(2**1024 - 2**971 + 2**969)) == -1.7976931348623157e308


def test_cast_value_just_above_float64_max_overflows_like_the_exact_value():
    """float64's max + 2^969 (a quarter ulp above max): float() gives max, and the value rounds
    toward zero to the format's max, to nearest to its overflow value."""
    text = str(2**1024 - 2**971 + 2**969)
    x = np.array([parse_value(text)[0]] * 2)
    assert encode(x[:1], "e5m2", rounding="toward_zero").tolist() == [get_format("e5m2").max_code]
    assert decode(encode(x[1:], "e5m2"), "e5m2").tolist() == [float("inf")]


def test_cast_cli_error_column_is_against_the_exact_input():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["cast", "0.99999999999999999", "-0", "--rounding", "toward_zero", "--json"]) == 0
    rows = json.loads(out.getvalue())["results"]
    assert rows[0]["value"] == 0.9375 and rows[0]["hex"] == "0x37"
    assert rows[0]["error"] == float(Fraction("0.9375") - Fraction("0.99999999999999999"))
    assert rows[1]["hex"] == "0x80" and rows[1]["error"] == 0.0  # the sign of zero is kept
