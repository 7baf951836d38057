"""dmref demo: the table, the JSON and the PNG, on a small problem."""

from __future__ import annotations

import contextlib
import io
import json

from dmref import cli
from dmref.demo import JSON_KEYS
from dmref.recipes import PRESETS

_SMALL = ["--seqlen", "256", "--heads", "2", "--head-dim", "32", "--draws", "2"]


def _run(argv) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert cli.main(argv) == 0
    return out.getvalue()


def test_demo_json_lists_every_preset_with_the_required_keys():
    rows = json.loads(_run(["demo", "--json", "--out", "", "--sweep", *_SMALL]))
    assert [r["recipe"] for r in rows] == list(PRESETS)
    for row in rows:
        assert set(JSON_KEYS) <= set(row)
        assert all(isinstance(row[k], float) for k in JSON_KEYS if k != "recipe")
    by = {r["recipe"]: r for r in rows}
    # Delta-Matching inside its FP32 bound on every row, the stale FP8 recipes far outside it
    assert by["delta_matching"]["rowsum_over_bound_max"] <= 1
    for stale in ("naive_fp8", "cudnn_fp8", "mxfp8_stale"):
        assert by[stale]["rowsum_residual_max"] > 100 * by["delta_matching"]["rowsum_bound_max"]
    # figure panel A's reading for each averaged recipe
    for name in ("cudnn_fp8", "mxfp8_stale", "delta_matching"):
        acc = by[name]["accumulation"]
        assert acc["draws"] == [1, 2] and acc["bias_resolved"] == (acc["ratio"] > acc["noise_band"])
        assert acc["verdict"].startswith(name)


def test_demo_prints_a_table_and_writes_a_png(tmp_path):
    png = tmp_path / "demo.png"
    text = _run(["demo", "--out", str(png), "--recipes", "bf16", "delta_matching", "--sweep", "64", "128",
                 *_SMALL])
    assert "delta_matching" in text and "plot written" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
