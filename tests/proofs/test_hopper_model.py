"""Lemma 7 of dmref/proofs/rounding_bounds.md: the wgmma model is the H200's, and its error bound
holds and is sharp."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dmref.emulation import get_format
from dmref.proofs import bounds, checks
from dmref.proofs.hopper import hopper_matmul

DATA = Path(__file__).resolve().parents[1] / "data" / "h200_fp8_gemm.npz"

#: The worst case reaches at least 1/SHARPNESS of the bound ("sharp within a factor of 2").
SHARPNESS = 2.0


def _h200_cases(max_k: int):
    data = np.load(DATA)
    names = sorted({k.split("_")[0] for k in data.files if k != "about"})
    for name in names:
        meta = json.loads(str(data[name + "_meta"]))
        if meta["K"] <= max_k:
            yield name, meta, data


def _promotion(meta) -> int | None:
    if meta["engine"] == "triton_dot":
        return meta["max_num_imprecise_acc"] if meta["chain"] else meta["BK"]
    return None if meta["use_fast_accum"] else 128  # cuBLAS: docs/gemm.md


def _decode(codes: np.ndarray, fmt: str) -> np.ndarray:
    f = get_format(fmt)
    table = np.array([f.value(c) for c in range(f.n_codes)])
    return table[codes]


def _check_case(name, meta, data):
    a = _decode(data[name + "_a"], meta["fa"])
    bt = _decode(data[name + "_bt"], meta["fb"])
    c = data[name + "_c"].view(np.float32)
    out = hopper_matmul(a, bt, meta["fa"], meta["fb"], promote_every=_promotion(meta), c=c)
    expected = data[name + "_out"]
    same = (out.view(np.uint32) == expected) | (np.isnan(out) & np.isnan(expected.view(np.float32)))
    assert same.all(), f"{name} {meta}: {np.count_nonzero(~same)} outputs differ"


@pytest.mark.parametrize("name,meta,data", [pytest.param(*c, id=c[0]) for c in _h200_cases(128)])
def test_hopper_model_reproduces_h200_outputs_bit_for_bit(name, meta, data):
    _check_case(name, meta, data)


@pytest.mark.slow
def test_hopper_model_reproduces_every_h200_case_bit_for_bit():
    for name, meta, data in _h200_cases(max_k=1 << 20):
        _check_case(name, meta, data)


@st.composite
def fp8_operands(draw):
    """FP8 values from codes: every finite code (subnormals included) or a narrow band."""
    fmt_a, fmt_b = draw(st.sampled_from([("e4m3", "e4m3"), ("e5m2", "e4m3"), ("e5m2", "e5m2")]))
    k = draw(st.sampled_from([1, 31, 32, 64, 100, 256]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))

    def values(fmt, rows):
        f = get_format(fmt)
        finite = np.array([c for c in range(f.n_codes) if np.isfinite(f.value(c))])
        spread = draw(st.sampled_from(["all_codes", "narrow"]))
        if spread == "narrow":  # one binade around 1: little truncation
            finite = finite[np.abs(np.array([f.value(int(c)) for c in finite]) - 1.5) <= 0.5]
        return _decode(rng.choice(finite, size=(rows, k)), fmt)

    promote = draw(st.sampled_from([None, 32, 64, 128]))
    return values(fmt_a, 4), values(fmt_b, 5), fmt_a, fmt_b, promote


@given(ops=fp8_operands())
def test_hopper_dot_error_within_lemma_7_bound(ops):
    a, bt, fmt_a, fmt_b, promote = ops
    assert checks.check_hopper_dot_bound(a, bt, fmt_a, fmt_b, promote).holds


def test_hopper_dot_bound_is_sharp_on_one_large_and_many_truncated_products():
    """One product 1 and 31 products just below 2**-13 in one k-step: each is truncated to 0,
    so the error is 31 * 1.75 * 2**-14 against the bound w * W."""
    a = np.array([[1.0] + [1.75 * 2.0**-7] * 31])
    bt = np.array([[1.0] + [2.0**-7] * 31])
    result = checks.check_hopper_dot_bound(a, bt, "e5m2", "e5m2")
    assert result.holds
    assert result.worst_fraction_of_bound >= 1.0 / SHARPNESS


def test_hopper_dot_bound_grows_with_the_chain_and_shrinks_with_promotion():
    n = 1024
    chain = bounds.hopper_dot_error_bound(n)
    promoted = bounds.hopper_dot_error_bound(n, 128)
    assert bounds.hopper_dot_error_bound(32) < chain
    assert promoted < chain
    with pytest.raises(ValueError):
        bounds.hopper_dot_error_bound(n, 48)


@given(ops=fp8_operands())
def test_vs_emulation_gemm_hopper_model_agrees_bit_for_bit(ops):
    """The proofs' small model and dmref.emulation.gemm's Hopper model, written independently,
    give the same float32 bits."""
    from dmref.emulation.gemm import matmul

    a, bt, fmt_a, fmt_b, promote = ops
    if promote is not None and promote > a.shape[1]:
        promote = None  # a promotion interval beyond K means one chain in both models
    ours = hopper_matmul(a, bt, fmt_a, fmt_b, promote_every=promote)
    theirs = matmul(a.astype(np.float32), bt.astype(np.float32), fa=fmt_a, fb=fmt_b,
                    model="hopper", promote_every=promote)
    assert (np.asarray(ours).view(np.uint32) == np.asarray(theirs).view(np.uint32)).all()
