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


@pytest.mark.slow
def test_check_runs_the_gqa_and_additive_mask_cases_of_a_ready_made_target():
    res = _dmref("dmref.oracle:sdpa_math", "--cases", "quick", "--case", "gqa", "--case", "additive_mask")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr
    table = res.stdout
    assert "gqa" in table and "additive_mask" in table
    assert "1x8/2x128x64" in table  # heads/kv_heads: 8 query heads on 2 key/value heads


@pytest.mark.slow
def test_check_holds_a_recipe_claim():
    res = _dmref("dmref.oracle:emulated_naive_fp8", "--recipe", "delta_matching", "--cases", "quick", "--case",
                 "peaked_rows", "--json")
    assert res.returncode == 1
    assert "peaked_rows:rowsum" in json.loads(res.stdout)["failed"]


# Each case below is a `dmref check` process that imports torch (3-8 s): the README's test command
# runs the first of each kind, the slow set the others.
@pytest.mark.parametrize("target,message", [
    ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
    *(pytest.param(*case, marks=pytest.mark.slow) for case in (
        ("planted:no_such_function", "has no attribute 'no_such_function'"),
        ("planted", "must look like package.module:function"),
        ("planted:wrong_signature", "cannot be called as fn(q, k, v, *, causal, scale)"),
        ("planted:BUGS", "not a function"))),
])
def test_check_explains_a_bad_target_with_exit_status_2(target, message):
    res = _dmref(target)
    assert res.returncode == 2
    assert message in " ".join(res.stderr.split())


@pytest.mark.slow
def test_an_implementation_without_gqa_passes_with_the_case_unsupported_and_fails_when_required():
    few = ["--cases", "quick", "--case", "realistic", "--case", "gqa"]
    res = _dmref("planted:mha_only", *few)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr
    assert "UNSUPPORTED" in res.stdout
    res = _dmref("planted:mha_only", *few, "--require", "gqa", "--json")
    assert res.returncode == 1
    assert "gqa:runs" in json.loads(res.stdout)["failed"]


@pytest.mark.slow
def test_a_wrong_grouping_fails_on_the_command_line_too():
    res = _dmref("planted:flash_kv_grouping", "--cases", "quick", "--case", "gqa")
    assert res.returncode == 1


@pytest.mark.slow
def test_head_dim_128():
    res = _dmref("dmref.oracle:sdpa_math", "--head-dim", "128", "--cases", "quick", "--case", "realistic",
                 "--case", "gqa", "--json")
    assert res.returncode == 0, res.stderr
    assert {c["shape"].split("x")[-1] for c in json.loads(res.stdout)["cases"]} == {"128"}


@pytest.mark.slow
def test_json_is_strict_and_lossless():
    res = _dmref("planted:mha_only", "--cases", "quick", "--case", "realistic", "--case", "gqa", "--json")

    def reject(name):
        raise ValueError(f"non-standard JSON constant {name}")

    report = json.loads(res.stdout, parse_constant=reject)
    values = [c["value"] for c in report["checks"]]
    assert "NaN" in values  # the runs check has no statistic: spelled out, not dropped
    assert all(isinstance(v, float) or v in ("NaN", "Infinity", "-Infinity") for v in values)


@pytest.mark.slow
def test_a_hanging_target_is_stopped_by_the_timeout():
    res = _dmref("planted:hangs", "--cases", "quick", "--case", "realistic", "--case", "tail_lengths", "--timeout",
                 "2")
    assert res.returncode == 1
    assert "timed out after 2 s" in " ".join(res.stdout.split())


@pytest.mark.parametrize("args,message", [
    (["--head-dim", "7"], "head_dim=7 must be even"),
    *(pytest.param(*case, marks=pytest.mark.slow) for case in (
        (["--timeout", "0"], "--timeout 0: timeout=0.0 must be a finite number of seconds"),
        (["--device", "nosuchdevice"], "is not a torch device"))),
])
def test_bad_options_give_one_line_and_exit_status_2(args, message):
    res = _dmref("dmref.oracle:sdpa_math", *args)
    assert res.returncode == 2
    assert message in res.stderr and len(res.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_a_cuda_device_without_a_gpu_is_refused_at_once():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    res = _dmref("dmref.oracle:sdpa_math", "--device", "cuda")
    assert res.returncode == 2
    assert "no CUDA device" in res.stderr and len(res.stderr.strip().splitlines()) == 1
