"""dmref.testing: the strategies produce what they say, the assertions fail with useful messages
exactly when they should, and the pytest plugin gives a user's test the oracle in three lines."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings

from dmref import emulation, oracle, testing

E4M3 = emulation.get_format("float8_e4m3fn")


@given(codes=testing.fp8_codes("float8_e4m3fn"))
@settings(max_examples=30)
def test_fp8_codes_are_finite_codes_of_the_format(codes):
    assert codes.dtype == torch.uint8
    assert not bool(torch.isnan(emulation.decode(codes, E4M3)).any())


@given(sample=testing.block_scaled_tensors("float8_e4m3fn", block="1x32", scale_rule="pow2_down"))
@settings(max_examples=20)
def test_block_scaled_tensors_dequantize_within_half_a_step_of_x(sample):
    x, codes, scales, block = sample
    back = emulation.dequantize_blocked(codes, scales, E4M3, block=block)
    one = emulation.encode(torch.tensor([1.0]), E4M3)[0]
    scale = emulation.dequantize_blocked(torch.full_like(codes, int(one)), scales, E4M3, block=block)
    # pow2_down never saturates: every element is within half a grid step of x, the step being
    # at most eps |x| (normal) or the scale times the smallest subnormal (subnormal range)
    half_step = torch.maximum(x.abs().double() * E4M3.eps, scale * E4M3.min_subnormal) / 2
    testing.assert_within_bound(back, x.double(), half_step)


@given(case=testing.attention_problems(dtype=torch.float32, max_seqlen=24))
@settings(max_examples=10)
def test_attention_problems_are_oracle_cases_that_sdpa_passes(case):
    report = oracle.check(oracle.sdpa_math, cases=[case], dtype=torch.float32)
    report.raise_for_failures()


@given(case=testing.attention_problems(dtype=torch.float32, max_seqlen=24, gqa=True, masks=True))
@settings(max_examples=10)
def test_gqa_and_masked_attention_problems_are_oracle_cases_that_sdpa_passes(case):
    """SDPA math (GQA through enable_gqa; bool or additive masks with fully masked rows)."""
    report = oracle.check(oracle.sdpa_math, cases=[case], dtype=torch.float32)
    report.raise_for_failures()
    assert case.q.shape[1] % case.k.shape[1] == 0 and not (case.causal and case.mask is not None)


def test_assert_codes_equal_tells_nan_and_signed_zero_apart():
    a = torch.tensor([0.0, float("nan"), 1.0])
    testing.assert_codes_equal(a, a.clone(), E4M3)  # NaN == NaN as codes
    with pytest.raises(AssertionError, match="1 of 3"):
        testing.assert_codes_equal(torch.tensor([-0.0, float("nan"), 1.0]), a, E4M3)
    with pytest.raises(ValueError, match="not exactly representable"):
        testing.assert_codes_equal(torch.tensor([0.1]), torch.tensor([0.1]), E4M3)


def test_ulp_distance_counts_grid_steps_across_zero():
    fmt = E4M3
    smallest = fmt.min_subnormal
    assert int(testing.ulp_distance(torch.tensor([smallest]), torch.tensor([-smallest]), fmt)) == 2
    assert int(testing.ulp_distance(torch.tensor([fmt.max]), torch.tensor([fmt.max]), fmt)) == 0
    one_up = 1.0 + fmt.eps
    testing.assert_within_ulps(torch.tensor([one_up]), torch.tensor([1.0]), fmt, ulps=1)
    with pytest.raises(AssertionError, match="more than 0"):
        testing.assert_within_ulps(torch.tensor([one_up]), torch.tensor([1.0]), fmt, ulps=0)


def test_assert_within_bound_names_the_worst_element():
    testing.assert_within_bound(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5]), torch.tensor([0.0, 0.5]))
    with pytest.raises(AssertionError, match=r"worst at \(1,\)"):
        testing.assert_within_bound(torch.tensor([1.0, 2.0]), torch.tensor([1.1, 3.0]), 0.2, what="x")


@pytest.mark.slow
def test_pytest_plugin_gives_a_user_test_the_oracle_in_three_lines(tmp_path):
    here = os.path.dirname(os.path.abspath(__file__))
    (tmp_path / "test_user.py").write_text(textwrap.dedent("""
        import pytest
        from planted import flash, flash_dk_transpose

        @pytest.mark.dmref_attention(cases=["realistic", "tail_lengths"])
        def test_my_attention(dmref_oracle):
            dmref_oracle(flash)

        @pytest.mark.dmref_attention(cases=["realistic"])
        def test_my_buggy_attention(dmref_oracle):
            dmref_oracle(flash_dk_transpose)
    """))
    env = {**os.environ, "PYTHONPATH": here + os.pathsep + os.environ.get("PYTHONPATH", "")}
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                          str(tmp_path / "test_user.py"), "--dmref-cases", "quick", "-k", "buggy or my_attention"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert "1 failed, 1 passed" in res.stdout, res.stdout[-3000:]
    assert "realistic:dk" in res.stdout


@pytest.mark.dmref_attention(head_dim=128, require=("gqa",), cases=["realistic", "gqa"])
def test_the_marker_passes_head_dim_and_require_to_the_fixture(dmref_oracle):
    import planted

    report = dmref_oracle(oracle.sdpa_math)
    assert {c.shape.split("x")[-1] for c in report.cases} == {"128"} and not report.unsupported
    with pytest.raises(AssertionError, match="gqa:runs"):
        dmref_oracle(planted.mha_only)
