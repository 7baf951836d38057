"""Tile configurations and the recipe each kernel implements, as data.

Nothing here imports triton: the reference (``dmref``) and the tests read these dataclasses to
reproduce exactly what the kernels compute.

Layout conventions used by every kernel (``B`` batch, ``H`` query heads, ``HKV`` key/value heads,
``N`` tokens, ``D`` head dim; ``H % HKV == 0``, query head ``h`` reads key/value head
``h // (H // HKV)``):

- *row copy* of a tensor ``X: (B, H, N, D)``: FP8 codes ``(B*H, N, D)``, one power-of-two scale per
  token (a 1 x D tile along the head dim), dequantization factors ``(B*H, N)`` float32.
- *transposed copy*: FP8 codes ``(B*H, D, NPAD)`` with the token dimension contiguous
  (``NPAD = ceil(N / QUANT_BLOCK) * QUANT_BLOCK``, padding codes are zero), one power-of-two scale
  per head-dim channel and block of ``QUANT_BLOCK`` tokens, dequantization factors
  ``(B*H, NPAD // QUANT_BLOCK, D)`` float32.

FP8 wgmma on Hopper reads both operands K-major from shared memory, so a matmul that contracts
over tokens (PV, P^T dO, dS K, dS^T Q) takes its token-major operand from a transposed copy, and a
matmul that contracts over the head dim (QK^T, dO V^T) takes row copies.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

#: Tokens per scale block of a transposed copy; every kernel tile along tokens divides it.
QUANT_BLOCK = 128

#: log2 of the fixed factor P is multiplied by before it is cast to FP8 (FA3's "max offset 8").
#: P <= 1 against the running max (forward) or against LSE (backward), so 256 * P <= 256 < 448.
P_SCALE_LOG2 = 8

#: log2 of P's scale at the kbar quantization point (matched dQ's deferred correction). With
#: P <= 1 against LSE, codes of P <= 2**4 and of K <= 448, a tile's float16 wgmma chain stays
#: below 2**4 * 448 * (1 + 2**-4) < 65504 (float16's max) for any input.
KBAR_P_SCALE_LOG2 = 4

DeltaStrategy = Literal["stale", "matched"]


@dataclass(frozen=True)
class FwdTiles:
    """Forward tiling: one program per ``block_m`` queries, looping over ``block_n`` keys.

    ``block_n`` is both the PV contraction length per promotion (``acc += dot(P~, V^)`` once per
    tile) and the granularity of the running max P is quantized against.
    """

    block_m: int = 64  #: queries per program
    block_n: int = 128  #: keys per inner step (divides QUANT_BLOCK)
    num_warps: int = 4  #: warps per program (Triton launch option)
    num_stages: int = 3  #: software-pipelining depth (Triton launch option)
    #: load K and V tiles through TMA tensor descriptors instead of per-element pointers (the
    #: H200 tiling run of 2026-11-29 measured +0.1% to +5% on all six benchmark shapes)
    tma: bool = True
    #: register cap per thread (Triton's ``maxnreg`` launch option; None: the compiler's choice).
    #: A lower cap lets more CTAs share an SM (ptxas spills what does not fit)
    maxnreg: int | None = None

    def __post_init__(self) -> None:
        _check_tile("block_m", self.block_m)
        _check_tile("block_n", self.block_n)


@dataclass(frozen=True)
class BwdTiles:
    """Backward tiling of the two named kernels.

    - ``dkdv``: one program per ``block_n1`` keys (and one key/value head, summing over its query
      heads), looping over ``block_m1`` queries.
    - ``dq``: one program per ``block_m2`` queries, looping over ``block_n2`` keys.

    With the ``rowwise`` dS granularity dS is quantized per ``block_m1`` queries for dK and per
    ``block_n2`` keys for dQ (the contraction of the tile): tiles of 128 give the reference
    presets' 1x128 granularity, tiles of 64 and 32 the 1x64 and 1x32 ones; all are expressible in
    ``dmref.recipes`` (``KernelRecipe.reference_recipe``). Tiles of 128 spill at head
    dim 128. The defaults (D = 128) are the fastest of the H200 sweeps in
    benchmarks/results/2026-11-29_nvidia-h200_bench_attention_v2.json (tiles) and ``..._v7_whole_
    accumulators.json`` (TMA loads, whole accumulators).
    """

    block_m1: int = 64
    block_n1: int = 128
    block_m2: int = 128
    block_n2: int = 64
    num_warps_dkdv: int = 8
    num_stages_dkdv: int = 2
    num_warps_dq: int = 8
    num_stages_dq: int = 2
    #: load the FP8 operand tiles of both loops through TMA tensor descriptors
    tma: bool = True
    #: keep dQ, kbar, dK and dV as two halves of the head dim (a half-size promotion temporary);
    #: whole accumulators were faster on the H200 at both head dims (bench_attention_v7)
    split_head: bool = False
    #: register caps per thread of the two kernels (Triton's ``maxnreg``; None: the compiler's
    #: choice); a lower cap lets more CTAs share an SM
    maxnreg_dq: int | None = None
    maxnreg_dkdv: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_m1", "block_n1", "block_m2", "block_n2"):
            _check_tile(name, getattr(self, name))

    def accumulator_width(self, head_dim: int) -> int:
        """Head-dim columns of each backward accumulator (and of the K, Q, dO column tiles
        multiplied into it): half the head dim with ``split_head``, else all of it."""
        return head_dim // 2 if self.split_head else head_dim


def _check_tile(name: str, value: int) -> None:
    # A token tile that feeds a K-major FP8 operand must lie inside one scale block, and FP8 wgmma
    # contracts 32 elements per step; so tiles are 32, 64 or 128 and divide one another, which
    # the causal loop split relies on.
    if value < 32 or QUANT_BLOCK % value:
        raise ValueError(f"{name}={value} must be >= 32 and divide QUANT_BLOCK={QUANT_BLOCK}")


@dataclass(frozen=True)
class KernelRecipe:
    """What the kernels compute, point by point, so that the reference can reproduce it.

    Scale rule everywhere (``pow2_floor``): for a block with ``amax = max |x|`` the multiplier is
    ``2**k`` with ``k = floor(log2(fmt.max / amax))`` computed exactly from the bits of ``amax``
    (``k = 0`` when ``amax == 0``; ``k`` clamped to [-126, 126]); codes are
    ``cast_rne_satfinite(x * 2**k)``, dequantized as ``code * 2**-k``.

    Accumulation: every ``tl.dot`` is one FP8 wgmma chain over its tile's contraction length with
    Triton's default (no intermediate promotion); results are scaled and added into float32
    registers once per tile (promotion per tile). QK^T and dO V^T contract over the head dim in one
    chain.
    """

    name: str
    delta: DeltaStrategy
    #: format of Q, K, V (all copies), P and dS
    qkv_format: str = "float8_e4m3fn"
    #: format of both dO copies
    do_format: str = "float8_e4m3fn"
    ds_format: str = "float8_e4m3fn"
    #: ``"rowwise"``: one scale per row of dS and the whole contraction of its tile: per query
    #: and ``block_n2`` keys for dQ, per key and ``block_m1`` queries for dK (with tiles of 128
    #: this is the reference's 1x128 granularity); ``"tile"``: one scale per backward tile
    ds_granularity: Literal["rowwise", "tile"] = "rowwise"
    p_format: str = "float8_e4m3fn"
    p_scale_log2: int = P_SCALE_LOG2
    fwd: FwdTiles = field(default_factory=FwdTiles)
    #: forward tiling at head dim 64 (None: ``fwd``); same key tile (the recipe's running-max
    #: granularity), with a register cap of 168 so that three CTAs share an SM (H200, 2026-11-29:
    #: +5-7% at D = 64 in ..._bench_fwd_tiles_maxnreg.json, +5% in the v9 sweep, +3% after
    #: mul_rn in ..._sweep_d64_mul_rn.json; at D = 128 the cap spills and loses)
    fwd_d64: FwdTiles | None = field(default_factory=lambda: FwdTiles(maxnreg=168))
    bwd: BwdTiles = field(default_factory=BwdTiles)
    #: backward tiling at head dim 64 (None: ``bwd``); the H200 sweeps of 2026-11-29 picked
    #: 64 x 64 tiles on 4 warps there, pointer loads, whole accumulators, and the defaults above
    #: at head dim 128; the matched dq capped at 168 registers (3 CTAs per SM instead of 2) runs
    #: 5% faster (..._bench_attention_v9_register_caps.json; the stale dq needs 158 anyway, and
    #: capping dkdv too was slower)
    bwd_d64: BwdTiles | None = field(
        default_factory=lambda: BwdTiles(64, 64, 64, 64, 4, 2, 4, 2, tma=False, maxnreg_dq=168))

    def __post_init__(self) -> None:
        for name in ("qkv_format", "ds_format", "p_format"):
            if getattr(self, name) != "float8_e4m3fn":
                raise ValueError(f"{name}={getattr(self, name)!r}: the kernels implement float8_e4m3fn only")
        if self.do_format not in ("float8_e4m3fn", "float8_e5m2"):
            raise ValueError(f"do_format={self.do_format!r} must be float8_e4m3fn or float8_e5m2")
        if self.delta not in ("stale", "matched"):
            raise ValueError(f"delta={self.delta!r} must be 'stale' or 'matched'")
        if self.ds_granularity not in ("rowwise", "tile"):
            raise ValueError(f"ds_granularity={self.ds_granularity!r} must be 'rowwise' or 'tile'")
        if self.fwd_d64 is not None and self.fwd_d64.block_n != self.fwd.block_n:
            raise ValueError(f"fwd_d64.block_n={self.fwd_d64.block_n} != fwd.block_n={self.fwd.block_n}: "
                             "the forward's key tile is the recipe's running-max granularity")

    def with_tiles(self, fwd: FwdTiles | None = None, bwd: BwdTiles | None = None) -> "KernelRecipe":
        """The same recipe with these tilings (a given tiling applies to every head dim)."""
        return dataclasses.replace(self, fwd=fwd or self.fwd, bwd=bwd or self.bwd,
                                   fwd_d64=None if fwd is not None else self.fwd_d64,
                                   bwd_d64=None if bwd is not None else self.bwd_d64)

    def fwd_tiles(self, head_dim: int) -> FwdTiles:
        """The forward tiling used at ``head_dim``."""
        return self.fwd_d64 if (head_dim == 64 and self.fwd_d64 is not None) else self.fwd

    def bwd_tiles(self, head_dim: int) -> BwdTiles:
        """The backward tiling used at ``head_dim``."""
        return self.bwd_d64 if (head_dim == 64 and self.bwd_d64 is not None) else self.bwd

    def quantization_points(self) -> dict[str, str]:
        """One line per quantization point, in the words the reference uses."""
        b = self.bwd
        p = f"2**{self.p_scale_log2}"
        if self.ds_granularity == "rowwise":
            ds_dk = f"{self.ds_format}, one pow2_floor scale per key and {b.block_m1} queries"
            ds_dq = f"{self.ds_format}, one pow2_floor scale per query and {b.block_n2} keys"
        else:
            ds_dk = f"{self.ds_format}, one pow2_floor scale per {b.block_m1} x {b.block_n1} tile"
            ds_dq = f"{self.ds_format}, one pow2_floor scale per {b.block_m2} x {b.block_n2} tile"
        return {
            "Q (QK^T, fwd and bwd)": f"{self.qkv_format}, 1 x D per token, pow2_floor, RNE satfinite",
            "K (QK^T, fwd and bwd)": f"{self.qkv_format}, 1 x D per token, pow2_floor, RNE satfinite",
            "V (PV, fwd)": f"{self.qkv_format}, {QUANT_BLOCK} tokens x 1 channel, pow2_floor",
            "P (PV, fwd)": f"{self.p_format}, P * {p} against the running max of each "
            f"{self.fwd.block_n}-key tile, normalizer l = sum of float32 P",
            "V (dO V^T)": f"{self.qkv_format}, 1 x D per token, pow2_floor",
            "dO (dO V^T)": f"{self.do_format}, 1 x D per token, pow2_floor",
            "P (P^T dO)": f"{self.p_format}, P * {p} against LSE",
            "dO (P^T dO)": f"{self.do_format}, {QUANT_BLOCK} tokens x 1 channel, pow2_floor",
            "dS (dS^T Q)": ds_dk,
            "Q (dS^T Q)": f"{self.qkv_format}, {QUANT_BLOCK} tokens x 1 channel, pow2_floor",
            "dS (dS K)": ds_dq,
            "K (dS K)": f"{self.qkv_format}, {QUANT_BLOCK} tokens x 1 channel, pow2_floor",
            "delta": _DELTA_WORDS[self.delta],
        }


    def reference_recipe(self, head_dim: int, accumulation: str = "hopper"):
        """The ``dmref.recipes.Recipe`` that reproduces these kernels at ``head_dim``, for the
        emulated reference ``dmref.tiled``.

        ``accumulation``: ``"hopper"`` for the H200 (one wgmma chain per kernel tile, promoted
        to float32 between tiles: ``hopper-p<tile>`` where a tile is shorter than the reference's
        128-wide scale blocks), ``"fp32"`` for Triton's interpreter (float32 matmuls).

        Raises ``ValueError`` where the reference cannot express the kernel: dS blocks other
        than 1x32 (``Granularity.MX32`` with ``ScaleRule.POW2_DOWN``), 1x64 (``TILE_1x64``) or
        1x128 (``TILE_1x128``), or a forward key tile other than the reference's 128. The
        matched dQ is the reference's ``DeferredDq`` (kbar's float16 wgmma chain modelled as a
        float32 tile sum rounded once to float16).
        """
        from dmref.recipes import Granularity, MatmulModel, MatmulModels, PReference, PScaling, QuantPoint, Recipe, ScaleRule

        b = self.bwd_tiles(head_dim)
        if self.fwd.block_n != QUANT_BLOCK:
            raise ValueError(f"forward block_n={self.fwd.block_n}: the reference rescales the "
                             f"running max every {QUANT_BLOCK} keys (Tiles.block_k)")
        if self.ds_granularity != "rowwise":
            raise ValueError("ds_granularity='tile': the reference has no per-tile dS scale")

        def ds_point(block: int) -> QuantPoint:
            gran = {32: Granularity.MX32, 64: Granularity.TILE_1x64, QUANT_BLOCK: Granularity.TILE_1x128}.get(block)
            if gran is None:
                raise ValueError(f"dS blocks of 1x{block}: dmref.recipes.Granularity has 1x32 "
                                 "(MX32), 1x64 and 1x128 only")
            return QuantPoint(self.ds_format, gran, ScaleRule.POW2_DOWN)

        row = QuantPoint(self.qkv_format, Granularity.ROW, ScaleRule.POW2_DOWN)
        do_row = QuantPoint(self.do_format, Granularity.ROW, ScaleRule.POW2_DOWN)
        tok = QuantPoint(self.qkv_format, Granularity.TILE_1x128, ScaleRule.POW2_DOWN)
        do_tok = QuantPoint(self.do_format, Granularity.TILE_1x128, ScaleRule.POW2_DOWN)
        p = QuantPoint(self.p_format, Granularity.TENSOR, ScaleRule.FIXED)

        def acc(tile: int) -> MatmulModel:
            model = MatmulModel.get(accumulation)
            if model.accumulation is not model.accumulation.HOPPER:
                return model
            return model if tile >= QUANT_BLOCK else MatmulModel(model.accumulation, promote_every=tile)

        return Recipe(
            name=f"kernels_{self.name}_d{head_dim}",
            q=row, k=row, v=tok, p=p, o=QuantPoint("bfloat16"),
            do_dp=do_row, v_dp=row, p_dv=p, do_dv=do_tok,
            ds_dq=ds_point(b.block_n2), k_dq=tok, ds_dk=ds_point(b.block_m1), q_dk=tok,
            accumulation=MatmulModels(
                qk=acc(QUANT_BLOCK), pv=acc(QUANT_BLOCK), qk_bwd=acc(QUANT_BLOCK),
                dp=acc(QUANT_BLOCK), dv=acc(b.block_m1), dq=acc(b.block_n2), dk=acc(b.block_m1)),
            p_fwd=PScaling(PReference.RUNNING_MAX, self.p_scale_log2),
            p_bwd=PScaling(PReference.LSE, self.p_scale_log2),
            delta=self._reference_delta(b),
        )

    def _reference_delta(self, b: BwdTiles):
        """The reference's delta strategy: STALE, or MATCHED with the dq kernel's deferred dQ."""
        from dmref.recipes import STALE, DeferredDq, DeltaKind, DeltaStrategy, QuantPoint

        if self.delta == "stale":
            return STALE
        fp16 = QuantPoint("float16", saturate=False)  # Triton's float32 -> float16: RNE, overflow to inf
        deferred = DeferredDq(predictor=STALE, p=QuantPoint(self.p_format), p_offset_log2=KBAR_P_SCALE_LOG2,
                              tile=b.block_n2, tile_result=fp16, accumulator=fp16)
        return DeltaStrategy(DeltaKind.MATCHED, deferred_dq=deferred)


_DELTA_WORDS = {
    "stale": "D = rowsum(float32(dO_bf16) * float32(O_bf16)); dS = P (dP - D) in both kernels",
    "matched": (
        "D = sum_j P_ij dP_ij with the float32 P and dP of the backward (accumulated in the dq "
        "kernel, which runs first; dmref's DeltaKind.MATCHED); dK: dS = P (dP - D) exactly; dQ "
        "by deferred correction: dQ = tau [sum_tiles deq(Q8(P (dP - D_stale))) K - (D - D_stale) "
        "* u kbar], kbar = sum_tiles fl16(kbar + fl16chain(Q8(2**4 P) K8) * k_scale / (2**4 u)) (float16 "
        "wgmma chain per tile, float16 accumulator in units u = the head's largest K block scale; "
        "dmref.recipes.DeferredDq)"
    ),
}

#: The recipes the kernels implement, by name.
#: The names are those of the reference presets they implement (``dmref.recipes``):
#: ``naive_fp8`` is every matmul in block-scaled FP8 with the stale delta.
RECIPES: dict[str, KernelRecipe] = {
    "delta_matching": KernelRecipe(name="delta_matching", delta="matched"),
    "naive_fp8": KernelRecipe(name="naive_fp8", delta="stale"),
}


def get_recipe(recipe: str | KernelRecipe) -> KernelRecipe:
    if isinstance(recipe, KernelRecipe):
        return recipe
    try:
        return RECIPES[recipe]
    except KeyError:
        raise ValueError(f"recipe={recipe!r} is not one of {sorted(RECIPES)}") from None
