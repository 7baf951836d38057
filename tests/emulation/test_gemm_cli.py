"""``dmref verify-gemm FILE.npz``: per group fractions, JSON, and an exit status that is 0 only
when every bit pattern is reproduced; files that cannot be replayed and bad options give one line
on stderr and exit status 2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

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


# ---- files that cannot be replayed: one line on stderr, exit status 2 ------------------------


def _arrays(name="c000") -> dict:
    with np.load(H200) as z:
        return {"about": z["about"], **{f"{name}_{k}": z[f"{name}_{k}"].copy()
                                         for k in ("a", "bt", "c", "out", "meta")}}


def _with_meta(**changes) -> dict:
    arrays = _arrays()
    meta = json.loads(str(arrays["c000_meta"]))
    meta.update(changes)
    arrays["c000_meta"] = np.array(json.dumps({k: v for k, v in meta.items() if v is not ...}))
    return arrays


def _torch_file(path: Path) -> None:
    import torch

    torch.save({"weight": torch.ones(3)}, path)


def _pickle_file(path: Path) -> None:
    import pickle

    path.write_bytes(pickle.dumps({"c000_a": [1, 2, 3]}))


#: (file name, how to make it (a dict of arrays for np.savez, or a function of the path), what
#: the one-line message must contain)
BAD_FILES = {
    "missing": ("nothing.npz", None, "nothing.npz: no such file"),
    "directory": ("adir", lambda p: p.mkdir(), "adir is a directory, not an .npz file"),
    "random_bytes": ("noise.npz", lambda p: p.write_bytes(np.random.default_rng(0).bytes(999)),
                     "noise.npz is not an .npz archive of arrays"),
    "pickle": ("p.npz", _pickle_file, "p.npz is not an .npz archive of arrays"),
    "single_npy": ("one.npy", lambda p: np.save(p, np.ones(3)), "is a single .npy array"),
    "empty_npz": ("empty.npz", {}, "empty.npz holds no cases"),
    "unrelated_keys": ("other.npz", {"x": np.ones(3), "weights": np.zeros(2)},
                       "other.npz holds no cases"),
    "torch_pt": ("model.pt", _torch_file, "model.pt holds no cases"),
    "missing_out": ("no_out.npz", {k: v for k, v in _arrays().items() if k != "c000_out"},
                    "case c000 has no c000_out"),
    "missing_meta": ("no_meta.npz", {k: v for k, v in _arrays().items() if k != "c000_meta"},
                     "case c000 has no c000_meta"),
    "out_shape": ("shape.npz", _arrays() | {"c000_out": np.zeros((64, 65), np.uint32)},
                  "out has shape (64, 65); a is (64, 32) (M, K), so out must be (64, 64)"),
    "bt_shape": ("k.npz", _arrays() | {"c000_bt": np.zeros((64, 31), np.uint8)},
                 "bt has shape (64, 31)"),
    "a_dtype": ("dtype.npz", _arrays() | {"c000_a": np.zeros((64, 32), np.float32)},
                "a is a float32 array of shape (64, 32); it must be a 2-D uint8 array"),
    "no_outputs": ("m0.npz", _arrays() | {"c000_a": np.zeros((0, 32), np.uint8),
                                          "c000_c": np.zeros((0, 64), np.uint32),
                                          "c000_out": np.zeros((0, 64), np.uint32)},
                   "case c000 has no outputs to check (M=0, N=64)"),
    "meta_not_json": ("json.npz", _arrays() | {"c000_meta": np.array("{engine: triton")},
                      "case c000: meta is not valid JSON"),
    "meta_not_string": ("mnum.npz", _arrays() | {"c000_meta": np.arange(3)},
                        "meta must be a JSON string, got a int64 array of shape (3,)"),
    "meta_not_object": ("mlist.npz", _arrays() | {"c000_meta": np.array("[1, 2]")},
                        "meta must be a JSON object, got list"),
    "meta_missing_key": ("nofa.npz", _with_meta(fa=...), "meta has no fa"),
    "unknown_engine": ("eng.npz", _with_meta(engine="cutlass"),
                       "engine='cutlass'; accepted: triton_dot, cublas_scaled_mm, triton_scaled"),
    "unknown_format": ("fmt.npz", _with_meta(fb="e9m9"), "fb='e9m9' is not an 8-bit format name"),
    "sixteen_bit_format": ("bf.npz", _with_meta(fa="bfloat16"), "fa='bfloat16' is not an 8-bit"),
    "K_disagrees": ("k2.npz", _with_meta(K=64), "meta K=64 but the arrays have K=32"),
    "BK_not_integer": ("bk.npz", _with_meta(BK="32"), "meta BK='32' must be a non-negative integer"),
    "BK_not_k_step": ("bk2.npz", _with_meta(BK=48), "case c000: tile_k=48 must be a positive multiple"),
    "BK_zero": ("bk0.npz", _with_meta(BK=0), "meta BK=0 must be positive"),
    "scale_block_k_zero": ("sbk0.npz", _with_meta(scale_block_k=0), "meta scale_block_k=0 must be positive"),
    "BK_missing": ("bk3.npz", _with_meta(BK=...), "a triton_dot case needs BK in its meta"),
    "BK_null": ("bk4.npz", _with_meta(BK=None), "a triton_dot case needs BK in its meta"),
    "engine_not_string": ("eng2.npz", _with_meta(engine=["triton_dot"]), "engine=['triton_dot']; accepted"),
    "dist_not_string": ("dist.npz", _with_meta(dist=3), "meta dist=3 must be a string"),
    "chain_not_bool": ("chain.npz", _with_meta(chain="yes"), "meta chain='yes' must be true or false"),
    "scales_for_triton_dot": ("sc.npz", _arrays() | {"c000_scale_a": np.ones((64, 1), np.float32),
                                                     "c000_scale_b": np.ones((64, 1), np.float32)},
                              "engine 'triton_dot' takes no scale_a and scale_b"),
    "one_scale": ("sc1.npz", _arrays() | {"c000_scale_a": np.ones((64, 1), np.float32)},
                  "has only one of scale_a and scale_b"),
    "stray_key": ("stray.npz", _arrays() | {"notes": np.array("hello")},
                  "entries 'notes' are not part of a case"),
    "about_not_json": ("about.npz", _arrays() | {"about": np.array("not json")},
                       "about is not valid JSON"),
}


@pytest.mark.parametrize("row", list(BAD_FILES))
@pytest.mark.parametrize("as_json", [False, True])
def test_verify_gemm_bad_file_is_one_line_and_exit_2(row, as_json, tmp_path, capsys):
    name, make, message = BAD_FILES[row]
    path = tmp_path / name
    if isinstance(make, dict):
        np.savez(path, **make)
    elif make is not None:
        make(path)
    assert main(["verify-gemm", str(path)] + (["--json"] if as_json else [])) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # no table, no JSON: nothing is reported as checked
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dmref verify-gemm: error: "), captured.err
    assert message in lines[0]
    assert "allow_pickle" not in lines[0] and "Traceback" not in captured.err


@pytest.mark.parametrize(("device", "message"), [
    ("banana", "--device 'banana' is not a torch device; accepted: cpu, cuda, cuda:N"),
    ("meta", "--device 'meta': the model runs on cpu or cuda"),
    ("cuda:99", "--device 'cuda:99': this machine has"),
])
def test_verify_gemm_bad_device_is_one_line_and_exit_2(device, message, tmp_path, capsys):
    path = _small_copy(tmp_path / "three.npz")
    assert main(["verify-gemm", str(path), "--device", device]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and message in captured.err


def test_verify_gemm_runs_as_a_program_with_exit_status_2_and_no_traceback(tmp_path):
    """The same through the installed entry point (a real process, its real exit status)."""
    import subprocess
    import sys

    path = tmp_path / "empty.npz"
    np.savez(path)
    done = subprocess.run([sys.executable, "-m", "dmref", "verify-gemm", str(path), "--json"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stdout == ""
    assert "holds no cases" in done.stderr and "Traceback" not in done.stderr
