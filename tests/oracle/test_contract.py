"""The calling contract: what a caller relies on beyond the numbers. Each item has a planted bug
(planted.CONTRACT_BUGS) whose numbers are right where the case sets look at them, and which the
check of that item fails, in one line naming the check."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import planted
import pytest

from dmref import oracle

_NAMES = ["realistic", "tail_lengths"]


def _cases(names=_NAMES):
    return oracle.make_cases("quick", names=names)


@pytest.mark.parametrize("item", sorted(planted.CONTRACT_BUGS))
def test_a_contract_bug_fails_the_check_of_its_item_and_nothing_else(item):
    fn, check_name, what = planted.CONTRACT_BUGS[item]
    report = oracle.check(fn, cases=_cases())
    assert report.failed_names() == {check_name}, f"{item} ({what}): {report.summary()}"
    (failed, *_) = [c for c in report.failed if c.name == check_name]
    assert failed.detail and "\n" not in failed.detail


def test_the_same_attention_without_a_contract_bug_passes_every_contract_check():
    report = oracle.check(planted.plain, cases=_cases())
    report.raise_for_failures()
    names = {c.name for c in report.checks if c.passed}
    assert {"output", "inputs", "defaults", "repeat"} <= names
    (repeat,) = [c for c in report.checks if c.name == "repeat"]
    assert repeat.detail == "bit for bit the same"


def test_defaults_are_skipped_for_an_implementation_that_requires_every_argument():
    def required(q, k, v, *, causal, scale):
        return oracle.sdpa_math(q, k, v, causal=causal, scale=scale)

    report = oracle.check(required, cases=_cases(["realistic"]))
    assert report.passed
    (defaults,) = [c for c in report.checks if c.name == "defaults"]
    assert defaults.passed is None and "no default" in defaults.detail


def test_a_mask_written_into_by_fn_fails_inputs():
    def writes_mask(q, k, v, *, causal=False, scale=None, mask=None):
        out = oracle.sdpa_math(q, k, v, causal=causal, scale=scale, mask=mask)
        mask.zero_() if mask.dtype != planted.torch.bool else mask.fill_(True)
        return out

    report = oracle.check(writes_mask, cases=_cases(["additive_mask"]))
    assert "inputs" in report.failed_names()
    assert "mask" in [c for c in report.failed if c.name == "inputs"][0].detail


@pytest.mark.parametrize("fn,declared", [(oracle.sdpa_math, "bottom_right"), (planted.plain, "top_left")])
def test_the_causal_alignment_is_declared_and_a_wrong_one_fails_in_one_line(fn, declared):
    names = ["causal_cross", "causal_more_queries", "realistic_causal"]
    right = oracle.check(fn, cases=_cases(names))
    right.raise_for_failures()
    wrong = oracle.check(fn, cases=_cases(names), causal_alignment=declared)
    assert wrong.failed_cases() == {"causal_cross", "causal_more_queries"}, wrong.summary()
    assert wrong.causal_alignment == declared and wrong.alignment_source == "declared"
    other = "top_left" if declared == "bottom_right" else "bottom_right"
    causes = [c.cause for c in wrong.failed if c.name in ("out", "dq", "dk", "dv")]
    # the other alignment's reference fits these cases: the cause says so, naming the option
    assert causes and all(f"--causal-alignment {other}" in c for c in causes)
    assert all(f"--causal-alignment {other}" in line for line in wrong.reasons()[:len(wrong.failed)])


def test_dmref_attention_declares_bottom_right_and_sdpa_is_top_left():
    assert oracle.emulated("bf16").causal_alignment == "bottom_right"
    assert getattr(oracle.sdpa_math, "causal_alignment", "top_left") == "top_left"
    with pytest.raises(ValueError, match="causal_alignment='diagonal'"):
        oracle.check(planted.plain, cases=_cases(), causal_alignment="diagonal")


@pytest.mark.slow  # a subprocess; the Python test above holds the same verdicts
def test_the_cli_takes_the_causal_alignment():
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": here + os.pathsep + os.environ.get("PYTHONPATH", "")}
    res = subprocess.run([sys.executable, "-m", "dmref", "check", "dmref.oracle:sdpa_math", "--cases", "quick",
                          "--case", "causal_cross", "--causal-alignment", "bottom_right", "--json"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 1, res.stderr
    report = json.loads(res.stdout)
    assert report["causal_alignment"] == "bottom_right" and "causal_cross:out" in report["failed"]
