"""``dmref verify-attention``: the replay of tests/data/h200_cudnn_fp8_sdpa.npz reproduces cuDNN's
FP8 codes (O, dK, dV: every code within one step; dQ likewise except where cuDNN writes +0 codes
into its last partial query tile, which are counted and left out of the goal), and bad files give
one line on stderr and exit status 2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dmref.cudnn import replay as ar
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


# ----------------------------------------------------------------------------------------------
# dP - D as one fused multiply-add (docs/cudnn_fp8.md, "dS in one-hot rows"), and fresh captures
# ----------------------------------------------------------------------------------------------

HELDOUT = CAPTURE.with_name("h200_cudnn_fp8_sdpa_heldout.npz")
#: captured after the FMA point was found (captures/capture_cudnn_fp8.py --seed 1, other lengths;
#: docs/cudnn_fp8.md gives the commands): every length a multiple of 64, and lengths with a tail
FRESH = CAPTURE.with_name("h200_cudnn_fp8_sdpa_seed1.npz")
FRESH_TAIL = CAPTURE.with_name("h200_cudnn_fp8_sdpa_seed1_tail.npz")
_DQ_TILE = 64  # cuDNN's dQ query tile (the +0 block of the 200-query cases lies in its last, partial one)


def test_fma32_rounds_once_where_float64_then_float32_rounds_twice():
    """a b + c = 1 + 2^-23 + 2^-24 - 2^-70: float64 rounds it onto the float32 midpoint
    1 + 2^-23 + 2^-24, which float32 then ties to even (1 + 2^-22); a fused multiply-add rounds
    the exact value once, down to 1 + 2^-23. The same with every sign flipped; an exact result stays exact."""
    f32 = np.float32
    a, b, c = f32(1 + 2.0**-23), f32((1 - 2.0**-23) * 2.0**-24), f32(1 + 2.0**-23)
    assert float(a) * float(b) == 2.0**-24 - 2.0**-70
    assert f32(float(a) * float(b) + float(c)) == f32(1 + 2.0**-22)  # twice rounded
    got = ar.fma32(np.array([a, -a, a]), np.array([b, b, f32(2)]), np.array([c, -c, f32(0.5)]))
    assert got.tolist() == [f32(1 + 2.0**-23), f32(-(1 + 2.0**-23)), f32(2.5 + 2.0**-22)]


@pytest.mark.slow
def test_heldout_capture_meets_the_goal(capsys):
    """The capture made after the replay was written (512 and 320 tokens): `dmref verify-attention`
    exits 0, no code of any tensor more than one step from cuDNN's."""
    rc = main(["verify-attention", str(HELDOUT), "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert len(rep["cases"]) == 8
    assert all(s["max_steps"] <= ar.MAX_STEPS for s in rep["summary"].values())
    assert rep["goal_met"] is True and rc == 0


def test_heldout_case_1_residual_is_dp_rounded_before_d_is_subtracted():
    """Heldout case 1 (512 keys, E5M2): with dP rounded to float32 before D is subtracted, the
    codes that differ from cuDNN's are dQ rows (head 0, query 505) and (head 1, query 85), up to
    45 steps, and dK (head 1, key 288), 7 steps; those query rows are one-hot (P = 0.99997 on key
    134, 1.000002 on key 288), where dP_ij - D_i cancels to 3e-5 of dP. With the fused multiply-add
    every code of the case is cuDNN's."""
    case = ar.load_capture(str(HELDOUT))[1]
    assert (case["grad_format"], case["k_fp8"].shape[2]) == ("e5m2", 512)
    fmt = "float8_e5m2"
    rounded = ar.replay_case(case, options=ar.ReplayOptions(dp_fma=False))
    off = {t: {tuple(int(x) for x in r[:3]) for r in np.argwhere(ar.code_steps(rounded[t], case[f"{t}_fp8"], fmt) > 0)}
           for t in ("dq", "dk")}
    assert off == {"dq": {(0, 0, 505), (0, 1, 85)}, "dk": {(0, 1, 288)}}
    assert ar.code_steps(rounded["dq"], case["dq_fp8"], fmt).max() == 45
    fused = ar.replay_case(case)
    for t in ("o", "dq", "dk", "dv"):
        assert (fused[t] == case[f"{t}_fp8"]).all(), t


def _fresh(path: Path) -> Path:
    if not path.is_file():
        pytest.skip(f"{path.name} is not in tests/data yet: capture it on an H200 with the command in "
                    "docs/cudnn_fp8.md (\"A fresh capture\")")
    return path


def _seed_and_lengths(path: Path) -> tuple[int, set[int]]:
    meta = json.loads(str(_arrays(path)["meta"]))
    return meta["seed"], {p[3] for p in meta["problems"]}


@pytest.mark.slow
def test_fresh_capture_meets_the_goal(capsys):
    """A capture the replay was not fitted to (seed 1, lengths 384 and 640, GQA): `dmref
    verify-attention` exits 0, every tensor of every case meeting the goal."""
    path = _fresh(FRESH)
    seed, lengths = _seed_and_lengths(path)
    earlier = set().union(*(_seed_and_lengths(p)[1] for p in (CAPTURE, HELDOUT)))
    assert seed != 0 and not lengths & earlier, (seed, lengths)
    rc = main(["verify-attention", str(path), "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert len(rep["cases"]) >= 4
    for case in rep["cases"]:
        for t, m in case["tensors"].items():
            assert m["meets_goal"], (case["case"], t, m)
    assert rep["goal_met"] is True and rc == 0


def test_fresh_tail_capture_departs_only_in_cudnns_zero_dq_tail():
    """Lengths that are not a multiple of 64 (seed 1): O, dK and dV meet the goal; every dQ code
    more than one step from the replay's is a +0 of cuDNN's in the last, partial 64-row query
    tile, and every other dQ code is within one step."""
    path = _fresh(FRESH_TAIL)
    cases = ar.load_capture(str(path))
    assert any(c["q_fp8"].shape[2] % _DQ_TILE for c in cases)
    for case in cases:
        got = ar.replay_case(case)
        fmt = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}[case["grad_format"]]
        for t in ("o", "dk", "dv"):
            steps = ar.code_steps(got[t], case[f"{t}_fp8"], "float8_e4m3fn" if t == "o" else fmt)
            assert (steps == 0).mean() >= ar.GOALS[t] and steps.max() <= ar.MAX_STEPS, (case["index"], t)
        steps = ar.code_steps(got["dq"], case["dq_fp8"], fmt)
        nq = case["q_fp8"].shape[2]
        tail = np.zeros(steps.shape, bool)
        tail[..., nq - nq % _DQ_TILE if nq % _DQ_TILE else nq:, :] = True
        far = steps > ar.MAX_STEPS
        assert not (far & ~(tail & (case["dq_fp8"] == 0))).any(), case["index"]


def _off(got: dict, case: dict, tensors) -> dict:
    """Per tensor, the (batch, head, row) of every code that differs from cuDNN's."""
    return {t: {tuple(int(v) for v in r[:3]) for r in np.argwhere(got[t] != case[f"{t}_fp8"])} for t in tensors}


@pytest.mark.slow
def test_fresh_capture_residual_is_the_backward_exponent_and_ds_scales():
    """Seed 1, case 0 (384 tokens, GQA 4 on 2, E4M3). With P's exponent from the forward's base-2
    logits, ``x - fl(stats log2 e)``, one P code differs: 448 P at (head 1, query 53, key 95) is
    1.3124995, below E4M3's midpoint 1.3125 between 1.25 and 1.375, where cuDNN's exponent,
    ``fl(fma(S, fl(attn_scale fl(descale_q descale_k)), -stats) log2 e)``, gives 1.3125004; that
    code moves the dV row (kv head 0, key 95) by up to 3 steps, and y = P attn_scale (dP - D)
    scale_dP at (head 3, query 6, key 115) crosses E4M3's midpoint -0.07421875 (dK's row (kv head
    1, key 115), one step). With dS's scalars applied in sequence, ``((P (dP - D)) attn_scale)
    scale_dP``, y at (head 3, query 327, key 241) is 10.500001 (E4M3 11) where
    ``(P attn_scale)((dP - D) scale_dP)`` gives the midpoint 10.5 (ties to even: 10, cuDNN's), and
    the dK row (kv head 1, key 241) is up to 15 steps off. With both of cuDNN's, dK and dV are
    cuDNN's code for code. The tail capture's case 5 (300 tokens, E5M2) fixes the order of the
    exponent's descales: with the forward's ``fl(fl(attn_scale descale_q) descale_k)``, y at (head
    0, query 138, key 210) is the float16 midpoint 0.93725586 (ties to 0.9375) and the dQ row
    (head 0, query 138) moves; with ``attn_scale fl(descale_q descale_k)`` it is 0.9372555 and
    every dQ code cuDNN computed is its own."""
    case = ar.load_capture(str(_fresh(FRESH)))[0]
    assert (case["grad_format"], case["q_fp8"].shape[1:3], case["k_fp8"].shape[1]) == ("e4m3", (4, 384), 2)
    p448 = {m: ar.backward_p(case, options=ar.ReplayOptions(p_exponent=m))[0, 1, 53, 95] * case["scale_s"]
            for m in ("natural", "base2")}
    assert p448["base2"] < np.float32(1.3125) < p448["natural"]
    fmt = "float8_e4m3fn"
    runs = {"cudnn": ar.ReplayOptions(), "base2": ar.ReplayOptions(p_exponent="base2"),
            "sequential": ar.ReplayOptions(ds_scales="sequential")}
    got = {name: ar.replay_case(case, options=o) for name, o in runs.items()}
    assert _off(got["cudnn"], case, ("dq", "dk", "dv")) == {"dq": set(), "dk": set(), "dv": set()}
    assert _off(got["base2"], case, ("dk", "dv")) == {"dk": {(0, 1, 115)}, "dv": {(0, 0, 95)}}
    assert ar.code_steps(got["base2"]["dv"], case["dv_fp8"], fmt).max() == 3
    assert _off(got["sequential"], case, ("dk", "dv")) == {"dk": {(0, 1, 241)}, "dv": set()}
    assert ar.code_steps(got["sequential"]["dk"], case["dk_fp8"], fmt).max() == 15

    tail = ar.load_capture(str(_fresh(FRESH_TAIL)))[5]
    assert (tail["grad_format"], tail["q_fp8"].shape[2]) == ("e5m2", 300)
    cudnn = ar.replay_case(tail)
    attn_first = ar.replay_case(tail, options=ar.ReplayOptions(p_exponent="natural_attn_first"))
    steps = {n: ar.code_steps(g["dq"], tail["dq_fp8"], "float8_e5m2") for n, g in
             (("cudnn", cudnn), ("attn_first", attn_first))}
    computed = np.ones(steps["cudnn"].shape, bool)  # every code but cuDNN's zeros of its dQ tail
    computed[..., ar.dq_tail_rows(300), :] = tail["dq_fp8"][..., ar.dq_tail_rows(300), :] != 0
    assert not (steps["cudnn"] * computed).any()
    moved = {tuple(int(v) for v in r[:3]) for r in np.argwhere((steps["attn_first"] > 0) & computed)}
    assert moved == {(0, 0, 138)} and (steps["attn_first"] * computed).max() == 3
