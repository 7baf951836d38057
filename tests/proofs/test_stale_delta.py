"""Proposition 2 of dmref/proofs/stale_delta.md: the effect of a stale delta, exactly, and the
spurious -sum_i delta_i LSE_i term, through torch.autograd in float64."""

from __future__ import annotations

from fractions import Fraction

from hypothesis import given
from hypothesis import strategies as st

from dmref.proofs import checks


@given(seed=st.integers(0, 2**20), n_q=st.integers(1, 4), n_k=st.integers(1, 5),
       d=st.integers(1, 8), causal=st.booleans())
def test_stale_delta_changes_dq_dk_and_rowsum_by_the_closed_forms(seed, n_q, n_k, d, causal):
    effects = checks.check_stale_delta_effects(seed, n_q=n_q, n_k=n_k, d=d,
                                               mask="causal" if causal else None)
    assert effects.rowsum == effects.rowsum_predicted
    assert effects.dq_change == effects.dq_predicted
    assert effects.dk_change == effects.dk_predicted


@given(seed=st.integers(0, 2**20), deltas=st.lists(
    st.fractions(min_value=-4, max_value=4, max_denominator=2**20), min_size=3, max_size=3))
def test_any_stale_delta_gives_dq_error_minus_tau_delta_kbar(seed, deltas):
    effects = checks.check_stale_delta_effects(seed, n_q=3,
                                               delta_error=[Fraction(x) for x in deltas])
    assert effects.holds


@given(seed=st.integers(0, 2**20), n_q=st.integers(1, 6), n_k=st.integers(1, 40),
       d=st.sampled_from([1, 4, 16, 64]), logit_scale=st.sampled_from([0.1, 1.0, 8.0, 30.0]))
def test_stale_delta_is_gradient_of_spurious_lse_term(seed, n_q, n_k, d, logit_scale):
    result = checks.check_spurious_lse_gradient(seed, n_q, n_k, d, logit_scale)
    assert (result.grad_s_error <= result.grad_s_bound).all()
    assert (result.grad_q_error <= result.grad_q_bound).all()
