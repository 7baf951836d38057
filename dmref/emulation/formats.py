"""Number formats as data.

One frozen :class:`Format` per format names its bit fields and its special-value rules; every
other property (max, min normal, min subnormal, eps, the codes of NaN, inf and max) is *derived*
from those fields by decoding codes, never typed in a second time.

Names and semantics follow ml_dtypes and torch: ``f`` = finite only (no infinities),
``n`` = NaN only at the outer range, ``uz`` = unsigned zero (no negative zero; the code of -0 is
NaN instead), ``e8m0fnu`` = unsigned, exponent only, used for MX block scales.
"""

from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


class Rounding(enum.Enum):
    """How a value between two neighbouring representable numbers is rounded."""

    NEAREST_EVEN = "nearest_even"  #: round to nearest, ties to the even significand (IEEE RNE)
    TOWARD_ZERO = "toward_zero"  #: truncate the magnitude (IEEE RTZ)
    TOWARD_POSITIVE = "toward_positive"  #: round toward +inf (IEEE RU)
    TOWARD_NEGATIVE = "toward_negative"  #: round toward -inf (IEEE RD)
    STOCHASTIC = "stochastic"  #: round away from zero with probability = discarded fraction


class Specials(enum.Enum):
    """Where a format keeps its NaN (and infinity) codes."""

    IEEE = "ieee"  #: exponent field all ones: mantissa 0 is +-inf, any other mantissa is NaN
    FN = "fn"  #: no infinities; only exponent and mantissa all ones (either sign) is NaN
    FNUZ = "fnuz"  #: no infinities, no -0; the code of -0 (sign bit alone) is the only NaN
    E8M0 = "e8m0"  #: unsigned, no zero, no infinities; the all-ones code is the only NaN


@dataclass(frozen=True)
class Format:
    """A binary floating-point format of at most 16 bits.

    A code is ``sign | exponent field | mantissa field`` (no sign bit when ``signed`` is
    false). A normal code has value ``(1 + M / 2**m) * 2**(E - bias)``; with ``subnormals`` the
    exponent field 0 holds ``M / 2**m * 2**(1 - bias)``, without them (E8M0) the field 0 is an
    ordinary normal binade.
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    specials: Specials
    signed: bool = True
    subnormals: bool = True

    # ---- structure ---------------------------------------------------------------------------
    @property
    def bits(self) -> int:
        return int(self.signed) + self.exponent_bits + self.mantissa_bits

    @property
    def n_codes(self) -> int:
        return 1 << self.bits

    @property
    def sign_bit(self) -> int:
        """The code bit that holds the sign (0 for unsigned formats)."""
        return (1 << (self.bits - 1)) if self.signed else 0

    @property
    def has_inf(self) -> bool:
        return self.specials is Specials.IEEE

    @property
    def has_negative_zero(self) -> bool:
        return self.signed and self.specials in (Specials.IEEE, Specials.FN)

    @property
    def has_zero(self) -> bool:
        return self.subnormals

    @property
    def is_fp8(self) -> bool:
        """Whether this is an 8-bit element format (E4M3, E5M2 and their variants): signed, 8
        bits. The unsigned E8M0 is a scale format, not an element format."""
        return self.bits == 8 and self.signed

    @property
    def short_name(self) -> str:
        """The name tables and recipe descriptions print: ``E4M3``, ``E5M2``, ``BF16``, ``FP16``
        (the ecosystem name for any other format)."""
        return _SHORT_NAMES.get(self.name, self.name)

    # ---- the definition: one code to its value -----------------------------------------------
    def value(self, code: int) -> float:
        """The exact value of ``code`` as a Python float (every value of these formats is a
        float64). NaN codes give ``nan`` with the code's sign bit; infinities ``+-inf``."""
        if not 0 <= code < self.n_codes:
            raise ValueError(f"{code=} is not a code of {self.name} ({self.bits} bits)")
        m, e = self.mantissa_bits, self.exponent_bits
        negative = bool(code & self.sign_bit)
        exp_field = (code >> m) & ((1 << e) - 1)
        man_field = code & ((1 << m) - 1)
        all_ones_exp = exp_field == (1 << e) - 1
        signed_nan = -math.nan if negative else math.nan  # NaN keeps the code's sign bit
        if self.specials is Specials.IEEE and all_ones_exp:
            return (-math.inf if negative else math.inf) if man_field == 0 else signed_nan
        if self.specials is Specials.FN and all_ones_exp and man_field == (1 << m) - 1:
            return signed_nan
        if self.specials is Specials.FNUZ and code == self.sign_bit:
            return signed_nan
        if self.specials is Specials.E8M0 and code == self.n_codes - 1:
            return math.nan
        if exp_field == 0 and self.subnormals:
            magnitude = math.ldexp(man_field, 1 - self.bias - m)
        else:
            magnitude = math.ldexp((1 << m) + man_field, exp_field - self.bias - m)
        return -magnitude if negative else magnitude

    # ---- derived properties ------------------------------------------------------------------
    @functools.cached_property
    def _positive_finite(self) -> tuple[tuple[float, int], ...]:
        """(value, code) of every finite code without the sign bit, by code."""
        out = []
        for code in range(self.n_codes):
            if code & self.sign_bit:
                continue
            v = self.value(code)
            if math.isfinite(v):
                out.append((v, code))
        return tuple(out)

    @functools.cached_property
    def max(self) -> float:
        """Largest finite value."""
        return max(v for v, _ in self._positive_finite)

    @functools.cached_property
    def max_code(self) -> int:
        """Code (without sign) of the largest finite value."""
        return max(self._positive_finite)[1]

    @property
    def min_normal(self) -> float:
        """Smallest positive normal value, 2**emin."""
        return math.ldexp(1.0, self.emin)

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal binade."""
        return (1 if self.subnormals else 0) - self.bias

    @property
    def emax(self) -> int:
        """Exponent of the largest finite value."""
        return math.frexp(self.max)[1] - 1

    @functools.cached_property
    def min_subnormal(self) -> float:
        """Smallest positive value (equal to min_normal for formats without subnormals)."""
        return min(v for v, _ in self._positive_finite if v > 0)

    @property
    def eps(self) -> float:
        """Distance from 1 to the next larger value, 2**-mantissa_bits."""
        return math.ldexp(1.0, -self.mantissa_bits)

    @property
    def unit_roundoff(self) -> float:
        """Half of eps: the relative error bound of round-to-nearest in the normal range."""
        return self.eps / 2

    @property
    def nan_code(self) -> int:
        """The code encode() writes for a positive NaN input (negative NaN: ``nan_code_for``)."""
        return self.nan_code_for(negative=False)

    def nan_code_for(self, negative: bool) -> int:
        """The NaN code encode() writes: all ones (keeping the sign) for IEEE and FN formats,
        the lone NaN code for FNUZ and E8M0 formats."""
        if self.specials in (Specials.FNUZ,):
            return self.sign_bit
        if self.specials is Specials.E8M0:
            return self.n_codes - 1
        return (self.n_codes - 1) if negative else (self.n_codes - 1) ^ self.sign_bit

    @property
    def inf_code(self) -> int | None:
        """Code of +inf, or None for formats without infinities."""
        if not self.has_inf:
            return None
        return ((1 << self.exponent_bits) - 1) << self.mantissa_bits

    @functools.cached_property
    def nan_codes(self) -> frozenset[int]:
        return frozenset(c for c in range(self.n_codes) if math.isnan(self.value(c)))

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The torch dtype of the same name (``torch.float8_e4m3fn`` ...), None where this torch
        has none. The one map from a format to a torch dtype; :func:`get_format` maps back.
        torch is imported here only: formats are data, readable without it."""
        import torch

        dtype = getattr(torch, self.name, None)
        return dtype if isinstance(dtype, torch.dtype) else None

    @property
    def code_dtype_bits(self) -> int:
        return 8 if self.bits <= 8 else 16

    def __repr__(self) -> str:
        return f"Format({self.name})"


FLOAT8_E4M3FN = Format("float8_e4m3fn", 4, 3, 7, Specials.FN)
FLOAT8_E5M2 = Format("float8_e5m2", 5, 2, 15, Specials.IEEE)
FLOAT8_E4M3FNUZ = Format("float8_e4m3fnuz", 4, 3, 8, Specials.FNUZ)
FLOAT8_E5M2FNUZ = Format("float8_e5m2fnuz", 5, 2, 16, Specials.FNUZ)
FLOAT8_E8M0FNU = Format("float8_e8m0fnu", 8, 0, 127, Specials.E8M0, signed=False, subnormals=False)
BFLOAT16 = Format("bfloat16", 8, 7, 127, Specials.IEEE)
FLOAT16 = Format("float16", 5, 10, 15, Specials.IEEE)

_SHORT_NAMES = {"float8_e4m3fn": "E4M3", "float8_e5m2": "E5M2", "bfloat16": "BF16", "float16": "FP16"}

#: Every format by its ecosystem name.
FORMATS: dict[str, Format] = {
    f.name: f
    for f in (FLOAT8_E4M3FN, FLOAT8_E5M2, FLOAT8_E4M3FNUZ, FLOAT8_E5M2FNUZ, FLOAT8_E8M0FNU, BFLOAT16, FLOAT16)
}

#: Short names used in recipes and in the H200 ground-truth file.
ALIASES: dict[str, str] = {
    "e4m3": "float8_e4m3fn",
    "e4m3fn": "float8_e4m3fn",
    "e5m2": "float8_e5m2",
    "e4m3fnuz": "float8_e4m3fnuz",
    "e5m2fnuz": "float8_e5m2fnuz",
    "e8m0": "float8_e8m0fnu",
    "e8m0fnu": "float8_e8m0fnu",
    "bf16": "bfloat16",
    "fp16": "float16",
}


def get_format(fmt: Format | str) -> Format:
    """The :class:`Format` for a format object, its name, an alias, or a matching torch /
    ml_dtypes dtype."""
    if isinstance(fmt, Format):
        return fmt
    name = getattr(fmt, "name", None) if not isinstance(fmt, str) else fmt
    if name is None:  # a torch dtype prints as torch.float8_e4m3fn
        name = str(fmt).removeprefix("torch.")
    key = ALIASES.get(name, name)
    if key not in FORMATS:
        known = ", ".join(sorted(FORMATS) + sorted(ALIASES))
        raise ValueError(f"unknown format {fmt!r}; known formats: {known}")
    return FORMATS[key]


def get_rounding(rounding: Rounding | str) -> Rounding:
    """The :class:`Rounding` for itself or its value (``"nearest_even"`` ...)."""
    if isinstance(rounding, Rounding):
        return rounding
    try:
        return Rounding(rounding)
    except ValueError:
        known = ", ".join(r.value for r in Rounding)
        raise ValueError(f"unknown rounding {rounding!r}; known: {known}") from None


def check_bool(value, name: str) -> bool:
    """``value`` as a bool. Raises TypeError unless it is a bool or a numpy.bool_: a string
    ("no", "False"), a number or a tensor would otherwise be taken by its truth value, so that
    ``saturate="no"`` would saturate."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    text = repr(value) if isinstance(value, (str, int, float)) else type(value).__name__
    raise TypeError(f"{name} must be True or False (bool or numpy.bool_), got {text[:60]}")
