"""``dmref verify-gemm FILE.npz``: per group fractions, JSON, and an exit status that is 0 only
when every bit pattern is reproduced."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dmref.cli import main

H200 = Path(__file__).resolve().parents[1] / "data" / "h200_fp8_gemm.npz"


def _small_copy(path: Path, names=("c000", "c003", "c039"), flip: str | None = None) -> Path:
    """A ground-truth file with a few cases of the H200 file; ``flip`` changes one output bit."""
    with np.load(H200) as z:
        arrays = {"about": z["about"]}
        for name in names:
            for key in ("a", "bt", "c", "out", "meta"):
                arrays[f"{name}_{key}"] = z[f"{name}_{key}"].copy()
    if flip:
        arrays[f"{flip}_out"][3, 5] ^= 1
    np.savez(path, **arrays)
    return path


def test_verify_gemm_json_reports_every_group_reproduced(tmp_path, capsys):
    path = _small_copy(tmp_path / "three.npz")
    assert main(["verify-gemm", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["all_reproduced"] and report["matched"] == report["outputs"] == 3 * 64 * 64
    assert {g["group"].split(" | ")[3] for g in report["groups"]} == {"randn"}
    assert all(g["fraction"] == 1.0 and g["max_ulps"] == 0 for g in report["groups"])


def test_verify_gemm_fails_and_names_the_group_when_one_bit_differs(tmp_path, capsys):
    path = _small_copy(tmp_path / "flipped.npz", flip="c003")
    assert main(["verify-gemm", str(path), "--json"]) == 1
    groups = json.loads(capsys.readouterr().out)["groups"]
    bad = [g for g in groups if g["matched"] < g["outputs"]]
    assert len(bad) == 1 and bad[0]["cases"] == ["c003"] and bad[0]["max_ulps"] == 1
    assert bad[0]["outputs"] - bad[0]["matched"] == 1


def test_verify_gemm_prints_a_table(tmp_path, capsys):
    path = _small_copy(tmp_path / "three.npz")
    assert main(["verify-gemm", str(path)]) == 0
    out = capsys.readouterr().out
    assert "100.000%" in out and "all reproduced" in out
