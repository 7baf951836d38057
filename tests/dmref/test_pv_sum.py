"""``Normalizer.PV_SUM``: the forward's normalizer l formed by the PV matmul itself, one more
column of P~ V against a column of ones (what the warp-specialized forward computes with an m64n8
wgmma beside PV, ``fwd_ws.forward(pv_sum=True)``), in ``dmref.tiled``.

- A column of ones appended to V comes out of the forward as exactly 1 in every row that sees a
  key: its column of the PV accumulator *is* l, rounded and rescaled alike, whether PV is
  chained (``pv_chain``) or promoted per tile. Under ``FP32_SUM`` (float32 P) and
  ``QUANTIZED_SUM`` (float32 adds of P~) the Hopper model's truncations make it differ from 1,
  so the property is the normalizer's and not the test's.
- Under float32 accumulation PV_SUM is QUANTIZED_SUM up to the order of float32 adds.
- The kernels accept it for the folded recipes only (the Triton forward sums float32 P).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dmref import tiled
from dmref.kernels.config import RECIPES, get_recipe
from dmref.recipes import Normalizer


def _problem(seed=0, n=300, d=64):
    """Logits over a wide range (peaked and flat rows), V with channel scales 2^-8 .. 2^7, and a
    last channel of ones."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, n, d, generator=g) for _ in range(3))
    q = q * torch.exp2(torch.randint(-4, 3, (1, 2, n, 1), generator=g).float())
    v = v * torch.exp2(torch.randint(-8, 8, (1, 1, 1, d), generator=g).float())
    v[..., -1] = 1.0
    return q, k, v


def _recipe(normalizer: Normalizer, pv_chain: bool):
    return replace(RECIPES["kernels_folded_naive_fp8"].recipe, normalizer=normalizer, pv_chain=pv_chain)


@pytest.mark.parametrize("pv_chain", [True, False], ids=["chained", "promoted"])
@pytest.mark.parametrize("causal", [False, True])
def test_a_column_of_ones_in_v_comes_out_as_one(pv_chain, causal):
    q, k, v = _problem(seed=int(causal))
    out = tiled.forward(q, k, v, recipe=_recipe(Normalizer.PV_SUM, pv_chain), causal=causal).out
    assert torch.equal(out[..., -1], torch.ones_like(out[..., -1]))


@pytest.mark.parametrize("normalizer", [Normalizer.FP32_SUM, Normalizer.QUANTIZED_SUM])
def test_the_float32_normalizers_do_not_give_exactly_one(normalizer):
    q, k, v = _problem()
    out = tiled.forward(q, k, v, recipe=_recipe(normalizer, True)).out
    assert not torch.equal(out[..., -1], torch.ones_like(out[..., -1]))


def test_under_float32_adds_it_is_the_quantized_sum():
    q, k, v = _problem(seed=2)
    recipes = {n: _recipe(n, True).with_accumulation("fp32") for n in (Normalizer.PV_SUM, Normalizer.QUANTIZED_SUM)}
    l_pv, l_q = (tiled.forward(q, k, v, recipe=r, causal=True).stats.l for r in recipes.values())
    # two float32 sums of the same <= 300 non-negative terms in different orders: gamma_300 each
    u = 2.0**-24
    bound = 2 * 300 * u / (1 - 300 * u)
    assert ((l_pv - l_q).abs() <= bound * l_q).all()
    assert not torch.equal(l_pv, tiled.forward(q, k, v, recipe=_recipe(Normalizer.FP32_SUM, True).with_accumulation("fp32"),
                                               causal=True).stats.l)


def test_the_kernels_take_it_for_the_folded_forward_only():
    folded = replace(RECIPES["kernels_folded_delta_matching"].recipe, name="folded_pv_sum", normalizer=Normalizer.PV_SUM)
    assert get_recipe(folded).recipe.normalizer is Normalizer.PV_SUM
    triton_fwd = replace(RECIPES["kernels_delta_matching"].recipe, name="pv_sum", normalizer=Normalizer.PV_SUM)
    with pytest.raises(ValueError, match="normalizer: the kernels divide by the float32 sum of P"):
        get_recipe(triton_fwd)
