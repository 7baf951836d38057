"""Numerical constants of dmref, each defined once and derived from a format or a count.

Everything here is a plain Python ``float`` or ``int`` (so that Triton kernels can use the values
as ``tl.constexpr``): the FP8 limits come from :class:`~dmref.emulation.formats.Format`, the
unit roundoffs from the mantissa widths of the IEEE binary formats; the wgmma model's bit counts
are the measured ones, and :class:`~dmref.emulation.gemm.WgmmaRules` (hence
:data:`~dmref.emulation.gemm.HOPPER`) takes them as its defaults.

Check: ``python -c "from dmref.emulation import constants as c; print(c.E4M3_MAX, c.U_FP32)"``
prints ``448.0 5.960464477539063e-08``; tests/emulation/test_constants.py compares every value
with an independent source (ml_dtypes, numpy's finfo, the float32 grid).
"""

from __future__ import annotations

import math

import numpy as np

from .formats import BFLOAT16, FLOAT8_E4M3FN, FLOAT8_E5M2, FLOAT16, Format

__all__ = [
    "FP32_MANTISSA_BITS",
    "FP64_MANTISSA_BITS",
    "U_FP32",
    "U_FP64",
    "U_BF16",
    "U_FP16",
    "FP32_EMIN",
    "FP32_MIN_NORMAL",
    "FP32_MAX",
    "LOG2E",
    "LN2",
    "E4M3_MAX",
    "E4M3_MIN_NORMAL",
    "E4M3_EMAX",
    "E4M3_SUB_MAGIC",
    "E4M3_DROP_BITS",
    "E5M2_MAX",
    "E5M2_MIN_NORMAL",
    "E5M2_EMAX",
    "E5M2_SUB_MAGIC",
    "E5M2_DROP_BITS",
    "WGMMA_K_STEP",
    "WGMMA_TERM_FRAC_BITS",
    "WGMMA_RESULT_BITS",
    "U_WGMMA",
    "gamma",
]

#: Stored fraction bits of float32 and float64.
FP32_MANTISSA_BITS: int = int(np.finfo(np.float32).nmant)
FP64_MANTISSA_BITS: int = int(np.finfo(np.float64).nmant)

#: Unit roundoff (round to nearest) of the IEEE working precisions: 2**-(mantissa bits + 1).
U_FP32: float = math.ldexp(1.0, -(FP32_MANTISSA_BITS + 1))
U_FP64: float = math.ldexp(1.0, -(FP64_MANTISSA_BITS + 1))
U_BF16: float = BFLOAT16.unit_roundoff
U_FP16: float = FLOAT16.unit_roundoff

#: float32's smallest normal exponent (-126), smallest normal (2**-126) and largest finite value.
FP32_EMIN: int = int(np.finfo(np.float32).minexp)
FP32_MIN_NORMAL: float = float(np.finfo(np.float32).tiny)
FP32_MAX: float = float(np.finfo(np.float32).max)

#: log2(e) and ln(2), rounded once to float64 (``1 / ln 2`` rounds to the same float64 as
#: the correctly rounded log2(e)).
LOG2E: float = 1.0 / math.log(2.0)
LN2: float = math.log(2.0)


def _sub_magic(fmt: Format) -> float:
    """C with ``fl32(a + C) - C`` = a rounded to a multiple of fmt's smallest subnormal, for a
    magnitude a below fmt's smallest normal: the float32 ulp of C (2**-23 C) is that subnormal."""
    return math.ldexp(fmt.min_subnormal, FP32_MANTISSA_BITS)


def _drop_bits(fmt: Format) -> int:
    """float32 fraction bits a normal fmt value does not have."""
    return FP32_MANTISSA_BITS - fmt.mantissa_bits


#: E4M3 (float8_e4m3fn): largest finite value, smallest normal, exponent of the largest binade,
#: the float32 addend that rounds to its subnormal grid, and the float32 fraction bits it drops.
E4M3_MAX: float = FLOAT8_E4M3FN.max
E4M3_MIN_NORMAL: float = FLOAT8_E4M3FN.min_normal
E4M3_EMAX: int = FLOAT8_E4M3FN.emax
E4M3_SUB_MAGIC: float = _sub_magic(FLOAT8_E4M3FN)
E4M3_DROP_BITS: int = _drop_bits(FLOAT8_E4M3FN)
#: The same for E5M2 (float8_e5m2).
E5M2_MAX: float = FLOAT8_E5M2.max
E5M2_MIN_NORMAL: float = FLOAT8_E5M2.min_normal
E5M2_EMAX: int = FLOAT8_E5M2.emax
E5M2_SUB_MAGIC: float = _sub_magic(FLOAT8_E5M2)
E5M2_DROP_BITS: int = _drop_bits(FLOAT8_E5M2)


def gamma(n, u: float = U_FP32):
    """Higham's gamma_n = n u / (1 - n u): the bound on |theta_n| for n roundings of unit
    roundoff u (Accuracy and Stability of Numerical Algorithms, 2nd ed., Lemma 3.1). ``n`` a
    number (a float comes back) or a numpy array (an array comes back); n u must be < 1."""
    arr = np.asarray(n, dtype=np.float64)
    if np.any(arr * u >= 1.0):
        raise ValueError(f"gamma_n needs n*u < 1, got n={arr.max()}, u={u}")
    out = arr * u / (1.0 - arr * u)
    return float(out) if out.ndim == 0 else out


#: The Hopper FP8 wgmma's bit counts, as measured on an H200 (docs/gemm.md): products per
#: k-step, fraction bits kept of each term relative to 2**E, significant bits of a step's result.
#: The defaults of :class:`~dmref.emulation.gemm.WgmmaRules`, so :data:`~dmref.emulation.gemm.HOPPER` has them.
WGMMA_K_STEP: int = 32
WGMMA_TERM_FRAC_BITS: int = 13
WGMMA_RESULT_BITS: int = 14
#: Relative error of truncating one k-step's result to WGMMA_RESULT_BITS significant bits
#: (2**-(WGMMA_RESULT_BITS - 1)): the unit roundoff of the wgmma accumulation.
U_WGMMA: float = math.ldexp(1.0, -(WGMMA_RESULT_BITS - 1))
