"""The Delta-Matching backward in exact rational arithmetic (``fractions.Fraction``).

This is the executable form of Theorem 1 of ``delta_matching.md``. Every quantity is an exact
rational; nothing is rounded except at the quantization points, which go through the readable
specification ``dmref.emulation.spec.encode_scalar`` / ``decode_scalar`` on exact rationals.

The pipeline, one attention head, queries i, keys j, head-dim index k:

1. Q, K, V, dO are quantized with block scales along the head dim (the contraction dim of QK^T
   and dO V^T): ``x_hat = s * decode(encode(x / s))`` for each block.
2. S = tau * Q_hat K_hat^T, exactly (tau rational).
3. P: the theorem needs nothing from exp. P_ij is any positive rational; here it is the float64
   value of exp(S_ij - LSE_i) taken as an exact rational (a "rational exp surrogate"), and then
   either normalized exactly so that every row sums to 1 (``mass="normalize"``), or kept as is
   with D divided by the row mass (``mass="divide_delta"``), or kept as is (``mass="raw"``: A3
   fails).
4. dP = dO_hat V_hat^T exactly (or under the Hopper model, :mod:`dmref.proofs.hopper`).
5. D_i = sum_j P_ij dP_ij (matched), dS_ij = P_ij (dP_ij - D_i), r_i = sum_j dS_ij.

Matrices are lists of rows of Fractions; sizes are small (the point is exactness, not speed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

from dmref.emulation import FLOAT8_E4M3FN, FLOAT8_E5M2, Rounding, ScaleRule, get_format
from dmref.emulation.spec import decode_scalar, encode_scalar

Matrix = list[list[Fraction]]


# ----------------------------------------------------------------------------------------------
# Conversions and exact linear algebra
# ----------------------------------------------------------------------------------------------
def to_fractions(x) -> Matrix:
    """A 2-D array of floats to exact rationals (every float is a rational)."""
    return [[Fraction(float(v)) for v in row] for row in np.asarray(x, dtype=np.float64)]


def matmul_nt(a: Matrix, b: Matrix) -> Matrix:
    """a @ b.T exactly."""
    return [[sum((x * y for x, y in zip(ra, rb)), Fraction(0)) for rb in b] for ra in a]


def matmul_nn(a: Matrix, b: Matrix) -> Matrix:
    """a @ b exactly."""
    cols = list(zip(*b))
    return [[sum((x * y for x, y in zip(ra, cb)), Fraction(0)) for cb in cols] for ra in a]


def floor_log2(a: Fraction) -> int:
    """floor(log2 a) for a positive rational, exactly."""
    e = a.numerator.bit_length() - a.denominator.bit_length()
    while Fraction(2) ** e > a:
        e -= 1
    while Fraction(2) ** (e + 1) <= a:
        e += 1
    return e


# ----------------------------------------------------------------------------------------------
# Quantization with block scales, exactly
# ----------------------------------------------------------------------------------------------
#: The scale rules of :func:`block_scale`: the emulation's rules, in exact arithmetic.
SCALE_RULES = (ScaleRule.MX_OCP, ScaleRule.POW2_DOWN, ScaleRule.AMAX)


def block_scale(amax: Fraction, fmt, rule: ScaleRule | str) -> Fraction:
    """The scale of one block with largest magnitude ``amax``, for the rules of
    :class:`dmref.emulation.ScaleRule` in exact arithmetic (no float32 rounding of amax / max,
    no exponent clamps):

    - ``MX_OCP``: OCP MX, 2**(floor(log2 amax) - emax_elem) (values may saturate);
    - ``POW2_DOWN``: Transformer Engine, the smallest power of two s with amax / s <= max
      (the multiplier max / amax rounded down to a power of two);
    - ``AMAX``: amax / max, an exact but non-power-of-two rational.
    """
    fmt = get_format(fmt)
    rule = ScaleRule.get(rule)
    if rule not in SCALE_RULES:
        raise ValueError(f"scale rule {rule.value!r} has no exact form here; known: "
                         f"{', '.join(r.value for r in SCALE_RULES)}")
    if amax == 0:
        return Fraction(1)
    fmax = Fraction(fmt.max)
    if rule is ScaleRule.MX_OCP:
        return Fraction(2) ** (floor_log2(amax) - fmt.emax)
    if rule is ScaleRule.POW2_DOWN:
        e = floor_log2(amax / fmax)
        s = Fraction(2) ** e
        return s if amax / s <= fmax else s * 2
    return amax / fmax


def quantize_exact(x: Fraction, fmt, rounding: Rounding | str = Rounding.NEAREST_EVEN) -> Fraction:
    """decode(encode(x)) for one exact rational, saturating (finite results only)."""
    return Fraction(decode_scalar(encode_scalar(x, fmt, rounding=rounding, saturate=True), fmt))


def quantize_blocked_exact(x: Matrix, fmt, block: int, rule: ScaleRule | str = ScaleRule.MX_OCP,
                           rounding: Rounding | str = Rounding.NEAREST_EVEN) -> tuple[Matrix, Matrix]:
    """Quantize each row in blocks of ``block`` consecutive entries (the last block may be
    shorter). Returns (dequantized values, one scale per block)."""
    if block < 1:
        raise ValueError(f"{block=} must be positive")
    out, scales = [], []
    for row in x:
        qrow, srow = [], []
        for b0 in range(0, len(row), block):
            chunk = row[b0:b0 + block]
            s = block_scale(max(abs(v) for v in chunk), fmt, rule)
            qrow.extend(s * quantize_exact(v / s, fmt, rounding) for v in chunk)
            srow.append(s)
        out.append(qrow)
        scales.append(srow)
    return out, scales


def transpose(m: Matrix) -> Matrix:
    return [list(c) for c in zip(*m)]


# ----------------------------------------------------------------------------------------------
# Masks and P
# ----------------------------------------------------------------------------------------------
def make_mask(n_q: int, n_k: int, kind: str | np.ndarray | None) -> list[list[bool]]:
    """True where key j is visible to query i. ``causal`` aligns the last query with the last
    key (bottom-right, as FlashAttention does for n_q != n_k)."""
    if kind is None or (isinstance(kind, str) and kind == "none"):
        return [[True] * n_k for _ in range(n_q)]
    if isinstance(kind, str):
        if kind != "causal":
            raise ValueError(f"unknown mask {kind!r}; use None, 'causal' or a boolean array")
        off = n_k - n_q
        return [[j <= i + off for j in range(n_k)] for i in range(n_q)]
    arr = np.asarray(kind, dtype=bool)
    if arr.shape != (n_q, n_k):
        raise ValueError(f"mask shape {arr.shape} != {(n_q, n_k)}")
    return arr.tolist()


def rational_exp(x: Fraction) -> Fraction:
    """The rational exp surrogate: exp(x) rounded to float64, as an exact rational. Any positive
    rational would do for Theorem 1; this one keeps P close to the real softmax."""
    return Fraction(math.exp(float(x)))


def lse_rows(s: Matrix, mask) -> list[Fraction]:
    """A rational LSE per row (float64 log-sum-exp as a rational); 0 for a fully masked row."""
    out = []
    for row, mrow in zip(s, mask):
        vals = [float(v) for v, m in zip(row, mrow) if m]
        if not vals:
            out.append(Fraction(0))
            continue
        mx = max(vals)
        out.append(Fraction(mx + math.log(math.fsum(math.exp(v - mx) for v in vals))))
    return out


def probabilities(s: Matrix, lse: list[Fraction], mask, mass: str = "normalize") -> Matrix:
    """P_ij = rational_exp(S_ij - LSE_i) on visible entries, 0 elsewhere; ``mass="normalize"``
    divides each row by its exact sum so that it sums to exactly 1."""
    p = [[rational_exp(v - l) if m else Fraction(0) for v, m in zip(row, mrow)]
         for row, l, mrow in zip(s, lse, mask)]
    if mass == "normalize":
        p = [[v / sum(row) for v in row] if sum(row) else row for row in p]
    return p


# ----------------------------------------------------------------------------------------------
# The matched backward and its residual
# ----------------------------------------------------------------------------------------------
def matched_delta(p: Matrix, dp: Matrix, mask, divide_by_mass: bool = False) -> list[Fraction]:
    """D_i = sum_{j visible} P_ij dP_ij (divided by sum_j P_ij when ``divide_by_mass``)."""
    out = []
    for prow, dprow, mrow in zip(p, dp, mask):
        d = sum((a * b for a, b, m in zip(prow, dprow, mrow) if m), Fraction(0))
        mass = sum((a for a, m in zip(prow, mrow) if m), Fraction(0))
        out.append(d / mass if divide_by_mass and mass else d)
    return out


def grad_scores(p: Matrix, dp: Matrix, delta: list[Fraction], mask) -> Matrix:
    """dS_ij = P_ij (dP_ij - D_i) on visible entries, 0 elsewhere."""
    return [[a * (b - d) if m else Fraction(0) for a, b, m in zip(prow, dprow, mrow)]
            for prow, dprow, d, mrow in zip(p, dp, delta, mask)]


def row_sums(m: Matrix) -> list[Fraction]:
    return [sum(row, Fraction(0)) for row in m]


@dataclass
class ExactBackward:
    """Every intermediate of the exact pipeline (dequantized values and scales)."""

    q: Matrix
    k: Matrix
    v: Matrix
    do: Matrix
    q_scales: Matrix
    k_scales: Matrix
    v_scales: Matrix
    do_scales: Matrix
    tau: Fraction
    mask: list[list[bool]]
    s: Matrix
    lse: list[Fraction]
    p: Matrix
    dp: Matrix
    delta: list[Fraction]
    ds: Matrix
    residuals: list[Fraction] = field(default_factory=list)

    @property
    def max_abs_residual(self) -> Fraction:
        return max((abs(r) for r in self.residuals), default=Fraction(0))


def exact_backward(q, k, v, do, *, tau=Fraction(1, 8), fmt_qk=FLOAT8_E4M3FN, fmt_v=FLOAT8_E4M3FN,
                   fmt_do=FLOAT8_E5M2, block: int = 32, scale_rule: ScaleRule | str = ScaleRule.MX_OCP,
                   mask=None, mass: str = "normalize", dp_accumulation: str = "exact",
                   promote_every: int | None = None) -> ExactBackward:
    """Run the matched pipeline on float arrays q (n_q, d), k (n_k, d), v (n_k, d),
    do (n_q, d). ``mass``: ``normalize`` or ``divide_delta`` (A3 holds), ``raw`` (it does not).
    ``dp_accumulation``: ``exact`` or ``hopper`` (the same dP numbers go to D and dS either
    way; with ``hopper`` the scales must be constant along each row's head dim, so the caller
    passes ``block >= d``)."""
    tau = Fraction(tau)
    qh, qs = quantize_blocked_exact(to_fractions(q), fmt_qk, block, scale_rule)
    kh, ks = quantize_blocked_exact(to_fractions(k), fmt_qk, block, scale_rule)
    vh, vs = quantize_blocked_exact(to_fractions(v), fmt_v, block, scale_rule)
    doh, dos = quantize_blocked_exact(to_fractions(do), fmt_do, block, scale_rule)
    msk = make_mask(len(qh), len(kh), mask)
    s = [[tau * x for x in row] for row in matmul_nt(qh, kh)]
    lse = lse_rows(s, msk)
    p = probabilities(s, lse, msk, "normalize" if mass == "normalize" else "raw")
    if dp_accumulation == "exact":
        dp = matmul_nt(doh, vh)
    elif dp_accumulation == "hopper":
        dp = hopper_dp_exact(doh, dos, vh, vs, fmt_do, fmt_v, promote_every)
    else:
        raise ValueError(f"unknown {dp_accumulation=}; use 'exact' or 'hopper'")
    delta = matched_delta(p, dp, msk, divide_by_mass=(mass == "divide_delta"))
    ds = grad_scores(p, dp, delta, msk)
    return ExactBackward(qh, kh, vh, doh, qs, ks, vs, dos, tau, msk, s, lse, p, dp, delta, ds,
                         row_sums(ds))


def hopper_dp_exact(doh: Matrix, dos: Matrix, vh: Matrix, vs: Matrix, fmt_do, fmt_v,
                    promote_every: int | None = None) -> Matrix:
    """dP = dO_hat V_hat^T under the Hopper wgmma model, as exact rationals. The FP8 codes'
    values are multiplied inside the model and the per-row power-of-two scales outside (exact);
    requires one scale per row (block >= head dim)."""
    from .hopper import hopper_matmul

    if any(len(r) != 1 for r in dos) or any(len(r) != 1 for r in vs):
        raise ValueError("the Hopper dP needs one scale per row: pass block >= head dim")
    a = np.array([[float(x / sr[0]) for x in row] for row, sr in zip(doh, dos)])
    b = np.array([[float(x / sr[0]) for x in row] for row, sr in zip(vh, vs)])
    out = hopper_matmul(a, b, fmt_do, fmt_v, promote_every=promote_every)
    return [[Fraction(float(out[i, j])) * dos[i][0] * vs[j][0] for j in range(out.shape[1])]
            for i in range(out.shape[0])]
