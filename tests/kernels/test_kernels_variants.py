"""The load and register variants of the kernels (``FwdTiles.tma``, ``BwdTiles.tma``, the
``maxnreg`` caps) load the same tiles (through TMA tensor descriptors instead of per-element
pointers) and form the same products (in however many registers): their outputs and gradients
equal the pointer variants' bit for bit (tails, GQA, causal)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dmref.kernels.config import SPECS

from kernel_inputs import ProblemShape, outlier_inputs, require_backend

_CASES = [
    pytest.param("interpreter", ProblemShape(1, 4, 2, 130, 64), id="interpreter-gqa-n130-d64"),
    pytest.param("gpu", ProblemShape(2, 4, 2, 1000, 128), id="gpu-gqa-n1000-d128", marks=pytest.mark.gpu),
    pytest.param("gpu", ProblemShape(1, 4, 4, 777, 64), id="gpu-n777-d64", marks=pytest.mark.gpu),
]


def _variant(recipe, head_dim, *, tma: bool):
    fwd = dataclasses.replace(recipe.fwd, tma=tma)
    bwd = dataclasses.replace(recipe.bwd_tiles(head_dim), tma=tma)
    return recipe.with_tiles(fwd=fwd, bwd=bwd)


#: (recipe, causal): the first in the README's test command, the others with the slow tests
#: (each is 7-10 s in the interpreter)
_RECIPES_CAUSAL = [pytest.param(r, c, id=f"{r}-{c}", marks=() if (r, c) == ("kernels_delta_matching", False)
                                else pytest.mark.slow)
                   for r in ("kernels_delta_matching", "kernels_naive_fp8") for c in (False, True)]


@pytest.mark.parametrize("recipe,causal", _RECIPES_CAUSAL)
@pytest.mark.parametrize("backend,case", _CASES)
def test_load_and_register_variants_equal_the_pointer_variant_bit_for_bit(backend, case, recipe, causal):
    device = require_backend(backend)
    from dmref.kernels import api

    q, k, v, do = outlier_inputs(case, device, seed=5)
    base = SPECS[recipe]
    runs = []
    hd = case.head_dim
    # the recipe's defaults (at D = 64 a capped forward), and every kernel capped at 168 registers
    capped = base.with_tiles(fwd=dataclasses.replace(base.fwd_tiles(hd), maxnreg=168),
                             bwd=dataclasses.replace(base.bwd_tiles(hd), maxnreg_dq=168, maxnreg_dkdv=168))
    variants = [_variant(base, hd, tma=tma) for tma in (False, True)]
    # register caps exist only for the compiler: the interpreter runs the same code without them
    for r in variants + ([base, capped] if backend == "gpu" else []):
        o, lse, saved, _ = api.attention_forward(q, k, v, causal=causal, recipe=r)
        grads = api.attention_backward(saved, o, do, shape=api.Shape.of(q, k, v), causal=causal,
                                       scale=case.head_dim**-0.5, recipe=r)[:3]
        runs.append((o, lse, *grads))
    for other in runs[1:]:
        for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), runs[0], other):
            assert torch.equal(a, b), name

