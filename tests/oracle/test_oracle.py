"""dmref.oracle.check: known answers pass at their dtype's derived bounds, each planted bug fails
the check that names it, recipe claims are held to the recipe."""

from __future__ import annotations

import json
import math

import planted
import pytest
import torch

from dmref import oracle

# A subset of the quick set that still has every kind of case the bugs need: the default and a
# non-default softmax scale, causal and not, a tail length, cross attention.
_NAMES = ["realistic", "realistic_causal", "peaked_rows", "flat_rows", "tail_lengths", "cross_tail"]


def _cases(dtype=torch.bfloat16, names=_NAMES):
    return oracle.make_cases("quick", dtype=dtype, names=names)


def _attention_f64(q, k, v, *, causal, scale, mask=None):
    """An independent float64 attention through torch.autograd (softmax's own backward); GQA by
    repeat_interleave (autograd sums dK, dV over each group); boolean or additive masks."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    s = scale * (q @ k.transpose(-1, -2))
    if causal:
        n_q, n_k = s.shape[-2:]
        keep = torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q)
        s = s.masked_fill(~keep, -math.inf)
    if mask is not None and mask.dtype == torch.bool:
        s = s.masked_fill(~mask, -math.inf)
    elif mask is not None:
        # -inf through masked_fill, whose backward is zero there: fully masked rows (softmax
        # NaN) then get zero gradients, where s + mask would let softmax's NaN through
        finite = torch.isfinite(mask)
        s = (s + torch.where(finite, mask, 0.0)).masked_fill(~finite, -math.inf)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # fully masked rows: zero
    return p @ v


_attention_f64.causal_alignment = "bottom_right"  # tril(n_k - n_q)


# ----------------------------------------------------------------------------------------------
# Known answers
# ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_float64_autograd_attention_passes_at_float64_bounds():
    report = oracle.check(_attention_f64, cases=oracle.make_cases("quick", dtype=torch.float64), dtype=torch.float64)
    report.raise_for_failures()
    # every case ran, the masked ones, GQA and the additive mask included (the function takes
    # mask), but the window and document cases (it takes neither argument)
    assert {(c.case, c.unsupported) for c in report.skipped} == {
        (n, f) for n, f in (("sliding_window", "window"), ("local_window", "window"), ("documents", "documents"),
                            ("documents_bidirectional", "documents"))}
    assert {"gqa", "additive_mask", "fully_masked_rows"} <= {c.name for c in report.cases}
    assert all(c.probe_valid is not False for c in report.cases)


def test_flash_style_implementation_passes_gqa_and_both_kinds_of_mask():
    report = oracle.check(planted.flash_masked, cases=_cases(names=["gqa", "additive_mask", "fully_masked_rows"]))
    report.raise_for_failures()
    assert not report.skipped


def test_flash_style_bf16_implementation_passes():
    """planted.flash: FlashAttention-2's numerics in float32 with a BF16 output and the stale D
    from the BF16 output; its BF16-level stale delta is within the BF16 baseline's."""
    report = oracle.check(planted.flash, cases=_cases())
    report.raise_for_failures()


# ----------------------------------------------------------------------------------------------
# Planted bugs
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bug", sorted(planted.BUGS))
def test_planted_bug_fails_the_check_that_names_it(bug):
    fn, check_name = planted.BUGS[bug]
    report = oracle.check(fn, cases=_cases())
    assert not report.passed
    assert check_name in report.failed_names(), report.summary()
    # the forward is right in every planted backward bug
    assert "out" not in report.failed_names()


@pytest.mark.parametrize("bug", sorted(planted.CASE_BUGS))
def test_case_specific_bug_fails_the_checks_that_name_it(bug):
    """A wrong kv-head grouping in dK/dV fails dk and dv of the gqa case; an additive mask
    dropped in the backward fails the gradients, one added before the softmax scale the output."""
    fn, case, must_fail, must_pass = planted.CASE_BUGS[bug]
    report = oracle.check(fn, cases=_cases(names=[case]))
    assert must_fail <= report.failed_names(), report.summary()
    assert not must_pass & report.failed_names(), report.summary()
    # the same implementation without the bug passes that case (flash_masked takes the mask)
    oracle.check(planted.flash_masked, cases=_cases(names=[case])).raise_for_failures()


def test_new_cases_are_gqa_and_an_additive_mask_on_the_input_grid():
    gqa, additive = _cases(names=["gqa", "additive_mask"])
    assert gqa.kv_heads >= 2 and gqa.q.shape[1] == 4 * gqa.kv_heads and gqa.causal
    assert gqa.shape == f"1x{4 * gqa.kv_heads}/{gqa.kv_heads}x128x64"
    m = additive.mask
    assert m.dtype == additive.q.dtype  # rounded like the inputs: fn and the reference see one mask
    finite = torch.isfinite(m)
    assert bool((m[finite] <= 0).all()) and bool((m[finite] < 0).any())  # a bias, not only -inf
    assert bool((~finite).any(dim=-1).any()) and bool((~finite).all(dim=-1).any())  # some -inf; rows all -inf


def test_naive_softmax_fails_fully_masked_rows_of_an_additive_mask():
    """softmax over a row of -inf is NaN: the additive mask exercises the zero-row path too."""
    def naive(q, k, v, *, causal, scale, mask=None):
        s = scale * (q.float() @ k.float().transpose(-1, -2)) + mask.float()
        return (torch.softmax(s, dim=-1) @ v.float()).to(q.dtype)

    report = oracle.check(naive, cases=_cases(names=["additive_mask"]))
    assert "finite" in report.failed_names()


def test_a_case_the_implementation_cannot_do_is_skipped_not_failed():
    def mha_only(q, k, v, *, causal, scale):
        if q.shape[1] != k.shape[1]:
            raise NotImplementedError("no GQA")
        return oracle.sdpa_math(q, k, v, causal=causal, scale=scale)

    report = oracle.check(mha_only, cases=_cases(names=["gqa", "realistic"]))
    assert report.passed
    skipped = [c for c in report.skipped if c.name == "runs"]
    assert [(c.case, c.name) for c in skipped] == [("gqa", "runs")]
    assert "no GQA" in skipped[0].detail


def test_backward_only_bugs_fail_only_where_they_apply():
    # a causal mask dropped in the backward: only causal cases fail
    report = oracle.check(planted.flash_bwd_causal, cases=_cases())
    causal = {c.name for c in _cases() if c.causal}
    assert report.failed_cases() == causal
    # the backward's default scale: only the cases with a non-default scale fail
    report = oracle.check(planted.flash_bwd_scale, cases=_cases())
    default = {c.name for c in _cases() if math.isclose(c.scale, 1 / math.sqrt(c.q.shape[-1]))}
    assert report.failed_cases() == {c.name for c in _cases()} - default


def test_dk_transpose_fails_only_dk():
    report = oracle.check(planted.flash_dk_transpose, cases=_cases(names=["realistic", "tail_lengths"]))
    assert report.failed_names() == {"dk"}


def test_stale_delta_shows_as_a_rowsum_residual_and_a_dq_bias_along_kbar():
    report = oracle.check(planted.flash_stale_delta, cases=_cases(names=["realistic", "tail_lengths"]))
    assert {"rowsum", "dq"} <= report.failed_names()
    correct = oracle.check(planted.flash, cases=_cases(names=["realistic", "tail_lengths"]))
    for bad, good in zip(report.cases, correct.cases):
        assert bad.rowsum_rms > 2 * good.rowsum_rms
        # the error of dQ lies along kbar_i, as the stale-delta algebra predicts
        assert bad.dq_bias_fraction > 1 - 1 / bad_head_dim(bad)


def bad_head_dim(case_result) -> int:
    return int(case_result.shape.split("x")[-1])


def test_wrong_quantization_axis_fails_recipe_agreement():
    report = oracle.check(planted.naive_fp8_wrong_axis, recipe="naive_fp8", cases=_cases(names=["outlier_channels"]))
    assert {n for n in report.failed_names()} & {"agree_out", "agree_dq", "agree_dk", "agree_dv"}
    # its errors against exact attention are no larger than the recipe's: only agreement sees it
    assert not report.failed_names() & {"out", "dq", "dk", "dv"}


def test_stale_fp8_recipe_fails_a_delta_matching_claim_in_every_case():
    """Even on Gaussian inputs (flat rows, tails), where naive_fp8's stale delta is only 1.5-2x
    Delta-Matching's FP8 dS-rounding noise, the probe's reading exceeds the claimed recipe's."""
    names = ["realistic", "peaked_rows", "flat_rows", "tail_lengths"]
    report = oracle.check(oracle.emulated("naive_fp8"), recipe="delta_matching", cases=_cases(names=names))
    assert report.failed_cases("rowsum") == set(names)
    honest = oracle.check(oracle.emulated("delta_matching"), recipe="delta_matching", cases=_cases(names=names))
    honest.raise_for_failures()


def test_other_accumulation_model_of_a_recipe_passes_its_claim():
    """The Hopper FP8 accumulation model of naive_fp8 makes naive_fp8's rounding errors up to
    rare FP8 rounding flips: a faithful implementation, agreement passes."""
    report = oracle.check(oracle.emulated("naive_fp8@hopper"), recipe="naive_fp8",
                          cases=_cases(names=["realistic_causal"]))
    report.raise_for_failures()


# ----------------------------------------------------------------------------------------------
# The report and the errors
# ----------------------------------------------------------------------------------------------


def test_masked_cases_are_skipped_for_a_function_without_mask():
    report = oracle.check(planted.flash, cases=_cases(names=["fully_masked_rows"]))
    assert [c.name for c in report.skipped] == ["runs"]
    assert not report.passed  # nothing ran: not a pass


def test_nan_output_fails_the_finite_check():
    def nan_attention(q, k, v, *, causal, scale):
        return oracle.sdpa_math(q, k, v, causal=causal, scale=scale) * float("nan")

    report = oracle.check(nan_attention, cases=_cases(names=["realistic"]))
    assert "finite" in report.failed_names()


def test_an_exception_of_the_implementation_is_a_failed_run():
    def broken(q, k, v, *, causal, scale):
        raise RuntimeError("kernel launch failed")

    report = oracle.check(broken, cases=_cases(names=["realistic"]))
    (failed,) = report.failed
    assert failed.name == "runs" and "kernel launch failed" in failed.detail


def test_wrong_signature_is_a_type_error_naming_the_expected_call():
    with pytest.raises(TypeError, match=r"fn\(q, k, v, \*, causal, scale\)"):
        oracle.check(planted.wrong_signature, cases=_cases(names=["realistic"]))


def test_report_round_trips_through_json_and_renders_a_table():
    report = oracle.check(planted.flash_dk_transpose, cases=_cases(names=["realistic"]))
    data = json.loads(json.dumps(report.as_dict()))
    assert data["passed"] is False and "realistic:dk" in data["failed"]
    assert {c["name"] for c in data["checks"]} >= {"runs", "out", "dq", "dk", "dv", "rowsum"}
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(report.table())
    assert "FAIL" in console.export_text()
    with pytest.raises(AssertionError, match="realistic:dk"):
        report.raise_for_failures()


# ----------------------------------------------------------------------------------------------
# Optional features: unsupported, not failed, unless required
# ----------------------------------------------------------------------------------------------


def test_an_exception_in_an_optional_feature_case_is_unsupported_not_a_failure():
    report = oracle.check(planted.mha_only, cases=_cases(names=["realistic", "gqa"]))
    assert report.passed, report.summary()
    (unsupported,) = report.unsupported
    assert unsupported.case == "gqa" and unsupported.unsupported == "gqa"
    assert "RuntimeError" in unsupported.detail
    assert "UNSUPPORTED" in report.summary() and "gqa (gqa: RuntimeError" in report.summary()
    data = json.loads(report.to_json())
    assert data["unsupported"][0]["feature"] == "gqa"


def test_a_required_feature_fails_when_the_implementation_cannot_do_it():
    report = oracle.check(planted.mha_only, cases=_cases(names=["realistic", "gqa", "additive_mask"]),
                          require=("gqa", "mask"))
    assert report.failed_cases("runs") == {"gqa", "additive_mask"}
    assert not report.unsupported
    with pytest.raises(ValueError, match="require"):
        oracle.check(planted.mha_only, cases=_cases(names=["realistic"]), require=("sliding_window",))


def test_wrong_grouping_still_fails_where_gqa_is_optional():
    """The kv_grouping bug runs (no exception): a numerical failure, never unsupported."""
    report = oracle.check(planted.flash_kv_grouping, cases=_cases(names=["gqa"]))
    assert {"dk", "dv"} <= report.failed_names() and not report.unsupported


def test_not_implemented_in_a_core_case_fails():
    def no_causal(q, k, v, *, causal, scale):
        if causal:
            raise NotImplementedError("no causal")
        return oracle.sdpa_math(q, k, v, causal=causal, scale=scale)

    report = oracle.check(no_causal, cases=_cases(names=["realistic_causal"]))
    assert report.failed_cases("runs") == {"realistic_causal"}


def test_a_case_that_outlives_the_timeout_fails_and_stops_the_check():
    report = oracle.check(planted.hangs, cases=_cases(names=["realistic", "tail_lengths"]), timeout=0.5)
    first, second = report.checks
    assert first.passed is False and first.detail.startswith("timed out after 0.5 s")
    assert second.passed is None and "timed out" in second.detail


def test_a_zero_baseline_excess_still_admits_rounding_to_the_dtype():
    """An implementation equal to the exact result rounded to BF16, plus one more BF16 rounding
    step on every element, passes where the baseline's error lies within the float32 floor (a
    bound of 2 x 0); one that errs by 4 roundings on one element of dK fails."""
    import torch

    (case,) = _cases(names=["realistic"])
    ex = oracle.exact_reference(case)

    def rounded(extra):
        class Fixed(torch.autograd.Function):
            @staticmethod
            def forward(ctx, q, k, v):
                return ex.out.to(torch.bfloat16)

            @staticmethod
            def backward(ctx, g):
                dk = ex.dk.clone()
                dk.view(-1)[dk.abs().argmax()] *= 1 + extra
                return tuple(t.to(torch.bfloat16) for t in (ex.dq, dk, ex.dv))

        def fn(q, k, v, *, causal, scale):
            return Fixed.apply(q, k, v)

        return fn

    u = oracle.rounding_allowance(torch.bfloat16)
    assert u == 2.0**-8
    oracle.check(rounded(u), cases=[case], probe=False).raise_for_failures()
    report = oracle.check(rounded(8 * u), cases=[case], probe=False)
    assert report.failed_names() == {"dk"}, report.summary()


def test_a_device_fault_fails_its_case_and_stops_the_rest_instead_of_blaming_them():
    """A CUDA error (misaligned or illegal access) leaves the process's CUDA context unusable:
    the faulting case fails ``runs``, is never taken for an unsupported feature, and the cases
    after it are reported as not run rather than failed."""
    calls = {"causal": 0}

    def faults_once(q, k, v, *, causal, scale):
        calls["causal"] += causal
        if causal and calls["causal"] == 1:  # the first call of the first causal case
            raise RuntimeError("CUDA error: misaligned address")
        return oracle.sdpa_math(q, k, v, causal=causal, scale=scale)

    report = oracle.check(faults_once, cases=_cases())
    runs = [c for c in report.checks if c.name == "runs"]
    failed = [c for c in runs if c.passed is False]
    assert len(failed) == 1 and failed[0].detail.startswith("device-side fault: RuntimeError: CUDA error")
    later = runs[runs.index(failed[0]) + 1:]
    assert later and all(c.passed is None and c.detail.startswith("not run: ") for c in later)
    assert not report.passed


def test_a_pv_chain_over_all_keys_fails_a_promoted_claim_on_long_averages():
    """An implementation that accumulates P V in one tensor-core chain over all keys (FA3's
    forward; ``Recipe.pv_chain``) while it claims the promoted recipe: the chain's accumulator
    outgrows the products of a long, flat row and truncates them (docs/kernels_speed.md), which
    only ``long_average`` shows. The honest implementation passes it."""
    from dataclasses import replace

    from dmref import get_recipe

    promoted = get_recipe("kernels_folded_naive_fp8")
    assert not promoted.pv_chain
    chained = replace(promoted, name="kernels_folded_naive_fp8_pv_chained", pv_chain=True)
    report = oracle.check(oracle.emulated(chained), recipe=promoted, cases=_cases(names=["long_average"]))
    assert "agree_out" in report.failed_names()
    oracle.check(oracle.emulated(promoted), recipe=promoted, cases=_cases(names=["long_average"])).raise_for_failures()
