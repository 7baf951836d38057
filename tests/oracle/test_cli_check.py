"""``dmref check``, end to end in a subprocess, on implementations from planted.py: exit status 0
only when every check passes, 1 when one fails, 2 with a message when the target is wrong."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
_FEW = ["--cases", "quick", "--case", "realistic", "--case", "tail_lengths"]


def _dmref(*args):
    env = {**os.environ, "PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "dmref", "check", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_check_passes_a_correct_implementation_with_exit_status_0():
    res = _dmref("planted:flash", *_FEW, "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["passed"] is True and report["failed"] == []
    assert {c["case"] for c in report["checks"]} == {"realistic", "tail_lengths"}


def test_check_fails_a_planted_bug_with_exit_status_1_and_a_table_naming_it():
    res = _dmref("planted:flash_dk_transpose", *_FEW)
    assert res.returncode == 1, res.stderr
    assert "FAIL" in res.stdout and "realistic:dk" in res.stdout.replace("\n", "")


def test_check_runs_the_gqa_and_additive_mask_cases_of_a_ready_made_target():
    res = _dmref("dmref.oracle:sdpa_math", "--cases", "quick", "--case", "gqa", "--case", "additive_mask")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr
    table = res.stdout
    assert "gqa" in table and "additive_mask" in table
    assert "1x8/2x128x64" in table  # heads/kv_heads: 8 query heads on 2 key/value heads


def test_check_holds_a_recipe_claim():
    res = _dmref("dmref.oracle:emulated_naive_fp8", "--recipe", "delta_matching", "--cases", "quick", "--case",
                 "peaked_rows", "--json")
    assert res.returncode == 1
    assert "peaked_rows:rowsum" in json.loads(res.stdout)["failed"]


@pytest.mark.parametrize("target,message", [
    ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
    ("planted:no_such_function", "has no attribute 'no_such_function'"),
    ("planted", "must look like package.module:function"),
    ("planted:wrong_signature", "cannot be called as fn(q, k, v, *, causal, scale)"),
    ("planted:BUGS", "not a function"),
])
def test_check_explains_a_bad_target_with_exit_status_2(target, message):
    res = _dmref(target)
    assert res.returncode == 2
    assert message in " ".join(res.stderr.split())
