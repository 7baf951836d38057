"""The GEMM model as data: how a matmul sums its products (:class:`Accumulation`), the rules of
one FP8 wgmma k-step (:class:`WgmmaRules`, :data:`HOPPER`), the accumulation model of a recipe's
matmul (:class:`MatmulModel`), the ``matmul`` keywords of real kernels' K loops
(:func:`triton_dot_schedule`, :func:`cublas_schedule`) and the K tiles such a loop runs
(:func:`plan_k_tiles`).

Plain Python: it imports no torch, so the model can be read, compared and checked without it
(tests/test_import_graph.py checks that). The engine that runs it is
:mod:`dmref.emulation.gemm.engine`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..constants import WGMMA_K_STEP, WGMMA_RESULT_BITS, WGMMA_TERM_FRAC_BITS
from ..formats import Rounding, check_bool


class Accumulation(enum.Enum):
    """How the products are summed."""

    EXACT = "exact"  #: exact products and sum, rounded once to float32
    FP32 = "fp32"  #: float32 adds, one product at a time, k increasing, starting from c
    HOPPER = "hopper"  #: Hopper FP8 wgmma k-steps (WgmmaRules), with the kernel's promotion


@dataclass(frozen=True)
class WgmmaRules:
    """The rules of one FP8 wgmma k-step. :data:`HOPPER` is the measured H100/H200 behaviour;
    each field can be flipped to show which captured case then fails (docs/gemm.md)."""

    k_step: int = WGMMA_K_STEP  #: products per wgmma k-step
    term_frac_bits: int = WGMMA_TERM_FRAC_BITS  #: fraction bits kept of every term, relative to 2**E
    result_bits: int = WGMMA_RESULT_BITS  #: significant bits of a step's result
    term_rounding: Rounding = Rounding.TOWARD_ZERO  #: how terms lose their low bits
    result_rounding: Rounding = Rounding.TOWARD_ZERO  #: how the result loses its low bits
    accumulator_in_max: bool = True  #: the accumulator's exponent takes part in E
    truncate_accumulator: bool = True  #: the accumulator is truncated like a product
    subnormals_at_emin: bool = True  #: a subnormal operand has exponent emin (significand < 1)
    subnormal_accumulator_at_emin: bool = True  #: a float32 subnormal C has exponent -126
    zeros_in_max: bool = False  #: zero products (exponent emin) take part in E
    normalised_products: bool = False  #: a product's exponent is floor(log2|ab|), not ea + eb

    def __post_init__(self):
        for name in ("term_rounding", "result_rounding"):
            r = Rounding(getattr(self, name))
            if r not in (Rounding.TOWARD_ZERO, Rounding.NEAREST_EVEN):
                raise ValueError(f"{name}={r.value!r}: only toward_zero and nearest_even exist here")
            object.__setattr__(self, name, r)
        if self.k_step <= 0 or self.k_step & (self.k_step - 1):
            raise ValueError(f"k_step={self.k_step} must be a power of two")
        if not 1 <= self.result_bits <= 24:
            raise ValueError(f"result_bits={self.result_bits} must be in 1..24")


#: The Hopper (sm_90) FP8 wgmma, as measured on an H200 (docs/gemm.md).
HOPPER = WgmmaRules()


@dataclass(frozen=True)
class MatmulModel:
    """How one matmul of an attention recipe sums its products: an :class:`Accumulation` and,
    for ``HOPPER``, the kernel's promotion interval and wgmma rules.

    - ``EXACT``: exact products and sum, rounded once to float32; with ``float64_result`` the
      sum is kept in float64 (the ``exact`` preset's reference arithmetic).
    - ``FP32``: float32 additions of exact products (the error bound is gamma_K whatever the
      order; :func:`~dmref.emulation.gemm.matmul` adds in k order, ``dmref.tiled`` in torch's order).
    - ``HOPPER``: the wgmma k-steps of ``rules``, promoted to float32 every ``promote_every``
      products (None: one chain per scale block).

    ``MatmulModel.get`` reads the names of the user's edge: ``"fp32"``, ``"exact"``,
    ``"float64"``, ``"hopper"``, ``"hopper-p64"`` (promotion every 64 products); ``name`` writes
    them back.
    """

    accumulation: Accumulation = Accumulation.FP32
    promote_every: int | None = None
    float64_result: bool = False
    rules: WgmmaRules = HOPPER

    def __post_init__(self):
        object.__setattr__(self, "accumulation", Accumulation(self.accumulation))
        object.__setattr__(self, "float64_result", check_bool(self.float64_result, "float64_result"))
        if self.promote_every is not None:
            if self.accumulation is not Accumulation.HOPPER:
                raise ValueError(f"promote_every={self.promote_every} describes a wgmma kernel; "
                                 f"the {self.accumulation.value!r} model is defined on the whole sum")
            if self.promote_every <= 0 or self.promote_every % self.rules.k_step:
                raise ValueError(f"promote_every={self.promote_every} must be a positive multiple of "
                                 f"the k-step {self.rules.k_step}")
        if self.float64_result and self.accumulation is not Accumulation.EXACT:
            raise ValueError(f"float64_result needs the exact model, got {self.accumulation.value!r}")

    @property
    def name(self) -> str:
        if self.float64_result:
            return "float64"
        if self.promote_every is not None:
            return f"{self.accumulation.value}-p{self.promote_every}"
        return self.accumulation.value

    def __str__(self) -> str:
        return self.name

    @classmethod
    def get(cls, model: "MatmulModel | Accumulation | str") -> "MatmulModel":
        """The model for itself, an :class:`Accumulation`, or a name (class docstring)."""
        if isinstance(model, MatmulModel):
            return model
        if isinstance(model, Accumulation):
            return cls(model)
        if not isinstance(model, str):
            raise TypeError(f"an accumulation model is a MatmulModel or a name, got {type(model).__name__}")
        if model == "float64":
            return cls(Accumulation.EXACT, float64_result=True)
        base, sep, promote = model.partition("-p")
        try:
            acc = Accumulation(base)
            every = int(promote) if sep else None
        except ValueError:
            known = "'exact', 'float64', 'fp32', 'hopper', 'hopper-p<N>'"
            raise ValueError(f"unknown accumulation model {model!r}; known: {known}") from None
        return cls(acc, every)


def triton_dot_schedule(block_k: int, max_num_imprecise_acc: int | None = None,
                        chain: bool = True) -> dict:
    """``matmul`` keywords for a Triton K loop over ``block_k`` tiles:
    ``acc = tl.dot(a, b, acc, max_num_imprecise_acc=N)`` (chain) or ``acc += tl.dot(a, b)``.
    ``None`` is Triton's FP8 default on sm_90 (2**30: never promote). Triton refuses
    ``max_num_imprecise_acc > block_k`` at compile time (seen on the H200 with Triton 3.6)."""
    if max_num_imprecise_acc is not None and max_num_imprecise_acc > block_k:
        raise ValueError(f"{max_num_imprecise_acc=} > {block_k=}: Triton rejects this schedule "
                         "('max_num_imprecise_acc must be <= K')")
    return {"tile_k": block_k, "promote_every": max_num_imprecise_acc, "chain": check_bool(chain, "chain")}


def cublas_schedule(use_fast_accum: bool) -> dict:
    """``matmul`` keywords for ``torch._scaled_mm`` on Hopper: fast accumulation is one
    unpromoted chain; without it cuBLAS promotes every 128 products (measured on an H200)."""
    return {"promote_every": None if check_bool(use_fast_accum, "use_fast_accum") else 128}


@dataclass(frozen=True)
class KTile:
    """One ``tile_k`` tile of a hopper kernel's K loop, products [k0, k1)."""

    k0: int
    k1: int
    segments: tuple[tuple[int, int], ...] | None  #: partial-accumulator spans; None: none


def plan_k_tiles(k_padded: int, k_step: int, promote_every: int | None, tile_k: int | None) -> list[KTile]:
    """The K loop of a hopper kernel: its ``tile_k`` tiles over ``k_padded`` products, each with
    the spans of its partial accumulators (``promote_every``; None: the tile is one chain)."""
    for name, v in (("promote_every", promote_every), ("tile_k", tile_k)):
        if v is not None and (v <= 0 or v % k_step):
            raise ValueError(f"{name}={v} must be a positive multiple of the k-step {k_step}")
    tile = tile_k or k_padded
    tiles = []
    for k0 in range(0, k_padded, tile):
        k1 = min(k_padded, k0 + tile)
        segments = None
        if promote_every is not None and promote_every <= tile:
            segments = tuple((s, min(k1, s + promote_every)) for s in range(k0, k1, promote_every))
        tiles.append(KTile(k0, k1, segments))
    return tiles


__all__ = ["Accumulation", "HOPPER", "KTile", "MatmulModel", "WgmmaRules", "cublas_schedule", "plan_k_tiles",
           "triton_dot_schedule"]
