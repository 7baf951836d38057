"""The terminal output of ``dmref formats``, ``verify-gemm``, ``verify-attention`` and ``demo`` at
80 and 120 columns: no line wider than the terminal, no number cut (every number of the JSON
output appears whole in the table, and rich's ellipsis never does); ``--wide`` gives the full
tables; ``verify-attention`` draws progress only on a terminal; and the "did you mean" of
unknown recipe and case names."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from rich.cells import cell_len
from rich.console import Console

from dmref.cudnn import replay as ar
from dmref import cli, demo
from dmref.cli.attention import _percent

DATA = Path(__file__).resolve().parents[1] / "data"
WIDTHS = (80, 120)


def _run(argv, width: int | None = None, monkeypatch=None) -> tuple[int, str, str]:
    if width is not None:
        monkeypatch.setenv("COLUMNS", str(width))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


def _fits(text: str, width: int) -> set[str]:
    """Assert that ``text`` fits ``width`` columns and holds no ellipsis; its words."""
    lines = text.splitlines()
    assert len(lines) > 3
    wide = [line for line in lines if cell_len(line) > width]
    assert not wide, f"{len(wide)} lines wider than {width} columns, e.g. {wide[0]!r}"
    assert "…" not in text and "..." not in text
    return set(re.findall(r"[^\s*]+", text))


# ---- dmref formats ---------------------------------------------------------------------------


@pytest.mark.parametrize("width", WIDTHS)
def test_formats_fits_and_shows_every_value(width, monkeypatch):
    code, text, _ = _run(["formats"], width, monkeypatch)
    assert code == 0
    words = _fits(text, width)
    rows = json.loads(_run(["formats", "--json"])[1])
    for row in rows:
        for key, value in row.items():
            if isinstance(value, float):
                assert f"{value:.6g}" in words, (row["name"], key)
            elif isinstance(value, bool):
                continue  # yes / no
            else:
                assert str(value) in words, (row["name"], key)


# ---- dmref verify-gemm -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemm_file(tmp_path_factory) -> Path:
    """Four cases of the H200 file in three engine settings and two formats; one output bit of
    c003 flipped, so that one group misses."""
    with np.load(DATA / "h200_fp8_gemm.npz") as z:
        arrays = {"about": z["about"]}
        for name in ("c000", "c003", "c039", "c050"):
            for key in ("a", "bt", "c", "out", "meta"):
                arrays[f"{name}_{key}"] = z[f"{name}_{key}"].copy()
    arrays["c003_out"][3, 5] ^= 1
    path = tmp_path_factory.mktemp("gemm") / "four.npz"
    np.savez(path, **arrays)
    return path


@pytest.mark.parametrize("width", WIDTHS)
def test_verify_gemm_summary_fits_and_names_the_group_that_misses(gemm_file, width, monkeypatch):
    code, text, _ = _run(["verify-gemm", str(gemm_file)], width, monkeypatch)
    assert code == 1
    words = _fits(text, width)
    report = json.loads(_run(["verify-gemm", str(gemm_file), "--json"])[1])
    by_setting: dict[str, list] = {}
    for g in report["groups"]:
        by_setting.setdefault(" | ".join(g["group"].split(" | ")[:2]), []).append(g)
    for groups in by_setting.values():
        assert str(sum(g["outputs"] for g in groups)) in words
    (missed,) = [g for g in report["groups"] if g["matched"] < g["outputs"]]
    flat = " ".join(text.split())
    assert f"missed: {missed['group']}: {missed['matched']}/{missed['outputs']} reproduced" in flat
    assert "100.000%" not in flat.split("missed:")[1]  # 4095 of 4096 never reads as all
    assert "NOT all reproduced" in flat


def test_verify_gemm_wide_has_one_row_per_group(gemm_file, monkeypatch):
    code, text, _ = _run(["verify-gemm", str(gemm_file), "--wide"], 80, monkeypatch)
    report = json.loads(_run(["verify-gemm", str(gemm_file), "--json"])[1])
    assert code == 1 and "…" not in text
    rows = [line for line in text.splitlines() if line.startswith(("triton_dot", "cublas_scaled_mm"))]
    assert len(rows) == len(report["groups"])
    for row, g in zip(rows, report["groups"]):
        engine, settings, formats, dist = g["group"].split(" | ")
        assert row.split() == [engine, *settings.split(), formats, dist, str(len(g["cases"])), str(g["outputs"]),
                               f"{100 * g['fraction']:.3f}%", str(g["max_ulps"])]


# ---- dmref verify-attention ------------------------------------------------------------------


@pytest.fixture(scope="module")
def capture(tmp_path_factory) -> Path:
    """Cases 3 and 4 of the H200 capture, case 4's dQ with +0 planted in its first query rows (a
    miss of the goal), so the table shows passing, starred and missing cells."""
    with np.load(DATA / "h200_cudnn_fp8_sdpa.npz", allow_pickle=False) as z:
        keep = {n: z[n] for n in z.files if not n.startswith("c") or n.split(".")[0] in ("c3", "c4")}
    keep["c4.dq_fp8"] = keep["c4.dq_fp8"].copy()
    keep["c4.dq_fp8"][..., 0:8, :] = 0
    path = tmp_path_factory.mktemp("capture") / "two.npz"
    np.savez(path, **keep)
    return path


@pytest.fixture(scope="module")
def capture_json(capture) -> dict:
    code, out, err = _run(["verify-attention", str(capture), "--json"])
    assert code == 1 and err == ""  # --json: no progress, nothing on stderr
    return json.loads(out)


@pytest.mark.parametrize("width", WIDTHS)
def test_verify_attention_fits_and_shows_every_fraction(capture, capture_json, width, monkeypatch):
    code, text, err = _run(["verify-attention", str(capture)], width, monkeypatch)
    assert code == 1 and err == ""  # stderr is not a terminal: no progress bar
    words = _fits(text, width)
    for case in capture_json["cases"]:
        for t, m in case["tensors"].items():
            assert _percent(m["fraction_checked"]) in words, (case["case"], t)
    flat = " ".join(text.split())
    assert "goal missed: case 4 dq" in flat and "goal NOT met" in flat


def test_verify_attention_wide_shows_steps_per_tensor(capture, capture_json, monkeypatch):
    code, text, _ = _run(["verify-attention", str(capture), "--wide"], 80, monkeypatch)
    assert code == 1 and "…" not in text
    for case in capture_json["cases"]:
        for m in case["tensors"].values():
            assert f"{_percent(m['fraction_checked'])} / {m['max_steps_checked']}" in text


def test_percent_never_reads_100_when_a_code_differs():
    assert _percent(1.0) == "100.00" and _percent(0.99996) == "99.99" and _percent(0.99657) == "99.66"
    assert _percent(1 - 1e-7, 3) == "99.999"


def test_verify_capture_reports_progress_per_case(capture):
    calls = []
    ar.verify_capture(str(capture), on_case=lambda done, total: calls.append((done, total)))
    assert calls == [(0, 2), (1, 2), (2, 2)]


def test_verify_attention_draws_progress_on_a_terminal(capture, monkeypatch):
    """With stderr a terminal, the bar is drawn there (and removed): stdout has the same table."""
    from dmref.cli import attention

    drawn = []
    real = attention._progress

    @contextlib.contextmanager
    def spy(show):
        with real(show) as on_case:
            drawn.append(show and on_case is not None)
            yield on_case

    monkeypatch.setattr(attention, "_progress", spy)
    err = io.StringIO()
    err.isatty = lambda: True
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert cli.main(["verify-attention", str(capture)]) == 1
    assert drawn == [True] and "replaying cases" in err.getvalue()
    assert "replaying" not in out.getvalue()


# ---- dmref demo ------------------------------------------------------------------------------

_SMALL = dict(batch=1, heads=1, seqlen=128, head_dim=32, sweep_seqlens=(), accum_draws=2, accum_seqlen=64)


@pytest.fixture(scope="module")
def small_demo():
    return demo.run_demo(demo.DemoConfig(**_SMALL))


@pytest.mark.parametrize("width", WIDTHS)
def test_demo_tables_fit_and_keep_every_exponent(small_demo, width):
    """1.08e-14 and 1.08e+00 must never both read 1.08: each number of the JSON rows appears whole."""
    out = io.StringIO()
    demo.print_table(small_demo, Console(file=out, width=width))
    words = _fits(out.getvalue(), width)
    keys = ("rowsum_residual_max", "rowsum_residual_mean", "rowsum_over_bound_max",
            "rowsum_residual_after_quant_max", "out_rel_err", "dq_rel_err", "dk_rel_err", "dv_rel_err")
    rows = small_demo.json_rows()
    assert {r["recipe"] for r in rows} >= {"exact", "delta_matching"}
    for row in rows:
        for key in keys:
            assert f"{row[key]:.2e}" in words, (row["recipe"], key)
        if "accumulation" in row:
            acc = row["accumulation"]
            for value in (acc["err"][0], acc["err"][-1], acc["noise_only"][-1]):
                assert f"{value:.2e}" in words
            assert f"{acc['ratio']:.2f}" in words and f"{acc['noise_band']:.2f}" in words


def test_demo_json_carries_panel_a_reading(small_demo):
    for row in small_demo.json_rows():
        if "accumulation" not in row:
            continue
        acc = row["accumulation"]
        assert acc["ratio"] == acc["err"][-1] / acc["noise_only"][-1]
        assert acc["noise_band"] == demo.noise_ratio_band(acc["single_draw_sq_err"], demo.BAND_SIGMAS)
        assert acc["bias_resolved"] == (acc["ratio"] > acc["noise_band"])
        assert (acc["bias"] is None) != acc["bias_resolved"]
        assert acc["verdict"].startswith(f"{row['recipe']} (") and f"{acc['ratio']:.2f}x" in acc["verdict"]


def test_demo_cli_at_80_columns_without_a_plot(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, text, _ = _run(["demo", "--no-plot", "--recipes", "fp32", "delta_matching", "--seqlen", "64",
                          "--heads", "1", "--head-dim", "16", "--sweep", "--draws", "2"], 80, monkeypatch)
    assert code == 0
    _fits(text, 80)
    assert "plot written" not in text and list(tmp_path.iterdir()) == []


# ---- did you mean ----------------------------------------------------------------------------


def test_unknown_recipe_in_check_suggests_the_close_name():
    done = subprocess.run([sys.executable, "-m", "dmref", "check", "dmref.targets:sdpa", "--recipe", "delta_matchng"],
                          capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("dmref check: error: unknown recipe 'delta_matchng'")
    assert "did you mean 'delta_matching'?" in lines[0]


@pytest.mark.parametrize("argv, hint", [
    (["check", "dmref.targets:sdpa", "--case", "causal_crss"], "did you mean 'causal_cross'?"),
    (["check", "dmref.targets:sdpa", "--case", "causal_crss", "--case", "gqa_ration_2"],
     "did you mean 'causal_cross' for 'causal_crss'? did you mean 'gqa_ratio_2' for 'gqa_ration_2'?"),
    (["check", "dmref.targets:sdpa", "--recipe", "naive_fp8@hoper"], None),
    (["check", "dmref.targets:sdpa", "--recipe", "cudnn_fp9@hopper"], "did you mean 'cudnn_fp8@hopper'?"),
    (["demo", "--recipes", "delta_matching", "mxfp8_stal"], "did you mean 'mxfp8_stale'?"),
])
def test_unknown_names_are_one_line_with_a_suggestion(argv, hint):
    code, out, err = _run(argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1
    if hint is None:
        assert "did you mean" not in err  # a bad model name after '@' is reported as such
    else:
        assert hint in err


def test_no_suggestion_for_a_name_like_none():
    with pytest.raises(ValueError) as e:
        demo.get_recipe("zzzz")
    assert "did you mean" not in str(e.value) and "presets:" in str(e.value)
