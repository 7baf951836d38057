"""``Recipe.pv_chain``: PV's accumulator running on across the forward's key tiles (a wgmma
chain with C = alpha acc, FA3's forward and the Gluon forward's ``CHAIN`` schedule), in
``dmref.tiled``.

- The chained product equals the emulated wgmma chain computed in the kernel's units (P codes
  with their fixed 2^8, V codes with a scale per channel, the accumulator in those units), on
  random codes over a wide range of channel scales and accumulators of both signs.
- Under the ``fp32`` model the option changes nothing (float32 adds in either form); under
  ``hopper`` it changes O.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dmref import tiled
from dmref.emulation import FLOAT8_E4M3FN, decode, gemm
from dmref.emulation.gemm import MatmulModel
from dmref.recipes import KERNEL_RECIPES, MatmulModels


def _codes(shape, gen) -> torch.Tensor:
    """E4M3 codes, finite (0x7F and 0xFF, NaN, left out)."""
    c = torch.randint(0, 256, shape, generator=gen, dtype=torch.int32).to(torch.uint8)
    return torch.where((c & 0x7F) == 0x7F, c - 1, c)


@pytest.mark.parametrize("seed", range(4))
def test_chained_product_equals_the_wgmma_chain_in_the_kernels_units(seed):
    gen = torch.Generator().manual_seed(seed)
    m, k, n = 16, 128, 32
    p_codes = _codes((m, k), gen)
    v_codes = _codes((n, k), gen)  # V^T: one row per channel
    p_scale = 2.0**-8  # P's fixed scale
    v_scale = torch.exp2(torch.randint(-40, 40, (n,), generator=gen).float())  # per channel
    acc_units = torch.randn(m, n, generator=gen) * torch.exp2(torch.randint(-6, 12, (m, n), generator=gen).float())
    # the kernel: wgmma(P8, V8, C = acc) in code units, scaled to values at the end
    want = gemm.matmul(p_codes, v_codes, acc_units, fa="e4m3", fb="e4m3", model="hopper") * (p_scale * v_scale)
    # dmref.tiled: dequantized operands, the accumulator in value units
    p_deq = decode(p_codes, FLOAT8_E4M3FN).float() * p_scale
    v_deq = (decode(v_codes, FLOAT8_E4M3FN).float() * v_scale[:, None]).T
    recipe = KERNEL_RECIPES["kernels_folded_naive_fp8"]
    points = (recipe.p, recipe.v)
    got = tiled._matmul(p_deq, v_deq, MatmulModel.get("hopper"), torch.float32, points,
                        c=acc_units * (p_scale * v_scale))
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def _problem(seed=0, n=300, d=64):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, n, d, generator=g) for _ in range(3))
    v = v * torch.exp2(torch.randint(-8, 8, (1, 1, 1, d), generator=g).float())  # channel scales
    return q, k, v


def test_the_option_changes_nothing_under_float32_adds():
    recipe = replace(KERNEL_RECIPES["kernels_folded_naive_fp8"],
                     accumulation=MatmulModels.all("fp32"))
    q, k, v = _problem()
    promoted = tiled.forward(q, k, v, recipe=recipe, causal=True).out
    chained = tiled.forward(q, k, v, recipe=replace(recipe, pv_chain=True), causal=True).out
    assert torch.equal(promoted, chained)


def test_under_hopper_the_chain_changes_o():
    """The option is not a no-op where it matters: the wgmma chain aligns each k-step to the
    accumulator as well as the products, so O differs from the promoted form's."""
    recipe = KERNEL_RECIPES["kernels_folded_naive_fp8"]
    assert not recipe.pv_chain  # the folded recipes promote PV per key tile, as the Triton forward does
    q, k, v = _problem(seed=1)
    promoted = tiled.forward(q, k, v, recipe=recipe).out
    chained = tiled.forward(q, k, v, recipe=replace(recipe, pv_chain=True)).out
    assert not torch.equal(promoted, chained)


@pytest.mark.slow
def test_a_long_chain_loses_what_promotion_keeps():
    """Why the folded recipes promote: an average over 4,096 keys (logits near zero) of a V whose
    channels have one sign. The chain's accumulator grows with every key and the tensor cores
    truncate each k-step's products to 2^(E-13) of the largest term, the accumulator included
    (docs/gemm.md), so late keys lose their low bits and O shrinks; promoted per 128-key tile, each
    chain starts from zero. Against float64 the chained O's error is more than twice the promoted
    one's: the accumulation loses more than all of the FP8 quantization does
    (dev/results/cpu_pv_accuracy.json, ``4096:dc``)."""
    g = torch.Generator().manual_seed(0)
    n, d = 4096, 64
    q, k = ((torch.randn(1, 1, n, d, generator=g) * 0.1).bfloat16().float() for _ in range(2))
    v = (1 + torch.randn(1, 1, n, d, generator=g) / 4).bfloat16().float()
    exact = tiled.forward(q.double(), k.double(), v.double(), recipe="exact").out
    recipe = KERNEL_RECIPES["kernels_folded_naive_fp8"]
    err = {c: ((tiled.forward(q, k, v, recipe=replace(recipe, pv_chain=c)).out.double() - exact).norm()
               / exact.norm()).item() for c in (False, True)}
    assert err[True] > 2 * err[False], err
