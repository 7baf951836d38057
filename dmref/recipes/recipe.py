"""Recipes: what a given FP8 attention implementation does, written down as data.

A :class:`Recipe` names, for every quantization point of the seven attention matmuls, the format,
the scale granularity, the scale rule and the rounding; the accumulation model of each matmul; how
P is scaled before it is quantized; what the forward normalizes by; the delta strategy; and the
tile sizes. The emulated reference (:mod:`dmref.tiled`) and every kernel take the same object.

The seven matmuls and their quantization points (field names in brackets)::

    forward    S  = Q Kᵀ      [q, k]        contraction over the head dim d
               O  = P V       [p, v]        contraction over the keys j
    backward   S  = Q Kᵀ      [q, k]        the recompute: the very same operands (assumption A1)
               dP = dO Vᵀ     [do_dp, v_dp] contraction over d
               dV = Pᵀ dO     [p_dv, do_dv] contraction over the queries i
               dQ = dS K      [ds_dq, k_dq] contraction over j
               dK = dSᵀ Q     [ds_dk, q_dk] contraction over i

Scale granularities are stated relative to the contraction of the matmul the operand enters
(see :class:`Granularity`), so "V blocked along the sequence in the forward and along the head dim
in the backward" (source 4 of dmref/proofs/stale_delta.md) is simply ``v`` and ``v_dp`` with the same granularity.

The vocabulary is the emulation's (:mod:`dmref.emulation`): a point's format is a
:class:`~dmref.emulation.Format`, its scale rule a :class:`~dmref.emulation.ScaleRule`, its
rounding a :class:`~dmref.emulation.Rounding`, its blocks an emulation :class:`~dmref.emulation.Block`
(:attr:`Granularity.block`), and a matmul's accumulation a :class:`~dmref.emulation.MatmulModel`.
Names (``"float8_e4m3fn"``, ``"pow2_down"``, ``"hopper-p64"``) are accepted where a user writes a
recipe (the constructors below, :func:`get_recipe`) and turned into those types there.
"""

from __future__ import annotations

import difflib
import enum
from dataclasses import dataclass, field, replace

from .emulation.blocked import Block, ScaleRule
from .emulation.formats import BFLOAT16, FLOAT8_E4M3FN, FLOAT8_E5M2, FLOAT16, Format, Rounding, check_bool, get_format, get_rounding
from .emulation.gemm import Accumulation, MatmulModel

__all__ = [
    "DeferredDq",
    "DeltaKind",
    "DeltaStrategy",
    "Granularity",
    "MatmulModel",
    "MatmulModels",
    "Normalizer",
    "PReference",
    "PScaling",
    "PRESETS",
    "DELTA_STUDY",
    "QuantPoint",
    "Recipe",
    "ScaleRule",
    "Tiles",
    "get_recipe",
    "kernel_recipes",
    "with_prepass_delta",
    "MATMULS",
    "NONE",
    "STALE",
    "STALE_FP8_DO",
    "STALE_UNROUNDED",
    "MATCHED",
    "CONSISTENT_P",
]


class Granularity(enum.Enum):
    """Which elements share one scale. "Row" and "contraction" refer to the operand laid out as
    (rows, contraction) for the matmul it enters; batch and heads are always separate rows."""

    TENSOR = "tensor"  #: one scale for the whole operand, across batch and heads (cuDNN per-tensor)
    HEAD = "head"  #: one scale per batch element and head, over all its rows and contraction (FA3's descales)
    ROW = "row"  #: one scale per row, over the whole contraction
    TILE_1x128 = "1x128"  #: one scale per row and 128 consecutive contraction elements (DeepSeek-V3 activations)
    TILE_1x64 = "1x64"  #: one scale per row and 64 consecutive contraction elements (dmref.kernels' dS at 64-wide tiles)
    BLOCK_128x128 = "128x128"  #: one scale per 128 rows x 128 contraction elements; transpose-invariant
    MX32 = "mx32"  #: one scale per row and 32 consecutive contraction elements (OCP MX v1.0)

    @property
    def block(self) -> Block:
        """The emulation's :class:`~dmref.emulation.Block` of this granularity on the operand
        laid out as (rows, contraction)."""
        if self is Granularity.TENSOR:
            return Block.tensor()
        if self is Granularity.HEAD:
            return Block.matrix()
        if self is Granularity.ROW:
            return Block.rows()
        return Block.tile(*_TILE_EXTENTS[self])

    @property
    def contraction_extent(self) -> int | None:
        """Contraction elements per scale block; None for TENSOR and ROW (the whole contraction)."""
        return self.block.block_cols if self not in (Granularity.TENSOR, Granularity.HEAD, Granularity.ROW) else None


_TILE_EXTENTS = {
    Granularity.TILE_1x128: (1, 128),
    Granularity.TILE_1x64: (1, 64),
    Granularity.BLOCK_128x128: (128, 128),
    Granularity.MX32: (1, 32),
}


@dataclass(frozen=True)
class QuantPoint:
    """One operand of one matmul: how it is rounded before the matmul sees it.

    ``fmt=None`` means the operand is not rounded: the matmul sees it in the recipe's working
    precision. ``fmt`` is a :class:`~dmref.emulation.Format` (a format name, ``"float8_e4m3fn"``,
    ``"e5m2"``, ``"bfloat16"`` ..., is turned into one), ``rounding`` a
    :class:`~dmref.emulation.Rounding` (or its value), ``scale_rule`` a
    :class:`~dmref.emulation.ScaleRule` (or its value). ``saturate=True`` is ``satfinite``:
    overflow clamps to +-fmt.max (what ``cvt.rn.satfinite`` and torch's e4m3fn cast do).
    """

    fmt: Format | None = None
    granularity: Granularity = Granularity.TENSOR
    scale_rule: ScaleRule = ScaleRule.FIXED
    rounding: Rounding = Rounding.NEAREST_EVEN
    saturate: bool = True

    def __post_init__(self):
        if self.fmt is not None:
            object.__setattr__(self, "fmt", get_format(self.fmt))
        object.__setattr__(self, "granularity", Granularity(self.granularity))
        object.__setattr__(self, "scale_rule", ScaleRule.get(self.scale_rule))
        object.__setattr__(self, "rounding", get_rounding(self.rounding))
        object.__setattr__(self, "saturate", check_bool(self.saturate, "saturate"))

    @property
    def quantized(self) -> bool:
        return self.fmt is not None

    def describe(self) -> str:
        """One line, as in the marker comments: ``E4M3, 1x128, pow2_down, RNE, satfinite``."""
        if self.fmt is None:
            return "not rounded"
        rnd = "RNE" if self.rounding is Rounding.NEAREST_EVEN else self.rounding.value
        sat = "satfinite" if self.saturate else "overflow per format"
        return f"{self.fmt.short_name}, {self.granularity.value}, {self.scale_rule.value}, {rnd}, {sat}"


#: The operand is used as it is.
NONE = QuantPoint()


class PReference(enum.Enum):
    """What P is computed against before it is quantized (all in base 2: x = S * log2(e))."""

    RUNNING_MAX = "running_max"  #: forward: p = 2^(x - m), m the running row max over the key tiles seen so far (FlashAttention)
    POW2_RUNNING_MAX = "pow2_running_max"  #: forward: p = 2^(x - k), k = ceil(m) an integer, so rescaling between tiles is by exact powers of two
    LSE = "lse"  #: backward: P = 2^(x - lse), lse = m + log2(l) saved by the forward
    SAVED_MAX = "saved_max"  #: backward: p = 2^(x - k) with the forward's final reference k, normalized by the forward's l (consistent P)


@dataclass(frozen=True)
class PScaling:
    """How P is formed before its quantization point.

    P enters its quantization point multiplied by 2^offset_log2 (FlashAttention-3 uses 8, so
    P in (0, 1] lands in (0, 256] inside E4M3's range with ``ScaleRule.FIXED``); the matmul sees
    the dequantized value times 2^-offset_log2, i.e. P in probability units. With a dynamic
    power-of-two scale rule the offset changes nothing (Q(2^k x) = 2^k Q(x) for those rules).
    """

    reference: PReference
    offset_log2: int = 0


class Normalizer(enum.Enum):
    """What the forward divides the P V accumulator by."""

    FP32_SUM = "fp32_sum"  #: l = sum_j p_ij of the unquantized p (FlashAttention; with quantized P the weights sum to != 1)
    QUANTIZED_SUM = "quantized_sum"  #: l = sum_j p~_ij of the quantized p actually multiplied into V


class DeltaKind(enum.Enum):
    """How D_i, the row constant in dS = P * (dP - D), is computed. Equations in dmref/tiled.py."""

    STALE = "stale"  #: D_i = sum_d dO'_id O'_id from the saved O (FlashAttention-2 preprocess; cuDNN per-tensor)
    MATCHED = "matched"  #: D_i = sum_j P_ij dP^_ij with the very P and dP^ that form dS (Delta-Matching)
    CONSISTENT_P = "consistent_p"  #: dS uses the forward's quantized P~/l~; D_i = dO^_i . O_i with the dP matmul's dO^


@dataclass(frozen=True)
class DeferredDq:
    """A matched delta without a pre-sweep (dmref.kernels' Delta-Matching). The one sweep that
    accumulates D_i = sum_j P_ij dP^_ij cannot wait for it, so dQ is formed with a stale D as
    predictor and corrected once the row is complete; dK still uses the final D::

        dQ_i   = scale [ sum_j Q(P_ij (dP^_ij - Dst_i)) K^_j  -  (D_i - Dst_i) u kbar_i ]
        kbar_i = fl_acc( kbar_i + fl_tile( sum_{j in tile} Q_kbar(P_ij) K^_j / u ) )   per key tile

    The rounding of ``Q(P (dP^ - Dst))`` is that of ``ds_dq``; only the row sums of dS change
    (see dmref/proofs/delta_matching.md, "Deferred dQ"). ``u`` is the largest of the key/value head's
    K scales under ``k_dq``'s format, rule and blocks: kbar is a convex combination of keys, so in
    units of u its magnitude stays below the format's max and a float16 accumulator cannot
    overflow, whatever K's magnitude.

    ``predictor``: the stale strategy giving Dst. ``p``: P's point in kbar (P enters it as
    P * 2^p_offset_log2). ``tile``: keys per kbar matmul; each tile's float32 sum is rounded to
    ``tile_result`` (a model of the kernels' float16 wgmma chain: its internal roundings are
    not modelled, and they are multiplied by D - Dst). ``accumulator``: kbar's running sum,
    rounded after every tile.
    """

    predictor: "DeltaStrategy"
    p: QuantPoint
    p_offset_log2: int
    tile: int
    tile_result: QuantPoint
    accumulator: QuantPoint

    def __post_init__(self):
        if self.predictor.kind is not DeltaKind.STALE:
            raise ValueError(f"DeferredDq.predictor must be a STALE delta, got {self.predictor.kind}")
        if not isinstance(self.tile, int) or self.tile <= 0 or 128 % self.tile:
            raise ValueError(f"DeferredDq.tile={self.tile!r} must divide the reference's 128-key tiles")
        if self.p.quantized and self.p.scale_rule.is_dynamic:
            raise ValueError("DeferredDq.p: kbar's P is formed tile by tile against LSE; use ScaleRule.FIXED")


@dataclass(frozen=True)
class DeltaStrategy:
    """A delta strategy. ``do`` and ``o`` say how dO and the saved O are rounded as they enter a
    STALE delta (the other kinds take their operands from the dP matmul and ignore them).
    ``deferred_dq`` (MATCHED only): dQ by deferred correction, see :class:`DeferredDq`."""

    kind: DeltaKind
    do: QuantPoint = NONE
    o: QuantPoint = NONE
    deferred_dq: DeferredDq | None = None

    def __post_init__(self):
        if self.deferred_dq is not None and self.kind is not DeltaKind.MATCHED:
            raise ValueError(f"deferred_dq needs a MATCHED delta, got {self.kind}")

    @property
    def name(self) -> str:
        if self.kind is DeltaKind.STALE:
            return "stale_fp8_do" if self.do.quantized and self.do.fmt.is_fp8 else "stale"
        if self.deferred_dq is not None:
            return "matched_deferred"
        return self.kind.value


_BF16 = QuantPoint(BFLOAT16)
_E5M2_TENSOR = QuantPoint(FLOAT8_E5M2, Granularity.TENSOR, ScaleRule.AMAX)
_E4M3_TENSOR = QuantPoint(FLOAT8_E4M3FN, Granularity.TENSOR, ScaleRule.AMAX)

#: D_i = rowsum(dO ∘ O) with BF16 dO and the saved O (FlashAttention-2/3, cuDNN MXFP8).
STALE = DeltaStrategy(DeltaKind.STALE, do=_BF16)
#: D_i = descale_dO descale_O rowsum(dO_fp8 ∘ O_fp8), per-tensor scales (cuDNN FP8 backward).
STALE_FP8_DO = DeltaStrategy(DeltaKind.STALE, do=_E5M2_TENSOR, o=_E4M3_TENSOR)
#: Delta-Matching.
MATCHED = DeltaStrategy(DeltaKind.MATCHED)
#: Consistent P.
CONSISTENT_P = DeltaStrategy(DeltaKind.CONSISTENT_P)
#: D from unrounded dO and O: the exact preset's FlashAttention-2 delta.
STALE_UNROUNDED = DeltaStrategy(DeltaKind.STALE)

#: The seven matmuls, by the names used in :class:`MatmulModels`.
MATMULS = ("qk", "pv", "qk_bwd", "dp", "dv", "dq", "dk")

_FP32 = MatmulModel()


@dataclass(frozen=True)
class MatmulModels:
    """The accumulation model of each matmul, by name: a :class:`~dmref.emulation.MatmulModel`
    (a name such as ``"fp32"``, ``"float64"``, ``"exact"``, ``"hopper"``, ``"hopper-p64"`` is
    turned into one).

    In :mod:`dmref.tiled`: ``fp32`` is torch's float32 matmul of the dequantized operands (each
    product is exact when both operands have at most 12 significant bits, as FP8 and BF16
    values with power-of-two scales do; the summation order is torch's); ``float64`` a float64
    matmul kept in float64 (the exact preset); ``exact`` a float64 matmul rounded once to
    float32; ``hopper`` the emulated GEMM of :mod:`dmref.emulation` (its promotion interval too).
    """

    qk: MatmulModel = _FP32
    pv: MatmulModel = _FP32
    qk_bwd: MatmulModel = _FP32
    dp: MatmulModel = _FP32
    dv: MatmulModel = _FP32
    dq: MatmulModel = _FP32
    dk: MatmulModel = _FP32

    def __post_init__(self):
        for m in MATMULS:
            object.__setattr__(self, m, MatmulModel.get(getattr(self, m)))

    @classmethod
    def all(cls, model: MatmulModel | str) -> "MatmulModels":
        return cls(**{m: model for m in MATMULS})

    def models(self) -> set[MatmulModel]:
        return {getattr(self, m) for m in MATMULS}


@dataclass(frozen=True)
class Tiles:
    """Tile sizes of the kernel the recipe describes.

    The forward's online softmax rescales once per ``block_k`` keys (this changes the running
    max P is quantized against). Both sizes must be multiples of 128 so that every scale block
    (1x128, 128x128, MX-32) lies inside one tile. The emulation processes all query rows of a key
    tile at once; since rows are independent this equals any ``block_q`` that is a multiple of 128.
    """

    block_q: int = 128
    block_k: int = 128

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0 or value % 128:
                raise ValueError(f"Tiles.{name}={value!r} must be a positive multiple of 128")


@dataclass(frozen=True)
class Recipe:
    """Everything that decides the numbers of one FP8 attention implementation."""

    name: str
    # forward: S = Q Kᵀ (and its backward recompute), O = P V
    q: QuantPoint = NONE
    k: QuantPoint = NONE
    v: QuantPoint = NONE
    p: QuantPoint = NONE
    o: QuantPoint = NONE  #: O as returned and saved for the backward
    # backward
    do_dp: QuantPoint = NONE
    v_dp: QuantPoint = NONE
    p_dv: QuantPoint = NONE
    do_dv: QuantPoint = NONE
    ds_dq: QuantPoint = NONE
    k_dq: QuantPoint = NONE
    ds_dk: QuantPoint = NONE
    q_dk: QuantPoint = NONE
    accumulation: MatmulModels = field(default_factory=MatmulModels)
    p_fwd: PScaling = PScaling(PReference.RUNNING_MAX)
    p_bwd: PScaling = PScaling(PReference.LSE)
    normalizer: Normalizer = Normalizer.FP32_SUM
    delta: DeltaStrategy = STALE
    tiles: Tiles = field(default_factory=Tiles)
    precision: str = "float32"  #: working precision of everything outside the matmuls
    #: PV's accumulator runs on across the forward's key tiles: each tile's P~ V^ is accumulated
    #: into fl(alpha acc), as a wgmma chain with C = alpha acc does (FA3's forward); False: each
    #: tile's P~ V^ is formed from zero and added to fl(alpha acc) in the working precision (a
    #: promotion per tile). The two differ only under the ``hopper`` model of ``accumulation.pv``.
    pv_chain: bool = False

    def __post_init__(self):
        object.__setattr__(self, "pv_chain", check_bool(self.pv_chain, "Recipe.pv_chain"))
        if self.precision not in ("float32", "float64"):
            raise ValueError(f"Recipe.precision={self.precision!r} must be 'float32' or 'float64'")
        if self.p_fwd.reference not in (PReference.RUNNING_MAX, PReference.POW2_RUNNING_MAX):
            raise ValueError(f"Recipe.p_fwd.reference={self.p_fwd.reference} is not a forward reference")
        if self.p_bwd.reference not in (PReference.LSE, PReference.SAVED_MAX):
            raise ValueError(f"Recipe.p_bwd.reference={self.p_bwd.reference} is not a backward reference")
        # HEAD blocks are whole operands of one head: Q, K, V and the backward's copies of them
        for name in ("p", "p_dv", "ds_dq", "ds_dk"):
            if getattr(self, name).granularity is Granularity.HEAD:
                raise ValueError(f"recipe {self.name!r}: {name} is formed one tile at a time; "
                                 "Granularity.HEAD is for Q, K, V and dO")
        # The forward sees one key tile at a time: P's scale cannot depend on the whole row.
        if self.p.quantized and self.p.scale_rule.is_dynamic and self.p.granularity in (
            Granularity.TENSOR, Granularity.HEAD, Granularity.ROW
        ):
            raise ValueError(
                f"recipe {self.name!r}: P in the forward is quantized with {self.p.granularity.value} "
                f"granularity and a data-dependent scale ({self.p.scale_rule.value}), which no online "
                "softmax can know before the row is finished; use ScaleRule.FIXED or a tile granularity"
            )

    def points(self) -> dict[str, QuantPoint]:
        """Every quantization point by field name."""
        names = ("q", "k", "v", "p", "o", "do_dp", "v_dp", "p_dv", "do_dv", "ds_dq", "k_dq", "ds_dk", "q_dk")
        return {n: getattr(self, n) for n in names}

    def with_accumulation(self, model: MatmulModel | str) -> "Recipe":
        """The same recipe with every matmul accumulated under ``model`` (e.g. ``"hopper"``)."""
        model = MatmulModel.get(model)
        return replace(self, name=f"{self.name}@{model.name}", accumulation=MatmulModels.all(model))

    def describe(self) -> str:
        lines = [f"recipe {self.name}"]
        for name, point in self.points().items():
            lines.append(f"  {name:6s} {point.describe()}")
        lines.append(f"  P fwd  {self.p_fwd.reference.value}, offset 2^{self.p_fwd.offset_log2}")
        lines.append(f"  P bwd  {self.p_bwd.reference.value}, offset 2^{self.p_bwd.offset_log2}")
        lines.append(f"  norm   {self.normalizer.value}")
        lines.append(f"  delta  {self.delta.name}")
        acc = ", ".join(f"{m}={getattr(self.accumulation, m).name}" for m in MATMULS)
        lines.append(f"  accum  {acc}" + (", PV chained across key tiles" if self.pv_chain else ""))
        lines.append(f"  tiles  {self.tiles.block_q}x{self.tiles.block_k}, working precision {self.precision}")
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Presets
# ----------------------------------------------------------------------------------------------


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
# accumulates as Hopper's FP8 wgmma does (dmref.attention_replay applies all of these).
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
    ``kernels_naive_fp8``, ``kernels_folded_delta_matching``, ``kernels_folded_naive_fp8``):
    each is the ``recipe`` of ``dmref.kernels.RECIPES[name]`` (its config imports no triton)."""
    from dmref.kernels.config import RECIPES as SPECS

    return {name: spec.recipe for name, spec in SPECS.items()}


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
        kernels = kernel_recipes()
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
