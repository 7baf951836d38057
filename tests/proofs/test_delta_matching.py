"""Theorem 1 of dmref/proofs/delta_matching.md in exact rationals, and the necessity of each
assumption."""

from __future__ import annotations

import pytest

from fractions import Fraction

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dmref.emulation import ScaleRule
from dmref.proofs import checks
from dmref.proofs.counterexamples import (
    GENERATORS,
    assumption_status,
    counterexample_a1,
    counterexample_a2,
    counterexample_a3,
    counterexample_a4_hopper,
    counterexample_a5,
)
from dmref.proofs.rational import exact_backward, quantize_blocked_exact, to_fractions

FORMATS = st.sampled_from(["e4m3", "e5m2"])
SCALE_RULES = st.sampled_from([ScaleRule.MX_OCP, ScaleRule.POW2_DOWN, ScaleRule.AMAX])


@st.composite
def small_problems(draw):
    """Awkward small shapes (1, tails of the block), outliers up to 2**12, any mask."""
    n_q = draw(st.integers(1, 4))
    n_k = draw(st.integers(1, 5))
    d = draw(st.integers(1, 7))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    outlier = 2.0 ** draw(st.integers(0, 12))

    def arr(rows):
        x = rng.standard_normal((rows, d))
        x[:, rng.integers(d)] *= outlier
        return x

    mask_kind = draw(st.sampled_from(["none", "causal", "random"]))
    mask = {"none": None, "causal": "causal",
            "random": rng.random((n_q, n_k)) < 0.6}[mask_kind]
    return arr(n_q), arr(n_k), arr(n_k), arr(n_q), mask


@given(problem=small_problems(), fmt_qk=FORMATS, fmt_do=FORMATS, rule=SCALE_RULES,
       block=st.integers(1, 8), mass=st.sampled_from(["normalize", "divide_delta"]))
def test_delta_matching_rowsum_is_exactly_zero_in_rationals(problem, fmt_qk, fmt_do, rule,
                                                            block, mass):
    q, k, v, do, mask = problem
    run = checks.check_delta_matching_exact(q, k, v, do, fmt_qk=fmt_qk, fmt_v=fmt_qk,
                                            fmt_do=fmt_do, block=block, scale_rule=rule,
                                            mask=mask, mass=mass)
    assert run.residuals == [0] * len(q)


@given(seed=st.integers(0, 2**16), d=st.sampled_from([32, 64, 96]),
       promote=st.sampled_from([None, 32, 64]))
def test_value_matched_rowsum_is_zero_whatever_the_dp_accumulation(seed, d, promote):
    """Theorem 1, value form: the same Hopper-accumulated dP numbers in D and in dS."""
    q, k, v, do = (np.random.default_rng(seed).standard_normal((3, d)) *
                   np.exp(2 * np.random.default_rng(seed + 1).standard_normal(d)) for _ in range(4))
    run = exact_backward(q, k, v, do, block=d, dp_accumulation="hopper", promote_every=promote)
    assert run.residuals == [0] * 3


@given(problem=small_problems())
def test_quantized_values_are_scale_times_format_value(problem):
    """The rational quantizer is what the proof assumes: each value is its block scale times a
    finite value of the format, and the scale is the rule's."""
    from dmref.emulation import get_format

    q = to_fractions(problem[0])
    fmt = get_format("e4m3")
    values = {Fraction(v) for v, _ in fmt._positive_finite}
    qh, scales = quantize_blocked_exact(q, fmt, 3, ScaleRule.MX_OCP)
    for row, srow in zip(qh, scales):
        for j, x in enumerate(row):
            assert abs(x) / srow[j // 3] in values


# ---------------------------------------------------------------------------------------------
# Each assumption is necessary: exactly that assumption fails on the data, the residual is not 0
# ---------------------------------------------------------------------------------------------
def test_assumption_A1_is_necessary():
    assert checks.check_assumption_necessary("A1").shows_necessity


def test_assumption_A2_is_necessary():
    assert checks.check_assumption_necessary("A2").shows_necessity


def test_assumption_A3_is_necessary():
    assert checks.check_assumption_necessary("A3").shows_necessity


def test_assumption_A4_is_necessary():
    """Float32 arithmetic in dP, D and dS (same dP numbers, unit-mass float32 P)."""
    assert checks.check_assumption_necessary("A4").shows_necessity


def test_assumption_A4_is_necessary_under_hopper_accumulation():
    """Operand-level matching with the Hopper-accumulated dP in dS and the exact contraction
    in D."""
    assert checks.check_assumption_necessary("A4-hopper").shows_necessity


def test_assumption_A5_is_necessary():
    assert checks.check_assumption_necessary("A5").shows_necessity


def test_matched_case_meets_every_assumption_and_has_zero_residual():
    from dmref.proofs.counterexamples import matched_case

    case = matched_case(0, mask="causal", n_q=4, n_k=4)
    assert all(assumption_status(case).values())
    assert case.max_abs_residual == 0


# ---------------------------------------------------------------------------------------------
# The residual of each dropped assumption has the closed form of delta_matching.md, exactly
# ---------------------------------------------------------------------------------------------
@given(seed=st.integers(0, 2**20), n_q=st.integers(1, 4), n_k=st.integers(1, 5),
       d=st.integers(1, 9), causal=st.booleans())
def test_residual_with_A1_dropped_is_sum_of_p_difference_times_dp(seed, n_q, n_k, d, causal):
    case = counterexample_a1(seed, n_q, n_k, d, mask="causal" if causal else None)
    assert case.residuals == case.predicted


@given(seed=st.integers(0, 2**20), n_q=st.integers(1, 4), n_k=st.integers(1, 5),
       d=st.integers(1, 9))
def test_residual_with_A2_dropped_is_minus_do_error_dot_pv(seed, n_q, n_k, d):
    case = counterexample_a2(seed, n_q, n_k, d)
    assert case.residuals == case.predicted


@settings(max_examples=20)  # exact rational arithmetic: about 1 s an example on 2 cores
@given(seed=st.integers(0, 2**20), n_q=st.integers(1, 4), n_k=st.integers(1, 5),
       d=st.integers(1, 9))
@pytest.mark.slow
def test_residual_with_A3_dropped_is_delta_times_mass_defect(seed, n_q, n_k, d):
    case = counterexample_a3(seed, n_q, n_k, d)
    assert case.residuals == case.predicted


@given(seed=st.integers(0, 2**20), promote=st.sampled_from([None, 32]))
def test_residual_with_A4_dropped_under_hopper_is_p_weighted_dp_error(seed, promote):
    case = counterexample_a4_hopper(seed, d=64, promote_every=promote)
    assert case.residuals == case.predicted


@given(seed=st.integers(0, 2**20), n=st.integers(1, 5), d=st.integers(1, 9))
def test_residual_with_A5_dropped_is_minus_masked_contributions(seed, n, d):
    case = counterexample_a5(seed, n, n, d)
    assert case.residuals == case.predicted


@given(name=st.sampled_from(sorted(GENERATORS)), seed=st.integers(0, 2**10))
def test_every_generated_case_drops_exactly_its_assumption(name, seed):
    case = GENERATORS[name](seed)
    assert [a for a, ok in assumption_status(case).items() if not ok] == [name.split("-")[0]]
