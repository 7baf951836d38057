"""The dmref command line on bad input: one line on stderr naming the bad value and what is
accepted, exit status 2, no traceback; internal errors in one line, exit status 1; strict JSON."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from dmref import cli, demo
from dmref.cli import demo as cli_demo, formats as cli_formats
from dmref.recipes import PRESETS

_SMALL = ["--seqlen", "64", "--heads", "1", "--head-dim", "16", "--sweep", "--draws", "2"]


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``dmref argv`` run in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as e:  # argparse's errors
            code = e.code
    return code, out.getvalue(), err.getvalue()


def assert_usage_error(result, *named: str) -> str:
    """Exit status 2 and one stderr line ``dmref[ command]: error: ...`` naming every string of ``named``."""
    code, _, err = result
    assert code == cli.EXIT_USAGE, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dmref") and ": error: " in lines[0], err
    for text in named:
        assert text in lines[0], (text, lines[0])
    return lines[0]


def _raise_on_parse_constant(name):
    raise ValueError(f"non-standard JSON constant {name}")


def strict_loads(text: str):
    return json.loads(text, parse_constant=_raise_on_parse_constant)


# ----------------------------------------------------------------------------------------------
# dmref cast and dmref formats
# ----------------------------------------------------------------------------------------------


def test_cast_unknown_format_is_one_line_naming_it_and_the_known_formats():
    assert_usage_error(run_cli(["cast", "1", "--format", "e4m4"]), "'e4m4'", "float8_e4m3fn", "e5m2")


@pytest.mark.parametrize("argv, named", [
    (["cast"], ["values"]),
    (["cast", "1", "--rounding", "nope"], ["'nope'", "nearest_even", "stochastic"]),
    (["cast", "abc"], ["'abc'", "decimal number", "nan"]),
    (["cast", "1", "0x10"], ["'0x10'"]),
    (["cast", "1e400"], ["'1e400'", "float64", "inf"]),
    (["cast", "-1e-400"], ["'-1e-400'", "float64"]),
    (["cast", "1e-999999999"], ["'1e-999999999'"]),  # rejected before an exact 10^-999999999 is built
    (["cast", "1", "--rounding", "stochastic"], ["--rbits", "0..65535", "stochastic"]),
    (["cast", "1", "--rbits", "3"], ["--rbits", "nearest_even"]),
    (["cast", "1", "--rounding", "stochastic", "--rbits", "70000"], ["70000", "0..65535"]),
    (["cast", "1", "--rounding", "stochastic", "--rbits", "-1"], ["-1", "0..65535"]),
    (["formats", "--jsn"], ["--jsn"]),
    (["nope"], ["'nope'", "cast"]),
])
def test_cast_and_formats_bad_input_is_one_line(argv, named):
    assert_usage_error(run_cli(argv), *named)


def test_cast_takes_values_that_start_with_a_minus_sign():
    code, out, err = run_cli(["cast", "-3e-3", "-inf", "-nan", "-.5", "--json"])
    assert code == 0, err
    rows = strict_loads(out)["results"]
    assert [r["input"] for r in rows] == ["-3e-3", "-inf", "-nan", "-.5"]
    assert all(r["code"] >> 7 == 1 for r in rows)  # every sign bit set


# ----------------------------------------------------------------------------------------------
# dmref demo: checked before anything is computed
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def no_compute(monkeypatch):
    """Make the demo's computation fail loudly: an input error must be found before it."""
    def refuse(*args, **kwargs):
        raise AssertionError("the demo computed although its input was bad")

    monkeypatch.setattr(demo, "run_demo", refuse)


@pytest.mark.parametrize("argv, named", [
    (["--recipes", "nope"], ["'nope'", *PRESETS]),
    (["--recipe", "naive_fp8@volta"], ["'volta'", "hopper", "fp32", "hopper-p<N>"]),
    (["--recipes", "naive_fp8@hopper-p7"], ["7", "32"]),
    (["--recipes", "bf16@hopper"], ["'bf16'", "FP8"]),
    (["--recipes", "bf16", "delta_matching", "bf16"], ["bf16", "more than once"]),
    (["--seqlen", "0"], ["--seqlen", "0", ">= 1"]),
    (["--heads", "0"], ["--heads", "0", ">= 1"]),
    (["--head-dim", "0"], ["--head-dim", "0", ">= 1"]),
    (["--batch", "-2"], ["--batch", "-2", ">= 1"]),
    (["--sweep", "128", "-5"], ["--sweep", "-5", ">= 1"]),
    (["--sweep-heads", "0"], ["--sweep-heads", "0", ">= 1"]),
    (["--seqlen", "1"], ["--seqlen", "1:", "relative errors undefined", "at least 2"]),
    (["--sweep", "128", "1"], ["--sweep", "1:", "at least 2"]),
    (["--seqlen", "1000000000"], ["--seqlen 1000000000", "GiB of memory", "GiB is available",
                                  "the largest sequence length that fits is"]),
    (["--sweep", "128", "10000000"], ["--sweep 10000000", "GiB is available", "largest sequence length"]),
    (["--batch", "100000000"], ["--batch 100000000", "GiB is available", "lower --batch"]),
    (["--heads", "two"], ["--heads", "'two'", "integer"]),
    (["--seed", str(1 << 64)], ["--seed", str(1 << 64)]),
    (["--out", "/nonexistent/x.png"], ["'/nonexistent/x.png'", "'/nonexistent'", "does not exist"]),
    (["--out", "plot.txt"], ["'plot.txt'", "png", "svg"]),
    (["--out", "plot"], ["'plot'", "png"]),
])
def test_demo_bad_option_is_one_line_before_computing(argv, named, no_compute):
    assert_usage_error(run_cli(["demo", *argv]), *named)


def test_demo_memory_limit_is_the_estimate_and_names_the_largest_length_that_fits():
    """check_memory refuses exactly when the estimate exceeds the memory available, and the
    length it proposes is the largest whose estimate fits (so the next run is not refused)."""
    config = demo.DemoConfig(seqlen=4096, sweep_seqlens=(), accum_draws=0)
    need = demo.peak_bytes(config)
    assert need == demo.problem_bytes(1, 4, 4096, 64)
    cli_demo.check_memory(config, need)  # exactly enough
    with pytest.raises(cli.UsageError, match=r"--seqlen 4096 .* the largest sequence length that fits is (\d+)") as info:
        cli_demo.check_memory(config, need - 1)
    fits = int(str(info.value).rsplit(" ", 1)[1])
    assert fits == 4095
    assert demo.problem_bytes(1, 4, fits, 64) <= need - 1 < demo.problem_bytes(1, 4, fits + 1, 64)
    cli_demo.check_memory(config, None)  # memory unknown: not checked


def test_demo_out_that_is_a_folder_is_rejected_before_computing(tmp_path, no_compute):
    folder = tmp_path / "plot.png"
    folder.mkdir()
    assert_usage_error(run_cli(["demo", "--out", str(folder)]), str(folder), "folder")


def test_demo_prints_its_results_when_the_plot_cannot_be_written(tmp_path, monkeypatch):
    def disk_full(result, path):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(demo, "write_plot", disk_full)
    png = tmp_path / "demo.png"
    code, out, err = run_cli(["demo", "--json", "--out", str(png), "--recipes", "bf16", *_SMALL])
    assert code == 1
    assert [r["recipe"] for r in strict_loads(out)] == ["bf16"]
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and str(png) in last and "No space left" in last and "printed" in last


def test_demo_checks_the_plot_folder_by_writing_in_it(tmp_path):
    """The check creates and removes a temporary file: nothing is left behind."""
    cli_demo.check_out_path(str(tmp_path / "a.png"))
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------------------------
# Strict JSON
# ----------------------------------------------------------------------------------------------


def test_cast_json_is_strict_and_names_non_finite_values():
    code, out, _ = run_cli(["cast", "nan", "inf", "-inf", "1", "--format", "e5m2", "--json"])
    assert code == 0
    values = [r["value"] for r in strict_loads(out)["results"]]
    assert values == ["nan", "inf", "-inf", 1.0]


def test_formats_json_is_strict():
    code, out, _ = run_cli(["formats", "--json"])
    assert code == 0
    assert {r["name"] for r in strict_loads(out)} >= {"float8_e4m3fn", "float8_e5m2"}


def test_demo_json_is_strict():
    code, out, err = run_cli(["demo", "--json", "--out", "", "--recipes", "naive_fp8", *_SMALL])
    assert code == 0, err
    assert [r["recipe"] for r in strict_loads(out)] == ["naive_fp8"]


def test_dumps_json_is_lossless_for_finite_floats_and_names_the_others():
    values = [0.1, -0.0, 5e-324, 1.7976931348623157e308, np.float32(0.1), np.float64(1 / 3), np.int64(7),
              math.nan, math.inf, -math.inf, np.float32("nan")]
    back = strict_loads(cli.dumps_json({"v": values, "t": (1, 2)}))
    assert back["t"] == [1, 2]
    finite = back["v"][:7]
    assert [math.copysign(1, x) for x in finite[:2]] == [1, -1]
    assert finite == [0.1, -0.0, 5e-324, 1.7976931348623157e308, float(np.float32(0.1)), 1 / 3, 7]
    assert back["v"][7:] == ["nan", "inf", "-inf", "nan"]


# ----------------------------------------------------------------------------------------------
# The safety net in cli.main
# ----------------------------------------------------------------------------------------------


def _boom(args):
    raise ZeroDivisionError("planted")


def test_an_internal_error_is_one_line_with_how_to_get_the_traceback(monkeypatch):
    monkeypatch.setattr(cli_formats, "_formats", _boom)
    monkeypatch.delenv(cli.TRACEBACK_ENV, raising=False)
    code, _, err = run_cli(["formats"])
    assert code == cli.EXIT_INTERNAL
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err
    assert "internal error" in lines[0] and "ZeroDivisionError: planted" in lines[0]
    assert f"{cli.TRACEBACK_ENV}=1" in lines[0]


def test_dmref_traceback_1_raises_the_internal_error(monkeypatch):
    monkeypatch.setattr(cli_formats, "_formats", _boom)
    monkeypatch.setenv(cli.TRACEBACK_ENV, "1")
    with pytest.raises(ZeroDivisionError, match="planted"):
        cli.main(["formats"])


def test_a_usage_error_raised_by_a_command_is_one_line(monkeypatch):
    def bad(args):
        with cli.input_errors():
            raise OSError(errno.ENOENT, "No such file or directory", "x.npz")

    monkeypatch.setattr(cli_formats, "_formats", bad)
    assert_usage_error(run_cli(["formats"]), "x.npz", "No such file")


# ----------------------------------------------------------------------------------------------
# The same through a real process (what a user sees)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, named", [
    (["cast", "1", "--format", "e4m4"], ["'e4m4'"]),
    # each case is a process that imports torch: the others run with the slow tests
    *(pytest.param(*case, marks=pytest.mark.slow) for case in (
        (["demo", "--recipe", "naive_fp8@volta"], ["'volta'", "hopper"]),
        (["demo", "--seqlen", "0"], ["--seqlen"]),
        (["demo", "--seqlen", "1000000000"], ["--seqlen 1000000000", "GiB is available"]))),
])
def test_bad_input_in_a_process_is_one_line_and_status_2(argv, named):
    proc = subprocess.run([sys.executable, "-m", "dmref", *argv], capture_output=True, text=True, timeout=120)
    assert_usage_error((proc.returncode, proc.stdout, proc.stderr), *named)
    assert proc.stdout == ""


def test_cast_nan_json_in_a_process_is_strict():
    proc = subprocess.run([sys.executable, "-m", "dmref", "cast", "nan", "--json"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert strict_loads(proc.stdout)["results"][0]["value"] == "nan"
