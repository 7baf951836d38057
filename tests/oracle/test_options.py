"""Bad options of the oracle are refused before anything runs: in Python a ValueError or
TypeError naming the value, on the command line one line on stderr and exit status 2."""

from __future__ import annotations

import math

import pytest
import torch

from dmref import oracle
from dmref.oracle.cases import MAX_SEED
from dmref.cli import main


def _main(*argv) -> int:
    """``dmref`` in this process: its exit status (argparse's own errors exit through SystemExit)."""
    try:
        return main(list(argv))
    except SystemExit as e:
        return e.code


def _one_case():
    return oracle.make_cases("quick", names=["tail_lengths"])


@pytest.mark.parametrize("kwargs,error,message", [
    ({"accumulation_u": -1}, ValueError, "accumulation_u=-1 must be a unit roundoff in (0, 1)"),
    ({"accumulation_u": math.nan}, ValueError, "accumulation_u=nan"),
    ({"accumulation_u": 1.0}, ValueError, "accumulation_u=1.0"),
    ({"accumulation_u": "2^-24"}, TypeError, "accumulation_u='2^-24' must be a number"),
    ({"probe": "no"}, TypeError, "probe='no' must be True or False"),
    ({"probe": 0}, TypeError, "probe=0 must be True or False"),
    ({"timeout": math.inf}, ValueError, "timeout=inf must be a finite number of seconds"),
    ({"timeout": 1e10}, ValueError, "threading.TIMEOUT_MAX"),
    ({"timeout": -1}, ValueError, "timeout=-1"),
    ({"timeout": "5"}, TypeError, "timeout='5' must be a number"),
    ({"seed": "a"}, TypeError, "seed='a' must be an int"),
    ({"seed": 1.0}, TypeError, "seed=1.0 must be an int"),
    ({"seed": MAX_SEED + 1}, ValueError, f"seed={MAX_SEED + 1} must be in [0, {MAX_SEED}]"),
    ({"seed": -1}, ValueError, "seed=-1"),
    ({"head_dim": 64.0}, TypeError, "head_dim=64.0 must be an int"),
    ({"head_dim": 7}, ValueError, "head_dim=7 must be even"),
    ({"device": "meta"}, ValueError, "device 'meta' cannot run an implementation here"),
    ({"dtype": "float8"}, TypeError, "dtype='float8'"),
    ({"cases": ["realistic", "realistic"]}, ValueError, "case 'realistic' named more than once"),
])
def test_check_refuses_a_bad_option_naming_its_value(kwargs, error, message):
    kwargs = {"cases": _one_case(), **kwargs}
    with pytest.raises(error) as info:
        oracle.check(oracle.sdpa_math, **kwargs)
    assert message in str(info.value)


def test_the_largest_seed_and_timeout_are_accepted():
    oracle.check_timeout(oracle.MAX_TIMEOUT)
    (case,) = oracle.make_cases("quick", names=["single_query"], seed=MAX_SEED, probe=False)
    assert case.q.shape[-2] == 1


@pytest.mark.parametrize("dtype", ["float16", "fp16", "torch.float16", torch.float16])
def test_dtype_names_of_the_cli_are_accepted_in_python(dtype):
    assert oracle.resolve_dtype(dtype) is torch.float16


@pytest.mark.dmref_attention(dtype="float16", cases=["single_query"])
def test_the_marker_takes_the_dtype_names_of_the_cli(dmref_oracle):
    report = dmref_oracle(oracle.sdpa_math)
    assert report.dtype == "float16"


def test_one_default_case_set_for_the_oracle_the_cli_and_the_fixture():
    import inspect

    from dmref.oracle import pytest_plugin
    from dmref.cli import check as cli_check

    assert inspect.signature(oracle.check).parameters["cases"].default == oracle.DEFAULT_CASES
    assert pytest_plugin.DEFAULT_CASES == oracle.DEFAULT_CASES
    import argparse

    parser = argparse.ArgumentParser()
    cli_check.register(parser.add_subparsers())
    assert parser.parse_args(["check", "m:f"]).cases == oracle.DEFAULT_CASES


@pytest.mark.parametrize("args,message", [
    (["--timeout", "inf"], "--timeout inf: timeout=inf must be a finite number of seconds"),
    (["--timeout", "1e10"], "threading.TIMEOUT_MAX"),
    (["--timeout", "0"], "--timeout 0: timeout=0.0 must be a finite number of seconds in (0,"),
    (["--device", "meta"], "--device 'meta' cannot run an implementation here"),
    (["--device", "nosuchdevice"], "--device 'nosuchdevice' is not a torch device"),
    (["--seed", "99999999999999999999"], "--seed 99999999999999999999: seed=99999999999999999999 must be in"),
    (["--seed", "-3"], "seed=-3 must be in"),
    (["--head-dim", "64.0"], "invalid int value: '64.0'"),
    (["--head-dim", "7"], "head_dim=7 must be even"),
    (["--case", "realistic", "--case", "realistic"], "case 'realistic' named more than once"),
])
def test_cli_refuses_a_bad_option_in_one_line_with_exit_status_2(args, message, capsys):
    assert _main("check", "dmref.oracle:sdpa_math", *args) == 2
    err = capsys.readouterr().err
    assert message in " ".join(err.split()) and len(err.strip().splitlines()) == 1, err


def test_cudnn_fp8_without_its_requirements_names_the_frontend_and_the_gpu(capsys):
    pytest.importorskip("torch")
    try:
        import cudnn  # noqa: F401
        has_frontend = True
    except (ImportError, OSError):
        has_frontend = False
    if has_frontend or torch.cuda.is_available():
        pytest.skip("this machine has the cuDNN frontend or a GPU")
    from dmref import targets

    x = torch.zeros(1, 1, 4, 128)
    with pytest.raises(oracle.TargetUnavailable) as info:
        targets.cudnn_fp8(x, x, x, causal=False, scale=1.0)
    assert "nvidia-cudnn-frontend" in str(info.value) and "compute capability 9.0" in str(info.value)
    rc = _main("check", "dmref.targets:cudnn_fp8", "--cases", "quick", "--case", "realistic", "--head-dim", "128")
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "nvidia-cudnn-frontend" in err and "compute capability 9.0" in err


def test_dmref_targets_imports_first_in_a_fresh_process():
    """``dmref check dmref.targets:cudnn_fp8`` imports dmref.targets before dmref.oracle."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", "import dmref.targets as t; print(t.sdpa_math.__name__)"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "sdpa_math", res.stderr
