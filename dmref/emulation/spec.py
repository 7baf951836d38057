"""The readable specification of encode and decode: one value at a time, in exact arithmetic.

This is the definition the vectorised code in :mod:`dmref.emulation.cast` must equal on every
input; the tests run the same cases through both. It takes a Python float or a
``fractions.Fraction`` (so the proofs can round exact rationals) and works on exact rationals
throughout, so there is no intermediate rounding anywhere.

Rules, for a finite non-zero input ``x`` of magnitude ``a`` and a format with ``m`` mantissa
bits and smallest normal exponent ``emin``:

1. ``e = floor(log2 a)``, clamped below at ``emin`` (the subnormal range shares emin's quantum).
2. The quantum is ``q = 2**(e - m)``; ``a / q = n + f`` with integer ``n`` and ``0 <= f < 1``.
3. ``n`` becomes ``n + up`` where ``up`` is decided by the rounding mode:
   - nearest_even: ``f > 1/2``, or ``f == 1/2`` and ``n`` is odd;
   - toward_zero: never;  toward_positive: ``f > 0`` and x > 0;  toward_negative: ``f > 0``
     and x < 0;
   - stochastic: ``floor(f * 2**w) + r >= 2**w`` for the caller's random integer
     ``0 <= r < 2**w`` (``w`` = ``rbits_width``). The discarded fraction is truncated to its top
     ``w`` bits, so P(up) = floor(f 2**w) / 2**w: unbiased up to 2**-w of a quantum.
4. The magnitude code is ``(e - emin) * 2**m + n`` (formats with subnormals; without them,
   E8M0, it is that minus ``2**m`` and a result below the smallest value becomes the smallest
   value, since E8M0 has no zero). So a positive input below 2**-127 is 2**-127 in E8M0 under
   every rounding mode and every ``rbits``: there is no neighbour below it (OCP MX v1.0:
   E8M0 holds 2**-127 .. 2**127 and NaN, no zero). Between 2**-127 and 2**-126 the neighbours
   are 2**-127 and 2**-126, one quantum apart, as in every other binade.
5. Overflow (magnitude code beyond the largest finite one, or an infinite input):
   - ``saturate=True``: +-max;
   - otherwise, IEEE 754-2019 clause 7.4: a rounding direction that points toward zero for this
     sign (toward_zero; toward_positive for x < 0; toward_negative for x > 0) gives +-max;
     nearest_even and stochastic give the format's overflow value: +-inf where it has
     infinities, else NaN. An infinite input with ``saturate=False`` stays infinite (NaN where the
     format has no infinities).
6. Zero results keep the sign of x where the format has -0 (FNUZ formats write +0).
7. NaN input gives ``fmt.nan_code_for(sign)``. E8M0 (unsigned, no zero) maps zero, negative
   values and NaN to its NaN code 0xFF, as ml_dtypes does.
"""

from __future__ import annotations

import math
from fractions import Fraction

from .formats import Format, Rounding, check_bool, get_format, get_rounding

Number = float | int | Fraction


def decode_scalar(code: int, fmt: Format | str) -> float:
    """The exact value of one code (a Python float; NaN for NaN codes)."""
    return get_format(fmt).value(code)


def _floor_log2(a: Fraction) -> int:
    """floor(log2 a) for a positive rational, exactly (no float log2)."""
    num, den = a.numerator, a.denominator
    e = num.bit_length() - den.bit_length()  # now 2**(e-1) < a < 2**(e+1)
    below = num < (den << e) if e >= 0 else (num << -e) < den  # a < 2**e
    return e - 1 if below else e


def _overflow_code(fmt: Format, negative: bool, rounding: Rounding, saturate: bool) -> int:
    toward_zero = rounding is Rounding.TOWARD_ZERO or (
        rounding is Rounding.TOWARD_POSITIVE and negative
    ) or (rounding is Rounding.TOWARD_NEGATIVE and not negative)
    if saturate or toward_zero:
        return fmt.max_code | (fmt.sign_bit if negative else 0)
    if fmt.has_inf:
        return fmt.inf_code | (fmt.sign_bit if negative else 0)
    return fmt.nan_code_for(negative)


def encode_scalar(
    x: Number,
    fmt: Format | str,
    *,
    rounding: Rounding | str = Rounding.NEAREST_EVEN,
    saturate: bool = False,
    rbits: int | None = None,
    rbits_width: int = 16,
) -> int:
    """Round one value into ``fmt`` and return its code (see the module docstring); TypeError
    unless ``saturate`` is a bool."""
    saturate = check_bool(saturate, "saturate")
    fmt = get_format(fmt)
    rounding = get_rounding(rounding)
    if rounding is Rounding.STOCHASTIC:
        if rbits is None or not 0 <= rbits < (1 << rbits_width):
            raise ValueError(f"stochastic rounding needs 0 <= rbits < 2**{rbits_width}, got {rbits=}")

    if isinstance(x, Fraction):
        negative, is_nan, is_inf = x < 0, False, False
    else:
        x = float(x)
        is_nan, is_inf = math.isnan(x), math.isinf(x)
        negative = math.copysign(1.0, x) < 0
    sign = fmt.sign_bit if negative else 0

    if is_nan:
        return fmt.nan_code_for(negative)
    if not fmt.signed and (negative or x == 0):
        return fmt.nan_code_for(negative)  # E8M0: no sign, no zero
    if is_inf:
        if saturate:
            return fmt.max_code | sign
        return (fmt.inf_code | sign) if fmt.has_inf else fmt.nan_code_for(negative)

    a = abs(Fraction(x))
    if a == 0:
        return sign if fmt.has_negative_zero else 0

    m, emin = fmt.mantissa_bits, fmt.emin
    e = max(_floor_log2(a), emin)
    quantum = Fraction(2) ** (e - m)
    n = math.floor(a / quantum)
    f = a / quantum - n

    match rounding:
        case Rounding.NEAREST_EVEN:
            up = f > Fraction(1, 2) or (f == Fraction(1, 2) and n % 2 == 1)
        case Rounding.TOWARD_ZERO:
            up = False
        case Rounding.TOWARD_POSITIVE:
            up = f > 0 and not negative
        case Rounding.TOWARD_NEGATIVE:
            up = f > 0 and negative
        case Rounding.STOCHASTIC:
            up = math.floor(f * (1 << rbits_width)) + rbits >= (1 << rbits_width)
    n += int(up)

    magnitude = (e - emin) * (1 << m) + n
    if not fmt.subnormals:
        magnitude = max(magnitude - (1 << m), 0)  # E8M0 has no zero: the smallest value instead
    if magnitude > fmt.max_code:
        return _overflow_code(fmt, negative, rounding, saturate)
    if magnitude == 0:
        return sign if fmt.has_negative_zero else 0
    return magnitude | sign
