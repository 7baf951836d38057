"""Formats are data: derived properties agree with ml_dtypes' finfo and with the structure."""

import math
from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest
import torch

from dmref.emulation import FORMATS, get_format
from dmref.emulation.formats import Specials

FP8 = ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"]
ALL_ML = FP8 + ["float8_e8m0fnu", "bfloat16", "float16"]


def _ml_dtype(name):
    return np.float16 if name == "float16" else getattr(ml_dtypes, name)


@pytest.mark.parametrize("name", ALL_ML)
def test_derived_properties_match_ml_dtypes_finfo(name):
    fmt, info = get_format(name), ml_dtypes.finfo(_ml_dtype(name))
    assert fmt.max == float(info.max)
    assert fmt.min_normal == float(info.smallest_normal)
    assert fmt.min_subnormal == float(info.smallest_subnormal)
    assert fmt.eps == float(info.eps)
    assert fmt.bits == info.bits


@pytest.mark.parametrize("name", ALL_ML)
def test_every_code_decodes_like_ml_dtypes(name):
    fmt = get_format(name)
    codes = np.arange(fmt.n_codes, dtype=np.uint8 if fmt.bits == 8 else np.uint16)
    with np.errstate(invalid="ignore"):
        theirs = codes.view(_ml_dtype(name)).astype(np.float64)
    ours = np.array([fmt.value(int(c)) for c in codes])
    assert np.array_equal(np.isnan(ours), np.isnan(theirs))
    finite = ~np.isnan(ours)
    assert np.array_equal(ours[finite], theirs[finite])
    assert np.array_equal(np.signbit(ours[finite]), np.signbit(theirs[finite]))


@pytest.mark.parametrize("name", list(FORMATS))
def test_fields_add_up_to_bits(name):
    fmt = get_format(name)
    assert int(fmt.signed) + fmt.exponent_bits + fmt.mantissa_bits == fmt.bits


@pytest.mark.parametrize("name", list(FORMATS))
def test_max_code_decodes_to_max_and_next_code_is_not_finite(name):
    fmt = get_format(name)
    assert fmt.value(fmt.max_code) == fmt.max
    beyond = fmt.max_code + 1
    if beyond < fmt.n_codes and not (beyond & fmt.sign_bit):
        assert not math.isfinite(fmt.value(beyond))


@pytest.mark.parametrize("name", list(FORMATS))
def test_nan_and_inf_codes_follow_the_specials_rule(name):
    fmt = get_format(name)
    assert fmt.nan_code in fmt.nan_codes
    assert fmt.nan_code_for(True) in fmt.nan_codes
    if fmt.specials is Specials.FNUZ or fmt.specials is Specials.E8M0:
        assert len(fmt.nan_codes) == 1
    if fmt.specials is Specials.FN:
        assert len(fmt.nan_codes) == 2
    if fmt.has_inf:
        assert fmt.value(fmt.inf_code) == math.inf
        assert fmt.value(fmt.inf_code | fmt.sign_bit) == -math.inf
        assert fmt.max == math.ldexp(2 - fmt.eps, fmt.emax)


@pytest.mark.parametrize("name", list(FORMATS))
def test_each_binade_holds_two_to_the_mantissa_bits_values(name):
    fmt = get_format(name)
    finite = sorted(v for v, _ in fmt._positive_finite if v >= fmt.min_normal)
    by_exponent = {}
    for v in finite:
        by_exponent.setdefault(math.frexp(v)[1], []).append(v)
    full = [vs for vs in by_exponent.values() if len(vs) == 1 << fmt.mantissa_bits]
    # every binade but possibly the top one (where NaN codes live) is complete
    assert len(full) >= len(by_exponent) - 1


@pytest.mark.parametrize("name", ALL_ML)
def test_torch_dtype_holds_the_same_values_and_maps_back(name):
    fmt = get_format(name)
    assert fmt.torch_dtype is getattr(torch, name)
    assert get_format(fmt.torch_dtype) is fmt
    assert fmt.torch_dtype.itemsize * 8 == fmt.bits
    codes = torch.arange(fmt.n_codes, dtype=torch.int32).to(torch.uint8 if fmt.bits == 8 else torch.int16)
    theirs = codes.view(fmt.torch_dtype).to(torch.float64)
    ours = torch.tensor([fmt.value(c) for c in range(fmt.n_codes)], dtype=torch.float64)
    assert torch.equal(torch.isnan(ours), torch.isnan(theirs))
    assert torch.equal(ours[~torch.isnan(ours)], theirs[~torch.isnan(theirs)])


def test_a_format_without_a_torch_dtype_of_its_name_has_none():
    assert replace(get_format("e4m3"), name="float8_e4m3_without_torch_dtype").torch_dtype is None


def test_unknown_format_name_is_an_error_naming_the_choices():
    with pytest.raises(ValueError, match="unknown format 'e4m4'.*float8_e4m3fn"):
        get_format("e4m4")
