"""The oracle's reasoning and its terminal report: the causal alignment found without a
declaration (and never at a real bug's expense), one line per failed check saying why, the
INCONCLUSIVE verdict (its exit status, the fixture's warning), and the report at 80 columns.
The implementations are in aligned.py (a float32 FlashAttention-2-style attention in either
alignment, undeclared, and planted bugs) and planted.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import aligned
import planted
import pytest
from rich.console import Console

from dmref import oracle
from dmref.oracle.pytest_plugin import DmrefInconclusiveWarning

HERE = os.path.dirname(os.path.abspath(__file__))
_CROSS = ["causal_cross", "causal_more_queries"]


def _cases(names):
    return oracle.make_cases("quick", names=names)


def _undeclared(fn):
    """fn without its ``causal_alignment`` attribute."""
    def call(q, k, v, *, causal=False, scale=None):
        return fn(q, k, v, causal=causal, scale=scale)

    call.__name__ = call.__qualname__ = fn.__name__
    assert not hasattr(call, "causal_alignment")
    return call


def _dmref(*args, columns=80):
    env = {**os.environ, "PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", ""), "COLUMNS": str(columns)}
    return subprocess.run([sys.executable, "-m", "dmref", "check", *args], capture_output=True, text=True, env=env,
                          timeout=600)


# ----------------------------------------------------------------------------------------------
# The causal alignment
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_a_correct_implementation_passes_in_either_alignment_without_declaring_it(alignment):
    fn = getattr(aligned, alignment)
    assert not hasattr(fn, "causal_alignment")
    report = oracle.check(fn, cases=_cases([*_CROSS, "realistic_causal"]))
    report.raise_for_failures()
    assert report.verdict == "PASSED"
    assert (report.causal_alignment, report.alignment_source) == (alignment, "inferred")
    name = alignment.replace("_", "-")
    assert (f"causal alignment: {name}, inferred; declare it with causal_alignment='{alignment}' "
            f"(--causal-alignment {alignment})") in report.verdict_line()
    # declared, the same alignment passes and the other fails both cases, the hint naming the right one
    declared = oracle.check(fn, cases=_cases(_CROSS), causal_alignment=alignment)
    assert declared.passed and declared.alignment_source == "declared"
    other = "top_left" if alignment == "bottom_right" else "bottom_right"
    wrong = oracle.check(fn, cases=_cases(_CROSS), causal_alignment=other)
    assert wrong.failed_cases() == set(_CROSS)
    assert all(f"--causal-alignment {alignment}" in c.cause for c in wrong.failed)


def test_the_fixture_passes_both_alignments_undeclared(dmref_oracle):
    for fn in (aligned.top_left, aligned.bottom_right):
        assert dmref_oracle(fn, cases=_cases(_CROSS)).passed


def test_an_implementation_that_follows_neither_alignment_fails():
    # bottom-right with more keys than queries, top-left with more queries than keys
    report = oracle.check(aligned.mixed, cases=_cases([*_CROSS, "realistic_causal"]))
    assert report.verdict == "FAILED" and report.alignment_source == "neither"
    assert report.failed_cases() == {"causal_cross"}  # checked top-left: causal_more_queries fits it
    assert "causal_cross fits bottom-right, causal_more_queries fits top-left" in report.verdict_line()
    assert all("follows neither convention" in c.cause for c in report.failed)


_PLANTED = {  # planted.py's bugs, undeclared: (implementation, the case, the checks that must fail)
    "bwd_scale": (planted.flash_bwd_scale, "peaked_rows", {"dq", "dk", "dv"}),
    "stale_delta": (planted.flash_stale_delta, "realistic", {"rowsum"}),
    "tail": (planted.AXIS_BUGS["tails"][0], "tail_lengths", {"out"}),
    "first_block_max": (planted.AXIS_BUGS["extreme_position"][0], "extreme_positions", {"out"}),
}


@pytest.mark.parametrize("bug", [*aligned.BUGS, *_PLANTED])
def test_inference_turns_no_planted_bug_into_a_pass_and_blames_no_alignment(bug):
    if bug in aligned.BUGS:
        fn, case, must_fail = aligned.BUGS[bug][0], "tail_lengths", set()
    else:
        fn, case, must_fail = _PLANTED[bug]
        fn = _undeclared(fn)
    report = oracle.check(fn, cases=_cases([*_CROSS, case]))
    assert report.verdict == "FAILED", report.summary()
    assert must_fail <= {c.name for c in report.failed if c.case == case}, report.summary()
    # the other alignment's reference fits none of these cases: no cause names the alignment
    assert not any("causal alignment" in c.cause for c in report.failed), report.reasons()
    if report.alignment_source == "inferred":  # an inference never names the wrong convention
        assert report.causal_alignment == "bottom_right"
    declared = oracle.check(fn, cases=_cases([*_CROSS, case]), causal_alignment="bottom_right")
    assert {c.id for c in report.failed} == {c.id for c in declared.failed}


# ----------------------------------------------------------------------------------------------
# Why each check failed
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fn,case,check_name,words", [
    (aligned.BUGS["dk_scale"][0], "realistic", "dk", "dK alone is wrong: its scale"),
    (aligned.BUGS["lse_bf16"][0], "realistic", "dv", "the LSE (or max and sum) saved in bf16"),
    (aligned.BUGS["no_rescale"][0], "realistic", "out", "rescale"),
    (aligned.BUGS["dropped_tile"][0], "tail_lengths", "out", "a dropped tile"),
    (planted.flash_stale_delta, "realistic", "rowsum", "a stale D"),
])
def test_each_failed_check_says_why_in_one_line(fn, case, check_name, words):
    report = oracle.check(fn, cases=_cases([case]))
    reasons = report.reasons()
    assert len(reasons) == len(report.failed) and all(c.cause for c in report.failed)
    (line,) = [r for r in reasons if r.startswith(f"{case}:{check_name} ")]
    (c,) = [c for c in report.failed if c.id == f"{case}:{check_name}"]
    assert f"{c.value:.3g} > {c.bound:.3g}" in line and words in line, line
    assert "\n" not in line


# ----------------------------------------------------------------------------------------------
# INCONCLUSIVE
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def inconclusive():
    # dQ's first half of the keys summed and rounded to bfloat16, then rounded again: the probe's
    # two readings disagree beyond its bound; every error check passes
    return oracle.check(aligned.top_left_dq_rounded_twice, cases=_cases(["realistic"]))


def test_a_reading_the_probe_cannot_vouch_for_is_inconclusive_not_failed(inconclusive):
    report = inconclusive
    assert report.verdict == "INCONCLUSIVE" and not report.passed and not report.failed
    assert [c.id for c in report.inconclusive] == ["realistic:rowsum"]
    assert all(c.passed for c in report.checks if c.name in ("out", "dq", "dk", "dv"))
    (c,) = report.inconclusive
    assert c.status == "INCONCLUSIVE" and c.value <= c.bound
    assert f"at {c.value:.3g}" in c.detail and f"below its bound {c.bound:.3g}" in c.detail
    assert "null channels' readings differ by up to" in c.detail
    report.raise_for_failures()  # not a failure
    data = json.loads(report.to_json())
    assert data["verdict"] == "INCONCLUSIVE" and data["inconclusive"] == ["realistic:rowsum"]
    assert data["passed"] is False and data["failed"] == []
    assert report.verdict_line().startswith("INCONCLUSIVE: 1 of ")


def test_the_fixture_warns_on_an_inconclusive_reading_and_does_not_fail(dmref_oracle):
    with pytest.warns(DmrefInconclusiveWarning, match="realistic:rowsum"):
        report = dmref_oracle(aligned.top_left_dq_rounded_twice, cases=_cases(["realistic"]))
    assert report.verdict == "INCONCLUSIVE"


def test_dmref_check_exits_3_on_an_inconclusive_reading():
    res = _dmref("aligned:top_left_dq_rounded_twice", "--cases", "quick", "--case", "realistic")
    assert res.returncode == 3, res.stdout + res.stderr
    assert res.stdout.splitlines()[0].startswith("INCONCLUSIVE: ")
    assert "realistic:rowsum INCONCLUSIVE: the probe read" in " ".join(res.stdout.split())


# ----------------------------------------------------------------------------------------------
# 80 and 120 columns
# ----------------------------------------------------------------------------------------------

_NUMBER = re.compile(r"\d…|…\d|\.…")


@pytest.fixture(scope="module")
def failing():
    """A failing report with long case names, GQA and windows unsupported, an alignment inferred."""
    names = ["realistic", "gqa_ratio_7", "documents_bidirectional", *_CROSS]
    return oracle.check(aligned.BUGS["lse_bf16"][0], cases=_cases(names))


@pytest.mark.parametrize("width", [80, 120])
def test_the_report_fits_the_console_and_cuts_no_number(failing, width):
    console = Console(width=width, record=True)
    failing.render(console)
    text = console.export_text()
    lines = text.splitlines()
    assert max(map(len, lines)) <= width
    assert "…" not in text and not _NUMBER.search(text)
    assert lines[0].startswith("FAILED: ")
    for cr in failing.cases:  # every case name and shape whole, on one line
        assert any(cr.name in line and cr.shape in line for line in lines), cr.name
    flat = " ".join(text.split())
    for line in failing.reasons():
        assert " ".join(line.split()) in flat
    wide = Console(width=width, record=True)
    failing.render(wide, wide=True)
    text = wide.export_text()
    assert "…" not in text
    for c in failing.checks:  # every statistic and bound in the wide table, whole
        if c.name in ("out", "dq", "dk", "dv") and c.passed is not None:
            assert f"{c.value:.2g} / {c.bound:.2g}" in text


def test_dmref_check_at_80_columns():
    res = _dmref("aligned:bottom_right_lse_bf16", "--cases", "quick", "--case", "documents_bidirectional",
                 "--case", "causal_cross", "--case", "gqa_ratio_7")
    assert res.returncode == 1, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith("FAILED: ") and max(map(len, lines)) <= 80
    assert "…" not in res.stdout
    assert "causal alignment: bottom-right, inferred" in " ".join(res.stdout.split())
    assert re.search(r"^causal_cross:dv  \S+ > \S+", res.stdout, re.M)


def test_dmref_check_passes_a_bottom_right_implementation_undeclared():
    res = _dmref("aligned:bottom_right", "--cases", "quick", "--case", "causal_cross", "--case",
                 "causal_more_queries", "--json")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr
    report = json.loads(res.stdout)
    assert (report["verdict"], report["causal_alignment"], report["alignment_source"]) == (
        "PASSED", "bottom_right", "inferred")
