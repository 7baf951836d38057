"""Every rule of the hopper model is needed: change one rule, and a captured H200 case that the
model reproduces bit for bit is no longer reproduced (docs/gemm.md lists the same table).

Rules that tests/data/h200_fp8_gemm.npz cannot decide (no case there depends on them) are
decided by the second capture, tests/data/h200_fp8_gemm_more.npz, made by
captures/gpu_capture_gemm.py; that the capture's inputs *do* depend on each of those rules is
checked here without a GPU, from the capture script's own case plan.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from dmref.emulation.gemm import triton_dot_schedule

from dmref.emulation.gemm.captures import Case, load_cases, replay
from dmref.emulation.formats import Rounding
from dmref.emulation.gemm import HOPPER

DATA = Path(__file__).resolve().parents[1] / "data"
CASES = {c.name: c for c in load_cases(DATA / "h200_fp8_gemm.npz")[1]}
MORE = DATA / "h200_fp8_gemm_more.npz"
CAPTURE_SCRIPT = Path(__file__).resolve().parents[2] / "captures" / "gpu_capture_gemm.py"


def rules(**change):
    return {"rules": dataclasses.replace(HOPPER, **change)}


#: (rule, the model with that rule changed, witness case of h200_fp8_gemm.npz)
FLIPS = [
    ("k-step of 32 products", rules(k_step=16), "c000"),
    ("k-step of 32 products", rules(k_step=64), "c001"),
    ("13 fraction bits below 2**E", rules(term_frac_bits=12), "c000"),
    ("13 fraction bits below 2**E", rules(term_frac_bits=14), "c000"),
    ("terms truncated toward zero", rules(term_rounding=Rounding.NEAREST_EVEN), "c000"),
    ("14 significant bits in the result", rules(result_bits=13), "c000"),
    ("14 significant bits in the result", rules(result_bits=15), "c000"),
    ("14 significant bits in the result", rules(result_bits=24), "c000"),
    ("result truncated toward zero", rules(result_rounding=Rounding.NEAREST_EVEN), "c000"),
    ("products unnormalised: exponent e(a) + e(b)", rules(normalised_products=True), "c000"),
    ("the accumulator takes part in E", rules(accumulator_in_max=False), "c001"),
    ("the accumulator is truncated like a product", rules(truncate_accumulator=False), "c001"),
    ("Triton's FP8 default never promotes", {"promote_every": 128}, "c005"),
    ("Triton max_num_imprecise_acc=128 promotes every 128", {"promote_every": None}, "c006"),
    ("Triton max_num_imprecise_acc=128 promotes every 128", {"promote_every": 64}, "c006"),
    ("acc += tl.dot: each tile from zero, added in float32", {"chain": True}, "c007"),
    ("cuBLAS use_fast_accum=True: one chain", {"promote_every": 128}, "c010"),
    ("cuBLAS use_fast_accum=False: promotion every 128", {"promote_every": None}, "c009"),
    ("cuBLAS use_fast_accum=False: promotion every 128", {"promote_every": 256}, "c009"),
]


@pytest.mark.parametrize("rule, change, witness", FLIPS,
                         ids=[f"{w}-{'-'.join(f'{k}' for k in c)}-{i}" for i, (_, c, w) in enumerate(FLIPS)])
def test_changing_a_rule_breaks_a_captured_case(rule, change, witness):
    case = CASES[witness]
    assert (replay(case) == case.out).all(), f"{witness} must be reproduced by the model itself"
    wrong = (replay(case, **change) != case.out).mean()
    assert wrong > 0, f"rule '{rule}': changing it ({change}) still reproduces {witness}"


# ----------------------------------------------------------------------------------------------
# Rules decided only by the second capture
# ----------------------------------------------------------------------------------------------

#: (rule, the model with the rule changed or None, which cases of the second capture decide it)
CAPTURE_FLIPS = [
    ("a subnormal operand keeps exponent emin", rules(subnormals_at_emin=False),
     lambda m: m["dist"] == "subnormal"),
    ("zero products take no part in E", rules(zeros_in_max=True), lambda m: m["dist"] == "zero_vs_max"),
    ("a float32 subnormal accumulator has exponent -126", rules(subnormal_accumulator_at_emin=False),
     lambda m: m["dist"] == "zero_rows"),
    ("Triton acc += dot with promotion: the tile's partials are summed first",
     {"chain": True}, lambda m: m["engine"] == "triton_dot" and not m.get("chain", True)
     and m.get("max_num_imprecise_acc") == 64),
]


def _capture_module():
    spec = importlib.util.spec_from_file_location("gpu_capture_gemm", CAPTURE_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("rule, change, decides", CAPTURE_FLIPS, ids=[r for r, _, _ in CAPTURE_FLIPS])
def test_the_capture_plan_decides_rules_the_first_file_cannot(rule, change, decides):
    """The inputs that captures/gpu_capture_gemm.py will send to the GPU give different outputs
    under the rule and under its change: whatever the H200 returns, one of them fails."""
    capture = _capture_module()
    witnesses = [c for c in capture.plan_cases() if decides(c)]
    assert witnesses, f"the capture plan has no case for rule '{rule}'"
    differing = 0
    for plan in witnesses[:4]:
        inputs = capture.make_inputs(plan, 2026)
        meta = {k: v for k, v in plan.items() if k != "name"}
        case = Case(plan["name"], meta, inputs["a"], inputs["bt"], inputs["c"], None,
                    inputs.get("scale_a"), inputs.get("scale_b"))
        differing += int((replay(case) != replay(case, **change)).sum())
    assert differing > 0, f"no planned output depends on rule '{rule}'"


@pytest.mark.skipif(not MORE.exists(), reason="tests/data/h200_fp8_gemm_more.npz not captured yet")
@pytest.mark.parametrize("rule, change, decides", CAPTURE_FLIPS, ids=[r for r, _, _ in CAPTURE_FLIPS])
def test_changing_a_rule_breaks_a_case_of_the_second_capture(rule, change, decides):
    cases = [c for c in load_cases(MORE)[1] if decides(c.meta)]
    assert cases, f"the second capture has no case for rule '{rule}'"
    assert all((replay(c) == c.out).all() for c in cases), "the model itself must reproduce them"
    assert any((replay(c, **change) != c.out).any() for c in cases), f"rule '{rule}' is not needed"


def test_triton_schedule_rejects_imprecise_acc_above_block_k():
    """Triton 3.6 refuses max_num_imprecise_acc > BK at compile time ("max_num_imprecise_acc
    (128) must be <= K (64)": the 12 such cases of the capture plan failed to compile on the
    H200, captures/results/h200_gemm_capture_report.json), so no kernel can run
    that schedule and the schedule helper says so instead of modelling it."""
    with pytest.raises(ValueError, match="max_num_imprecise_acc=128 > block_k=64"):
        triton_dot_schedule(64, 128)
    assert triton_dot_schedule(64, 64)["promote_every"] == 64
