"""The presets: the recipes of dmref's tables by name (:data:`PRESETS`), written in the vocabulary
of :mod:`dmref.recipes.recipe`, and the candidates of the delta study (:data:`DELTA_STUDY`)."""

from __future__ import annotations

from dataclasses import replace

from ..emulation.blocked import ScaleRule
from ..emulation.formats import BFLOAT16, FLOAT8_E4M3FN, FLOAT8_E5M2, Format
from ..emulation.gemm import MatmulModel
from .recipe import (CONSISTENT_P, MATCHED, NONE, STALE, STALE_FP8_DO, STALE_UNROUNDED, DeltaKind, DeltaStrategy,
                     Granularity, MatmulModels, Normalizer, PReference, PScaling, QuantPoint, Recipe, Tiles)

__all__ = ["PRESETS", "DELTA_STUDY", "EXACT", "FP32", "BF16", "NAIVE_FP8", "CUDNN_FP8", "MXFP8_STALE", "DELTA_MATCHING",
           "CONSISTENT_P_RECIPE", "CONSISTENT_P_TILE", "CONSISTENT_P_FP32_PV_DP", "STALE_FP32_O", "with_prepass_delta"]

_BF16 = QuantPoint(BFLOAT16)


def _fp8(fmt: Format, granularity: Granularity, rule: ScaleRule) -> QuantPoint:
    return QuantPoint(fmt, granularity, rule)


def _all_operands(fwd: QuantPoint, grad: QuantPoint, p: QuantPoint, ds: QuantPoint) -> dict:
    """Forward operands and V in ``fwd``; dO in ``grad``; P points in ``p``; dS in ``ds``."""
    return dict(
        q=fwd, k=fwd, v=fwd, p=p,
        do_dp=grad, v_dp=fwd, p_dv=p, do_dv=grad,
        ds_dq=ds, k_dq=fwd, ds_dk=ds, q_dk=fwd,
    )


#: P into E4M3 with no data-dependent scale: P * 2^offset is stored as it is (FA3).
_P_E4M3_FIXED = QuantPoint(FLOAT8_E4M3FN, Granularity.TENSOR, ScaleRule.FIXED)

_E4M3_1x128 = _fp8(FLOAT8_E4M3FN, Granularity.TILE_1x128, ScaleRule.POW2_DOWN)

EXACT = Recipe(
    name="exact",
    accumulation=MatmulModels.all(MatmulModel.get("float64")),
    delta=STALE_UNROUNDED,
    precision="float64",
)

FP32 = Recipe(name="fp32", delta=STALE_UNROUNDED)

BF16 = Recipe(
    name="bf16",
    **_all_operands(_BF16, _BF16, _BF16, _BF16),
    o=_BF16,
    delta=STALE,
)

# Every matmul operand cast to FP8 the way a training framework casts GEMM inputs (1x128 tiles,
# power-of-two scales, E4M3 throughout as in TE Float8BlockScaling), P against the running max
# in the forward and against LSE in the backward, and FlashAttention-2's delta from BF16 dO and
# the BF16 output.
NAIVE_FP8 = Recipe(
    name="naive_fp8",
    **_all_operands(_E4M3_1x128, _E4M3_1x128, _P_E4M3_FIXED, _E4M3_1x128),
    o=_BF16,
    p_fwd=PScaling(PReference.RUNNING_MAX, 8),
    p_bwd=PScaling(PReference.LSE, 8),
    delta=STALE,
)

# cuDNN FP8 (per-tensor) on Hopper, as `dmref verify-attention tests/data/h200_cudnn_fp8_sdpa.npz`
# reproduces it code for code (docs/cudnn_fp8.md): E4M3 Q, K, V, P and O; dO, dS and dQ, dK, dV in
# one gradient format (E5M2 here, TE's HYBRID; cuDNN takes E4M3 as well); one scale per tensor
# (current scaling stands in for delayed scaling); the forward's online softmax runs over key
# tiles of 256; D = descale_dO descale_O rowsum(dO_fp8 ∘ O_fp8). What this Recipe cannot state
# (docs/cudnn_fp8.md, "The cudnn_fp8 preset"): P is multiplied by scale_s = 448, not 2^8; dS is
# attn_scale P (dP - D), scaled by 448 / amax of itself whatever its format; dQ's dS operand is
# rounded to float16 before FP8; dQ sums one wgmma chain per 128 keys in float32; every matmul
# accumulates as Hopper's FP8 wgmma does (dmref.cudnn.replay applies all of these).
_E4M3_T = _fp8(FLOAT8_E4M3FN, Granularity.TENSOR, ScaleRule.AMAX)
_E5M2_T = _fp8(FLOAT8_E5M2, Granularity.TENSOR, ScaleRule.AMAX)
CUDNN_FP8 = Recipe(
    name="cudnn_fp8",
    **_all_operands(_E4M3_T, _E5M2_T, _P_E4M3_FIXED, _E5M2_T),
    o=_E4M3_T,
    p_fwd=PScaling(PReference.RUNNING_MAX, 8),
    p_bwd=PScaling(PReference.LSE, 8),
    delta=STALE_FP8_DO,
    tiles=Tiles(block_q=128, block_k=256),
)

# cuDNN MXFP8 backward (cuDNN >= 9.21): MX-32 blocks everywhere
# (E8M0 scales rounded up, NVIDIA's rule), E4M3 forward, E5M2 gradients, D from BF16 dO and the
# BF16 output, P * 256 against the running max in the forward and P * 16 against LSE in the
# backward (which side uses which grid is not public; the mismatch is the point).
_E4M3_MX = _fp8(FLOAT8_E4M3FN, Granularity.MX32, ScaleRule.MX_NVIDIA)
_E5M2_MX = _fp8(FLOAT8_E5M2, Granularity.MX32, ScaleRule.MX_NVIDIA)
MXFP8_STALE = Recipe(
    name="mxfp8_stale",
    **_all_operands(_E4M3_MX, _E5M2_MX, _P_E4M3_FIXED, _E5M2_MX),
    o=_BF16,
    p_fwd=PScaling(PReference.RUNNING_MAX, 8),
    p_bwd=PScaling(PReference.LSE, 4),
    delta=STALE,
)

# Delta-Matching: naive_fp8's quantization, with D_i = sum_j P_ij dP^_ij.
DELTA_MATCHING = replace(NAIVE_FP8, name="delta_matching", delta=MATCHED)

# Consistent P: the forward quantizes P against a power-of-two running reference and
# normalizes by the quantized mass; the backward recomputes the same P~ against the saved final
# reference and uses P~/l~ in dS; V has transpose-invariant 128x128 blocks so that P V and dO Vᵀ
# see the same V^; O is saved in FP32 and D = dO^ . O needs no extra sweep.
_E4M3_128x128 = _fp8(FLOAT8_E4M3FN, Granularity.BLOCK_128x128, ScaleRule.POW2_DOWN)
CONSISTENT_P_RECIPE = replace(
    NAIVE_FP8,
    name="consistent_p",
    v=_E4M3_128x128,
    v_dp=_E4M3_128x128,
    o=NONE,
    p_fwd=PScaling(PReference.POW2_RUNNING_MAX, 8),
    p_bwd=PScaling(PReference.SAVED_MAX, 8),
    normalizer=Normalizer.QUANTIZED_SUM,
    delta=CONSISTENT_P,
)

#: Every preset by name, in the order tables list them.
PRESETS: dict[str, Recipe] = {
    r.name: r
    for r in (EXACT, FP32, BF16, NAIVE_FP8, CUDNN_FP8, MXFP8_STALE, DELTA_MATCHING, CONSISTENT_P_RECIPE)
}

# ----------------------------------------------------------------------------------------------
# The delta study: recipes whose D is known before a single backward pass (docs/delta_study.md)
# ----------------------------------------------------------------------------------------------

# Consistent P with P scaled per row and 128-key tile (POW2_DOWN, 1x128 along the keys): a
# dynamic power-of-two block scale commutes with the forward's power-of-two rescaling, Q(2^c y)
# = 2^c Q(y) for every y, so the backward recomputes the forward's P~ bit for bit at the final
# reference (condition C1 of dmref/proofs/consistent_p.md holds everywhere, also where a fixed
# 2^8 offset makes P subnormal at one reference and normal at the other). The block's scale is
# the tile's row max, which the online softmax has already: the kernel pays nothing for it.
_E4M3_P_TILE = _fp8(FLOAT8_E4M3FN, Granularity.TILE_1x128, ScaleRule.POW2_DOWN)
CONSISTENT_P_TILE = replace(CONSISTENT_P_RECIPE, name="consistent_p_tile", p=_E4M3_P_TILE)

# consistent_p_tile with the two contractions behind D = dO^ . O accumulated in float32: PV in
# the forward and dP = dO^ V^ᵀ in the backward (FP8 values are exact in BF16, so a BF16 tensor
# core with float32 accumulation runs them at half the FP8 rate); every other matmul on Hopper's
# FP8 tensor cores. Theorem 9 needs the associativity O_i . dO^_i = sum_j w_ij dP_ij, which
# Hopper's truncating FP8 accumulation breaks (Theorem 9b).
CONSISTENT_P_FP32_PV_DP = replace(
    CONSISTENT_P_TILE, name="consistent_p_fp32_pv_dp",
    accumulation=MatmulModels(qk="hopper", pv="fp32", qk_bwd="hopper", dp="fp32", dv="hopper", dq="hopper",
                              dk="hopper"),
)

# D from the forward's float32 output without consistent P: naive_fp8 with O saved in float32 and
# D_i = dO^_i . O_i from the dP matmul's dO^ (its E4M3 1x128 point). dS keeps the float32 P of the
# backward, so O's P~ (the forward's FP8 P) is not dS's P: assumption A1 fails by P's rounding.
STALE_FP32_O = replace(NAIVE_FP8, name="stale_fp32_o", o=NONE, delta=DeltaStrategy(DeltaKind.STALE, do=_E4M3_1x128))

#: The candidates of the delta study beside the presets, by name (:func:`get_recipe` finds them;
#: the seven-GEMM recipe is ``delta_matching`` itself: dmref.tiled computes its D in a pre-sweep).
DELTA_STUDY: dict[str, Recipe] = {r.name: r for r in (CONSISTENT_P_TILE, CONSISTENT_P_FP32_PV_DP, STALE_FP32_O)}


def with_prepass_delta(recipe: Recipe, name: str | None = None) -> Recipe:
    """``recipe`` (a matched one) in the seven-GEMM schedule: D_i = sum_j P_ij dP^_ij from a
    pre-pass of QKᵀ and dO Vᵀ that runs the main pass's very matmuls (so its dP^ are the main
    pass's numbers, Theorem 1′ of dmref/proofs/delta_matching.md), then the five GEMMs of the
    backward with the final D: the MATCHED delta without deferred dQ, named ``name`` (default
    ``<recipe>_prepass``). dmref.tiled computes every MATCHED delta this way."""
    if recipe.delta.kind is not DeltaKind.MATCHED:
        raise ValueError(f"with_prepass_delta: recipe {recipe.name!r} has a {recipe.delta.name} delta, not a matched one")
    return replace(recipe, name=name or f"{recipe.name}_prepass", delta=MATCHED)
