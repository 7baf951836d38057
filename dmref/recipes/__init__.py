"""Recipes: what a given FP8 attention implementation does, written down as data.

- :mod:`dmref.recipes.recipe`: the vocabulary (:class:`Recipe`, :class:`QuantPoint`,
  :class:`Granularity`, :class:`DeltaStrategy`, ...).
- :mod:`dmref.recipes.presets`: the presets (:data:`PRESETS`) and the delta study's candidates
  (:data:`DELTA_STUDY`).
- :mod:`dmref.recipes.kernels`: the Recipes the kernels run (:data:`KERNEL_RECIPES`) and
  :func:`~dmref.recipes.kernels.fit_to_tiles`.
- :func:`get_recipe`: one lookup over all of them, returning a :class:`Recipe`.
"""

from __future__ import annotations

import difflib

from ..emulation.blocked import ScaleRule
from ..emulation.gemm import Accumulation, MatmulModel
from .kernels import KERNEL_RECIPES
from .presets import (BF16, CONSISTENT_P_FP32_PV_DP, CONSISTENT_P_RECIPE, CONSISTENT_P_TILE, CUDNN_FP8, DELTA_MATCHING,
                      DELTA_STUDY, EXACT, FP32, MXFP8_STALE, NAIVE_FP8, PRESETS, STALE_FP32_O, with_prepass_delta)
from .recipe import (CONSISTENT_P, MATCHED, MATMULS, NONE, STALE, STALE_FP8_DO, STALE_UNROUNDED, DeferredDq, DeltaKind,
                     DeltaStrategy, Granularity, MatmulModels, Normalizer, PReference, PScaling, QuantPoint, Recipe,
                     Tiles)

__all__ = [
    "DeferredDq", "DeltaKind", "DeltaStrategy", "Granularity", "MatmulModel", "MatmulModels", "Normalizer",
    "PReference", "PScaling", "PRESETS", "DELTA_STUDY", "KERNEL_RECIPES", "QuantPoint", "Recipe", "ScaleRule",
    "Tiles", "get_recipe", "kernel_recipes", "with_prepass_delta", "MATMULS", "NONE", "STALE", "STALE_FP8_DO",
    "STALE_UNROUNDED", "MATCHED", "CONSISTENT_P", "ACCUMULATION_MODELS",
    "EXACT", "FP32", "BF16", "NAIVE_FP8", "CUDNN_FP8", "MXFP8_STALE", "DELTA_MATCHING", "CONSISTENT_P_RECIPE",
    "CONSISTENT_P_TILE", "CONSISTENT_P_FP32_PV_DP", "STALE_FP32_O",
]

#: Accumulation models a preset name may ask for after "@" (:meth:`MatmulModel.get` reads them);
#: "hopper-p<N>" is hopper with float32 promotion every N products.
ACCUMULATION_MODELS = ("fp32", "float64", "exact", "hopper", "hopper-p<N>")

#: The two operands of each matmul, by the names of :data:`MATMULS`.
_MATMUL_OPERANDS = {
    "qk": ("q", "k"), "pv": ("p", "v"), "qk_bwd": ("q", "k"), "dp": ("do_dp", "v_dp"),
    "dv": ("p_dv", "do_dv"), "dq": ("ds_dq", "k_dq"), "dk": ("ds_dk", "q_dk"),
}


def _check_model(preset: Recipe, model: str, name: str) -> None:
    """Raise ValueError unless ``model`` names an accumulation model ``preset`` can run under."""
    try:
        parsed = MatmulModel.get(model)
    except ValueError as e:
        raise ValueError(f"recipe {name!r}: {e} (after '@')") from None
    if parsed.accumulation is Accumulation.HOPPER:
        # the emulated wgmma multiplies FP8 codes whose block scales are powers of two
        points = {n: getattr(preset, n) for ops in _MATMUL_OPERANDS.values() for n in ops}
        bad = [n for n, p in points.items()
               if p.fmt is None or not p.fmt.is_fp8 or p.scale_rule is ScaleRule.AMAX]
        if bad:
            raise ValueError(f"recipe {name!r}: the {model!r} model emulates FP8 tensor cores, whose "
                             f"operands are FP8 with power-of-two scales; preset {preset.name!r} has "
                             f"other operands: {', '.join(bad)} ({bad[0]}: {points[bad[0]].describe()})")


def kernel_recipes() -> dict[str, Recipe]:
    """The Recipes ``dmref.kernels`` runs, by name (``kernels_delta_matching``,
    ``kernels_naive_fp8``, ``kernels_delta_prepass`` and their ``kernels_folded_`` forms):
    :data:`dmref.recipes.kernels.KERNEL_RECIPES`, each the ``recipe`` of the kernels' spec of
    that name."""
    return dict(KERNEL_RECIPES)


def get_recipe(recipe: Recipe | str) -> Recipe:
    """A :class:`Recipe`, or one by name: a preset (``"delta_matching"``), a candidate of the
    delta study (:data:`DELTA_STUDY`) or a recipe the kernels
    run (``"kernels_delta_matching"``, :func:`kernel_recipes`); ``"naive_fp8@hopper"`` for one
    with every matmul under another accumulation model, one of :data:`ACCUMULATION_MODELS`.
    Raises TypeError for other types, ValueError for an unknown name or model, and for a hopper
    model on a recipe with operands that are not FP8 with power-of-two scales."""
    if isinstance(recipe, Recipe):
        return recipe
    if not isinstance(recipe, str):
        raise TypeError(f"recipe must be a Recipe or a preset name, got {type(recipe).__name__}")
    base, at, model = recipe.partition("@")
    named = PRESETS.get(base) or DELTA_STUDY.get(base)
    if named is None:
        kernels = KERNEL_RECIPES
        named = kernels.get(base)
        if named is None:
            close = difflib.get_close_matches(base, [*PRESETS, *DELTA_STUDY, *kernels], n=1)
            hint = f"did you mean {close[0] + at + model!r}? " if close else ""
            raise ValueError(f"unknown recipe {recipe!r}; {hint}presets: {', '.join(PRESETS)}; the delta study's: "
                             f"{', '.join(DELTA_STUDY)}; the kernels' "
                             f"recipes: {', '.join(kernels)} (NAME@MODEL for another accumulation model)")
    if not at:
        return named
    _check_model(named, model, recipe)
    return named.with_accumulation(model)
