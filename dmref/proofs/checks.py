"""The executable checks of ``dmref.proofs``, one function per claim of the Markdown.

Each returns a small result object (so a test, the demo or a notebook can print or assert on
it) and never asserts itself:

=====================================  ==========================================================
check                                  claim
=====================================  ==========================================================
:func:`check_delta_matching_exact`      Theorem 1: residual exactly 0 in rationals (A1..A5 hold)
:func:`check_assumption_necessary`      each A_k dropped alone: exactly A_k fails, residual != 0
:func:`check_stale_delta_effects`       Proposition 2: dQ, dK, row-sum changes, exactly
:func:`check_spurious_lse_gradient`     Proposition 2: stale part = grad of -sum delta LSE
:func:`check_fp32_residual_bound`       Theorem 3 / Cor. 6 / Thm 8 on the float32 pipeline
:func:`check_hopper_dot_bound`          Lemma 7 on the wgmma model
:func:`check_consistent_p`              Theorem 9 and its failures
:func:`residual_table`                  the figures: each delta strategy against the bound
=====================================  ==========================================================
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import consistent_p, fp32_pipeline, stale
from .bounds import hopper_dot_error_bound, matched_residual_coefficient
from .counterexamples import ASSUMPTIONS, BackwardCase, assumption_status, find_counterexample
from .hopper import hopper_magnitude, hopper_matmul
from .rational import ExactBackward, exact_backward

__all__ = [
    "ASSUMPTIONS",
    "check_assumption_necessary",
    "check_consistent_p",
    "check_delta_matching_exact",
    "check_fp32_residual_bound",
    "check_hopper_dot_bound",
    "check_spurious_lse_gradient",
    "check_stale_delta_effects",
    "residual_table",
]


# ----------------------------------------------------------------------------------------------
# Theorem 1 and the necessity of each assumption
# ----------------------------------------------------------------------------------------------
def check_delta_matching_exact(q, k, v, do, **kw) -> ExactBackward:
    """Run the exact matched pipeline (:func:`dmref.proofs.rational.exact_backward`); Theorem 1
    says every entry of ``.residuals`` is 0 when ``mass`` is ``normalize`` or
    ``divide_delta``."""
    return exact_backward(q, k, v, do, **kw)


@dataclass
class NecessityResult:
    name: str  #: "A1" .. "A5", or "A4-hopper"
    case: BackwardCase
    status: dict[str, bool]  #: A1..A5 evaluated on the case's data

    @property
    def dropped(self) -> list[str]:
        return [a for a, ok in self.status.items() if not ok]

    @property
    def residual(self):
        return self.case.max_abs_residual

    @property
    def shows_necessity(self) -> bool:
        """Only the named assumption fails, and the residual is not zero."""
        return self.dropped == [self.name.split("-")[0]] and self.residual != 0


def check_assumption_necessary(name: str, **kw) -> NecessityResult:
    """The generated counterexample for assumption ``name`` (``A1``..``A5``, ``A4-hopper``)."""
    case = find_counterexample(name, **kw)
    return NecessityResult(name, case, assumption_status(case))


# ----------------------------------------------------------------------------------------------
# Proposition 2
# ----------------------------------------------------------------------------------------------
def check_stale_delta_effects(seed: int = 0, **kw) -> stale.StaleEffects:
    return stale.stale_effects_exact(seed, **kw)


def check_spurious_lse_gradient(seed: int = 0, n_q: int = 5, n_k: int = 7, d: int = 16,
                                logit_scale: float = 1.0) -> stale.SpuriousGradientCheck:
    import torch

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n_q, d, generator=g, dtype=torch.float64) * logit_scale
    k = torch.randn(n_k, d, generator=g, dtype=torch.float64)
    delta = torch.randn(n_q, generator=g, dtype=torch.float64)
    return stale.spurious_lse_gradient(q, k, delta, tau=d ** -0.5)


# ----------------------------------------------------------------------------------------------
# Theorem 3, Corollary 6, Theorem 8 on the float32 pipeline
# ----------------------------------------------------------------------------------------------
@dataclass
class BoundCheck:
    strategy: str
    residual: np.ndarray  #: |r_i| per row
    bound: np.ndarray  #: the bound per row
    relative_residual: np.ndarray  #: |r_i| / A_i
    bounds_by_name: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def holds(self) -> bool:
        """Every row within the bound, and within each of the named bounds."""
        return bool(np.all(self.residual <= self.bound)) and all(
            bool(np.all(self.residual <= b)) for b in self.bounds_by_name.values())

    @property
    def worst_fraction_of_bound(self) -> float:
        """max_i |r_i| / bound_i for the main bound: how much of it is used (<= 1 if it holds)."""
        ok = self.bound > 0
        return float(np.max(self.residual[ok] / self.bound[ok], initial=0.0))


def check_fp32_residual_bound(q, k, v, do, *, delta: str = "matched", **kw) -> BoundCheck:
    """Run :func:`dmref.proofs.fp32_pipeline.fp32_backward` and compare every row with its
    bound: Theorem 3 for ``matched`` (also the a-priori form, in ``bounds_by_name``),
    Corollary 6 for ``matched_normalized``, Theorem 8 for ``operand_matched``."""
    run = fp32_pipeline.fp32_backward(q, k, v, do, delta=delta, **kw)
    names = {"matched": ("matched", "matched_a_priori"),
             "matched_normalized": ("matched_normalized",),
             "operand_matched": ("operand_matched",)}[delta]
    by_name = {name: run.bound(name) for name in names}
    return BoundCheck(delta, np.abs(run.residual), by_name[names[0]], run.relative_residual,
                      by_name)


@dataclass
class HopperDotCheck:
    error: np.ndarray  #: |hopper - exact| per output
    bound: np.ndarray  #: beta * W per output
    beta: float

    @property
    def holds(self) -> bool:
        return bool(np.all(self.error <= self.bound))

    @property
    def worst_fraction_of_bound(self) -> float:
        ok = self.bound > 0
        return float(np.max(self.error[ok] / self.bound[ok], initial=0.0))


def check_hopper_dot_bound(a, bt, fmt_a, fmt_b, promote_every: int | None = None) -> HopperDotCheck:
    """Lemma 7: the wgmma-model product of FP8 values a (M, K), bt (N, K) against the exact
    product (float64 is exact for the products; the exact sum uses math.fsum)."""
    import math

    a = np.asarray(a, dtype=np.float64)
    bt = np.asarray(bt, dtype=np.float64)
    out = hopper_matmul(a, bt, fmt_a, fmt_b, promote_every=promote_every).astype(np.float64)
    exact = np.array([[math.fsum(x * y for x, y in zip(ra, rb)) for rb in bt] for ra in a])
    beta = hopper_dot_error_bound(a.shape[1], promote_every)
    w = hopper_magnitude(a, bt, fmt_a, fmt_b)
    # W evaluated in float64 (K products, K - 1 additions): round it up
    w = w * (1.0 + (a.shape[1] + 1) * 2.0**-52)
    # |out - exact| is itself rounded to float64 (exact to within 2**-53 of itself)
    err = np.abs(out - exact) * (1.0 - 2.0**-52)
    return HopperDotCheck(err, beta * w, beta)


# ----------------------------------------------------------------------------------------------
# Theorem 9
# ----------------------------------------------------------------------------------------------
def check_consistent_p(failure: str = "", seed: int = 0, **kw) -> consistent_p.ConsistentPCase:
    """A consistent-P case: ``failure=""`` meets every condition (residual exactly 0); a key of
    :data:`dmref.proofs.consistent_p.FAILURES` gives a counterexample (first seed with a
    non-zero residual)."""
    if failure:
        return consistent_p.find_consistent_p_failure(failure, **kw)
    return consistent_p.consistent_p_case("", seed, **kw)


# ----------------------------------------------------------------------------------------------
# Figures
# ----------------------------------------------------------------------------------------------
def residual_table(seed: int = 0, *, heads: int = 4, seqlen: int = 256, head_dim: int = 64,
                   causal: bool = True, outlier_channels: int = 4, peaked: float = 1.0,
                   strategies=fp32_pipeline.DELTA_STRATEGIES,
                   dp_accumulation: str = "fp32") -> list[dict]:
    """One row per delta strategy on a realistic problem: the relative row-sum residual
    |r_i| / A_i (max, mean) and the a-priori Delta-Matching coefficient it is compared with."""
    q, k, v, do = fp32_pipeline.attention_inputs(
        seed, heads=heads, seqlen=seqlen, head_dim=head_dim,
        outlier_channels=outlier_channels, peaked=peaked)
    rows = []
    for strat in strategies:
        run = fp32_pipeline.fp32_backward(q, k, v, do, causal=causal, delta=strat,
                                          dp_accumulation=dp_accumulation)
        rel = run.relative_residual
        coef = matched_residual_coefficient(run.visible, run.row_max)
        rows.append({
            "strategy": strat,
            "dp_accumulation": dp_accumulation,
            "rel_residual_max": float(rel.max()),
            "rel_residual_mean": float(rel.mean()),
            "fp32_bound_max": float(coef.max()),
            "fraction_of_rows_above_bound": float(np.mean(rel > coef)),
        })
    return rows

