"""The consistent-P variant (``consistent_p.md``) in exact rationals, and where it fails.

Consistent P: the backward uses the forward's quantized probabilities in dS, the forward
normalizes by their quantized mass, and D = dO_hat . O needs no pre-sweep. Logits are handled in
base 2, x = S log2(e), with the rational surrogate :func:`exp2_surrogate`, for which
``E(x - k) = E(x) 2**-k`` holds exactly for every integer k, as it does for the real 2**x.

Forward, row i, column tile t (columns t*T .. t*T+T-1), running integer max
``mu_t = ceil(max of x over tiles <= t)``, final ``mu``:

    P~_ij = 2**-a Q(2**a E(x_ij - mu_t))          # Q-point P (fwd): FP8, scale 2**a ("offset")
    w~_ij = P~_ij * R(mu_t - mu)                   # lazy rescale: R = 2**(.) (pow2) or E(real)
    l~_i = sum_j w~_ij ;  w_ij = w~_ij / l~_i ;  O_i = sum_j w_ij V~_j

Backward, saved (mu, l~) and O:

    P^_ij = 2**-b Q(2**b E(x_ij - mu))            # Q-point P (bwd): FP8, scale 2**b
    w^_ij = P^_ij / l~_i ;  dP = dO^ V^T ;  D_i = dO^_i . O_i ;  dS = w^ (dP - D)

With w^ = w (the grids agree), sum_j w_ij = 1, V~ = V^, O saved exactly and exact arithmetic,
sum_j dS_ij = dO^_i . O_i - D_i = 0. The grids agree when a = b and nothing is rescaled, and
otherwise exactly where scale invariance Q(2**c y) = 2**c Q(y) holds: both values in the
normal, non-saturating range. :data:`FAILURES` lists the ways it breaks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from dmref.emulation import FLOAT8_E4M3FN, FLOAT8_E5M2, ScaleRule, constants, get_format

from .counterexamples import random_problem
from .rational import (
    Matrix,
    make_mask,
    matmul_nt,
    quantize_blocked_exact,
    quantize_exact,
    row_sums,
    to_fractions,
    transpose,
)

#: Rational stand-in for log2(e) (the float64 value); any positive rational would do.
LOG2E = Fraction(constants.LOG2E)

#: Each way the variant can break, with what it changes.
FAILURES = {
    "grid_edge": "forward and backward P grids differ by a power of two (scale offsets a != b, "
                 "or lazy rescaling); they disagree where a value is subnormal in one grid",
    "natural_rescale": "lazy rescaling by exp of a real max difference: not a power of two",
    "lse_grid": "the backward quantizes exp(S - LSE) = P/l~ instead of exp(S - mu): a non-"
                "power-of-two factor between the grids",
    "unquantized_normalizer": "the forward divides by the unquantized mass sum_j E(x - mu)",
    "saved_o_bf16": "O is rounded to bfloat16 before it is saved",
    "split_v": "V is blocked along the sequence in the forward, along the head dim in the "
               "backward",
}


def exp2_surrogate(x: Fraction) -> Fraction:
    """2**x as an exact rational: 2**floor(x) times the float64 value of 2**frac(x). Satisfies
    E(x - k) = E(x) 2**-k exactly for integer k."""
    f = math.floor(x)
    return Fraction(2) ** f * Fraction(2.0 ** float(x - f))


def quantize_scaled(x: Fraction, fmt, scale_exp: int) -> Fraction:
    """2**-a Q(2**a x): FP8 with a power-of-two scale 2**-a (so 2**a x is what is encoded)."""
    s = Fraction(2) ** scale_exp
    return quantize_exact(x * s, fmt) / s


def _ceil(x: Fraction) -> int:
    return -math.floor(-x)


@dataclass
class ConsistentPCase:
    failure: str  #: "" when every condition of Theorem 9 is met
    w_fwd: Matrix
    w_bwd: Matrix
    grids_agree: list[list[bool]]  #: w_bwd == w_fwd on visible entries
    edge_entries: list[list[bool]]  #: visible entries whose two encoded values are not both in
    #: the normal, non-saturating range (where scale invariance is not guaranteed)
    mass: list[Fraction]  #: sum_j w_fwd_ij
    o: Matrix
    o_saved: Matrix
    dp: Matrix
    delta: list[Fraction]
    ds: Matrix
    residuals: list[Fraction]
    hopper_bound: list[Fraction] | None = None  #: Theorem 9b, per row (Hopper variant only)

    @property
    def max_abs_residual(self) -> Fraction:
        return max((abs(r) for r in self.residuals), default=Fraction(0))


def _quantize_v(v, fmt, block: int, v_blocking: str):
    """(V^ of P V, V^ of dO Vᵀ, the tensor scale or None): ``same`` blocks along the head dim
    for both, ``split`` along the sequence (the PV contraction) in the forward, ``tensor`` one
    scale, constant along both contractions (the Hopper case)."""
    v_bwd, _ = quantize_blocked_exact(to_fractions(v), fmt, block)  # blocks along the head dim
    if v_blocking == "same":
        return v_bwd, v_bwd, None
    if v_blocking == "split":  # blocks along the sequence, the PV contraction dim
        return transpose(quantize_blocked_exact(transpose(to_fractions(v)), fmt, block)[0]), v_bwd, None
    if v_blocking == "tensor":  # one scale: constant along both contractions (Hopper case)
        flat = [x for row in to_fractions(v) for x in row]
        vq, (vs,) = quantize_blocked_exact([flat], fmt, len(flat))
        d_v = len(v_bwd[0])
        v_one = [vq[0][r * d_v:(r + 1) * d_v] for r in range(len(v_bwd))]
        return v_one, v_one, vs[0]
    raise ValueError(f"unknown {v_blocking=}")


def consistent_p_backward(q, k, v, do, *, tau=Fraction(1, 8), fmt_p=FLOAT8_E4M3FN, fmt=FLOAT8_E4M3FN,
                          fmt_do=FLOAT8_E5M2, fwd_scale_exp: int = 8, bwd_scale_exp: int = 8,
                          tile: int | None = None, rescale: str = "pow2",
                          normalizer: str = "quantized", bwd_grid: str = "mu",
                          saved_o: str | None = None, v_blocking: str = "same", block: int = 32,
                          mask=None, failure: str = "", accumulation: str = "exact",
                          promote_every: int | None = None) -> ConsistentPCase:
    """Run the consistent-P forward and backward of the module docstring on float arrays."""
    fmt_p = get_format(fmt_p)
    qh, _ = quantize_blocked_exact(to_fractions(q), fmt, block)
    kh, _ = quantize_blocked_exact(to_fractions(k), fmt, block)
    doh, _ = quantize_blocked_exact(to_fractions(do), fmt_do, block)
    v_fwd, v_bwd, v_tensor_scale = _quantize_v(v, fmt, block, v_blocking)
    if accumulation not in ("exact", "hopper"):
        raise ValueError(f"unknown {accumulation=}")
    if accumulation == "hopper" and (v_blocking != "tensor" or block < len(v_bwd[0])
                                     or (tile or len(v_bwd)) < len(v_bwd)):
        raise ValueError("the Hopper variant needs v_blocking='tensor', block >= head dim and "
                         "one tile (so every scale factors out of both wgmma chains)")
    n_q, n_k = len(qh), len(kh)
    tile = n_k if tile is None else tile
    msk = make_mask(n_q, n_k, mask)
    x = [[Fraction(tau) * LOG2E * s for s in row] for row in matmul_nt(qh, kh)]

    w_fwd, w_bwd, agree, edge, masses = [], [], [], [], []
    p_tildes, l_tildes = [], []  # the forward's P~ (times its rescale factor) and l~, per row
    lo, hi = Fraction(fmt_p.min_normal), Fraction(fmt_p.max)
    for xr, mr in zip(x, msk):
        vis = [j for j in range(n_k) if mr[j]]
        if not vis:
            zeros = [Fraction(0)] * n_k
            w_fwd.append(zeros), w_bwd.append(zeros), masses.append(Fraction(0))
            p_tildes.append(zeros), l_tildes.append(Fraction(0))
            agree.append([True] * n_k), edge.append([False] * n_k)
            continue
        real_max = max(xr[j] for j in vis)
        mu = _ceil(real_max) if rescale == "pow2" else real_max
        wt, enc_f = [Fraction(0)] * n_k, [None] * n_k
        for t0 in range(0, n_k, tile):
            run = [xr[j] for j in vis if j < t0 + tile]
            if not any(t0 <= j < t0 + tile for j in vis):
                continue
            mu_t = _ceil(max(run)) if rescale == "pow2" else max(run)
            factor = Fraction(2) ** (mu_t - mu) if rescale == "pow2" else exp2_surrogate(mu_t - mu)
            for j in vis:
                if t0 <= j < t0 + tile:
                    p_t = exp2_surrogate(xr[j] - mu_t)
                    enc_f[j] = p_t * Fraction(2) ** fwd_scale_exp
                    wt[j] = quantize_scaled(p_t, fmt_p, fwd_scale_exp) * factor
        if normalizer == "quantized":
            l_tilde = sum(wt)
        elif normalizer == "unquantized":
            l_tilde = sum(exp2_surrogate(xr[j] - mu) for j in vis)
        else:
            raise ValueError(f"unknown {normalizer=}")
        wf = [w / l_tilde for w in wt]
        p_tildes.append(wt), l_tildes.append(l_tilde)
        wb, ag, ed = [Fraction(0)] * n_k, [True] * n_k, [False] * n_k
        for j in vis:
            p_b = exp2_surrogate(xr[j] - mu)
            if bwd_grid == "mu":  # quantize exp(S - mu), divide by l~ afterwards
                wb[j] = quantize_scaled(p_b, fmt_p, bwd_scale_exp) / l_tilde
            elif bwd_grid == "lse":  # quantize exp(S - LSE) = p / l~ directly
                wb[j] = quantize_scaled(p_b / l_tilde, fmt_p, bwd_scale_exp)
            else:
                raise ValueError(f"unknown {bwd_grid=}")
            ag[j] = wb[j] == wf[j]
            enc_b = p_b * Fraction(2) ** bwd_scale_exp
            ed[j] = not (lo <= enc_f[j] <= hi and lo <= enc_b <= hi)
        w_fwd.append(wf), w_bwd.append(wb), agree.append(ag), edge.append(ed)
        masses.append(sum(wf))

    hopper_bound = None
    if accumulation == "exact":
        o = [[sum((w * vj[c] for w, vj in zip(wr, v_fwd)), Fraction(0))
              for c in range(len(v_fwd[0]))] for wr in w_fwd]
        dp = matmul_nt(doh, v_bwd)
    else:
        o, dp, hopper_bound = _hopper_products(p_tildes, l_tildes, w_bwd, doh, v_bwd, fmt_p, fmt,
                                               fmt_do, fwd_scale_exp, v_tensor_scale,
                                               promote_every)
    if saved_o is None:
        o_saved = o
    else:
        o_saved = [[quantize_exact(val, saved_o) for val in row] for row in o]
    delta = [sum((a * b for a, b in zip(dr, orow)), Fraction(0)) for dr, orow in zip(doh, o_saved)]
    ds = [[w * (g - dl) if m else Fraction(0) for w, g, m in zip(wr, gr, mr)]
          for wr, gr, dl, mr in zip(w_bwd, dp, delta, msk)]
    return ConsistentPCase(failure, w_fwd, w_bwd, agree, edge, masses, o, o_saved, dp, delta, ds,
                           row_sums(ds), hopper_bound)


def _hopper_products(p_tilde, l_tilde, w_bwd, doh, vh, fmt_p, fmt_v, fmt_do, fwd_scale_exp,
                     v_scale, promote_every):
    """O = (P~ V~) / l~ and dP = dO^ V^T under the wgmma model (exact elsewhere), and the bound
    of Theorem 9b per row: beta_n sum_k |dO^_ik| W^PV_ik / l~_i + beta_d sum_j w^_ij W^dP_ij,
    W the Lemma 7 magnitudes (scales included)."""
    import numpy as np

    from .bounds import hopper_dot_error_bound
    from .hopper import hopper_magnitude, hopper_matmul
    from .rational import block_scale

    n_k, d = len(vh), len(vh[0])
    s_p = Fraction(2) ** -fwd_scale_exp
    p_codes = np.array([[float(x / s_p) for x in row] for row in p_tilde])  # FP8 values
    v_codes = np.array([[float(x / v_scale) for x in row] for row in vh])
    do_scale = [block_scale(max(abs(x) for x in row), fmt_do, ScaleRule.MX_OCP) for row in doh]
    do_codes = np.array([[float(x / sc) for x in row] for row, sc in zip(doh, do_scale)])
    pv = hopper_matmul(p_codes, v_codes.T, fmt_p, fmt_v, promote_every=promote_every)
    dpc = hopper_matmul(do_codes, v_codes, fmt_do, fmt_v, promote_every=promote_every)
    o = [[Fraction(float(pv[i, c])) * s_p * v_scale / l_tilde[i] if l_tilde[i] else Fraction(0)
          for c in range(d)] for i in range(len(p_tilde))]
    dp = [[Fraction(float(dpc[i, j])) * do_scale[i] * v_scale for j in range(n_k)]
          for i in range(len(doh))]
    w_pv = hopper_magnitude(p_codes, v_codes.T, fmt_p, fmt_v)
    w_dp = hopper_magnitude(do_codes, v_codes, fmt_do, fmt_v)
    beta_n = Fraction(hopper_dot_error_bound(n_k, promote_every))
    beta_d = Fraction(hopper_dot_error_bound(d, promote_every))
    bound = []
    for i in range(len(doh)):
        pv_term = sum((abs(doh[i][c]) * Fraction(float(w_pv[i, c])) for c in range(d)),
                      Fraction(0)) * s_p * v_scale / (l_tilde[i] or 1)
        dp_term = sum((abs(w_bwd[i][j]) * Fraction(float(w_dp[i, j])) for j in range(n_k)),
                      Fraction(0)) * do_scale[i] * v_scale
        bound.append(beta_n * pv_term + beta_d * dp_term)
    return o, dp, bound


def consistent_p_case(failure: str = "", seed: int = 0, n_q: int = 3, n_k: int = 8, d: int = 8,
                      mask=None) -> ConsistentPCase:
    """One generated case: ``failure`` "" meets every condition (a = b = 8, no rescaling), any
    key of :data:`FAILURES` breaks that one. Logits are spread wide (so that small
    probabilities reach the FP8 subnormal range) and the forward uses tiles of 2 keys where a
    rescale is involved."""
    q, k, v, do = random_problem(seed, n_q, n_k, d, spread=1.0)
    q = q * 3.0  # wide logits: probabilities down to the FP8 subnormal range
    kw = dict(mask=mask, failure=failure)
    match failure:
        case "":
            pass
        case "grid_edge":
            kw.update(fwd_scale_exp=8, bwd_scale_exp=4, tile=2)
        case "natural_rescale":
            kw.update(rescale="natural", tile=2)
        case "lse_grid":
            kw.update(bwd_grid="lse")
        case "unquantized_normalizer":
            kw.update(normalizer="unquantized")
        case "saved_o_bf16":
            kw.update(saved_o="bfloat16")
        case "split_v":
            kw.update(v_blocking="split", block=2)
        case _:
            raise ValueError(f"unknown failure {failure!r}; known: {sorted(FAILURES)}")
    return consistent_p_backward(q, k, v, do, **kw)


def find_consistent_p_failure(failure: str, *, max_seeds: int = 64, **kw) -> ConsistentPCase:
    """The first seed whose case of ``failure`` has a non-zero residual."""
    for seed in range(max_seeds):
        case = consistent_p_case(failure, seed, **kw)
        if case.max_abs_residual != 0:
            return case
    raise RuntimeError(f"no counterexample for {failure} within {max_seeds} seeds")
