"""Verdicts that hold in every dtype: every case is representable in the dtype under test, a
float64 claim is a claim to compute in float64, and any exit of fn fails its case."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import planted
import pytest
import torch

from dmref import oracle
from dmref.oracle.cases import representable

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


_SLOW = pytest.mark.slow


@pytest.mark.parametrize("size,dtype", [
    ("standard", torch.float16), pytest.param("standard", torch.bfloat16, marks=_SLOW),
    pytest.param("quick", torch.float16, marks=_SLOW), pytest.param("standard", torch.float32, marks=_SLOW),
    *(pytest.param("thorough", d, marks=_SLOW) for d in _DTYPES)], ids=str)
def test_every_case_is_representable_in_the_dtype_under_test(size, dtype):
    """Inputs, exact outputs, gradients, dP and dS within half the dtype's largest value: the
    magnitudes are derived from the dtype (float16's outlier channels at 2^4, not 2^14)."""
    bad = {c.name: why for c in oracle.make_cases(size, dtype=dtype) if (why := representable(c))}
    assert not bad, bad


def test_sdpa_math_passes_the_large_magnitude_cases_in_float16():
    """outlier_channels' exact dQ reached 6.9e7 with 2^14 outliers, beyond float16's 65504."""
    names = ["outlier_channels", "large_values", "huge_values"]
    oracle.check(oracle.sdpa_math, cases=oracle.make_cases("quick", dtype=torch.float16, names=names),
                 dtype="fp16").raise_for_failures()


_F64_NAMES = ["realistic", "tail_lengths", "gqa", "huge_values"]


def test_a_float64_claim_fails_an_implementation_that_computes_in_float32():
    cases = oracle.make_cases("quick", dtype=torch.float64, names=_F64_NAMES)
    report = oracle.check(planted.float32_inside, cases=cases, dtype=torch.float64)
    assert report.failed_cases() == set(_F64_NAMES), report.summary()
    assert {"out", "dq", "dk", "dv"} <= report.failed_names()
    # the same computation in float64 passes, and in float32 at float32 bounds too
    oracle.check(oracle.sdpa_math, cases=cases, dtype=torch.float64).raise_for_failures()
    cases32 = oracle.make_cases("quick", dtype=torch.float32, names=_F64_NAMES)
    oracle.check(planted.float32_inside, cases=cases32, dtype=torch.float32).raise_for_failures()


def test_the_floor_is_float64_arithmetic_for_a_float64_claim():
    assert oracle.floor_unit_roundoff(torch.float64) == 2.0**-53
    assert {oracle.floor_unit_roundoff(d) for d in _DTYPES} == {2.0**-24}


@pytest.mark.parametrize("timeout", [None, 30.0])
def test_an_exit_of_fn_fails_its_case_and_the_check_goes_on(timeout):
    report = oracle.check(planted.exits, cases=oracle.make_cases("quick", names=["realistic", "tail_lengths"]),
                          timeout=timeout)
    assert report.failed_cases("runs") == {"realistic", "tail_lengths"}
    assert "SystemExit(0)" in report.failed[0].detail


def test_an_exit_of_fn_makes_dmref_check_exit_1_with_its_report():
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": here + os.pathsep + os.environ.get("PYTHONPATH", "")}
    res = subprocess.run([sys.executable, "-m", "dmref", "check", "planted:exits", "--cases", "quick", "--case",
                          "realistic", "--json"], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 1, res.stderr
    assert json.loads(res.stdout)["failed"] == ["realistic:runs"]
