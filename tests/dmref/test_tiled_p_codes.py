"""``dmref.tiled.forward(..., p_codes=True)``: the codes of the recipe's quantized P, which the
kernels' differential tests compare a kernel's P against."""

from __future__ import annotations

import pytest
import torch

from dmref import tiled
from dmref.emulation import decode
from dmref.recipes import get_recipe


def _inputs(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, n, 64, generator=g) for _ in range(3))
    q[..., :4] *= 8.0  # a wide logit range: many P codes in E4M3's subnormals and at 0
    return q, k, v


@pytest.mark.parametrize("causal", [False, True])
def test_p_codes_are_the_quantized_p_against_the_running_max(causal):
    """Each row's largest code in a tile holding its running max is P = 1 (2^offset); codes are
    0 exactly where a key is masked or P underflows; and the codes decode to the values of the
    recipe's P grid (E4M3 times 2^-offset <= 1)."""
    recipe = get_recipe("naive_fp8")
    n = 100  # one key tile: the running max is the row max
    q, k, v = _inputs(n)
    res = tiled.forward(q, k, v, recipe=recipe, causal=causal, p_codes=True)
    codes = res.p_codes
    assert codes.shape == (1, 2, n, n) and codes.dtype == torch.uint8
    values = torch.as_tensor(decode(codes.numpy(), recipe.p.fmt)).float()
    one = 2.0 ** recipe.p_fwd.offset_log2
    assert torch.equal(values.amax(dim=-1), torch.full((1, 2, n), one))
    assert float(values.max()) <= one
    if causal:
        assert bool((codes[..., ~torch.ones(n, n, dtype=torch.bool).tril()] == 0).all())
    assert bool((values == 0).any())  # the wide range underflows some P to code 0
    # without p_codes nothing is computed for them
    assert tiled.forward(q, k, v, recipe=recipe, causal=causal).p_codes is None


def test_p_codes_need_a_quantized_p():
    q, k, v = _inputs(8)
    with pytest.raises(ValueError, match="does not quantize P"):
        tiled.forward(q, k, v, recipe="exact", p_codes=True)
