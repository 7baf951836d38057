"""Theorem 9 of dmref/proofs/consistent_p.md: the consistent-P variant gives exactly zero row sums
when its conditions hold, and each failure mode breaks it."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dmref.emulation import get_format
from dmref.proofs import checks
from dmref.proofs.consistent_p import FAILURES, consistent_p_case, quantize_scaled
from dmref.proofs.rational import quantize_exact


@given(seed=st.integers(0, 2**20), n_q=st.integers(1, 4), n_k=st.integers(1, 9),
       d=st.integers(1, 8), causal=st.booleans())
def test_consistent_p_rowsum_is_exactly_zero_in_rationals(seed, n_q, n_k, d, causal):
    case = consistent_p_case("", seed, n_q, n_k, d, mask="causal" if causal else None)
    assert all(all(row) for row in case.grids_agree)
    assert case.residuals == [0] * n_q


@given(seed=st.integers(0, 2**20), n_k=st.integers(2, 9))
def test_consistent_p_grids_disagree_only_at_the_subnormal_or_saturation_edge(seed, n_k):
    """Different power-of-two scales and lazy rescaling: every entry where the forward and
    backward P differ has an encoded value outside the normal range (scale invariance holds
    everywhere else); and if no entry differs the residual is zero."""
    case = consistent_p_case("grid_edge", seed, 3, n_k, 4)
    for agree_row, edge_row in zip(case.grids_agree, case.edge_entries):
        assert all(edge for agree, edge in zip(agree_row, edge_row) if not agree)
    if all(all(row) for row in case.grids_agree):
        assert case.residuals == [0] * 3


@pytest.mark.parametrize("failure", sorted(FAILURES))
def test_consistent_p_fails_when_its_condition_is_dropped(failure):
    case = checks.check_consistent_p(failure)
    assert case.max_abs_residual != 0


def test_consistent_p_fails_at_the_fp8_subnormal_edge():
    case = checks.check_consistent_p("grid_edge")
    disagree = [(i, j) for i, row in enumerate(case.grids_agree)
                for j, ok in enumerate(row) if not ok]
    assert disagree and all(case.edge_entries[i][j] for i, j in disagree)


@given(code=st.integers(0, 0x7D), c=st.integers(-12, 12), frac=st.fractions(0, 1))
def test_power_of_two_scaling_commutes_with_rounding_in_the_normal_range(code, c, frac):
    """Lemma (scale invariance): Q(2**c y) = 2**c Q(y) when y and 2**c y are in [min_normal,
    max]; y is a finite code's value plus a fraction of the gap to the next one (0x7E = max
    has no next finite code)."""
    fmt = get_format("e4m3")
    lo, hi = Fraction(fmt.min_normal), Fraction(fmt.max)
    y = Fraction(fmt.value(code)) + frac * Fraction(fmt.value(code + 1) - fmt.value(code))
    scaled = y * Fraction(2) ** c
    if lo <= y <= hi and lo <= scaled <= hi:
        assert quantize_exact(scaled, fmt) == Fraction(2) ** c * quantize_exact(y, fmt)
        assert quantize_scaled(y, fmt, c) == quantize_exact(y, fmt)


def test_power_of_two_scaling_does_not_commute_below_the_normal_range():
    """The counterexample of consistent_p.md: 1.125 is exact in e4m3, 1.125 * 2**-8 is
    subnormal there and rounds to 2**-8."""
    fmt = get_format("e4m3")
    y = Fraction(9, 8)
    assert quantize_exact(y, fmt) == y
    assert quantize_exact(y / 256, fmt) == Fraction(1, 256) != y / 256


def _hopper_case(seed: int, n_k: int, promote):
    from dmref.proofs.consistent_p import consistent_p_backward
    from dmref.proofs.counterexamples import random_problem

    q, k, v, do = random_problem(seed, 2, n_k, 64, spread=2.0)
    return consistent_p_backward(3 * q, k, v, do, v_blocking="tensor", block=64,
                                 accumulation="hopper", promote_every=promote)


@pytest.mark.parametrize("seed,n_k,promote", [(0, 40, None), (1, 33, 32)])
def test_consistent_p_rowsum_within_theorem_9b_bound_under_hopper_accumulation(seed, n_k, promote):
    case = _hopper_case(seed, n_k, promote)
    assert all(abs(r) <= b for r, b in zip(case.residuals, case.hopper_bound))
    assert case.max_abs_residual != 0  # the tensor core breaks the exact zero of Theorem 9


@pytest.mark.slow
@given(seed=st.integers(0, 2**20), n_k=st.integers(1, 70), promote=st.sampled_from([None, 32, 64]))
def test_consistent_p_rowsum_within_theorem_9b_bound_on_generated_inputs(seed, n_k, promote):
    case = _hopper_case(seed, n_k, promote)
    assert all(abs(r) <= b for r, b in zip(case.residuals, case.hopper_bound))
