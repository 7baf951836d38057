"""The emulated FP8 GEMM: bit-exact against the H200 ground truth, and the vectorised models equal
the plain-Python specification (dmref.emulation.gemm.spec) on every input, NaN/inf and the
extremes of the float32 accumulator included."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dmref.emulation import decode
from dmref.emulation.gemm import spec
from dmref.emulation.gemm.captures import load_cases, replay, ulp_distance
from dmref.emulation.formats import Rounding
from dmref.emulation.gemm import HOPPER, cublas_schedule, matmul, triton_dot_schedule

DATA = Path(__file__).resolve().parents[1] / "data"
H200 = DATA / "h200_fp8_gemm.npz"
MORE = DATA / "h200_fp8_gemm_more.npz"  # captured by captures/gpu_capture_gemm.py


def _groups(path: Path) -> dict:
    if not path.exists():
        return {}
    groups: dict = {}
    for case in load_cases(path)[1]:
        groups.setdefault(case.group, []).append(case)
    return groups


H200_GROUPS = _groups(H200)
MORE_GROUPS = _groups(MORE)


def _assert_reproduced(cases) -> None:
    for case in cases:
        got = replay(case)
        wrong = got != case.out
        assert not wrong.any(), (
            f"{case.name} {case.meta}: {wrong.mean():.4%} of bit patterns differ, up to "
            f"{ulp_distance(got, case.out).max()} ulps")


@pytest.mark.parametrize("group", sorted(H200_GROUPS))
def test_hopper_model_reproduces_every_h200_bit_pattern(group):
    _assert_reproduced(H200_GROUPS[group])


@pytest.mark.parametrize("group", sorted(MORE_GROUPS))
def test_hopper_model_reproduces_every_bit_pattern_of_the_second_capture(group):
    _assert_reproduced(MORE_GROUPS[group])


# ----------------------------------------------------------------------------------------------
# The vectorised models equal the specification
# ----------------------------------------------------------------------------------------------

FORMATS = ["e4m3", "e5m2"]
_FINITE = {f: np.flatnonzero(np.isfinite(decode(np.arange(256, dtype=np.uint8), f))) for f in FORMATS}
_SPECIAL = {f: np.flatnonzero(~np.isfinite(decode(np.arange(256, dtype=np.uint8), f))) for f in FORMATS}


def _float32(bits: int) -> float:
    return float(np.array(bits, dtype=np.uint32).view(np.float32))


#: accumulators: ordinary, +-0, float32 subnormals, the extremes of the range
accumulators = st.one_of(
    st.floats(-1e3, 1e3, width=32),
    st.sampled_from([0.0, -0.0, _float32(1), _float32(0x80000001), _float32(0x007FFFFF),
                     _float32(0x00800000), _float32(0x7F7FFFFF), _float32(0xFF7FFFFF)]),
    st.integers(0, 0xFFFFFFFF).map(_float32).filter(np.isfinite),
)


@st.composite
def problems(draw, max_k=96, specials=False):
    """(a codes, bt codes, c, fa, fb): small shapes; codes from the whole range, subnormal-heavy
    or mostly zero; NaN/inf codes and non-finite accumulators when ``specials``."""
    fa, fb = draw(st.sampled_from(FORMATS)), draw(st.sampled_from(FORMATS))
    m, n, k = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, max_k))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    style = draw(st.sampled_from(["any", "subnormal", "zeros"]))

    def codes(rows, fmt):
        pool = _FINITE[fmt]
        if style == "subnormal":
            pool = pool[(pool & 0x7F) < (0x10 if fmt == "e4m3" else 0x0C)]
        x = rng.choice(pool, size=(rows, k))
        if style == "zeros":
            x = np.where(rng.random((rows, k)) < 0.7, 0, x)
        if specials and len(_SPECIAL[fmt]):
            x = np.where(rng.random((rows, k)) < 0.03, rng.choice(_SPECIAL[fmt], size=(rows, k)), x)
        return x.astype(np.uint8)

    c = np.array([[draw(accumulators) for _ in range(n)] for _ in range(m)], dtype=np.float32)
    if specials and draw(st.booleans()):
        c[0, 0] = draw(st.sampled_from([np.inf, -np.inf, np.nan]))
    return codes(m, fa), codes(n, fb), c, fa, fb


schedules = st.sampled_from([
    {}, {"promote_every": 32}, {"promote_every": 64}, {"tile_k": 64}, {"tile_k": 32, "chain": False},
    {"tile_k": 64, "promote_every": 32}, {"tile_k": 64, "promote_every": 32, "chain": False},
    {"tile_k": 32, "promote_every": 64},
])


def _check_against_spec(problem, model="hopper", **kwargs):
    a, bt, c, fa, fb = problem
    got = matmul(a, bt, c, fa=fa, fb=fb, model=model, **kwargs)
    want = spec.matmul(decode(a, fa), decode(bt, fb), c, fa, fb, model, **kwargs)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@settings(max_examples=40)
@given(problems(), schedules)
def test_hopper_equals_scalar_spec(problem, schedule):
    _check_against_spec(problem, "hopper", **schedule)


@settings(max_examples=25)
@given(problems(specials=True), schedules)
def test_hopper_equals_scalar_spec_with_nan_inf_and_nonfinite_accumulators(problem, schedule):
    _check_against_spec(problem, "hopper", **schedule)


RULE_VARIANTS = [
    dataclasses.replace(HOPPER, **change) for change in (
        {"k_step": 16}, {"term_frac_bits": 12}, {"result_bits": 24}, {"result_bits": 13},
        {"term_rounding": Rounding.NEAREST_EVEN}, {"result_rounding": Rounding.NEAREST_EVEN},
        {"accumulator_in_max": False}, {"truncate_accumulator": False},
        {"subnormals_at_emin": False}, {"subnormal_accumulator_at_emin": False},
        {"zeros_in_max": True}, {"normalised_products": True},
    )
]


@pytest.mark.parametrize("rules", RULE_VARIANTS, ids=lambda r: next(
    f"{f.name}={getattr(r, f.name)}" for f in dataclasses.fields(r) if getattr(r, f.name) != getattr(HOPPER, f.name)))
@settings(max_examples=10)
@given(problem=problems(max_k=70))
def test_every_rule_variant_equals_scalar_spec(rules, problem):
    _check_against_spec(problem, "hopper", rules=rules)


@settings(max_examples=25)
@given(problems(max_k=200, specials=True), st.sampled_from(["exact", "fp32"]))
def test_exact_and_fp32_models_equal_scalar_spec(problem, model):
    _check_against_spec(problem, model)


@settings(max_examples=20)
@given(problems(max_k=140), st.sampled_from(["hopper", "exact", "fp32"]),
       st.lists(st.floats(2.0 ** -20, 2.0 ** 20, width=32), min_size=16, max_size=16))
def test_block_scaled_models_equal_scalar_spec(problem, model, pool):
    """Per K tile of 32 (here) the tile's partial, then y = fma(partial * sx, sw, y): the scales
    are arbitrary float32 (DeepSeek-style), so the order of the roundings shows."""
    a, bt, c, fa, fb = problem
    m, n, k = a.shape[0], bt.shape[0], a.shape[1]
    t = -(-k // 32)
    sa = np.resize(np.array(pool, np.float32), (m, t))
    sb = np.resize(np.array(pool[::-1], np.float32), (n, t))
    got = matmul(a, bt, c, fa=fa, fb=fb, model=model, scale_a=sa, scale_b=sb, scale_block_k=32)
    want = spec.matmul(decode(a, fa), decode(bt, fb), c, fa, fb, model, scales=(sa, sb, 32))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_exact_model_rounds_once_when_c_nearly_cancels_the_products():
    """c = -(the products' sum rounded to float32) plus or minus a few ulps: the exact sum is
    then tiny and must come out correctly rounded, not as the difference of two roundings."""
    rng = np.random.default_rng(7)
    a = rng.choice(_FINITE["e5m2"], size=(1, 64)).astype(np.uint8)
    b = rng.choice(_FINITE["e5m2"], size=(1, 64)).astype(np.uint8)
    exact = spec.matmul(decode(a, "e5m2"), decode(b, "e5m2"), 0.0, "e5m2", "e5m2", "exact")[0, 0]
    accumulators, up, down = [-exact], -exact, -exact
    for _ in range(3):
        up, down = np.nextafter(up, np.float32(np.inf)), np.nextafter(down, np.float32(-np.inf))
        accumulators += [up, down]
    for c in accumulators:
        _check_against_spec((a, b, np.full((1, 1), c, np.float32), "e5m2", "e5m2"), "exact")


def test_nan_results_are_the_gpus_canonical_nan():
    a = np.array([[0x7F, 0x38]], np.uint8)  # e4m3 NaN, 1.0
    b = np.array([[0x38, 0x38]], np.uint8)
    for model in ("hopper", "exact", "fp32"):
        out = matmul(a, b, fa="e4m3", fb="e4m3", model=model)
        assert out.view(np.uint32)[0, 0] == 0x7FFFFFFF, model


def test_an_exact_zero_sum_is_positive_zero():
    """-0 codes, a -0 accumulator, products that cancel: the wgmma sum of integers is +0."""
    a = np.array([[0x80, 0x38, 0x38]], np.uint8)  # -0, 1, 1 (e4m3)
    b = np.array([[0x38, 0x38, 0xB8]], np.uint8)  # 1, 1, -1
    out = matmul(a, b, np.full((1, 1), -0.0, np.float32), fa="e4m3", fb="e4m3")
    assert out.view(np.uint32)[0, 0] == 0


# ----------------------------------------------------------------------------------------------
# Inputs, outputs, schedules
# ----------------------------------------------------------------------------------------------


def _random_codes(shape, fmt, seed):
    return np.random.default_rng(seed).choice(_FINITE[fmt], size=shape).astype(np.uint8)


def test_codes_fp8_dtypes_and_exact_floats_give_the_same_result():
    a, b = _random_codes((5, 70), "e4m3", 1), _random_codes((3, 70), "e5m2", 2)
    want = matmul(a, b, fa="e4m3", fb="e5m2")
    as_torch = matmul(torch.from_numpy(a).view(torch.float8_e4m3fn),
                      torch.from_numpy(b).view(torch.float8_e5m2)).numpy()
    as_ml = matmul(a.view(ml_dtypes.float8_e4m3fn), b.view(ml_dtypes.float8_e5m2))
    as_float = matmul(torch.from_numpy(decode(a, "e4m3")), torch.from_numpy(decode(b, "e5m2")),
                      fa="e4m3", fb="e5m2").numpy()
    for other in (as_torch, as_ml, as_float):
        np.testing.assert_array_equal(other.view(np.uint32), want.view(np.uint32))
    assert isinstance(want, np.ndarray) and want.dtype == np.float32


def test_batch_dimensions_are_independent_matmuls():
    a, b = _random_codes((2, 3, 4, 40), "e4m3", 3), _random_codes((2, 3, 5, 40), "e4m3", 4)
    out = matmul(a, b, fa="e4m3", fb="e4m3", promote_every=32)
    for i in range(2):
        for j in range(3):
            one = matmul(a[i, j], b[i, j], fa="e4m3", fb="e4m3", promote_every=32)
            np.testing.assert_array_equal(out[i, j].view(np.uint32), one.view(np.uint32))


def test_inputs_are_rejected_with_a_message_naming_the_problem():
    a = _random_codes((2, 32), "e4m3", 5)
    with pytest.raises(ValueError, match="give its FP8 format"):
        matmul(a, a)
    with pytest.raises(ValueError, match="not exactly float8_e4m3fn values"):
        matmul(np.full((2, 32), 0.1, np.float32), a, fa="e4m3", fb="e4m3")
    with pytest.raises(ValueError, match="multiple of the k-step"):
        matmul(a, a, fa="e4m3", fb="e4m3", promote_every=48)
    with pytest.raises(ValueError, match="whole sum"):
        matmul(a, a, fa="e4m3", fb="e4m3", model="exact", promote_every=128)
    with pytest.raises(ValueError, match="float8_e5m2 but its format"):
        matmul(torch.from_numpy(a).view(torch.float8_e5m2), a, fa="e4m3", fb="e4m3")


def test_kernel_schedules_map_to_matmul_keywords():
    assert triton_dot_schedule(128) == {"tile_k": 128, "promote_every": None, "chain": True}
    assert triton_dot_schedule(128, 64, chain=False) == {"tile_k": 128, "promote_every": 64, "chain": False}
    assert cublas_schedule(True) == {"promote_every": None}
    assert cublas_schedule(False) == {"promote_every": 128}


@pytest.mark.gpu
def test_cuda_gives_the_cpu_bits():
    a, b = _random_codes((200, 1000), "e4m3", 6), _random_codes((130, 1000), "e5m2", 7)
    c = np.random.default_rng(8).standard_normal((200, 130)).astype(np.float32)
    for model, kw in (("hopper", {}), ("hopper", {"promote_every": 128}), ("exact", {}), ("fp32", {})):
        cpu = matmul(a, b, c, fa="e4m3", fb="e5m2", model=model, **kw)
        gpu = matmul(torch.from_numpy(a).cuda(), torch.from_numpy(b).cuda(), torch.from_numpy(c).cuda(),
                     fa="e4m3", fb="e5m2", model=model, **kw).cpu().numpy()
        np.testing.assert_array_equal(gpu.view(np.uint32), cpu.view(np.uint32))


def test_the_exponent_division_by_six_is_exact_on_its_whole_domain():
    """dmref.emulation.gemm.hopper finds floor(x / 6) as (x * 43691) >> 18 in int32 for its lifted exponents x,
    which lie in [0, 2**12)."""
    x = torch.arange(1 << 15, dtype=torch.int32)
    assert torch.equal((x * 43691) >> 18, x // 6)
