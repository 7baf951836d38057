"""What the kernels run, as data: a :class:`KernelSpec` is a ``dmref.recipes.Recipe`` the
kernels run (the object the reference ``dmref.tiled`` takes) and the kernels' tilings, built once
(:func:`unsupported` says why a Recipe is not run); :data:`SPECS` holds the shipped specs (built from
:data:`dmref.recipes.kernels.KERNEL_RECIPES`) under
their recipes' names. Nothing here imports triton.

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
from dataclasses import dataclass

from dmref.emulation import BFLOAT16, FLOAT8_E4M3FN, FLOAT8_E5M2, Accumulation, Rounding, ScaleRule
from dmref.recipes import MATCHED, PRESETS, STALE, DeltaKind, Granularity, Normalizer, PReference, QuantPoint, Recipe
from dmref.recipes import kernels as _recipes
from dmref.recipes.kernels import KBAR_P_SCALE_LOG2, KERNEL_RECIPES, QUANT_BLOCK, KernelDelta  # noqa: F401 (the kernels read them here)



@dataclass(frozen=True)
class FwdTiles:
    """Forward tiling: one program per ``block_m`` queries, looping over key tiles of the
    recipe's ``Tiles.block_k`` (128) keys, the running-max granularity P is quantized against
    and the PV contraction per promotion (``acc += dot(P~, V^)`` once per tile). The Triton
    forward honours every field but ``overlap`` and ``consumers``; the warp-specialized Gluon
    forward (``fwd_ws``, the folded recipes') honours ``num_stages``, ``overlap`` and
    ``consumers`` (with ``block_m`` its 64 queries a consumer warp group) and refuses any other
    ``block_m``, ``num_warps``, ``tma`` or ``maxnreg`` than its own (:func:`fwd_refusal`).
    :func:`default_fwd_tiles` says which tiling each runs by default, and why."""

    block_m: int = 64  #: queries per program
    num_warps: int = 4  #: warps per program (Triton launch option)
    #: software-pipelining depth (Triton launch option); in ``fwd_ws`` the depth of the
    #: shared-memory ring of K and V tiles (``STAGES``)
    num_stages: int = 3
    #: load K and V tiles through TMA tensor descriptors instead of per-element pointers (faster on
    #: the H200 at every benchmark shape: docs/kernels_speed.md, "Tried, measured, and not kept")
    tma: bool = True
    #: register cap per thread (Triton's ``maxnreg`` launch option; None: the compiler's choice).
    #: A lower cap lets more CTAs share an SM (ptxas spills what does not fit)
    maxnreg: int | None = None
    #: ``fwd_ws``'s schedule (``OVERLAP``): 0 serial, 1 QK^T of the next key tile issued before
    #: the softmax of this one; None for the Triton forward, which has one schedule
    overlap: int | None = None
    #: ``fwd_ws``'s consumer warp groups a CTA, sharing one K/V ring, each on 64 queries
    #: (``block_m = 64 * consumers``): 1, two CTAs an SM; 2, FlashAttention-3's structure, one CTA
    #: of 128 queries an SM (each K/V tile loaded once for both). The Triton forward runs 1
    consumers: int = 1

    def __post_init__(self) -> None:
        _check_tile("block_m", self.block_m)


#: What the warp-specialized forward (``fwd_ws``) fixes: one m64 wgmma row block a consumer warp
#: group (``block_m`` = 64 times ``consumers``), the launch's ``num_warps`` the first consumer's
#: warp group, K and V through TMA, registers set by ``setmaxnreg`` (one consumer: 128 at launch,
#: 232 for the consumer; two: 168 at launch, 240 for each), so no cap of its own.
WS_FWD_BLOCK_M, WS_FWD_NUM_WARPS = 64, 4
#: the consumer warp groups a CTA that ``fwd_ws`` runs
WS_FWD_CONSUMERS = (1, 2)
#: the consumer warp groups a CTA that the five-GEMM Gluon backward (``bwd_ws.fused``) runs
WS_BWD_FUSED_CONSUMERS = (1, 2)


def fwd_refusal(recipe, tiles: FwdTiles) -> str | None:
    """None if the forward kernel of ``recipe``'s family honours ``tiles``, else why not, one
    line: the warp-specialized forward (folded recipes) fixes its block, warps, loads and
    registers; the Triton forward has no overlapped schedule."""
    if recipe.k.granularity is not Granularity.HEAD:
        if tiles.overlap is not None:
            return (f"overlap={tiles.overlap}: the Triton forward has one schedule (overlap is the warp-specialized "
                    "forward's, the folded recipes')")
        if tiles.consumers != 1:
            return (f"consumers={tiles.consumers!r}: the Triton forward runs one program of block_m queries "
                    "(consumer warp groups are the warp-specialized forward's, the folded recipes')")
        return None
    if tiles.consumers not in WS_FWD_CONSUMERS:
        return (f"consumers={tiles.consumers!r}: the warp-specialized forward runs "
                f"{' or '.join(map(str, WS_FWD_CONSUMERS))} consumer warp groups a CTA")
    block_m = WS_FWD_BLOCK_M * tiles.consumers
    fixed = dict(block_m=block_m, num_warps=WS_FWD_NUM_WARPS, tma=True, maxnreg=None)
    wrong = [f"{k}={getattr(tiles, k)!r}" for k, v in fixed.items() if getattr(tiles, k) != v]
    if wrong:
        return (f"{', '.join(wrong)}: the warp-specialized forward runs block_m={block_m} with "
                f"consumers={tiles.consumers} (one m64 wgmma warp group of num_warps={WS_FWD_NUM_WARPS} each), "
                "TMA loads and setmaxnreg's registers (maxnreg=None)")
    if tiles.overlap not in (None, 0, 1):
        return f"overlap={tiles.overlap!r}: the warp-specialized forward's schedules are 0 (serial) and 1"
    if tiles.num_stages < 1:
        return f"num_stages={tiles.num_stages}: the warp-specialized forward's ring needs at least one stage"
    return None


@dataclass(frozen=True)
class BwdTiles:
    """Backward tiling of the two named Triton kernels (``bwd``), whose ``block_m1`` and
    ``block_n2`` the Gluon ones (``bwd_ws``) take too: they decide the recipe's dS blocks.

    - ``dkdv``: one program per ``block_n1`` keys (and one key/value head, summing over its query
      heads), looping over ``block_m1`` queries.
    - ``dq``: one program per ``block_m2`` queries, looping over ``block_n2`` keys.

    dS is quantized with one scale per row and ``block_m1`` queries for dK and per row and
    ``block_n2`` keys for dQ (the contraction of the tile): tiles of 128 give the reference
    presets' 1x128 granularity, tiles of 64 and 32 the 1x64 and 1x32 ones (the Recipe's
    ``ds_dq`` and ``ds_dk``, :func:`fit_to_tiles`). Tiles of 128 spill at head
    dim 128. :func:`default_bwd_tiles` says which tiling runs by default, and why.
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
    #: register caps per thread of the two kernels (Triton's ``maxnreg``; None: the compiler's
    #: choice); a lower cap lets more CTAs share an SM
    maxnreg_dq: int | None = None
    maxnreg_dkdv: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_m1", "block_n1", "block_m2", "block_n2"):
            _check_tile(name, getattr(self, name))


def _check_tile(name: str, value: int) -> None:
    # A token tile that feeds a K-major FP8 operand must lie inside one scale block, and FP8 wgmma
    # contracts 32 elements per step; so tiles are 32, 64 or 128 and divide one another, which
    # the causal loop split relies on.
    if value < 32 or QUANT_BLOCK % value:
        raise ValueError(f"{name}={value} must be >= 32 and divide QUANT_BLOCK={QUANT_BLOCK}")


#: the pre-pass's register caps at launch (``WsBwdTiles.prepass_regs``): four, three and two CTAs an SM
PREPASS_REGS = (64, 80, 128)


@dataclass(frozen=True)
class WsBwdTiles:
    """The warp-specialized Gluon backward's schedule (``bwd_ws``). Its CTAs are fixed (64 keys
    (dkdv) or 64 queries (dq) on one consumer warp group and a producer warp, 128 registers at
    launch; the five-GEMM kernel also on two consumer warp groups, ``fused_consumers``) and its
    query tile (dkdv) and key tile (dq) are the backward tiling's ``block_m1`` and ``block_n2``;
    what is left to choose is each kernel's ring and schedule (``bwd_ws``'s module docstring: the
    same operations on the same values in every schedule, so the same bits).
    :func:`default_ws_bwd_tiles` says which runs by default, and why."""

    dkdv_stages: int = 2  #: shared-memory stages of dkdv's query-tile ring
    #: dK and dV held as two halves of the head dim (four n = D/2 wgmmas a tile instead of two)
    dkdv_split: bool = False
    #: dkdv's ``OVERLAP``: 0 serial, 1 dP^T issued behind S^T, 2 and P^T dO behind dP^T (not split)
    dkdv_overlap: int = 0
    dq_stages: int = 2  #: shared-memory stages of dq's key-tile ring
    #: dq's ``OVERLAP``: 0 serial, 1 dP behind S, 2 (matched) kbar's wgmma behind dS K, 3 the next
    #: key tile's S behind the last wgmma of this one
    dq_overlap: int = 0
    #: the five-GEMM kernel's (``bwd_ws.fused``) consumer warp groups a CTA, each on 64 keys: 1, two
    #: CTAs of 64 keys an SM; 2, FlashAttention-3's structure, one CTA of 128 keys an SM, the two
    #: sharing one ring of query tiles (each streamed once for both). It runs the ring and
    #: schedule of dkdv (``dkdv_stages``, ``dkdv_overlap``)
    fused_consumers: int = 1
    #: where the five-GEMM kernel's dQ^T partial goes among dV and dK (``bwd_ws._consumer``'s
    #: ``DQ_ORDER``; dQ^T's partials only, ``bwd_ws.launch``'s ``dq_t``): 0 before both; 1 (D = 128)
    #: its two channel halves around dV; 2 (D = 64) its wgmma and dV's and dK's issued together; 3
    #: (D = 128) before both, its halves through two shared tiles taking turns
    fused_dq_order: int = 0
    #: the five-GEMM kernel's per-query vectors (Q's scale, LSE2, dO's scale, D, U) through the ring
    #: by TMA with the row tiles, read in the accumulator's column layout (N a multiple of 64),
    #: instead of loaded a element a thread and moved into that layout through shared memory
    fused_vec_tma: bool = False
    #: the pre-pass's register cap a thread at launch (``bwd_ws.launch(kernel="prepass")``'s
    #: ``maxnreg``; None: the kernels' 128, two CTAs an SM): 80 lets three CTAs share an SM and 64
    #: four (its consumer then holds 136 and 104 after the producer's drop; no spills at either)
    prepass_regs: int | None = None

    def __post_init__(self) -> None:
        if self.dkdv_overlap not in (0, 1, 2) or self.dq_overlap not in (0, 1, 2, 3):
            raise ValueError(f"dkdv_overlap={self.dkdv_overlap} must be 0, 1 or 2 and dq_overlap={self.dq_overlap} "
                             "0, 1, 2 or 3")
        if self.fused_consumers not in WS_BWD_FUSED_CONSUMERS:
            raise ValueError(f"fused_consumers={self.fused_consumers!r}: the five-GEMM Gluon backward runs "
                             f"{' or '.join(map(str, WS_BWD_FUSED_CONSUMERS))} consumer warp groups a CTA")
        if self.prepass_regs is not None and self.prepass_regs not in PREPASS_REGS:
            raise ValueError(f"prepass_regs={self.prepass_regs!r} must be None or one of {PREPASS_REGS}")
        if self.fused_dq_order not in (0, 1, 2, 3):
            raise ValueError(f"fused_dq_order={self.fused_dq_order!r} must be 0, 1, 2 or 3")
        if self.dkdv_overlap == 2 and self.dkdv_split:
            raise ValueError("dkdv_overlap=2 issues P^T dO behind dP^T, which the split dK and dV do not")
        if min(self.dkdv_stages, self.dq_stages) < 1:
            raise ValueError(f"stages ({self.dkdv_stages}, {self.dq_stages}) must be at least 1")


# ---- every default tiling and schedule, one function per kernel family (FA3's tile_size.h) ------
# The reasons are measurements on the H200 (docs/kernels_speed.md; the files named).


def default_fwd_tiles(recipe, head_dim: int) -> FwdTiles:
    """The forward tiling each forward kernel runs ``recipe`` with at ``head_dim`` by default:
    the warp-specialized Gluon one for the folded recipes, the Triton one otherwise."""
    if recipe.k.granularity is Granularity.HEAD:  # folded K and V: the warp-specialized Gluon forward
        # 64 queries on 4 warps, TMA, setmaxnreg: fixed by the kernel (fwd_refusal); two ring stages:
        # 72 KB of shared memory at D = 128, so two CTAs share an SM; overlap 1, QK^T of the next tile
        # during the softmax: 0.99-1.11x the serial speed (dev/gpu_fwd_ws_probe.py); one consumer warp group
        # a CTA (two sharing the ring, consumers=2: their speed is bench_attention.py's ours_fwd_ws_2cons_*)
        return FwdTiles(block_m=WS_FWD_BLOCK_M, num_warps=WS_FWD_NUM_WARPS, num_stages=2, overlap=1)
    return triton_fwd_tiles(head_dim)


def triton_fwd_tiles(head_dim: int) -> FwdTiles:
    """The Triton forward's tiling at ``head_dim``: its recipes' default, and what it runs a folded
    recipe with where the warp-specialized forward does not run (``fwd.launch``)."""
    if head_dim == 64:
        # a register cap of 168 so that three CTAs share an SM: 3% faster (h200_sweep_d64.json)
        return FwdTiles(maxnreg=168)
    # 64 queries on 4 warps, 3 stages, TMA loads: the fastest of the sweeps (a cap spills and loses)
    return FwdTiles()


def default_bwd_tiles(recipe, head_dim: int) -> BwdTiles:
    """The Triton backward's tiling (``bwd``) at ``head_dim`` by default; its ``block_m1`` and
    ``block_n2`` (64) are the recipes' 1 x 64 dS blocks, which the Gluon backward runs too."""
    if head_dim == 64:
        # 64 x 64 tiles on 4 warps, pointer loads, the matched dq capped at 168 registers (3 CTAs an SM
        # instead of 2; capping dkdv too is slower): the sweep's fastest (h200_sweep_d64.json)
        return BwdTiles(64, 64, 64, 64, 4, 2, 4, 2, tma=False, maxnreg_dq=168)
    # 64 x 128 (dkdv) and 128 x 64 (dq) on 8 warps, 2 stages, TMA loads: the fastest of the sweeps
    # bench_attention.py runs (h200_bench_attention.json); tiles of 128 x 128 spill
    return BwdTiles()


def default_ws_bwd_tiles(recipe, head_dim: int) -> WsBwdTiles:
    """The Gluon backward's schedule (``bwd_ws``) for ``recipe`` at ``head_dim`` by default."""
    # two ring stages: 80 KB (dkdv) and 65 KB (dq) of shared memory at D = 128, two CTAs an SM; dK and dV
    # whole: they fit 232 registers at both head dims
    if head_dim == 64:
        # dkdv: dP^T behind S^T, 2-3% faster than serial; dq, matched: kbar's wgmma behind dS K, 3-5%
        # faster; stale: serial, the overlapped ones within +-4% (h200_bwd_ws_probe.jsonl)
        return WsBwdTiles(dkdv_overlap=1, dq_overlap=2 if recipe.delta.deferred_dq is not None else 0)
    # serial: the schedules that fit 232 registers without spills at D = 128 are no faster there
    return WsBwdTiles(dkdv_overlap=0, dq_overlap=0)


def fit_to_tiles(recipe, bwd: BwdTiles):
    """``recipe`` with the parts the backward tiling decides (:func:`dmref.recipes.kernels.fit_to_tiles`
    over ``bwd``'s ``block_m1`` queries (dK) and ``block_n2`` keys (dQ))."""
    return _recipes.fit_to_tiles(recipe, bwd.block_m1, bwd.block_n2)


def unsupported(recipe, bwd: BwdTiles | None = None) -> str | None:
    """None if the kernels run ``recipe`` (a ``dmref.recipes.Recipe``) with the backward tiling
    ``bwd`` (None: any tiling the dS blocks allow), else the reasons they do not, "; "-joined."""
    reasons = _differences(recipe, bwd)
    return "; ".join(reasons) if reasons else None


def _differences(recipe, bwd: BwdTiles | None) -> list[str]:
    """What the kernels do otherwise than ``recipe`` (with ``bwd``), one line per difference."""
    e4m3, e5m2 = FLOAT8_E4M3FN, FLOAT8_E5M2  # the formats of the kernels' casts (_common.to_fp8)

    def point(name, fmts, granularity, rule=ScaleRule.POW2_DOWN):
        pt = getattr(recipe, name)
        if pt.fmt not in fmts or pt.scale_rule is not rule or pt.rounding is not Rounding.NEAREST_EVEN \
                or not pt.saturate or pt.granularity not in granularity:
            return (f"{name}: the kernels quantize it as {'/'.join(f.short_name for f in fmts)}, "
                    f"{'/'.join(g.value for g in granularity)}, {rule.value}, RNE, satfinite; "
                    f"the recipe says {pt.describe()}")
        return None

    row, tok, tensor = (Granularity.ROW,), (Granularity.TILE_1x128,), (Granularity.TENSOR,)
    ds_grans = (Granularity.MX32, Granularity.TILE_1x64, Granularity.TILE_1x128)
    do_fmt = (recipe.do_dp.fmt,) if recipe.do_dp.fmt in (e4m3, e5m2) else (e4m3, e5m2)
    # K and V: the Triton forward's (per token, per 128-token block and channel) or the
    # warp-specialized forward's folded pair (per head, per head and channel)
    folded = recipe.k.granularity is Granularity.HEAD
    k_v = ((point("k", (e4m3,), (Granularity.HEAD,)), point("v", (e4m3,), row)) if folded
           else (point("k", (e4m3,), row), point("v", (e4m3,), tok)))
    # dS for dQ per query over all keys from the pre-pass's bound (Recipe.ds_dq_bound), K for dQ
    # per head: the folded pre-pass recipe's refinement (kernels_folded_delta_prepass_dsq_row)
    dsq_row = recipe.ds_dq_bound
    checks = [point("q", (e4m3,), row), *k_v,
              point("p", (e4m3,), tensor, ScaleRule.FIXED), point("do_dp", do_fmt, row),
              point("v_dp", (e4m3,), row), point("p_dv", (e4m3,), tensor, ScaleRule.FIXED),
              point("do_dv", do_fmt, tok), point("ds_dq", (e4m3,), row if dsq_row else ds_grans),
              point("k_dq", (e4m3,), (Granularity.HEAD,) if dsq_row else tok),
              point("ds_dk", (e4m3,), ds_grans), point("q_dk", (e4m3,), tok)]
    if dsq_row and not (folded and recipe.delta == MATCHED):
        checks.append("ds_dq_bound: the kernels scale dS for dQ from the pre-pass's bound with the folded "
                      "forward's K (per head) and the matched D of a pre-pass only")
    if recipe.o != QuantPoint(BFLOAT16):
        checks.append(f"o: the kernels return O in BF16 (round to nearest); the recipe says {recipe.o.describe()}")
    if recipe.p_fwd.reference is not PReference.RUNNING_MAX or recipe.p_bwd.reference is not PReference.LSE:
        checks.append("P: the kernels quantize P against the running max (forward) and LSE (backward)")
    if recipe.p_fwd.offset_log2 != recipe.p_bwd.offset_log2:
        checks.append(f"P: the kernels scale P by one power of two in both passes; the recipe has "
                      f"2^{recipe.p_fwd.offset_log2} and 2^{recipe.p_bwd.offset_log2}")
    if recipe.pv_chain and not folded:
        checks.append("pv_chain: the Triton forward promotes PV once per key tile; the warp-specialized "
                      "forward (K scaled per head) runs both")
    if recipe.normalizer is not Normalizer.FP32_SUM:
        checks.append("normalizer: the kernels divide by the float32 sum of P")
    if recipe.precision != "float32" or recipe.tiles.block_k != QUANT_BLOCK:
        checks.append(f"the kernels work in float32 with the running max rescaled every {QUANT_BLOCK} keys")
    deferred = recipe.delta.deferred_dq
    if recipe.delta not in (STALE, MATCHED) and not (recipe.delta.kind is DeltaKind.MATCHED and deferred is not None
                                                     and deferred == _recipes.deferred_dq(deferred.tile)):
        checks.append(f"delta: the kernels compute the stale delta from BF16 dO and O, the matched delta "
                      f"with their deferred dQ, or the matched delta from a pre-pass (no deferred dQ); "
                      f"the recipe says {recipe.delta.name}")
    if any(m.accumulation is Accumulation.EXACT for m in recipe.accumulation.models()):
        checks.append("accumulation: the kernels accumulate on tensor cores (hopper) or in float32")
    if bwd is not None and not any(checks) and fit_to_tiles(recipe, bwd) != recipe:
        checks.append(f"tiles: the backward tiling {bwd.block_m1}x{bwd.block_n1} / {bwd.block_m2}x{bwd.block_n2} "
                      "quantizes dS, promotes the backward matmuls and tiles kbar differently from the recipe")
    return [c for c in checks if c]


def kernel_recipe(delta: KernelDelta, bwd: BwdTiles | None = None, do_format: str = "float8_e4m3fn",
                  folded: bool = False) -> Recipe:
    """The Recipe the kernels run for ``delta`` with the backward tiling ``bwd``
    (:func:`dmref.recipes.kernels.kernel_recipe` over its tile extents)."""
    bwd = bwd or BwdTiles()
    return _recipes.kernel_recipe(delta, bwd.block_m1, bwd.block_n2, do_format=do_format, folded=folded)


@dataclass(frozen=True)
class KernelSpec:
    """What the kernels run: ``recipe``, the very ``dmref.recipes.Recipe`` the emulated reference
    ``dmref.tiled`` takes, and the kernels' tilings. Built from a Recipe the kernels run
    (:func:`unsupported` is None at every tiling), else ``ValueError`` with the reason.

    ``recipe`` states every quantization point, the delta and the accumulation at the hardware
    (HOPPER wgmma chains, promoted to float32 between backward tiles shorter than 128). The
    backward tiling decides the dS block extents, the promotion interval and kbar's tile
    (:func:`fit_to_tiles`), so every tiling of a spec agrees with its recipe; the forward's key
    tile is the recipe's ``Tiles.block_k``. A forward tiling its forward kernel does not honour is
    refused (:func:`fwd_refusal`). The launchers read the spec through one launch description per
    kernel (``fwd.launch``, ``fwd_ws.launch``, ``bwd.launch``, ``bwd_ws.launch``, ``bwd_fused.launch``,
    ``bwd_prepass.launch``), which ``compile_check`` reads too.
    """

    recipe: Recipe
    #: forward tiling (None: :func:`default_fwd_tiles` of the recipe at head dim 128, and
    #: ``fwd_d64`` its default at 64 unless given)
    fwd: FwdTiles | None = None
    #: forward tiling at head dim 64 (None: ``fwd`` where ``fwd`` is given, else the default)
    fwd_d64: FwdTiles | None = None
    #: the Triton backward's tiling (None: :func:`default_bwd_tiles`, as ``fwd``)
    bwd: BwdTiles | None = None
    bwd_d64: BwdTiles | None = None  #: at head dim 64 (None: as ``fwd_d64``)
    #: the Gluon backward's schedule (None: :func:`default_ws_bwd_tiles`, as ``fwd``)
    ws_bwd: WsBwdTiles | None = None
    ws_bwd_d64: WsBwdTiles | None = None  #: at head dim 64 (None: as ``fwd_d64``)

    def __post_init__(self) -> None:
        if not isinstance(self.recipe, Recipe):
            raise TypeError(f"recipe must be a dmref.recipes.Recipe, got {type(self.recipe).__name__}")
        for name, default in (("fwd", default_fwd_tiles), ("bwd", default_bwd_tiles),
                              ("ws_bwd", default_ws_bwd_tiles)):
            if getattr(self, name) is None:  # the defaults, resolved once (frozen: set as dataclasses do)
                object.__setattr__(self, name, default(self.recipe, 128))
                if getattr(self, f"{name}_d64") is None and default(self.recipe, 64) != getattr(self, name):
                    object.__setattr__(self, f"{name}_d64", default(self.recipe, 64))
        for tiles in {self.fwd, self.fwd_d64 or self.fwd}:
            reason = fwd_refusal(self.recipe, tiles)
            if reason is not None:
                raise ValueError(f"the forward kernel of recipe {self.recipe.name!r} does not run this tiling: {reason}")
        for tiles in {self.bwd, self.bwd_d64 or self.bwd}:
            reason = unsupported(self.recipe, tiles)
            if reason is not None:
                raise ValueError(f"the kernels do not run recipe {self.recipe.name!r}: {reason}")

    @property
    def name(self) -> str:
        """The recipe's name: one name for one numerics (for the specs of :data:`SPECS`,
        ``dmref.get_recipe(name)`` is ``recipe``)."""
        return self.recipe.name

    @staticmethod
    def unsupported(recipe, bwd: BwdTiles | None = None) -> str | None:
        """None if the kernels run ``recipe``, else why not (:func:`unsupported`)."""
        return unsupported(recipe, bwd)

    # ---- derived from the recipe ---------------------------------------------------------------
    @property
    def matched(self) -> bool:
        """Whether the delta is matched with the dq kernel's deferred dQ (``recipe.delta.deferred_dq``
        is set): what the dq kernels (``bwd``, ``bwd_ws``) read; False for the stale delta and for
        :attr:`prepass`."""
        return self.recipe.delta.deferred_dq is not None

    @property
    def prepass(self) -> bool:
        """Whether the delta is matched with D from a pre-pass (``recipe.delta`` is ``MATCHED``, no
        deferred dQ; the ``kernels_*delta_prepass`` recipes): the backward is ``bwd_prepass`` then the
        five-GEMM ``bwd_fused``; the dq and dkdv kernels refuse it."""
        return self.recipe.delta == MATCHED

    @property
    def dsq_row(self) -> bool:
        """Whether dS for dQ is scaled once per query over all keys from the pre-pass's bound of
        its amax and K for dQ once per head (``recipe.ds_dq_bound``;
        ``kernels_folded_delta_prepass_dsq_row``): the pre-pass also returns the bound
        (``bwd_prepass.delta(bound=True)``, ``bwd_ws.prepass(bound=True)``), the folded
        quantization writes K's transposed copy with the head's scale, and the five-GEMM
        kernels take the bound (``dsq_bound``)."""
        return self.recipe.ds_dq_bound

    @property
    def folded(self) -> bool:
        """Whether the forward is the warp-specialized one (``fwd_ws``): K scaled per head
        (``recipe.k.granularity`` is HEAD) and V per head and channel."""
        return self.recipe.k.granularity is Granularity.HEAD

    @property
    def p_scale_log2(self) -> int:
        """log2 of P's fixed scale in both passes (``recipe.p_fwd.offset_log2``, equal to
        ``recipe.p_bwd.offset_log2``)."""
        return self.recipe.p_fwd.offset_log2

    # ---- tilings -------------------------------------------------------------------------------
    def with_tiles(self, fwd: FwdTiles | None = None, bwd: BwdTiles | None = None,
                   ws_bwd: WsBwdTiles | None = None) -> "KernelSpec":
        """The spec with these tilings (a given tiling applies to every head dim). A backward
        tiling that quantizes dS, promotes or tiles kbar otherwise refits the recipe to it
        (:func:`fit_to_tiles`) under a name of its own, ``<name>_tiles<block_m1>x<block_n2>``."""
        recipe = self.recipe
        if bwd is not None and fit_to_tiles(recipe, bwd) != recipe:
            recipe = dataclasses.replace(fit_to_tiles(recipe, bwd), name=f"{self.name}_tiles{bwd.block_m1}x{bwd.block_n2}")
        return dataclasses.replace(self, recipe=recipe, fwd=fwd or self.fwd, bwd=bwd or self.bwd,
                                   ws_bwd=ws_bwd or self.ws_bwd,
                                   fwd_d64=None if fwd is not None else self.fwd_d64,
                                   bwd_d64=None if bwd is not None else self.bwd_d64,
                                   ws_bwd_d64=None if ws_bwd is not None else self.ws_bwd_d64)

    def fwd_tiles(self, head_dim: int) -> FwdTiles:
        """The forward tiling used at ``head_dim``."""
        return self.fwd_d64 if (head_dim == 64 and self.fwd_d64 is not None) else self.fwd

    def bwd_tiles(self, head_dim: int) -> BwdTiles:
        """The backward tiling used at ``head_dim``."""
        return self.bwd_d64 if (head_dim == 64 and self.bwd_d64 is not None) else self.bwd

    def ws_bwd_tiles(self, head_dim: int) -> WsBwdTiles:
        """The Gluon backward's schedule used at ``head_dim``."""
        return self.ws_bwd_d64 if (head_dim == 64 and self.ws_bwd_d64 is not None) else self.ws_bwd

    def reference_recipe(self, accumulation: str = "hopper") -> Recipe:
        """``recipe`` for the emulated reference ``dmref.tiled`` under ``accumulation``:
        ``"hopper"`` for the H200 (``recipe`` itself), ``"fp32"`` for Triton's interpreter (every
        matmul in float32: ``recipe.with_accumulation("fp32")``, named ``<name>@fp32``)."""
        from dmref.emulation import MatmulModel

        if MatmulModel.get(accumulation) == MatmulModel.get("hopper"):
            return self.recipe
        return self.recipe.with_accumulation(accumulation)


#: The specs the kernels ship, one per Recipe of :data:`dmref.recipes.kernels.KERNEL_RECIPES`, by
#: its name; ``dmref.get_recipe(name)`` is the ``recipe`` of each.
SPECS: dict[str, KernelSpec] = {name: KernelSpec(recipe) for name, recipe in KERNEL_RECIPES.items()}
RECIPES = SPECS  #: deprecated alias of :data:`SPECS`

#: The recipe ``dmref.kernels.attention`` and ``api``'s functions run when none is named: the
#: matched delta with folded K and V scales. On a Hopper GPU its forward is the warp-specialized
#: Gluon kernel, faster with its quantization than the Triton forward of ``kernels_delta_matching``
#: at every shape of the bench, end to end too (the backward is the same eight-GEMM one), and as
#: accurate (docs/kernels_speed.md, "Which recipe is the default"); elsewhere (Triton's
#: interpreter) and for debug dumps the Triton forward runs it on the same folded scales.
DEFAULT_RECIPE = "kernels_folded_delta_matching"


def _suggestion(recipe: Recipe) -> str:
    """The shipped spec of the same delta (and forward) as ``recipe``."""
    folded = recipe.k.granularity is Granularity.HEAD
    matched = recipe.delta.kind is DeltaKind.MATCHED
    return f"kernels_{'folded_' if folded else ''}{'delta_matching' if matched else 'naive_fp8'}"


def _not_run(recipe: Recipe) -> ValueError:
    """One line: the kernel recipe to use instead of ``recipe``, and the first thing that differs."""
    first, *rest = _differences(recipe, BwdTiles())
    more = f" (and {len(rest)} more: KernelSpec.unsupported(recipe))" if rest else ""
    suggest = _suggestion(recipe)
    return ValueError(f"the kernels do not run recipe {recipe.name!r}; use {suggest!r} "
                      f"(dmref.get_recipe({suggest!r}) is its Recipe). First difference{more}: {first}")


def get_spec(recipe: "str | Recipe | KernelSpec") -> KernelSpec:
    """The spec the kernels run for ``recipe``: a name of :data:`SPECS`, a ``KernelSpec``, or a
    ``dmref.recipes.Recipe`` the kernels run (the shipped spec holding it, else a spec with the
    default tilings). Raises ValueError with the reason for a recipe or preset name the kernels
    do not run, naming the kernel recipe to use."""
    if isinstance(recipe, KernelSpec):
        return recipe
    if isinstance(recipe, Recipe):
        for spec in SPECS.values():
            if spec.recipe == recipe:
                return spec
        if _differences(recipe, BwdTiles()):
            raise _not_run(recipe)
        return KernelSpec(recipe)
    if not isinstance(recipe, str):
        raise TypeError(f"recipe must be a name, a Recipe or a KernelSpec, got {type(recipe).__name__}")
    if recipe in SPECS:
        return SPECS[recipe]
    if recipe in PRESETS:
        return get_spec(PRESETS[recipe])
    raise ValueError(f"recipe={recipe!r} is not one of the kernels' recipes {sorted(SPECS)}")


get_recipe = get_spec  #: deprecated alias of :func:`get_spec`
