"""dmref.emulation.constants: every value agrees with an independent source (ml_dtypes, numpy's
finfo, the float32 grid itself)."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from dmref.emulation import HOPPER, constants as c, decode, encode


@pytest.mark.parametrize("prefix, dtype", [("E4M3", ml_dtypes.float8_e4m3fn), ("E5M2", ml_dtypes.float8_e5m2)])
def test_fp8_limits_are_those_of_ml_dtypes(prefix, dtype):
    info = ml_dtypes.finfo(dtype)
    assert getattr(c, f"{prefix}_MAX") == float(info.max)
    assert getattr(c, f"{prefix}_MIN_NORMAL") == float(info.tiny)
    assert getattr(c, f"{prefix}_EMAX") == math.frexp(float(info.max))[1] - 1
    assert getattr(c, f"{prefix}_DROP_BITS") == np.finfo(np.float32).nmant - info.nmant
    assert isinstance(getattr(c, f"{prefix}_MAX"), float) and isinstance(getattr(c, f"{prefix}_EMAX"), int)


@pytest.mark.parametrize("prefix, fmt", [("E4M3", "e4m3"), ("E5M2", "e5m2")])
def test_sub_magic_rounds_float32_magnitudes_to_the_subnormal_grid(prefix, fmt):
    """fl32(a + C) - C is a rounded to nearest-even on fmt's subnormal grid, for every magnitude
    a below the smallest normal (how dmref/kernels/_common.py uses C): compared with the emulation's
    cast."""
    magic = np.float32(getattr(c, f"{prefix}_SUB_MAGIC"))
    tiny = getattr(c, f"{prefix}_MIN_NORMAL")
    a = np.linspace(0.0, tiny, 4001, dtype=np.float32)
    got = (a + magic) - magic
    want = decode(encode(a, fmt), fmt).astype(np.float32)
    np.testing.assert_array_equal(got, want)


def test_unit_roundoffs_and_float32_limits_are_numpys():
    assert c.U_FP32 == float(np.finfo(np.float32).eps) / 2
    assert c.U_FP64 == float(np.finfo(np.float64).eps) / 2
    assert c.U_BF16 == float(ml_dtypes.finfo(ml_dtypes.bfloat16).eps) / 2
    assert c.U_FP16 == float(np.finfo(np.float16).eps) / 2
    assert c.FP32_MIN_NORMAL == math.ldexp(1.0, c.FP32_EMIN) == float(np.finfo(np.float32).tiny)
    assert c.FP32_MAX == float(np.finfo(np.float32).max)
    assert c.LOG2E == math.log2(math.e) and c.LN2 == math.log(2.0)


def test_gamma_is_higham_and_refuses_n_u_of_one():
    assert c.gamma(3) == 3 * c.U_FP32 / (1 - 3 * c.U_FP32)
    np.testing.assert_array_equal(c.gamma(np.array([1, 2]), 0.25), [1 / 3, 1.0])
    with pytest.raises(ValueError, match="n\\*u < 1"):
        c.gamma(2**24)


def test_wgmma_constants_are_the_hopper_rules():
    assert (c.WGMMA_K_STEP, c.WGMMA_TERM_FRAC_BITS, c.WGMMA_RESULT_BITS) == (
        HOPPER.k_step, HOPPER.term_frac_bits, HOPPER.result_bits)
    assert c.U_WGMMA == math.ldexp(1.0, 1 - HOPPER.result_bits)
