"""The a-priori error bounds of ``rounding_bounds.md``, as functions.

Every constant here is derived from a unit roundoff and a count, never typed in: ``u = 2**-24``
for float32 (round to nearest), ``gamma(n) = n u / (1 - n u)`` (Higham, *Accuracy and Stability
of Numerical Algorithms*, 2nd ed., Lemma 3.1), the half-subnormal ``eta`` for underflowing
products, and for the Hopper tensor core the bit widths of the wgmma model of docs/gemm.md
(:data:`dmref.emulation.gemm.HOPPER`, a :class:`~dmref.emulation.WgmmaRules`).

Naming follows the Markdown: for one row ``i`` of dS,

- ``A = sum_j |P_ij dP_ij|``              (the scale the row-sum residual is measured against),
- ``sigma = sum_j P_ij``                  (the row mass of the P actually used; A3 says 1),
- ``n``   = number of columns j with P_ij != 0 (the unmasked, non-underflowed ones),
- ``m``   = the row maximum of the FP32 logits S (for the a-priori row-mass bound).

The functions accept Python floats or numpy arrays (one value per row) and return the same.
Each final bound is multiplied by :data:`EVALUATION_SLACK`, which covers the float64 rounding
of the bound's own evaluation (fewer than 64 operations of relative error 2**-53 each).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from dmref.emulation.constants import FP32_EMIN, FP32_MANTISSA_BITS, FP64_MANTISSA_BITS, gamma
from dmref.emulation.gemm import HOPPER, WgmmaRules

#: Covers the float64 evaluation of a bound formula: (1 + 2**-53)**64 < 1 + 2**-46.
EVALUATION_SLACK = 1.0 + 2.0**-46


# ----------------------------------------------------------------------------------------------
# Working precisions
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FloatModel:
    """The standard model of one binary floating-point working precision, round to nearest.

    ``fl(a op b) = (a op b)(1 + e) + h`` with ``|e| <= u``; ``h = 0`` for + and - (an
    underflowing sum is exact with gradual underflow), ``|h| <= eta`` for a product or quotient
    that underflows. ``exp`` and ``log`` of the library used are accurate to ``ulps`` units in
    the last place: relative error ``ulps * 2u`` for a normal result, absolute ``ulps * 2 eta``
    for a subnormal one.
    """

    name: str
    mantissa_bits: int  #: stored fraction bits (23 for float32, 52 for float64)
    emin: int  #: exponent of the smallest normal number (-126, -1022)
    ulps: float = 1.0  #: accuracy of the exp and log used, in units in the last place

    @property
    def u(self) -> float:
        """Unit roundoff, 2**-(mantissa_bits + 1)."""
        return math.ldexp(1.0, -(self.mantissa_bits + 1))

    @property
    def eta(self) -> float:
        """Half the smallest subnormal: the absolute error of an underflowing product."""
        return math.ldexp(1.0, self.emin - self.mantissa_bits - 1)

    @property
    def exp_rel_err(self) -> float:
        """Relative error bound of exp (and log) for a normal result: ulps * 2u."""
        return self.ulps * 2.0 * self.u

    @property
    def exp_abs_err(self) -> float:
        """Absolute error bound of exp for a subnormal result: ulps * smallest subnormal."""
        return self.ulps * 2.0 * self.eta


#: float32 with exp/log accurate to 1 ulp (SLEEF u10 in torch's vectorised CPU kernels,
#: glibc expf/logf otherwise; tests/proofs checks the torch build at hand against float64).
FP32 = FloatModel("float32", FP32_MANTISSA_BITS, FP32_EMIN)
#: float64, exp/log accurate to 1 ulp.
FP64 = FloatModel("float64", FP64_MANTISSA_BITS, int(np.finfo(np.float64).minexp))


def unit_roundoff(model: FloatModel = FP32) -> float:
    return model.u


# ----------------------------------------------------------------------------------------------
# FP32: Theorem 3 (matched delta), Corollary 6 (delta divided by the row mass)
# ----------------------------------------------------------------------------------------------
def dot_error_bound(abs_products_sum, n, model: FloatModel = FP32):
    """|fl(sum_j x_j y_j) - sum_j x_j y_j| for n terms, any summation order, with or without FMA:
    ``gamma_n * sum_j |x_j y_j| + n eta (1 + gamma_{n-1})`` (Higham eq. (3.5) plus underflow)."""
    n = np.maximum(np.asarray(n, dtype=np.float64), 1.0)
    g, g1 = gamma(n, model.u), gamma(n - 1, model.u)
    return g * abs_products_sum + n * model.eta * (1.0 + g1)


def _mass_defect_upper(sigma):
    """|1 - sigma| rounded up, for a sigma that is itself the correctly rounded float64 value of
    the exact row mass (math.fsum): the exact mass lies within 2**-53 sigma of it."""
    sigma = np.asarray(sigma, dtype=np.float64)
    return np.abs(1.0 - sigma) + sigma * 2.0**-52


def matched_residual_bound(A, n, sigma, model: FloatModel = FP32):
    """Theorem 3: |sum_j dS_ij| for D = fl(sum_j P_ij dP_ij) and dS = fl(P (fl(dP - D))), given
    the FP32 arrays P and dP (of any provenance: the dP accumulation model does not enter).

    ``|r| <= gamma_n A + Dmax |1 - sigma| + gamma_2 (A + Dmax sigma) + n eta (2 + gamma_{n-1})``
    with ``Dmax = (1 + gamma_n) A + n eta (1 + gamma_{n-1})`` bounding |fl(D)|.
    """
    n = np.maximum(np.asarray(n, dtype=np.float64), 1.0)
    u, eta = model.u, model.eta
    g_n, g_n1, g_2 = gamma(n, u), gamma(n - 1, u), gamma(2, u)
    sigma = np.asarray(sigma, dtype=np.float64)
    d_max = (1.0 + g_n) * A + n * eta * (1.0 + g_n1)
    sigma_up = sigma * (1.0 + 2.0**-52)
    bound = (
        g_n * A
        + d_max * _mass_defect_upper(sigma)
        + g_2 * (A + d_max * sigma_up)
        + n * eta * (2.0 + g_n1)
    )
    return bound * EVALUATION_SLACK


def normalized_matched_residual_bound(A, n, sigma, model: FloatModel = FP32):
    """Corollary 6: D = fl(fl(sum_j P dP) / fl(sum_j P)); the row mass no longer enters except
    through underflow terms. With ``phi = (u + gamma_{n-1}) / (1 - gamma_{n-1})`` bounding the
    relative error of the quotient against the exact mass,

    ``|r| <= e_N (1 + phi) + phi A + gamma_2 (A + (A + e_N)(1 + phi) + eta sigma)
              + eta sigma + n eta``,  ``e_N = gamma_n A + n eta (1 + gamma_{n-1})``.
    """
    n = np.maximum(np.asarray(n, dtype=np.float64), 1.0)
    u, eta = model.u, model.eta
    g_n, g_n1, g_2 = gamma(n, u), gamma(n - 1, u), gamma(2, u)
    sigma_up = np.asarray(sigma, dtype=np.float64) * (1.0 + 2.0**-52)
    phi = (u + g_n1) / (1.0 - g_n1)
    e_n = g_n * A + n * eta * (1.0 + g_n1)
    d_sigma = (A + e_n) * (1.0 + phi) + eta * sigma_up  # bound on |fl(D)| * sigma
    bound = e_n * (1.0 + phi) + phi * A + eta * sigma_up + g_2 * (A + d_sigma) + n * eta
    return bound * EVALUATION_SLACK


# ----------------------------------------------------------------------------------------------
# FP32: Lemma 5 (the forward's LSE) and Lemma 4 (row mass and l1 error of the recomputed P)
# ----------------------------------------------------------------------------------------------

def _normalizer_phi(n, model: "FloatModel"):
    """(n, log n, phi_L): phi_L of Lemma 5, the bound on |log| of the computed normalizer's
    relative error, ``max(log((1 + g)(n**u (1 + e) + n h)), -log((1 - g)(n**-u (1 - e) - n h)))``
    with ``g = gamma_{n-1}``, ``e``/``h`` the relative/absolute exp error."""
    n = np.maximum(np.asarray(n, dtype=np.float64), 1.0)
    u, e, h = model.u, model.exp_rel_err, model.exp_abs_err
    g = gamma(n - 1, u)
    log_n = np.log(n)
    up = np.log((1.0 + g) * (np.exp(u * log_n) * (1.0 + e) + n * h))
    down = -np.log((1.0 - g) * (np.exp(-u * log_n) * (1.0 - e) - n * h))
    return n, log_n, np.maximum(up, down)

def lse_error_bound(n, m_abs, model: FloatModel = FP32):
    """Lemma 5: |L - LSE(S)| for the two-pass FP32 log-sum-exp of n finite logits with maximum m:
    ``L = fl(m + fl_log(fl(sum_j fl_exp(fl(S_j - m)))))``, any summation order.

    ``phi_L = max(log((1 + g)(n**u (1 + e) + n h)), -log((1 - g)(n**-u (1 - e) - n h)))`` with
    ``g = gamma_{n-1}``, ``e``/``h`` the relative/absolute exp error; then
    ``|lambda| <= (phi_L + e (log n + phi_L))(1 + u) + u (|m| + log n)``.
    """
    n, log_n, phi_l = _normalizer_phi(n, model)
    u, e, h = model.u, model.exp_rel_err, model.exp_abs_err
    lam = (phi_l + e * (log_n + phi_l)) * (1.0 + u) + u * (np.asarray(m_abs) + log_n)
    return lam * EVALUATION_SLACK


def rowmass_defect_bound(n, lam, model: FloatModel = FP32):
    """Lemma 4: for P_ij = fl_exp(fl(S_ij - L_i)) over n unmasked logits, with |L_i - LSE_i| <=
    lam, both ``|1 - sum_j P_ij|`` and ``sum_j |P_ij - softmax(S)_ij|`` are at most

    ``rho = exp(lam (1 + u) + u log n) / (1 - e) - 1 + n h``.

    (The proof uses sum_j p_j**(1-u) <= n**u, Hoelder: the entropy of a row never exceeds
    log n.)
    """
    n = np.maximum(np.asarray(n, dtype=np.float64), 1.0)
    u, e, h = model.u, model.exp_rel_err, model.exp_abs_err
    rho = (np.expm1(np.asarray(lam) * (1.0 + u) + u * np.log(n)) + e) / (1.0 - e) + n * h
    return rho * EVALUATION_SLACK


def softmax_l1_error_bound(n, m_abs, model: FloatModel = FP64):
    """``sum_j |P_j - softmax(S)_j|`` for ``P = fl(fl_exp(fl(S - m)) / fl(sum_j ...))`` (the
    two-pass softmax of torch): ``exp(phi_L + u log n) / ((1 - e)(1 - u)) - 1 + 2 n (h + eta)``,
    with phi_L of Lemma 5 (the relative error of the computed normalizer)."""
    n, log_n, phi_l = _normalizer_phi(n, model)
    u, e, h = model.u, model.exp_rel_err, model.exp_abs_err
    out = np.exp(phi_l + u * log_n) / ((1.0 - e) * (1.0 - u)) - 1.0 + 2.0 * n * (h + model.eta)
    del m_abs  # the normalized softmax does not depend on the size of the logits
    return out * EVALUATION_SLACK


def matched_residual_bound_a_priori(A, n, m_abs, model: FloatModel = FP32):
    """Theorem 3 with Lemmas 4 and 5 substituted: depends only on A, n and the row maximum of
    the logits, for the recompute P = fl_exp(fl(S - L)) against the forward's two-pass LSE."""
    n = np.maximum(np.asarray(n, dtype=np.float64), 1.0)
    u, eta = model.u, model.eta
    g_n, g_n1, g_2 = gamma(n, u), gamma(n - 1, u), gamma(2, u)
    rho = rowmass_defect_bound(n, lse_error_bound(n, m_abs, model), model)
    d_max = (1.0 + g_n) * A + n * eta * (1.0 + g_n1)
    bound = g_n * A + d_max * rho + g_2 * (A + d_max * (1.0 + rho)) + n * eta * (2.0 + g_n1)
    return bound * EVALUATION_SLACK


def matched_residual_coefficient(n, m_abs=0.0, model: FloatModel = FP32):
    """The a-priori bound of :func:`matched_residual_bound_a_priori` per unit of A, underflow
    terms (of size n 2**-149 / A) dropped: the relative row-sum residual |r_i| / A_i that
    Delta-Matching guarantees in float32, for reports."""
    no_underflow = replace(model, emin=-(1 << 20))  # eta = 0 and no subnormal exp error
    return matched_residual_bound_a_priori(1.0, n, m_abs, no_underflow)


# ----------------------------------------------------------------------------------------------
# Hopper: Lemma 7 (one wgmma dot), Theorem 8 (operand-level matching)
# ----------------------------------------------------------------------------------------------
def check_wgmma_rules(rules: WgmmaRules) -> WgmmaRules:
    """The bounds are proved for the wgmma model of docs/gemm.md: truncation of terms
    and result, the accumulator in the alignment and truncated like a product. Only the bit
    counts (k_step, term_frac_bits, result_bits) may differ from :data:`HOPPER`."""
    same = replace(rules, k_step=HOPPER.k_step, term_frac_bits=HOPPER.term_frac_bits,
                    result_bits=HOPPER.result_bits)
    if same != HOPPER:
        raise ValueError(f"the wgmma bounds are proved for HOPPER's rounding rules; got {rules}")
    return rules


def step_growth(rules: WgmmaRules = HOPPER) -> float:
    """w: one k-step errs by at most w times the running magnitude W_t (Lemma 7):
    ``w = (k + 1) 2**-f + 2**-(s-1)`` (k products and C each truncated by less than
    2**(E-f) <= 2**-f W_t, the sum by less than 2**-(s-1) of itself, itself <= W_t), with
    k = ``rules.k_step``, f = ``rules.term_frac_bits``, s = ``rules.result_bits``."""
    check_wgmma_rules(rules)
    e_term = math.ldexp(1.0, -rules.term_frac_bits)
    e_result = math.ldexp(1.0, -(rules.result_bits - 1))
    return (rules.k_step + 1) * e_term + e_result


def hopper_chain_growth(steps: int, model: WgmmaRules = HOPPER) -> float:
    """psi_t = t w: relative error bound (against W) of a chain of t k-steps started from a zero
    accumulator. Linear, because truncation toward zero never increases a magnitude, so every
    accumulator stays below the running sum of |products| <= W."""
    return steps * step_growth(model)


def hopper_dot_error_bound(n: int, promote_every: int | None = None,
                           model: WgmmaRules = HOPPER, acc: FloatModel = FP32) -> float:
    """Lemma 7: beta such that ``|dot_hopper(a, b) - a.b| <= beta * W`` for a length-n dot of FP8
    values, ``W = sum_k mu(a_k) mu(b_k)`` with ``mu(x) = max(|x|, 2**e(x))`` (e() the FP8
    exponent, emin for subnormals), so W = sum_k |a_k b_k| when no operand is subnormal.

    Without promotion (``promote_every`` None or >= n): ``psi_{ceil(n/k)}``. With promotion
    every N: ``psi_{N/k} + gamma_{ceil(n/N) - 1} (1 + psi_{N/k})``.
    """
    k = model.k_step
    if promote_every is None or promote_every >= n:
        return hopper_chain_growth(max(1, -(-n // k)), model) * EVALUATION_SLACK
    if promote_every % k:
        raise ValueError(f"{promote_every=} must be a multiple of the wgmma k-step {k}")
    psi = hopper_chain_growth(promote_every // k, model)
    chunks = -(-n // promote_every)
    return (psi + gamma(chunks - 1, acc.u) * (1.0 + psi)) * EVALUATION_SLACK


def operand_matched_residual_bound(A, Bw, Bp, n, d, sigma, dO_abs_sum, beta,
                                   model: FloatModel = FP32, dp_abs_err: float = 0.0):
    """Theorem 8 (operand-level matching): D = fl(dO_hat . fl(P V_hat)) computed in FP32 from the
    quantized operands, while dS = fl(P fl(dP - D)) uses the dP the tensor core produced, with
    ``|dP - dP_exact| <= beta W`` entrywise (Lemma 7). Per row:

    - ``Bw = sum_j P_ij W_ij``  (the Hopper magnitudes of the dP entries, weighted by P);
    - ``Bp = sum_j sum_k P_ij |dO_ik| |V_jk|``  (<= Bw);
    - ``A  = sum_j |P_ij dP_ij|`` of the computed dP.

    ``|r| <= beta Bw + c sigma + e_D + Dmax |1 - sigma| + gamma_2 (A + Dmax sigma) + n eta``
    (``c`` = ``dp_abs_err``, an absolute error per dP entry: underflow of a float32 dP) with
    ``e_D = (gamma_n + gamma_d (1 + gamma_n)) Bp
    + (1 + gamma_d) n eta (1 + gamma_{n-1}) sum_k|dO_ik| + d eta (1 + gamma_{d-1})`` and
    ``Dmax = Bp + e_D``.
    """
    n = np.maximum(np.asarray(n, dtype=np.float64), 1.0)
    u, eta = model.u, model.eta
    g_n, g_n1, g_2 = gamma(n, u), gamma(n - 1, u), gamma(2, u)
    g_d, g_d1 = gamma(d, u), gamma(max(d - 1, 0), u)
    e_d = (g_n + g_d * (1.0 + g_n)) * Bp + (1.0 + g_d) * n * eta * (1.0 + g_n1) * dO_abs_sum \
        + d * eta * (1.0 + g_d1)
    d_max = Bp + e_d
    sigma = np.asarray(sigma, dtype=np.float64)
    bound = (
        beta * Bw + dp_abs_err * sigma * (1.0 + 2.0**-52) + e_d + d_max * _mass_defect_upper(sigma)
        + g_2 * (A + d_max * sigma * (1.0 + 2.0**-52)) + n * eta
    )
    return bound * EVALUATION_SLACK
