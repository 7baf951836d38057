"""``dmref verify-attention``: the replay of tests/data/h200_cudnn_fp8_sdpa.npz reproduces cuDNN's
FP8 codes (O, dK, dV: every code within one step; dQ likewise except where cuDNN writes +0 codes
into its last partial query tile, which are counted and left out of the goal), and bad files give
one line on stderr and exit status 2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dmref import attention_replay as ar
from dmref.cli import main

CAPTURE = Path(__file__).resolve().parents[1] / "data" / "h200_cudnn_fp8_sdpa.npz"
#: one case per problem shape that is fast enough for the CPU suite: 128 keys (one tile,
#: e5m2 gradients, causal) and 200 keys (GQA, a partial tile, cuDNN's zeros in dQ's last tile)
SUBSET = (3, 4)


def _arrays(path=CAPTURE) -> dict:
    with np.load(path, allow_pickle=False) as z:
        return {n: z[n] for n in z.files}


@pytest.fixture(scope="module")
def subset_file(tmp_path_factory) -> Path:
    arrays = _arrays()
    keep = {n: a for n, a in arrays.items()
            if not n.startswith("c") or int(n[1:].split(".")[0]) in SUBSET}
    path = tmp_path_factory.mktemp("capture") / "subset.npz"
    np.savez(path, **keep)
    return path


@pytest.fixture(scope="module")
def report(subset_file) -> tuple[int, dict]:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["verify-attention", str(subset_file), "--json"])

    def no_constants(name):
        raise AssertionError(f"non-strict JSON constant {name}")

    return rc, json.loads(out.getvalue(), parse_constant=no_constants)


def test_replay_matches_cudnn_codes(report):
    rc, rep = report
    assert [c["case"] for c in rep["cases"]] == list(SUBSET)
    for case in rep["cases"]:
        for t in ("o", "dk", "dv"):
            m = case["tensors"][t]
            assert m["meets_goal"], (case["case"], t, m)
            assert m["max_steps"] <= ar.MAX_STEPS
        dq = case["tensors"]["dq"]
        assert dq["fraction"] >= ar.GOALS["dq"]
        assert dq["max_steps_where_cudnn_nonzero"] <= ar.MAX_STEPS
        # every dQ code more than one step off is a +0 that cuDNN returned
        assert dq["beyond_one_step"] == dq["cudnn_zero_beyond_one_step"]
        # the float32 stats agree to a few float32 ulps of logits of magnitude ~1e3
        assert case["stats_max_abs"] <= 8 * np.spacing(np.float32(1024.0))


def test_cudnn_dq_tail_zeros_are_counted_and_left_out_of_the_goal(report):
    """cuDNN's +0 codes in dQ's last partial query tile (200 queries: rows 192-199) are counted
    apart; every other code meets the goal, so the README's example exits 0."""
    rc, rep = report
    by_case = {c["case"]: c for c in rep["cases"]}
    assert by_case[3]["tensors"]["dq"]["identical"] == by_case[3]["tensors"]["dq"]["codes"]
    assert by_case[3]["tensors"]["dq"]["cudnn_dq_tail_zeros"] == 0  # 128 queries: no partial tile
    tail = by_case[4]["tensors"]["dq"]
    assert tail["cudnn_dq_tail_zeros"] == tail["beyond_one_step"] == tail["cudnn_zero_beyond_one_step"] > 0
    assert tail["max_steps"] > ar.MAX_STEPS >= tail["max_steps_checked"]
    assert tail["meets_goal"] and rep["goal_met"] is True and rc == 0
    assert "cuDNN writes zeros" in rep["goal"]["left_out"]


def test_the_table_names_cudnns_dq_tail_and_exits_0(subset_file, capsys):
    assert main(["verify-attention", str(subset_file)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "cuDNN's zeros in dQ, cases 4:" in out and "cuDNN writes zeros there" in out
    assert "goal met on every code cuDNN computed" in out


def _with_dq_zeros(tmp_path, case: int, rows: slice) -> Path:
    """A one-case capture whose cuDNN dQ codes are set to +0 in ``rows``."""
    arrays = {n: a for n, a in _arrays().items() if n.startswith(f"c{case}.")}
    dq = arrays[f"c{case}.dq_fp8"].copy()
    dq[..., rows, :] = 0
    arrays[f"c{case}.dq_fp8"] = dq
    path = tmp_path / f"zeros{case}.npz"
    np.savez(path, **arrays)
    return path


@pytest.mark.parametrize("case, rows", [(4, slice(0, 8)), (3, slice(120, 128))])
def test_zeros_outside_cudnns_dq_tail_fail_the_goal(tmp_path, case, rows):
    """The exclusion is that tile only: zeros in the first rows (case 4), or in the last rows of
    a query count that is a multiple of 64 (case 3, 128 queries), are compared and fail."""
    (result,) = ar.verify_capture(str(_with_dq_zeros(tmp_path, case, rows)))
    dq = result["tensors"]["dq"]
    assert dq["max_steps_checked"] > ar.MAX_STEPS and not dq["meets_goal"]
    assert dq["beyond_one_step"] - dq["cudnn_dq_tail_zeros"] > 0  # the planted zeros are compared
    if case == 3:
        assert dq["cudnn_dq_tail_zeros"] == 0


def test_cudnn_dq_tail_codes_are_zero():
    """The +0 block behind the dQ failure, read directly from the capture: rows 192..199 (the
    last partial 64-row tile of 200 queries), columns 16..31 of every 32."""
    arrays = _arrays()
    cols = np.r_[16:32, 48:64, 80:96, 112:128]
    for i in (4, 5, 6, 7):
        assert not arrays[f"c{i}.dq_fp8"][..., 192:200, :][..., cols].any()


def test_code_steps():
    e4m3 = "float8_e4m3fn"
    a = np.array([0x00, 0x01, 0x01, 0x7E, 0x7F, 0x7F], np.uint8)
    b = np.array([0x80, 0x81, 0x02, 0xFE, 0x7E, 0x7F], np.uint8)
    assert ar.code_steps(a, b, e4m3).tolist() == [0, 2, 1, 2 * 0x7E, ar.NAN_STEPS, 0]


def _run_bad(path, capsys) -> str:
    assert main(["verify-attention", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err
    return err


def test_missing_file(tmp_path, capsys):
    assert "does not exist" in _run_bad(tmp_path / "nope.npz", capsys)


def test_not_an_npz(tmp_path, capsys):
    path = tmp_path / "text.npz"
    path.write_text("not a zip archive\n")
    assert "not a readable .npz" in _run_bad(path, capsys)


def test_random_bytes_are_one_line_without_numpys_pickle_advice(tmp_path, capsys):
    path = tmp_path / "random.npz"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    err = _run_bad(path, capsys)
    assert "not a readable .npz" in err and "allow_pickle" not in err and "unsafely" not in err


def test_a_single_npy_is_refused(tmp_path, capsys):
    path = tmp_path / "one.npy"
    np.save(path, np.zeros(3))
    assert "single .npy array" in _run_bad(path, capsys)


@pytest.mark.parametrize("causal", [np.str_("no"), np.str_("yes"), np.int64(1), np.array([True])])
def test_causal_must_be_a_bool(tmp_path, capsys, causal):
    """bool() of the string "no" is True: a capture's causal flag is a 0-d bool or refused."""
    arrays = {n: a for n, a in _arrays().items() if n.startswith("c0.")}
    arrays["c0.causal"] = causal
    path = tmp_path / "causal.npz"
    np.savez(path, **arrays)
    assert "case 0: causal must be a 0-d bool array" in _run_bad(path, capsys)


def test_pickle_is_refused(tmp_path, capsys):
    path = tmp_path / "pickled.npz"
    np.savez(path, **{"c0.q_fp8": np.array([{"a": 1}], dtype=object)})
    assert "not a readable .npz" in _run_bad(path, capsys)


def test_no_cases(tmp_path, capsys):
    path = tmp_path / "empty.npz"
    np.savez(path, about=np.str_("nothing"))
    assert "no case" in _run_bad(path, capsys)


def test_missing_array(tmp_path, capsys):
    arrays = {n: a for n, a in _arrays().items() if n.startswith("c0.") and n != "c0.dq_fp8"}
    path = tmp_path / "missing.npz"
    np.savez(path, **arrays)
    assert "case 0 lacks dq_fp8" in _run_bad(path, capsys)


def test_bad_shape(tmp_path, capsys):
    arrays = {n: a for n, a in _arrays().items() if n.startswith("c0.")}
    arrays["c0.dk_fp8"] = arrays["c0.dk_fp8"][..., :64, :]
    path = tmp_path / "shape.npz"
    np.savez(path, **arrays)
    assert "inconsistent shapes (dk_fp8)" in _run_bad(path, capsys)
