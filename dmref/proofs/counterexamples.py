"""Generated counterexamples: each assumption of Theorem 1, dropped alone, leaves a non-zero
row sum of dS (``delta_matching.md``, "Each assumption is necessary").

A :class:`BackwardCase` keeps apart what D was computed from and what dS was computed from, so
that :func:`assumption_status` can evaluate each assumption A1..A5 *from the data* (not from a
label), and a test can assert that exactly one of them fails. Where the residual has a closed
form, the case carries it as ``predicted`` and it must equal the residual exactly.

Every generator takes a seed and sizes; :func:`find_counterexample` walks seeds until the
residual is non-zero (a random instance can be zero by accident, e.g. a quantization that
happens to be exact), so it always returns a genuine counterexample.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from dmref.emulation import FLOAT8_E4M3FN, FLOAT8_E5M2, ScaleRule

from .rational import (
    Matrix,
    exact_backward,
    grad_scores,
    hopper_dp_exact,
    matched_delta,
    matmul_nn,
    matmul_nt,
    probabilities,
    quantize_blocked_exact,
    row_sums,
    to_fractions,
)

ASSUMPTIONS = ("A1", "A2", "A3", "A4", "A5")


@dataclass
class BackwardCase:
    """One backward row-sum experiment in exact rationals (float32 arithmetic, where used, is
    carried out exactly on float32 numbers and its results stored as rationals)."""

    assumption: str  #: the assumption this case drops ("" for none)
    description: str
    p_delta: Matrix  #: the P that D was computed with
    p_ds: Matrix  #: the P that dS was computed with
    dp_delta: Matrix
    dp_ds: Matrix
    cols_delta: list[list[bool]]  #: the (i, j) that D summed over
    cols_ds: list[list[bool]]  #: the (i, j) where dS was formed
    operands_delta: tuple  #: the quantized (dO, V, their scales) behind dp_delta
    operands_ds: tuple
    accumulation: tuple[str, str]  #: how dp_delta, dp_ds were accumulated: exact|hopper|float32
    arithmetic: str  #: of D and dS: exact | float32
    divide_by_mass: bool
    delta: list[Fraction]
    ds: Matrix
    residuals: list[Fraction]
    predicted: list[Fraction] | None = None  #: closed form of the residuals, where there is one

    @property
    def max_abs_residual(self) -> Fraction:
        return max((abs(r) for r in self.residuals), default=Fraction(0))

    @property
    def abs_products(self) -> list[Fraction]:
        """A_i = sum_j |P_ij dP_ij| over dS's columns, the scale the residual is measured in."""
        return [sum((abs(a * b) for a, b, m in zip(pr, dr, mr) if m), Fraction(0))
                for pr, dr, mr in zip(self.p_ds, self.dp_ds, self.cols_ds)]


def assumption_status(case: BackwardCase) -> dict[str, bool]:
    """Evaluate A1..A5 of ``delta_matching.md`` on the data of one case."""
    both = [[a and b for a, b in zip(ra, rb)] for ra, rb in zip(case.cols_delta, case.cols_ds)]
    a1 = all(x == y for px, py, mr in zip(case.p_delta, case.p_ds, both)
             for x, y, m in zip(px, py, mr) if m)
    a2 = case.operands_delta == case.operands_ds
    masses = [sum((v for v, m in zip(pr, mr) if m), Fraction(0)) for pr, mr in
              zip(case.p_ds, case.cols_ds)]
    a3 = case.divide_by_mass or all(s == 1 for s, mr in zip(masses, case.cols_ds) if any(mr))
    a4 = case.arithmetic == "exact" and case.accumulation == ("exact", "exact")
    a5 = case.cols_delta == case.cols_ds
    return {"A1": a1, "A2": a2, "A3": a3, "A4": a4, "A5": a5}


# ----------------------------------------------------------------------------------------------
# Random problems
# ----------------------------------------------------------------------------------------------
def random_problem(seed: int, n_q: int = 3, n_k: int = 4, d: int = 8, spread: float = 1.0):
    """q, k, v, do as float64 arrays: normal values times a per-channel lognormal scale
    (``spread`` is the log-std: 0 gives plain normal values, 2 wide exponent spreads)."""
    rng = np.random.default_rng(seed)

    def draw(rows):
        return rng.standard_normal((rows, d)) * np.exp(spread * rng.standard_normal(d))

    return draw(n_q), draw(n_k), draw(n_k), draw(n_q)


def _case_from(base, assumption, description, *, p_delta=None, dp_delta=None, cols_delta=None,
               operands_delta=None, p_ds=None, dp_ds=None, accumulation=("exact", "exact"),
               divide_by_mass=False, predicted_fn=None) -> BackwardCase:
    """Build a case from an exact matched run ``base``, replacing the given ingredients."""
    p_ds = base.p if p_ds is None else p_ds
    dp_ds = base.dp if dp_ds is None else dp_ds
    p_delta = p_ds if p_delta is None else p_delta
    dp_delta = dp_ds if dp_delta is None else dp_delta
    cols_ds = base.mask
    cols_delta = cols_ds if cols_delta is None else cols_delta
    operands = (base.do, base.v, base.do_scales, base.v_scales)
    delta = matched_delta(p_delta, dp_delta, cols_delta, divide_by_mass)
    ds = grad_scores(p_ds, dp_ds, delta, cols_ds)
    case = BackwardCase(assumption, description, p_delta, p_ds, dp_delta, dp_ds, cols_delta,
                        cols_ds, operands if operands_delta is None else operands_delta,
                        operands, accumulation, "exact", divide_by_mass, delta, ds, row_sums(ds))
    if predicted_fn is not None:
        case.predicted = predicted_fn(case)
    return case


# ----------------------------------------------------------------------------------------------
# The cases
# ----------------------------------------------------------------------------------------------
def matched_case(seed: int = 0, n_q: int = 3, n_k: int = 4, d: int = 8, mask=None,
                 **kw) -> BackwardCase:
    """All assumptions hold: the residual is exactly zero (Theorem 1)."""
    base = exact_backward(*random_problem(seed, n_q, n_k, d), mask=mask, **kw)
    return _case_from(base, "", "Delta-Matching with every assumption met")


def counterexample_a1(seed: int = 0, n_q: int = 3, n_k: int = 4, d: int = 8,
                      mask=None) -> BackwardCase:
    """A1 dropped: D uses the forward's P (FP8-quantized with a per-row power-of-two scale, then
    renormalized to unit mass), dS the recomputed P. r_i = sum_j (P_ij - P'_ij) dP_ij."""
    base = exact_backward(*random_problem(seed, n_q, n_k, d), mask=mask)
    p_fwd, _ = quantize_blocked_exact(base.p, FLOAT8_E4M3FN, n_k, ScaleRule.POW2_DOWN)
    p_fwd = probabilities_from_weights(p_fwd)
    return _case_from(
        base, "A1", "D from the forward's quantized, renormalized P; dS from the recomputed P",
        p_delta=p_fwd,
        predicted_fn=lambda c: [sum(((a - b) * x for a, b, x, m in zip(pa, pb, dr, mr) if m),
                                    Fraction(0))
                                for pa, pb, dr, mr in zip(c.p_ds, c.p_delta, c.dp_ds, c.cols_ds)])


def probabilities_from_weights(w: Matrix) -> Matrix:
    """Each row divided by its sum (rows summing to zero are left alone)."""
    return [[x / sum(row) for x in row] if sum(row) else row for row in w]


def counterexample_a2(seed: int = 0, n_q: int = 3, n_k: int = 4, d: int = 8,
                      mask=None) -> BackwardCase:
    """A2 dropped: D's dP uses the unquantized dO (the BF16 dO of a stale kernel) with the same
    V_hat. r_i = -(dO_i - dO_hat_i) . (P V_hat)_i, the delta of source 1 of stale_delta.md."""
    q, k, v, do = random_problem(seed, n_q, n_k, d)
    base = exact_backward(q, k, v, do, mask=mask)
    do_raw = to_fractions(do)
    dp_delta = matmul_nt(do_raw, base.v)

    def predicted(c):
        pv = matmul_nn(c.p_ds, base.v)
        return [-sum(((x - y) * z for x, y, z in zip(r_raw, r_hat, r_pv)), Fraction(0))
                for r_raw, r_hat, r_pv in zip(do_raw, base.do, pv)]

    return _case_from(base, "A2", "D's dP from the unquantized dO; dS's dP from the FP8 dO",
                      dp_delta=dp_delta, operands_delta=(do_raw, base.v, None, base.v_scales),
                      predicted_fn=predicted)


def counterexample_a3(seed: int = 0, n_q: int = 3, n_k: int = 4, d: int = 8,
                      mask=None) -> BackwardCase:
    """A3 dropped: P is FP8-quantized after normalization (the "P-collapse" of an unquantized
    normalizer), the same P in D and dS, D not divided by the mass. r_i = D_i (1 - sum_j P_ij).
    The problem is that of the first seed from ``seed`` on whose quantized rows do not all sum to
    exactly 1 (a few draws in a hundred happen to, and would not drop A3)."""
    for s in range(seed, seed + 1000):
        base = exact_backward(*random_problem(s, n_q, n_k, d), mask=mask)
        p_q, _ = quantize_blocked_exact(base.p, FLOAT8_E4M3FN, n_k, ScaleRule.POW2_DOWN)
        masses = [sum((x for x, m in zip(pr, mr) if m), Fraction(0)) for pr, mr in zip(p_q, base.mask)]
        if any(mass != 1 for mass, mr in zip(masses, base.mask) if any(mr)):
            break
    return _case_from(
        base, "A3", "P quantized after normalization: rows no longer sum to 1", p_ds=p_q,
        predicted_fn=lambda c: [dl * (1 - sum((x for x, m in zip(pr, mr) if m), Fraction(0)))
                                for dl, pr, mr in zip(c.delta, c.p_ds, c.cols_ds)])


def counterexample_a5(seed: int = 0, n_q: int = 4, n_k: int = 4, d: int = 8) -> BackwardCase:
    """A5 dropped: dS is causal, the pre-sweep that computes D forgets the mask and sums
    exp(S_ij - LSE_i) over future keys too. r_i = -sum_{j masked} P'_ij dP_ij."""
    base = exact_backward(*random_problem(seed, n_q, n_k, d), mask="causal")
    p_all = probabilities(base.s, base.lse, [[True] * n_k for _ in range(n_q)], mass="raw")
    p_delta = [[a if m else b for a, b, m in zip(pr, pa, mr)]
               for pr, pa, mr in zip(base.p, p_all, base.mask)]
    return _case_from(
        base, "A5", "D over every key (mask forgotten in the pre-sweep); dS causal",
        p_delta=p_delta, cols_delta=[[True] * n_k for _ in range(n_q)],
        predicted_fn=lambda c: [-sum((a * x for a, x, m in zip(pd, dr, mr) if not m), Fraction(0))
                                for pd, dr, mr in zip(c.p_delta, c.dp_ds, c.cols_ds)])


def counterexample_a4_hopper(seed: int = 0, n_q: int = 3, n_k: int = 4, d: int = 64,
                             promote_every: int | None = None) -> BackwardCase:
    """A4 dropped (accumulation): dS uses dP from the Hopper wgmma model, D is the exact
    contraction of the same quantized operands (operand-level matching, e.g. D = dO_hat.(P
    V_hat)). r_i = sum_j P_ij (dP^H_ij - dP_ij). Wide exponent spreads make the truncation bite."""
    base = exact_backward(*random_problem(seed, n_q, n_k, d, spread=2.0), block=d)
    dp_h = hopper_dp_exact(base.do, base.do_scales, base.v, base.v_scales, FLOAT8_E5M2, FLOAT8_E4M3FN,
                           promote_every)
    return _case_from(
        base, "A4", "dS from the Hopper-accumulated dP, D from the exact contraction",
        dp_ds=dp_h, dp_delta=base.dp, accumulation=("exact", "hopper"),
        predicted_fn=lambda c: [sum((a * (h - x) for a, h, x in zip(pr, hr, er)), Fraction(0))
                                for pr, hr, er in zip(c.p_ds, c.dp_ds, c.dp_delta)])


def _f32(x: Fraction) -> np.float32:
    """A rational that is a float32 number (FP8 value times a power-of-two scale, or a dyadic P
    entry), as np.float32; exact for every input used here."""
    out = np.float32(x)
    if Fraction(float(out)) != x:
        raise ValueError(f"{x} is not a float32 number")
    return out


def _fp32_dot(x: list[np.float32], y: list[np.float32]) -> np.float32:
    """Recursive float32 dot product, left to right, separate multiply and add."""
    acc = np.float32(0)
    for a, b in zip(x, y):
        acc = np.float32(acc + np.float32(a * b))
    return acc


def dyadic_unit_rows(p: Matrix, mask, frac_bits: int = 20) -> Matrix:
    """Round each visible P_ij to a multiple of 2**-frac_bits and put the rounding slack on the
    row's largest entry, so each row is float32-representable and sums to exactly 1."""
    grid = Fraction(1, 1 << frac_bits)
    out = []
    for row, mrow in zip(p, mask):
        r = [Fraction(round(x / grid)) * grid if m else Fraction(0) for x, m in zip(row, mrow)]
        if any(mrow):
            big = max(range(len(r)), key=lambda j: r[j])
            r[big] += 1 - sum(r)
        out.append(r)
    return out


def counterexample_a4_fp32(seed: int = 0, n_q: int = 3, n_k: int = 6, d: int = 8,
                           mask=None) -> BackwardCase:
    """A4 dropped (arithmetic): the whole backward in float32 (dP = fl(dO_hat V_hat^T), D, dS),
    with float32 P rows that sum to exactly 1. The same dP numbers go to D and dS. No closed
    form; Theorem 3 bounds it."""
    base = exact_backward(*random_problem(seed, n_q, n_k, d), mask=mask)
    p = dyadic_unit_rows(base.p, base.mask)
    p32 = [[_f32(x) for x in row] for row in p]
    assert all(Fraction(float(a)) == b for ra, rb in zip(p32, p) for a, b in zip(ra, rb))
    do32 = [[_f32(x) for x in row] for row in base.do]
    v32 = [[_f32(x) for x in row] for row in base.v]
    dp32 = [[_fp32_dot(r, c) for c in v32] for r in do32]
    delta32 = [_fp32_dot([a if m else np.float32(0) for a, m in zip(pr, mr)], dr)
               for pr, dr, mr in zip(p32, dp32, base.mask)]
    ds32 = [[np.float32(a * np.float32(b - dl)) if m else np.float32(0)
             for a, b, m in zip(pr, dr, mr)]
            for pr, dr, dl, mr in zip(p32, dp32, delta32, base.mask)]
    as_q = lambda m: [[Fraction(float(x)) for x in row] for row in m]  # noqa: E731
    dp_q, ds_q = as_q(dp32), as_q(ds32)
    operands = (base.do, base.v, base.do_scales, base.v_scales)
    return BackwardCase(
        "A4", "float32 dP, D and dS (left-to-right sums) on float32 P with unit row sums",
        p, p, dp_q, dp_q, base.mask, base.mask, operands, operands, ("float32", "float32"),
        "float32", False, [Fraction(float(x)) for x in delta32], ds_q, row_sums(ds_q))


GENERATORS = {
    "A1": counterexample_a1,
    "A2": counterexample_a2,
    "A3": counterexample_a3,
    "A4": counterexample_a4_fp32,
    "A4-hopper": counterexample_a4_hopper,
    "A5": counterexample_a5,
}


def find_counterexample(name: str, *, max_seeds: int = 64, **kw) -> BackwardCase:
    """The first seed whose case has a non-zero residual (deterministic)."""
    try:
        gen = GENERATORS[name]
    except KeyError:
        raise ValueError(f"unknown assumption {name!r}; known: {sorted(GENERATORS)}") from None
    for seed in range(max_seeds):
        case = gen(seed, **kw)
        if case.max_abs_residual != 0:
            return case
    raise RuntimeError(f"no counterexample for {name} within {max_seeds} seeds")
