"""The deferred dQ of a matched delta (``recipes.DeferredDq``, dmref.kernels' Delta-Matching).

    dQ_i = tau [ sum_j Q(P_ij (dP_ij - Dst_i)) K_j - (D_i - Dst_i) u kbar_i ],  kbar_i ~ sum_j P_ij K_j / u

Properties: it changes dQ only; unquantized, it is the direct matched dQ up to float32 rounding
(the identity sum_j P (dP - Dst) K - (D - Dst) sum_j P K = sum_j P (dP - D) K); power-of-two
rescaling of Q and K commutes with it bit for bit, also when |K| is far beyond the float16
range of kbar's accumulator.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from dmref_problems import attention_shapes, make_inputs, masks
from hypothesis import given, settings
from hypothesis import strategies as st

from dmref import reference, tiled
from dmref.diagnostics import U_FP32, gamma
from dmref.kernels.config import SPECS  # dataclasses only: no triton import
from dmref.recipes import MATCHED, NONE, PRESETS, STALE_UNROUNDED, DeltaKind, DeltaStrategy, get_recipe

#: the recipe the kernels run, with float32 accumulation
KERNEL_RECIPE = get_recipe("kernels_delta_matching@fp32")
#: its kbar: E4M3 P * 2^4, 64-key tiles, float16 tile results and accumulator
KERNEL_LIKE = KERNEL_RECIPE.delta.deferred_dq


def _deferred(recipe, deferred=KERNEL_LIKE):
    return replace(recipe, name=recipe.name + "_deferred", delta=DeltaStrategy(DeltaKind.MATCHED, deferred_dq=deferred))


@settings(max_examples=12, deadline=None)
@given(shape=attention_shapes(max_seqlen=200, max_head_dim=20), causal=st.booleans(), data=st.data(),
       seed=st.integers(0, 2**31 - 1))
def test_deferred_dq_changes_dq_only(shape, causal, data, seed):
    q, k, v, dout = make_inputs(shape, seed, dtype=torch.float32)
    mask = data.draw(masks(shape))
    direct = PRESETS["delta_matching"]
    kw = dict(causal=causal, mask=mask)
    f1, b1 = tiled.attention(q, k, v, dout, recipe=direct, **kw)
    f2, b2 = tiled.attention(q, k, v, dout, recipe=_deferred(direct), **kw)
    assert torch.equal(f1.out, f2.out)
    assert torch.equal(b1.dk, b2.dk) and torch.equal(b1.dv, b2.dv)
    # fully masked rows stay zero (their D, Dst and kbar are all 0)
    dead = reference.attention_ref(q.double(), k.double(), v.double(), **kw)[1] == -math.inf
    assert bool((b2.dq[dead] == 0).all())


@settings(max_examples=12, deadline=None)
@given(shape=attention_shapes(max_seqlen=300, max_head_dim=20), causal=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_unquantized_deferred_dq_is_the_matched_dq_up_to_float32_rounding(shape, causal, seed):
    """Both sides round in float32; each is within gamma_{n+4}(2^-24) of its exact value, whose
    magnitudes are, per element (tau omitted): direct sum_j P |dP - D| |K|; deferred
    sum_j P |dP - Dst| |K| + |D - Dst| sum_j P |K| (the correction's product and subtraction
    are the +4)."""
    q, k, v, dout = make_inputs(shape, seed, dtype=torch.float32)
    plain = replace(KERNEL_LIKE, predictor=STALE_UNROUNDED, p=NONE, tile_result=NONE, accumulator=NONE)
    fp32 = replace(PRESETS["fp32"], delta=MATCHED)
    _, b_direct = tiled.attention(q, k, v, dout, recipe=fp32, causal=causal, diagnostics=True)
    _, b_def = tiled.attention(q, k, v, dout, recipe=_deferred(fp32, plain), causal=causal)
    # magnitudes from the float64 problem
    q64, k64, v64, do64 = (t.double() for t in (q, k, v, dout))
    out, lse, *_ = reference.attention_ref(q64, k64, v64, do64, causal=causal)
    shp = reference.check_attention_inputs(q64, k64, v64)
    s = reference.scores(q64, k64, shp, causal, None)
    lse_safe = torch.where(lse == -math.inf, torch.full_like(lse, math.inf), lse)[..., None]
    p = torch.exp(s - lse_safe)
    kk = reference.expand_kv(k64, shp.groups).abs()
    dp = do64 @ reference.expand_kv(v64, shp.groups).transpose(-1, -2)
    d = b_direct.rowsum.delta[..., None]
    d_st = (do64 * out).sum(-1, keepdim=True)
    mag = (p * (dp - d).abs()) @ kk + (p * (dp - d_st).abs()) @ kk + (d - d_st).abs() * (p @ kk)
    bound = shp.scale * gamma(shape["seqlen_k"] + shape["head_dim_v"] + 4, U_FP32) * mag
    excess = ((b_def.dq.double() - b_direct.dq.double()).abs() - bound).max().item()
    assert excess <= 0, excess


@pytest.mark.parametrize("causal", [False, True])
def test_pow2_rescaling_of_q_and_k_commutes_with_deferred_dq_beyond_float16_range(causal):
    shape = dict(batch=1, heads=2, kv_heads=1, seqlen_q=200, seqlen_k=200, head_dim=64, head_dim_v=64)
    q, k, v, dout = make_inputs(shape, 7, dtype=torch.float32)
    e = 17  # |K| 2^17 > 65504 = float16's max for |K| > 0.5
    assert KERNEL_RECIPE.delta.deferred_dq is not None
    _, b = tiled.attention(q, k, v, dout, recipe=KERNEL_RECIPE, causal=causal)
    _, b2 = tiled.attention(q * 2.0**-e, k * 2.0**e, v, dout, recipe=KERNEL_RECIPE, causal=causal)
    assert bool(torch.isfinite(b2.dq).all())
    assert torch.equal(b2.dq, b.dq * 2.0**e)
    assert torch.equal(b2.dk, b.dk * 2.0**-e) and torch.equal(b2.dv, b.dv)


def test_deferred_dq_refuses_what_it_cannot_mean():
    with pytest.raises(ValueError, match="STALE"):
        replace(KERNEL_LIKE, predictor=MATCHED)
    with pytest.raises(ValueError, match="divide"):
        replace(KERNEL_LIKE, tile=48)
    with pytest.raises(ValueError, match="MATCHED"):
        DeltaStrategy(DeltaKind.STALE, deferred_dq=KERNEL_LIKE)
    assert KERNEL_RECIPE.delta.name == "matched_deferred"


def test_kernels_run_their_own_recipes_and_say_why_not_for_the_presets():
    """KernelSpec.unsupported: None for the Recipe a KernelSpec holds (at its tiling), a reason
    naming the first differing point for a preset or a changed point; one name, one Recipe."""
    from dmref.emulation import ScaleRule
    from dmref.kernels.config import KernelSpec, get_spec as kernel_spec

    for name, spec in SPECS.items():
        assert KernelSpec.unsupported(spec.recipe, spec.bwd) is None
        assert spec.name == spec.recipe.name == name
        assert get_recipe(name) == spec.recipe
        assert spec.reference_recipe("hopper") is spec.recipe
        assert name not in PRESETS
    assert KERNEL_RECIPE == SPECS["kernels_delta_matching"].reference_recipe("fp32")
    assert "q:" in KernelSpec.unsupported(PRESETS["naive_fp8"])
    spec = SPECS["kernels_naive_fp8"]
    amax_k = replace(spec.recipe, k=replace(spec.recipe.k, scale_rule=ScaleRule.AMAX))
    reason = KernelSpec.unsupported(amax_k)
    assert reason.startswith("k:") and "amax" in reason
    with pytest.raises(ValueError, match="the kernels do not run recipe 'kernels_naive_fp8': k:"):
        KernelSpec(amax_k)
    assert "tiles" in KernelSpec.unsupported(spec.recipe, replace(spec.bwd, block_n2=128))
    # a preset by name: one line naming the kernel recipe of the same delta and the first difference
    for preset, use in (("delta_matching", "kernels_delta_matching"), ("naive_fp8", "kernels_naive_fp8")):
        with pytest.raises(ValueError, match=f"use '{use}'.*First difference.*q: ") as err:
            kernel_spec(preset)
        assert "\n" not in str(err.value)
    assert kernel_spec(get_recipe("kernels_naive_fp8")) is spec
