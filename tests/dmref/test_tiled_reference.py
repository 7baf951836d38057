"""The tiled reference: its quantization call site against dmref.emulation, the unquantized
pipeline against the exact reference, masking, recipes and bad input."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from dmref_problems import attention_shapes, make_inputs, masks
from hypothesis import given, settings
from hypothesis import strategies as st

from dmref import emulation, reference, tiled
from dmref.diagnostics import U_FP32, U_FP64, attention_error_bound
from dmref.emulation.blocked import dequantize_blocked, quantize_blocked
from dmref.recipes import (
    PRESETS,
    MatmulModel,
    Granularity,
    PReference,
    PScaling,
    QuantPoint,
    Recipe,
    ScaleRule,
    Tiles,
    get_recipe,
)

# ---------------------------------------------------------------------------------------------
# The quantization call site
# ---------------------------------------------------------------------------------------------


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical float32 values, NaN (any payload) equal to NaN."""
    a32, b32 = a.to(torch.float32), b.to(torch.float32)
    nan = torch.isnan(a32)
    return torch.equal(nan, torch.isnan(b32)) and torch.equal(
        a32[~nan].view(torch.int32), b32[~nan].view(torch.int32))


_RULES = [ScaleRule.AMAX, ScaleRule.POW2_DOWN, ScaleRule.POW2_UP, ScaleRule.MX_OCP, ScaleRule.MX_NVIDIA]
_GRANULARITIES = list(Granularity)


@st.composite
def operands(draw):
    """float tensors (b, rows, cols) with tails, rows of very different magnitude, and optional
    zeros, tiny values (float32 subnormal quotients) and NaN."""
    rows, cols = draw(st.integers(1, 300)), draw(st.integers(1, 300))
    batch = draw(st.integers(1, 2))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(batch, rows, cols, generator=g, dtype=torch.float64)
    x = x * torch.exp(4 * torch.randn(batch, rows, 1, generator=g, dtype=torch.float64))
    special = draw(st.sampled_from(["none", "zeros", "tiny", "nan", "huge"]))
    if special == "zeros":
        x[:, : rows // 2] = 0
    elif special == "tiny":
        x[:, -1] *= 1e-40
    elif special == "nan":
        x[0, 0, 0] = math.nan
    elif special == "huge":
        x[0, -1, -1] = 3e38
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))
    return x.to(dtype)


# The fast quantizer itself is tested against the specification on its whole domain in
# tests/emulation/test_blocked_fast.py; here: a QuantPoint and a contraction dim map onto it as the
# specification's block, rule, rounding and saturation.
@settings(max_examples=30)
@given(x=operands(), fmt=st.sampled_from(["float8_e4m3fn", "float8_e5m2"]),
       rule=st.sampled_from(_RULES), granularity=st.sampled_from(_GRANULARITIES),
       contract_dim=st.sampled_from([-1, -2]),
       rounding=st.sampled_from(["nearest_even", "nearest_even", "toward_zero", "toward_positive"]),
       saturate=st.booleans())
def test_quantize_call_site_equals_quantize_blocked(x, fmt, rule, granularity, contract_dim, rounding, saturate):
    point = QuantPoint(fmt, granularity, rule, rounding=rounding, saturate=saturate)
    got = tiled._quantize(x, point, contract_dim=contract_dim, dtype=torch.float32)
    block = tiled._block(granularity, contract_dim)
    codes, scales = quantize_blocked(x, fmt, block=block, scale_rule=rule.value, rounding=rounding,
                                     saturate=saturate)
    want = dequantize_blocked(codes, scales, fmt, block=block)
    assert _same_values(got, want)
    if granularity in (Granularity.TENSOR, Granularity.ROW):
        amax = tiled.group_amax(x, point, contract_dim=contract_dim)
        given_amax = tiled._quantize(x, point, contract_dim=contract_dim, dtype=torch.float32, amax=amax)
        assert _same_values(given_amax, want)


@settings(max_examples=15)
@given(x=operands(), fmt=st.sampled_from(["float8_e4m3fn", "float8_e5m2", "bfloat16"]),
       offset=st.integers(0, 8))
def test_fixed_scale_point_is_a_plain_cast_of_p_times_two_to_the_offset(x, fmt, offset):
    x = x.to(torch.float32).abs()
    point = QuantPoint(fmt, Granularity.TENSOR, ScaleRule.FIXED)
    got = tiled._quantize(x, point, contract_dim=-1, dtype=torch.float32, fixed_log2=-offset)
    want = emulation.quantize(x * 2.0**offset, fmt, saturate=True) * 2.0**-offset
    assert _same_values(got, want)


# ---------------------------------------------------------------------------------------------
# The unquantized pipeline against the exact reference
# ---------------------------------------------------------------------------------------------


def _assert_within(name, got, want, bound):
    got = got.to(torch.float64)
    assert not torch.isnan(got).any(), f"{name}: NaN"
    excess = (got - want).abs() - bound
    assert bool((excess <= 0).all()), (
        f"{name}: |tiled - exact| exceeds the derived bound by {excess.max().item():.3g} "
        f"(largest difference {(got - want).abs().max().item():.3g})")


@pytest.mark.parametrize("recipe, u", [("exact", U_FP64), ("fp32", U_FP32)])
@settings(max_examples=15)
@given(shape=attention_shapes(max_seqlen=300, max_head_dim=20), causal=st.booleans(), data=st.data(),
       seed=st.integers(0, 2**31 - 1))
def test_unquantized_tiled_equals_exact_within_derived_bound(recipe, u, shape, causal, data, seed):
    q, k, v, dout = make_inputs(shape, seed)
    mask = data.draw(masks(shape))
    kw = dict(causal=causal, mask=mask)
    fwd, bwd = tiled.attention(q, k, v, dout, recipe=recipe, **kw)
    out, lse, dq, dk, dv = reference.attention_ref(q, k, v, dout, **kw)
    n_tiles = -(-shape["seqlen_k"] // get_recipe(recipe).tiles.block_k)
    # |tiled - exact arithmetic| <= bound(u, tiles); |reference - exact arithmetic| <= bound(2^-53)
    b_tiled = attention_error_bound(q, k, v, dout, u=u, n_tiles=n_tiles, **kw)
    b_ref = attention_error_bound(q, k, v, dout, u=U_FP64, **kw)
    for name, got, want in (("out", fwd.out, out), ("dq", bwd.dq, dq), ("dk", bwd.dk, dk), ("dv", bwd.dv, dv)):
        _assert_within(name, got, want, b_tiled[name] + b_ref[name])
    finite = torch.isfinite(lse)
    assert torch.equal(torch.isfinite(fwd.stats.lse), finite)
    _assert_within("lse", fwd.stats.lse[finite], lse[finite], (b_tiled["lse"] + b_ref["lse"])[finite])


@pytest.mark.parametrize("recipe", list(PRESETS))
def test_fully_masked_rows_are_zero_with_zero_gradients_in_every_preset(recipe):
    shape = dict(batch=1, heads=2, kv_heads=1, seqlen_q=150, seqlen_k=140, head_dim=16, head_dim_v=16)
    q, k, v, dout = make_inputs(shape, 4, dtype=torch.float32)
    mask = torch.ones(1, 2, 150, 140, dtype=torch.bool)
    mask[0, 0, 149] = False
    fwd, bwd = tiled.attention(q, k, v, dout, recipe=recipe, causal=True, mask=mask)
    dead = torch.zeros(1, 2, 150, dtype=torch.bool)
    dead[..., :10] = True  # causal, Nq > Nk: query i sees keys j <= i - 10
    dead[0, 0, 149] = True
    for t in (fwd.out, bwd.dq, bwd.dk, bwd.dv):
        assert not torch.isnan(t).any()
    assert bool((fwd.out[dead] == 0).all()) and bool((bwd.dq[dead] == 0).all())
    assert bool((fwd.stats.lse[dead] == -math.inf).all())


def test_nan_in_one_query_row_spreads_through_its_scale_blocks():
    shape = dict(batch=1, heads=1, kv_heads=1, seqlen_q=130, seqlen_k=130, head_dim=16, head_dim_v=16)
    q, k, v, dout = make_inputs(shape, 5, dtype=torch.float32)
    q[0, 0, 3, 0] = math.nan
    out = tiled.forward(q, k, v, recipe="fp32").out
    assert bool(torch.isnan(out[0, 0, 3]).all())
    assert not torch.isnan(out[0, 0, 4:]).any()
    # per-tensor scales (cuDNN FP8): one NaN makes the scale, and so every value, NaN
    assert bool(torch.isnan(tiled.forward(q, k, v, recipe="cudnn_fp8").out).all())


# ---------------------------------------------------------------------------------------------
# Recipes and bad input
# ---------------------------------------------------------------------------------------------


def test_recipes_refuse_what_no_kernel_can_do():
    with pytest.raises(ValueError, match="multiple of 128"):
        Tiles(block_k=100)
    dynamic_p = QuantPoint("float8_e4m3fn", Granularity.ROW, ScaleRule.POW2_DOWN)
    with pytest.raises(ValueError, match="online"):
        Recipe(name="bad", p=dynamic_p)
    with pytest.raises(ValueError, match="forward reference"):
        Recipe(name="bad", p_fwd=PScaling(PReference.LSE))
    with pytest.raises(ValueError, match="unknown recipe"):
        get_recipe("fp9")


def test_bad_input_to_the_tiled_reference_gets_a_clear_error():
    shape = dict(batch=1, heads=1, kv_heads=1, seqlen_q=4, seqlen_k=4, head_dim=8, head_dim_v=8)
    q, k, v, dout = make_inputs(shape, 0, dtype=torch.float32)
    with pytest.raises(ValueError, match="does not fit the working precision float32"):
        tiled.forward(q, k, v, recipe="delta_matching", scale=1e-46)
    offset9 = replace(PRESETS["naive_fp8"], name="p512", p_fwd=PScaling(PReference.RUNNING_MAX, 9))
    with pytest.raises(ValueError, match=r"P \* 2\^9 does not fit float8_e4m3fn"):
        tiled.forward(q, k, v, recipe=offset9)
    with pytest.raises(ValueError, match="head_dim of q"):
        tiled.forward(q, k[..., :4], v, recipe="naive_fp8")


# ---------------------------------------------------------------------------------------------
# Accumulation models
# ---------------------------------------------------------------------------------------------


def test_hopper_hook_equals_emulated_gemm_on_the_original_codes_and_scales():
    from dmref.emulation import gemm

    g = torch.Generator().manual_seed(0)
    a = torch.randn(2, 24, 200, generator=g) * torch.exp(3 * torch.randn(2, 24, 1, generator=g))
    b = torch.randn(2, 16, 200, generator=g)
    point = QuantPoint("float8_e4m3fn", Granularity.TILE_1x128, ScaleRule.POW2_DOWN)
    ca, sa = quantize_blocked(a, "e4m3", block="1x128", scale_rule="pow2_down")
    cb, sb = quantize_blocked(b, "e4m3", block="1x128", scale_rule="pow2_down")
    want = gemm.matmul(ca, cb, fa="e4m3", fb="e4m3", model="hopper", scale_a=sa, scale_b=sb, scale_block_k=128)
    a_deq = dequantize_blocked(ca, sa, "e4m3", block="1x128").float()
    b_deq = dequantize_blocked(cb, sb, "e4m3", block="1x128").float()
    got = tiled._matmul(a_deq, b_deq.transpose(-1, -2), MatmulModel.get("hopper"), torch.float32, (point, point))
    assert _same_values(got, want)


def test_delta_matching_under_the_hopper_model_runs_and_keeps_its_bound():
    from dmref.diagnostics import matched_rowsum_bound

    shape = dict(batch=1, heads=1, kv_heads=1, seqlen_q=70, seqlen_k=70, head_dim=32, head_dim_v=32)
    q, k, v, dout = make_inputs(shape, 6, dtype=torch.float32)
    _, bwd = tiled.attention(q, k, v, dout, recipe="delta_matching@hopper", causal=True, diagnostics=True)
    rs = bwd.rowsum
    assert bool((rs.residual.abs() <= matched_rowsum_bound(rs)).all())


def test_consistent_p_recomputes_the_forward_p_when_nothing_underflows():
    """With logits in a narrow range every P * 2^8 is a normal E4M3 number at every running
    reference, so the backward's P~ is the forward's, and D = dO^ . O matches sum_j P dP^ up to
    FP32 rounding: the row sums are at the level of the FP32 bound, relative to
    sum_j P_ij sum_d |dO^_id V^_jd|."""
    from dmref.diagnostics import gamma

    shape = dict(batch=1, heads=2, kv_heads=2, seqlen_q=256, seqlen_k=256, head_dim=32, head_dim_v=32)
    q, k, v, dout = make_inputs(shape, 7, dtype=torch.float32)
    q = emulation.quantize(q * 0.05, "bfloat16")  # logits within +-1: P >= e^-2 / 256 >> 2^-14
    _, bwd = tiled.attention(q, k, v, dout, recipe="consistent_p", diagnostics=True)
    rs = bwd.rowsum
    magnitude = (dout.abs().double() @ v.abs().double().transpose(-1, -2)).amax(-1) * rs.psum
    n, d = 256, 32
    bound = (gamma(n + d + 8, U_FP32) * 2 + (1 - rs.psum).abs()) * magnitude
    assert bool((rs.residual.abs() <= bound).all())


def test_a_64x64_block_scale_is_the_same_for_both_contractions():
    """``Granularity.BLOCK_64x64`` (one scale per 64 x 64 tile: docs/delta_study.md, "One dS
    quantization for dK and dQ?") quantizes a matrix to the same values whichever of its dims is
    contracted, so dS quantized once could serve dQ (contracting keys) and dK (contracting queries);
    the kernels' 1 x 64 blocks do not, on rows of different magnitudes and tail tiles."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 130, 97, generator=g, dtype=torch.float64)
    x = x * torch.exp2(torch.randint(-12, 12, (2, 130, 1), generator=g).double())
    tile = QuantPoint("float8_e4m3fn", Granularity.BLOCK_64x64, ScaleRule.POW2_DOWN)
    rows = QuantPoint("float8_e4m3fn", Granularity.TILE_1x64, ScaleRule.POW2_DOWN)
    a = tiled._quantize(x, tile, contract_dim=-1, dtype=torch.float64)
    b = tiled._quantize(x, tile, contract_dim=-2, dtype=torch.float64)
    assert torch.equal(a, b)
    assert not torch.equal(tiled._quantize(x, rows, contract_dim=-1, dtype=torch.float64),
                           tiled._quantize(x, rows, contract_dim=-2, dtype=torch.float64))
