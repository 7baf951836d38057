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
recipe (the constructors below, :func:`dmref.recipes.get_recipe`) and turned into those types there.
"""

from __future__ import annotations

import difflib
import enum
from dataclasses import dataclass, field, replace

from ..emulation.blocked import Block, ScaleRule
from ..emulation.formats import BFLOAT16, FLOAT8_E4M3FN, FLOAT8_E5M2, FLOAT16, Format, Rounding, check_bool, get_format, get_rounding
from ..emulation.gemm import Accumulation, MatmulModel

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
    "QuantPoint",
    "Recipe",
    "ScaleRule",
    "Tiles",
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
    BLOCK_64x64 = "64x64"  #: one scale per 64 rows x 64 contraction elements; transpose-invariant (dS's kernel tile)
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
    Granularity.BLOCK_64x64: (64, 64),
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
    #: dS for dQ (``ds_dq``, ROW granularity: one scale per query over all keys) scaled from an
    #: upper bound of its row amax instead of the amax itself, U_i = max_j P_ij |dP^_ij| +
    #: |D_i| max_j P_ij >= max_j |P_ij (dP^_ij - D_i)|: what a pre-pass of S and dP knows, with D_i,
    #: before the main pass, so that a one-pass kernel (one CTA per key block) can quantize dS for
    #: dQ with a scale that is the same in every key block. U_i is computed in float32 and
    #: multiplied by 1 + 2^-21, which covers the rounding of dS and of U_i itself.
    ds_dq_bound: bool = False

    def __post_init__(self):
        object.__setattr__(self, "pv_chain", check_bool(self.pv_chain, "Recipe.pv_chain"))
        object.__setattr__(self, "ds_dq_bound", check_bool(self.ds_dq_bound, "Recipe.ds_dq_bound"))
        if self.ds_dq_bound and not (self.ds_dq.quantized and self.ds_dq.granularity is Granularity.ROW
                                     and self.ds_dq.scale_rule.is_dynamic):
            raise ValueError(f"recipe {self.name!r}: ds_dq_bound scales ds_dq per row from a bound of its amax; "
                             f"ds_dq is {self.ds_dq.describe()}, not a dynamically scaled ROW point")
        if self.ds_dq_bound and self.delta.deferred_dq is not None:
            raise ValueError(f"recipe {self.name!r}: ds_dq_bound needs the final D before the main pass; "
                             "the deferred dQ corrects dQ after it")
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
        if self.ds_dq_bound:
            lines.append("  ds_dq  scaled from U_i = max_j P|dP| + |D_i| max_j P (a pre-pass bound of its row amax)")
        acc = ", ".join(f"{m}={getattr(self.accumulation, m).name}" for m in MATMULS)
        lines.append(f"  accum  {acc}" + (", PV chained across key tiles" if self.pv_chain else ""))
        lines.append(f"  tiles  {self.tiles.block_q}x{self.tiles.block_k}, working precision {self.precision}")
        return "\n".join(lines)
