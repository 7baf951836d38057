"""The recipes the kernels run, as data: :data:`KERNEL_RECIPES` holds the six named Recipes
(``kernels_delta_matching``, ``kernels_naive_fp8``, ``kernels_delta_prepass`` and their
``kernels_folded_*`` forms), built from the ``naive_fp8`` preset by :func:`kernel_recipe` (the
pre-pass ones by ``with_prepass_delta`` of the matched ones); :func:`fit_to_tiles` writes into a recipe
what the kernels' backward tile extents decide (dS blocks, promotion, kbar's tile).
``dmref.kernels.config`` builds its ``KernelSpec`` objects from these; nothing here imports the
kernels or triton."""

from __future__ import annotations

import dataclasses
from typing import Literal

from ..emulation.blocked import ScaleRule
from ..emulation.formats import FLOAT8_E4M3FN, FLOAT16, get_format
from ..emulation.gemm import Accumulation, MatmulModel
from .presets import PRESETS, with_prepass_delta
from .recipe import DeferredDq, DeltaKind, DeltaStrategy, Granularity, MatmulModels, QuantPoint, Recipe, STALE

__all__ = ["KERNEL_RECIPES", "QUANT_BLOCK", "KBAR_P_SCALE_LOG2", "KernelDelta", "DEFAULT_DS_TILE", "ds_point",
           "deferred_dq", "fit_to_tiles", "kernel_recipe"]

#: Tokens per scale block of the kernels' transposed copies; every kernel tile along tokens
#: divides it, and a backward tile of this extent is promoted once per tile.
QUANT_BLOCK = 128

#: log2 of P's scale at the kbar quantization point (matched dQ's deferred correction). With
#: P <= 1 against LSE, codes of P <= 2**4 and of K <= 448, a tile's float16 wgmma chain stays
#: below 2**4 * 448 * (1 + 2**-4) < 65504 (float16's max) for any input.
KBAR_P_SCALE_LOG2 = 4

#: The backward tile extent (queries of dK's tile, keys of dQ's tile) of the named recipes: the
#: default tiling's ``block_m1`` and ``block_n2`` (``dmref.kernels.config.BwdTiles``).
DEFAULT_DS_TILE = 64

#: The two deltas :func:`kernel_recipe` builds a Recipe for.
KernelDelta = Literal["stale", "matched"]


def ds_point(extent: int) -> QuantPoint:
    """dS as the kernels quantize it: E4M3, one POW2_DOWN scale per row and ``extent``
    contraction elements (the kernel tile's contraction: 32, 64 or 128)."""
    gran = {32: Granularity.MX32, 64: Granularity.TILE_1x64, QUANT_BLOCK: Granularity.TILE_1x128}[extent]
    return QuantPoint(FLOAT8_E4M3FN, gran, ScaleRule.POW2_DOWN)


def _promoted(model: MatmulModel, tile: int) -> MatmulModel:
    """``model`` with the kernels' promotion: a HOPPER chain per kernel tile, promoted to float32
    between tiles shorter than the reference's 128-wide scale blocks."""
    if model.accumulation is not Accumulation.HOPPER:
        return model
    return MatmulModel(model.accumulation, promote_every=None if tile >= QUANT_BLOCK else tile, rules=model.rules)


def deferred_dq(tile: int) -> DeferredDq:
    """The kernels' deferred dQ (:class:`~dmref.recipes.DeferredDq`) over kbar tiles of ``tile``
    keys: stale predictor, P in E4M3 times 2^KBAR_P_SCALE_LOG2, float16 tile sums and accumulator
    (Triton's float32 -> float16: RNE, overflow to inf)."""
    fp16 = QuantPoint(FLOAT16, saturate=False)
    return DeferredDq(predictor=STALE, p=QuantPoint(FLOAT8_E4M3FN), p_offset_log2=KBAR_P_SCALE_LOG2,
                      tile=tile, tile_result=fp16, accumulator=fp16)


def fit_to_tiles(recipe: Recipe, dk_tile: int, dq_tile: int) -> Recipe:
    """``recipe`` with the parts the backward's tile extents decide: dS blocks of 1 x ``dq_tile``
    (dQ, keys per tile) and 1 x ``dk_tile`` (dK, queries per tile), HOPPER promotion per kernel
    tile for dV, dQ and dK, and the deferred dQ's kbar tile of ``dq_tile`` keys; dS for dQ scaled
    per query over all keys (``ds_dq_bound``) stays so (only its promotion follows the tile)."""
    acc = recipe.accumulation
    delta = recipe.delta
    if delta.deferred_dq is not None:
        delta = DeltaStrategy(delta.kind, delta.do, delta.o, dataclasses.replace(delta.deferred_dq, tile=dq_tile))
    return dataclasses.replace(
        recipe, ds_dq=recipe.ds_dq if recipe.ds_dq_bound else ds_point(dq_tile), ds_dk=ds_point(dk_tile), delta=delta,
        accumulation=MatmulModels(qk=acc.qk, pv=acc.pv, qk_bwd=acc.qk_bwd, dp=acc.dp,
                                  dv=_promoted(acc.dv, dk_tile), dq=_promoted(acc.dq, dq_tile),
                                  dk=_promoted(acc.dk, dk_tile)))


def kernel_recipe(delta: KernelDelta, dk_tile: int = DEFAULT_DS_TILE, dq_tile: int = DEFAULT_DS_TILE,
                  do_format: str = "float8_e4m3fn", folded: bool = False) -> Recipe:
    """The Recipe the kernels run for ``delta`` (``"stale"`` or ``"matched"``) with backward tiles
    of ``dk_tile`` queries (dK) and ``dq_tile`` keys (dQ): the ``naive_fp8`` preset with Q, K, dO
    and V (dP) scaled per token over the whole head dim (ROW), dS in 1 x tile blocks, O in BF16,
    the Hopper accumulation with promotion per kernel tile, and for ``"matched"`` the matched
    delta with the kernels' deferred dQ.

    ``folded``: the warp-specialized forward's (``fwd_ws``) scales, which fold out of its loop:
    K with one POW2_DOWN scale per (batch, key/value head) (``Granularity.HEAD``, in QK^T and
    in the backward's recomputation of it), V in PV with one per (batch, key/value head,
    channel) over all tokens (``Granularity.ROW`` of V laid out for PV). PV is promoted to float32
    per 128-key tile, as in the Triton forward: one wgmma chain over all keys
    (``Recipe.pv_chain``) loses the products of a long row once its accumulator outgrows them
    (an average over thousands of keys of a V whose channels have one sign: 6.8% of O at 4,096
    keys, dev/results/cpu_pv_accuracy.json)."""
    if delta not in ("stale", "matched"):
        raise ValueError(f"delta={delta!r} must be 'stale' or 'matched'")
    base = PRESETS["naive_fp8"]
    e4m3_row = QuantPoint(base.q.fmt, Granularity.ROW, ScaleRule.POW2_DOWN)
    do_fmt = get_format(do_format)
    recipe = dataclasses.replace(
        base, name=f"kernels_{'delta_matching' if delta == 'matched' else 'naive_fp8'}",
        q=e4m3_row, k=e4m3_row, v_dp=e4m3_row, do_dp=QuantPoint(do_fmt, Granularity.ROW, ScaleRule.POW2_DOWN),
        do_dv=dataclasses.replace(base.do_dv, fmt=do_fmt), accumulation=MatmulModels.all("hopper"),
        delta=(base.delta if delta == "stale" else DeltaStrategy(DeltaKind.MATCHED, deferred_dq=deferred_dq(dq_tile))),
    )
    if folded:
        recipe = dataclasses.replace(recipe, name=recipe.name.replace("kernels_", "kernels_folded_"),
                                     k=QuantPoint(base.k.fmt, Granularity.HEAD, ScaleRule.POW2_DOWN),
                                     v=QuantPoint(base.v.fmt, Granularity.ROW, ScaleRule.POW2_DOWN))
    return fit_to_tiles(recipe, dk_tile, dq_tile)


def _dsq_row(recipe: Recipe, name: str) -> Recipe:
    """``recipe`` (a folded pre-pass one) with dS for dQ scaled once per query over all keys from
    the pre-pass's bound of its amax (``Recipe.ds_dq_bound``) and K for dQ scaled per head, the
    forward's scale: every factor of dQ's partials is then the same in every key block, so a
    one-pass kernel adds them unscaled and applies the factors once, after the pass."""
    return dataclasses.replace(recipe, name=name,
                               ds_dq=QuantPoint(FLOAT8_E4M3FN, Granularity.ROW, ScaleRule.POW2_DOWN), ds_dq_bound=True,
                               k_dq=QuantPoint(FLOAT8_E4M3FN, Granularity.HEAD, ScaleRule.POW2_DOWN))


#: The Recipes the kernels ship, by name. ``kernels_naive_fp8``: naive_fp8's quantization with the
#: kernels' scales (Q, K, dO, V of dP per token) and the stale delta; ``kernels_delta_matching``:
#: the same with the matched delta and the kernels' deferred dQ; ``kernels_folded_*``: the same
#: backward with the warp-specialized forward's folded K and V scales; ``kernels_delta_prepass``
#: (and its folded form): the matched recipe in the seven-GEMM schedule (``with_prepass_delta``):
#: D = sum_j P dP from a pre-pass of QK^T and dO V^T, then the five-GEMM backward with that D and
#: no deferred dQ; ``kernels_folded_delta_prepass_dsq_row``: ``kernels_folded_delta_prepass`` with dS
#: for dQ scaled per query over all keys from the pre-pass's bound U_i and K for dQ per head
#: (docs/delta_study.md, "dS for dQ with a scale known before the pass").
KERNEL_RECIPES: dict[str, Recipe] = {r.name: r for r in (
    kernel_recipe("matched"),
    kernel_recipe("stale"),
    kernel_recipe("matched", folded=True),
    kernel_recipe("stale", folded=True),
    with_prepass_delta(kernel_recipe("matched"), "kernels_delta_prepass"),
    with_prepass_delta(kernel_recipe("matched", folded=True), "kernels_folded_delta_prepass"),
)}
KERNEL_RECIPES["kernels_folded_delta_prepass_dsq_row"] = _dsq_row(KERNEL_RECIPES["kernels_folded_delta_prepass"],
                                                                  "kernels_folded_delta_prepass_dsq_row")


