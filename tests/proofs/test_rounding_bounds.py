"""Theorem 3, Lemmas 4-5 and Corollary 6 of dmref/proofs/rounding_bounds.md against the emulated
float32 pipeline of dmref.proofs.fp32_pipeline ("Delta-Matching holds"), and the stale delta
against the same bound ("stale delta fails visibly")."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dmref.proofs import bounds, checks
from dmref.proofs.counterexamples import counterexample_a4_fp32
from dmref.proofs.fp32_pipeline import attention_inputs, fp32_backward, forward_lse

#: "Orders of magnitude" in the claim "stale delta exceeds the bound by orders of magnitude".
ORDERS_OF_MAGNITUDE = 2


@st.composite
def attention_problems(draw, max_seqlen: int = 160):
    """Shapes with tails and length 1, GQA/MQA, outlier channels, peaked rows, masks."""
    heads, kv_heads = draw(st.sampled_from([(1, 1), (2, 1), (4, 2), (2, 2)]))
    seqlen = draw(st.sampled_from([1, 2, 7, 33, 64, 113, max_seqlen]))
    head_dim = draw(st.sampled_from([16, 40, 64]))
    inputs = attention_inputs(
        draw(st.integers(0, 2**31 - 1)), heads=heads, kv_heads=kv_heads, seqlen=seqlen,
        head_dim=head_dim, outlier_channels=draw(st.sampled_from([0, 1, 4])),
        outlier_scale=draw(st.sampled_from([4.0, 20.0, 100.0])),
        peaked=draw(st.sampled_from([0.0, 1.0, 3.0])))
    options = dict(
        causal=draw(st.booleans()),
        padding=draw(st.integers(0, min(seqlen, 5))),
        fmt_qk=draw(st.sampled_from(["e4m3", "e5m2"])),
        fmt_do=draw(st.sampled_from(["e4m3", "e5m2"])),
        block=draw(st.sampled_from([16, 32, head_dim])),
    )
    return inputs, options


@given(problem=attention_problems())
def test_delta_matching_rowsum_within_fp32_bound(problem):
    (q, k, v, do), options = problem
    result = checks.check_fp32_residual_bound(q, k, v, do, delta="matched", **options)
    assert (result.residual <= result.bounds_by_name["matched"]).all()
    assert (result.residual <= result.bounds_by_name["matched_a_priori"]).all()


@given(problem=attention_problems())
def test_normalized_delta_rowsum_within_fp32_bound(problem):
    (q, k, v, do), options = problem
    result = checks.check_fp32_residual_bound(q, k, v, do, delta="matched_normalized", **options)
    assert result.holds


@given(problem=attention_problems())
def test_operand_matched_rowsum_within_theorem_8_bound_with_fp32_dp(problem):
    (q, k, v, do), options = problem
    result = checks.check_fp32_residual_bound(q, k, v, do, delta="operand_matched", **options)
    assert result.holds


@given(problem=attention_problems())
def test_recomputed_p_row_mass_within_lemmas_4_and_5(problem):
    """|1 - sum_j P_ij| <= rho (Lemma 4 with lambda of Lemma 5), and the l1 distance to the
    exact softmax of the same float32 logits <= rho as well (measured against the float64
    softmax, whose own l1 error is softmax_l1_error_bound in float64)."""
    (q, k, v, do), options = problem
    run = fp32_backward(q, k, v, do, **options)
    seen = run.visible > 0
    rho = bounds.rowmass_defect_bound(run.visible, bounds.lse_error_bound(run.visible, run.row_max))
    assert (np.abs(1.0 - run.mass)[seen] <= rho[seen]).all()
    s64 = run.s.double().reshape(-1, run.s.shape[-1])
    soft64 = torch.softmax(s64[seen], dim=-1).numpy()
    p = run.p.double().reshape(-1, run.p.shape[-1]).numpy()[seen]
    rho64 = bounds.softmax_l1_error_bound(run.visible[seen], 0.0, bounds.FP64)
    l1 = np.abs(p - soft64).sum(axis=-1) * (1 + bounds.gamma(p.shape[-1], bounds.FP64.u))
    assert (l1 <= rho[seen] + rho64).all()


@given(problem=attention_problems(max_seqlen=64))
def test_value_matched_rowsum_within_fp32_bound_with_hopper_dp(problem):
    """Theorem 3 takes dP as given: a Hopper-accumulated dP changes nothing."""
    (q, k, v, do), options = problem
    options.pop("block")
    result = checks.check_fp32_residual_bound(q, k, v, do, delta="matched",
                                              dp_accumulation="hopper", **options)
    assert result.holds


@given(problem=attention_problems(max_seqlen=64), promote=st.sampled_from([None, 32]))
def test_operand_matched_rowsum_within_theorem_8_bound_with_hopper_dp(problem, promote):
    (q, k, v, do), options = problem
    options.pop("block")
    result = checks.check_fp32_residual_bound(q, k, v, do, delta="operand_matched",
                                              dp_accumulation="hopper", promote_every=promote,
                                              **options)
    assert result.holds


@pytest.mark.slow
@pytest.mark.parametrize("seed,causal,kv_heads", [(0, True, 1), (1, False, 2)])
def test_delta_matching_rowsum_within_fp32_bound_on_long_sequences(seed, causal, kv_heads):
    q, k, v, do = attention_inputs(seed, heads=2, kv_heads=kv_heads, seqlen=2048, head_dim=128,
                                   outlier_channels=4, peaked=2.0)
    for delta in ("matched", "matched_normalized"):
        assert checks.check_fp32_residual_bound(q, k, v, do, delta=delta, causal=causal).holds


@given(seed=st.integers(0, 2**20), n_q=st.integers(1, 4), n_k=st.integers(1, 9),
       d=st.integers(1, 9))
def test_fp32_counterexample_of_A4_is_within_theorem_3_bound(seed, n_q, n_k, d):
    case = counterexample_a4_fp32(seed, n_q, n_k, d)
    a = np.array([float(x) for x in case.abs_products])
    n = np.array([sum(r) for r in case.cols_ds], dtype=float)
    bound = bounds.matched_residual_bound(a, n, np.ones_like(a))  # rows sum to exactly 1
    assert all(abs(float(r)) <= b for r, b in zip(case.residuals, bound))


@functools.lru_cache(maxsize=1)
def _table() -> dict[str, dict]:
    """The figures' problem (outlier channels, peaked rows, causal) at a test-sized length."""
    return {r["strategy"]: r for r in checks.residual_table(seqlen=128, heads=2)}


def test_stale_delta_exceeds_fp32_bound_by_orders_of_magnitude():
    rows = _table()
    for stale in ("stale_bf16", "stale_fp8"):
        ratio = rows[stale]["rel_residual_mean"] / rows["matched"]["fp32_bound_max"]
        assert ratio > 10.0**ORDERS_OF_MAGNITUDE
    assert rows["matched"]["fraction_of_rows_above_bound"] == 0.0


def test_dividing_delta_by_row_mass_removes_the_lse_rounding_term():
    """Corollary 6 in numbers: on large logits the matched residual is dominated by
    D (1 - sigma), and dividing D by sigma brings it down to the gamma_n level."""
    rows = _table()
    g = bounds.gamma(128) + 2 * bounds.gamma(2)
    assert rows["matched_normalized"]["rel_residual_max"] <= g
    assert rows["matched"]["rel_residual_max"] > rows["matched_normalized"]["rel_residual_max"]


# ---------------------------------------------------------------------------------------------
# The arithmetic the lemmas assume of this torch build
# ---------------------------------------------------------------------------------------------
def _ulp_model_holds(y32: np.ndarray, y64: np.ndarray, model=bounds.FP32) -> bool:
    """|y32 - y| <= e |y| + h with y the exact value, y64 within 2 u64 |y| of it."""
    err = np.abs(y32.astype(np.float64) - y64)
    slack = 2.0 * bounds.FP64.u * np.abs(y64)
    return bool(np.all(err <= model.exp_rel_err * np.abs(y64) * (1 + 2 * bounds.FP64.u)
                       + model.exp_abs_err + slack))


def test_torch_float32_exp_is_within_the_assumed_ulps():
    g = torch.Generator().manual_seed(0)
    x = torch.cat([-104.0 * torch.rand(1 << 20, generator=g), torch.tensor([0.0, -87.0, -103.9])])
    y32 = torch.exp(x).numpy()
    y64 = np.exp(x.double().numpy())
    assert _ulp_model_holds(y32, y64)


def test_torch_float32_log_is_within_the_assumed_ulps():
    g = torch.Generator().manual_seed(1)
    x = torch.cat([1.0 + 4096.0 * torch.rand(1 << 20, generator=g),
                   1.0 + torch.rand(1 << 16, generator=g) * 2.0**-10])
    y32 = torch.log(x).numpy()
    y64 = np.log(x.double().numpy())
    assert _ulp_model_holds(y32, y64)


def test_forward_lse_is_within_lemma_5():
    q, k, _, _ = attention_inputs(3, heads=2, seqlen=97, head_dim=64, outlier_channels=2,
                                  peaked=2.0)
    s = (q @ k.transpose(-1, -2)) / 8.0
    lse32 = forward_lse(s).double()
    exact = torch.logsumexp(s.double(), dim=-1)  # float64: within lse_error_bound(FP64)
    n = s.shape[-1]
    m_abs = s.amax(-1).abs().double().numpy()
    lam = bounds.lse_error_bound(n, m_abs) + bounds.lse_error_bound(n, m_abs, bounds.FP64)
    assert ((lse32 - exact).abs().numpy() <= lam).all()


# ---------------------------------------------------------------------------------------------
# The bound formulas themselves
# ---------------------------------------------------------------------------------------------
def test_gamma_is_n_u_over_one_minus_n_u():
    u = bounds.unit_roundoff()
    assert u == 2.0**-24
    assert bounds.gamma(1) == u / (1 - u)
    with pytest.raises(ValueError):
        bounds.gamma(2**24)


def test_matched_bound_reduces_to_gamma_terms_when_mass_is_one():
    n = 1024.0
    first_order = bounds.gamma(n) + 2 * bounds.gamma(2)
    coef = bounds.matched_residual_bound(1.0, n, 1.0)
    # Dmax (|1 - sigma| = 2**-52 slack) and second-order terms only
    assert first_order <= coef <= first_order * (1 + 2 * bounds.gamma(n)) + 4 * 2.0**-52


def test_hopper_step_growth_is_derived_from_the_bit_widths():
    m = bounds.HOPPER
    assert bounds.step_growth(m) == (32 + 1) * 2.0**-m.term_frac_bits + 2.0**-(m.result_bits - 1)
    assert bounds.hopper_chain_growth(4) == 4 * bounds.step_growth(m)
