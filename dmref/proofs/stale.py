"""Executable form of ``stale_delta.md``: what a stale delta D_i + delta_i does to dS, dQ, dK.

- :func:`stale_effects_exact` runs the matched and the stale backward side by side in exact
  rationals and returns the differences next to the closed forms of Proposition 2
  (row sums -delta_i sigma_i, dQ_i gains -tau delta_i kbar_i, dK_j gains -tau sum_i delta_i P_ij
  Q_i). They must be equal, exactly.
- :func:`spurious_lse_gradient` checks in float64 with torch.autograd that the stale part of dS
  is the gradient of the spurious loss -sum_i delta_i LSE_i(S), and the stale part of dQ its
  gradient through S = tau Q K^T, within bounds derived from Lemmas 4 and 5 in float64.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import torch

from .bounds import FP64, gamma, lse_error_bound, rowmass_defect_bound, softmax_l1_error_bound
from .counterexamples import random_problem
from .rational import Matrix, exact_backward, grad_scores, matmul_nn, row_sums, transpose


@dataclass
class StaleEffects:
    """Differences stale minus matched, and the closed forms that predict them."""

    delta_error: list[Fraction]  #: delta_i
    rowsum: list[Fraction]  #: sum_j dS^stale_ij
    rowsum_predicted: list[Fraction]  #: -delta_i sum_j P_ij
    dq_change: Matrix  #: dQ^stale - dQ^matched
    dq_predicted: Matrix  #: -tau delta_i kbar_i, kbar_i = sum_j P_ij K_j
    dk_change: Matrix
    dk_predicted: Matrix  #: -tau sum_i delta_i P_ij Q_i

    @property
    def holds(self) -> bool:
        return (self.rowsum == self.rowsum_predicted and self.dq_change == self.dq_predicted
                and self.dk_change == self.dk_predicted)


def stale_effects_exact(seed: int = 0, n_q: int = 3, n_k: int = 4, d: int = 8, mask=None,
                        delta_error: list[Fraction] | None = None) -> StaleEffects:
    """Matched vs stale (D_i + delta_i) in exact rationals. By default delta_i is the stale
    delta of source 1 of stale_delta.md: D from the unquantized dO, delta_i = (dO_i - dO_hat_i).(PV)_i."""
    q, k, v, do = random_problem(seed, n_q, n_k, d)
    base = exact_backward(q, k, v, do, mask=mask)
    if delta_error is None:
        pv = matmul_nn(base.p, base.v)
        do_raw = [[Fraction(float(x)) for x in row] for row in np.asarray(do)]
        delta_error = [sum(((a - b) * c for a, b, c in zip(r, rh, rp)), Fraction(0))
                       for r, rh, rp in zip(do_raw, base.do, pv)]
    stale = [dl + e for dl, e in zip(base.delta, delta_error)]
    ds_m, ds_s = base.ds, grad_scores(base.p, base.dp, stale, base.mask)
    tau = base.tau

    def dq(ds):  # dQ = tau dS K
        return [[tau * x for x in row] for row in matmul_nn(ds, base.k)]

    def dk(ds):  # dK = tau dS^T Q
        return [[tau * x for x in row] for row in matmul_nn(transpose(ds), base.q)]

    def minus(a, b):
        return [[x - y for x, y in zip(ra, rb)] for ra, rb in zip(a, b)]

    kbar = matmul_nn(base.p, base.k)
    dq_pred = [[-tau * e * x for x in row] for e, row in zip(delta_error, kbar)]
    weighted = [[e * x for x in prow] for e, prow in zip(delta_error, base.p)]  # delta_i P_ij
    dk_pred = [[-tau * x for x in row] for row in matmul_nn(transpose(weighted), base.q)]
    return StaleEffects(
        delta_error, row_sums(ds_s), [-e * sum(prow) for e, prow in zip(delta_error, base.p)],
        minus(dq(ds_s), dq(ds_m)), dq_pred, minus(dk(ds_s), dk(ds_m)), dk_pred)


@dataclass
class SpuriousGradientCheck:
    """Autograd gradients of -sum_i delta_i LSE_i(tau Q K^T) against the closed forms."""

    grad_s_error: np.ndarray  #: per row, sum_j |dL/dS_ij - (-delta_i softmax_ij)|
    grad_s_bound: np.ndarray
    grad_q_error: np.ndarray  #: per (i, k), |dL/dQ_ik - (-tau delta_i kbar_ik)|
    grad_q_bound: np.ndarray

    @property
    def holds(self) -> bool:
        return bool(np.all(self.grad_s_error <= self.grad_s_bound)
                    and np.all(self.grad_q_error <= self.grad_q_bound))


def spurious_lse_gradient(q: torch.Tensor, k: torch.Tensor, delta_error: torch.Tensor,
                          tau: float) -> SpuriousGradientCheck:
    """q (n_q, d), k (n_k, d), delta_error (n_q,), float64, no mask.

    Autograd computes ``dL/dS_ij = fl(-delta_i fl_exp(fl(S_ij - LSE_i)))`` (torch.logsumexp's
    backward; its forward is the two-pass LSE of Lemma 5), then ``dL/dQ = fl(fl(tau dL/dS) K)``.
    The closed forms use torch.softmax. Both are compared with the exact softmax p through
    l1 bounds: Lemma 4 (rho_a, for exp(S - LSE)) and :func:`softmax_l1_error_bound` (rho_s),
    then the matmul with K adds gamma_n. Per row i and channel k, with K_k = max_j |K_jk|:

    ``|grad - closed| <= |tau delta_i| K_k sum_{x in a, s} [(rho_x + gamma_n (1 + rho_x))
    (1 + gamma_2) + gamma_2]``.
    """
    q = q.detach().clone().requires_grad_(True)
    k = k.detach()
    s = tau * (q @ k.T)
    s.retain_grad()
    loss = -(delta_error * torch.logsumexp(s, dim=-1)).sum()
    loss.backward()
    with torch.no_grad():
        sm = torch.softmax(s, dim=-1)
        closed_s = -delta_error[:, None] * sm
        closed_q = -tau * delta_error[:, None] * (sm @ k)
        n = s.shape[-1]
        m_abs = s.amax(dim=-1).abs().numpy()
        rho_a = rowmass_defect_bound(n, lse_error_bound(n, m_abs, FP64), FP64)
        rho_s = softmax_l1_error_bound(n, m_abs, FP64)
        g2, gn = gamma(2, FP64.u), gamma(n, FP64.u)
        dabs = delta_error.abs().numpy()
        grad_s_err = (s.grad - closed_s).abs().sum(dim=-1).numpy()
        grad_s_bound = dabs * ((rho_a + g2 * (1 + rho_a)) + (rho_s + g2 * (1 + rho_s)))
        k_max = k.abs().amax(dim=0).numpy()
        per_path = lambda rho: (rho + gn * (1 + rho)) * (1 + g2) + g2  # noqa: E731
        grad_q_bound = (abs(tau) * dabs)[:, None] * k_max[None, :] * (
            per_path(rho_a) + per_path(rho_s))[:, None]
        grad_q_err = (q.grad - closed_q).abs().numpy()
    return SpuriousGradientCheck(grad_s_err, grad_s_bound, grad_q_err, grad_q_bound)
