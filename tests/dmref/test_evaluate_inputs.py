"""dmref.evaluate never reports a finite diagnostic computed from non-finite data, and refuses
inputs it cannot compare: non-finite q, k, v, dout, and exact results of another problem."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from dmref_problems import make_inputs

import dmref
from dmref import diagnostics

_SHAPE = dict(batch=1, heads=2, kv_heads=1, seqlen_q=33, seqlen_k=33, head_dim=16, head_dim_v=16)
#: every Report field derived from dS's row sums or from dQ's error direction
_ROWSUM_AND_BIAS = ("rowsum_residual_max", "rowsum_residual_mean", "rowsum_residual_after_quant_max",
                    "rowsum_residual_after_quant_mean", "rowsum_residual_after_quant_dk_max",
                    "rowsum_bound_max", "rowsum_over_bound_max", "dq_bias_fraction")


@pytest.mark.parametrize("name", ["q", "k", "v", "dout"])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_inputs_are_refused_naming_the_input(name, bad):
    inputs = dict(zip(("q", "k", "v", "dout"), make_inputs(_SHAPE, 0, dtype=torch.float32)))
    inputs[name] = torch.full_like(inputs[name], bad)
    kind = "NaN" if math.isnan(bad) else "inf"
    with pytest.raises(ValueError, match=rf"^{name} holds \d+ non-finite value\(s\) \({kind}\)"):
        dmref.evaluate(*inputs.values(), "naive_fp8")


def test_v_times_1e300_in_float32_is_refused():
    """The issue's example: float32 v * 1e300 is inf."""
    q, k, v, dout = make_inputs(_SHAPE, 1, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"^v holds .*\(inf\)"):
        dmref.evaluate(q, k, v * 1e300, dout, "naive_fp8")


def test_an_overflow_inside_the_recipe_gives_nan_diagnostics_and_names_the_results():
    """float64 v * 1e300 is finite; naive_fp8's float32 arithmetic overflows on it. Every
    row-sum and bias diagnostic is then NaN, and Report.nonfinite names what overflowed."""
    q, k, v, dout = make_inputs(_SHAPE, 2)
    report, _ = dmref.evaluate(q, k, v * 1e300, dout, "naive_fp8")
    assert {"dS", "dq"} <= set(report.nonfinite)
    for name in _ROWSUM_AND_BIAS:
        assert math.isnan(getattr(report, name)), name


def test_finite_results_report_finite_diagnostics_and_no_nonfinite():
    """The counterpart: the same problem at its own scale is all finite (the test above is not
    passing because every report is NaN)."""
    q, k, v, dout = make_inputs(_SHAPE, 2)
    report, _ = dmref.evaluate(q, k, v, dout, "naive_fp8")
    assert report.nonfinite == ()
    assert all(math.isfinite(getattr(report, name)) for name in _ROWSUM_AND_BIAS)


def test_dq_bias_split_of_a_nan_error_is_nan():
    dq = torch.ones(1, 1, 3, 4, dtype=torch.float64)
    dq_nan = dq.clone()
    dq_nan[0, 0, 1, 2] = math.nan
    assert math.isnan(diagnostics.dq_bias_split(dq_nan, dq, dq)[2])
    assert diagnostics.dq_bias_split(dq, dq, dq)[2] == 0.0  # no error at all: nothing along kbar


def test_exact_of_the_same_problem_gives_the_same_report():
    q, k, v, dout = make_inputs(_SHAPE, 3)
    exact = diagnostics.exact_results(q, k, v, dout, causal=True)
    with_exact, _ = dmref.evaluate(q, k, v, dout, "naive_fp8", causal=True, exact=exact)
    without, _ = dmref.evaluate(q, k, v, dout, "naive_fp8", causal=True)
    assert with_exact.as_dict() == without.as_dict()


@pytest.mark.parametrize("change, named", [
    (dict(seed=4), "q, k, v, dout"),
    (dict(causal=False), "causal"),
    (dict(scale=0.5), "scale"),
    (dict(v_plus=1.0), "v"),
])
def test_exact_of_another_problem_is_refused(change, named):
    q, k, v, dout = make_inputs(_SHAPE, 3)
    exact = diagnostics.exact_results(q, k, v, dout, causal=True)
    if "seed" in change:
        q, k, v, dout = make_inputs(_SHAPE, change["seed"])
    v = v + change.get("v_plus", 0.0)
    with pytest.raises(ValueError, match=rf"exact holds the results of another problem: its {named} differ"):
        dmref.evaluate(q, k, v, dout, "naive_fp8", causal=change.get("causal", True),
                       scale=change.get("scale"), exact=exact)


def test_exact_without_a_fingerprint_is_refused():
    """Exact built by hand (no record of its problem) cannot be checked, so it is not taken."""
    q, k, v, dout = make_inputs(_SHAPE, 5)
    exact = dataclasses.replace(diagnostics.exact_results(q, k, v, dout), problem={})
    with pytest.raises(ValueError, match="another problem: its q, k, v, dout, mask, causal, scale differ"):
        dmref.evaluate(q, k, v, dout, "naive_fp8", exact=exact)
