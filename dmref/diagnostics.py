"""Diagnostics of a recipe against the exact reference, and the error bounds the tests state.

For a recipe run on one problem, :func:`evaluate` reports

- the row-sum residual r_i = sum_j dS_ij of dS *as the backward computed it* (working precision,
  before dS is quantized for the dQ/dK matmuls), relative to A_i = sum_j |P_ij dP^_ij|, and the
  same after dS's quantization for the dQ matmul (and for the dK matmul);
- the errors of out, dQ, dK and dV against float64 :mod:`dmref.reference`, as
  ||X - X_exact||_F / ||X_exact||_F;
- dQ's error split into its component along kbar_i = sum_j P_ij K_j (exact P and K) and the
  rest: stale delta predicts the error -scale * delta_i * kbar_i, so ``dq_bias_fraction``
  = sum_i |e_i . kbar_i|^2 / |kbar_i|^2 / sum_i |e_i|^2 is near 1 when that bias dominates
  and about 1/head_dim for isotropic noise.

The bounds (each derivation is in its docstring):

- :func:`matched_rowsum_bound`: |r_i| of Delta-Matching with FP32 (or any) working precision;
- :func:`psum_error_bound`: a-priori bound on |1 - sum_j P_ij| of the backward's recomputed P;
- :func:`attention_error_bound`: per-element rounding-error bound of a float attention forward
  and backward against exact arithmetic (used to compare the float64 reference with
  torch.autograd, and the unquantized tiled pipeline with the reference).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass, field

import torch

from . import reference, tiled
from .emulation.constants import LN2, U_FP32, U_FP64, gamma  # U_FP32, U_FP64, gamma: re-exported
from .recipes import get_recipe

__all__ = [
    "U_FP32",
    "U_FP64",
    "Report",
    "attention_error_bound",
    "dq_bias_split",
    "evaluate",
    "exact_results",
    "gamma",
    "matched_rowsum_bound",
    "problem_fingerprint",
    "psum_error_bound",
    "relative_error",
]



def relative_error(x: torch.Tensor, exact: torch.Tensor) -> float:
    """||x - exact||_F / ||exact||_F in float64 (0 when both are zero; NaN when either holds a
    NaN, inf when x holds an infinity and exact does not)."""
    e = exact.to(torch.float64)
    num = (x.to(torch.float64) - e).norm().item()
    den = e.norm().item()
    if math.isnan(num) or math.isnan(den):
        return math.nan
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


# ----------------------------------------------------------------------------------------------
# Row sums of dS
# ----------------------------------------------------------------------------------------------


def _exp2_ulp_error() -> float:
    """Relative error bound of torch's float32 exp2 (SLEEF u10: at most 1 ulp = 2u)."""
    return 2 * U_FP32


def matched_rowsum_bound(stats: "tiled.RowsumStats", u: float = U_FP32, chain: int | None = None) -> torch.Tensor:
    """Bound on |r_i| = |sum_j dS_ij| of Delta-Matching, per row, given the measured sigma_i.

    Derivation (every step one rounding of unit roundoff u; T_i = sum_j P_ij dP^_ij exactly,
    A_i = sum_j |P_ij dP^_ij|, sigma_i = sum_j P_ij, P and dP^ the working-precision values;
    c = ``chain``, the longest chain of roundings a product passes through in D's sum: n for
    any summation order (the a-priori statement); block_k + key tiles for dmref.tiled, which
    sums each tile in torch's order and adds the tiles one by one; default
    ``stats.sum_chain``):

    1. D_i = fl(sum_j fl(P_ij dP^_ij)) = T_i + e_D with |e_D| <= gamma_c A_i.
    2. dS_ij = fl(P_ij fl(dP^_ij - D_i)) = P_ij (dP^_ij - D_i) + eta_ij,
       |eta_ij| <= gamma_2 P_ij (|dP^_ij| + |D_i|).
    3. sum_j dS_ij = T_i (1 - sigma_i) - e_D sigma_i + sum_j eta_ij, so with |T_i| <= A_i and
       |D_i| <= (1 + gamma_c) A_i:
       |r_i| <= [ |1 - sigma_i| + gamma_c sigma_i + gamma_2 (1 + sigma_i (1 + gamma_c)) ] A_i.
    4. r_i itself is summed in float64 from the dS tiles: add gamma_n(2^-53) sum_j |dS_ij|
       <= gamma_n(2^-53) (1 + gamma_2)(1 + sigma_i (1 + gamma_c)) A_i.

    The |1 - sigma_i| term is assumption A3 (sum_j P_ij = 1); :func:`psum_error_bound` bounds it
    a priori. The bound holds whatever produced dP^ (any FP8 recipe, any accumulation model).
    """
    n = stats.n_keys
    c = stats.sum_chain if chain is None else chain
    a, sigma = stats.abs_pdp, stats.psum
    g_c, g_2 = gamma(c, u), gamma(2, u)
    d_mag = 1 + sigma * (1 + g_c)
    bound = ((1 - sigma).abs() + g_c * sigma + g_2 * d_mag) * a
    return bound + gamma(n, U_FP64) * (1 + g_2) * d_mag * a


def psum_error_bound(x_max: torch.Tensor, n_keys: int, n_tiles: int, u: float = U_FP32) -> torch.Tensor:
    """A-priori bound on |1 - sum_j P_ij| for P = 2^(x - lse) recomputed by the tiled backward.

    ``x_max``: per row, a bound M_i >= max_j |x_ij| on the base-2 logits of the row (e.g.
    log2(e) (scale |q_i| max_j |k_j| + max |mask|) by Cauchy-Schwarz). Derivation, with
    L_i = log2 sum_j 2^(x_ij) of the computed x (the forward and backward see the same x) and
    P*_ij = 2^(x_ij - L_i), which sums to 1 exactly:

    1. the forward's l = sum_j 2^(x_j - m_t) with tile rescales has relative error
       |theta| <= gamma(n + 3 n_tiles + 2) + ln2 u 4 M_i (exp2 within 1 ulp; argument roundings
       u |x - m_t| weighted by P, <= 2 M_i; rescale arguments sum to <= 2 M_i);
    2. lse2 = fl(m + fl(log2 l)) = L + dL, |dL| <= 1.45 |theta| + 2u log2(n) + u (M_i + log2 n);
    3. the backward's fl(x - lse2) errs by u |x - lse2| <= u (2 M_i + log2 n), exp2 by 2u, so
       |1 - sigma_i| <= 1.01 [ ln2 |dL| + ln2 u (2 M_i + log2 n) + 2u ]
       (1.01 covers second-order terms while the bracket is below 1e-2, which it is for any
       float32 logits below 1e4).
    """
    log2n = math.log2(max(n_keys, 2))
    theta = gamma(n_keys + 3 * n_tiles + 2, u) + LN2 * u * 4 * x_max
    d_l = 1.45 * theta + 2 * u * log2n + u * (x_max + log2n)
    return 1.01 * (LN2 * d_l + LN2 * u * (2 * x_max + log2n) + _exp2_ulp_error())


def logit_bound(q, k, *, scale: float, mask=None) -> torch.Tensor:
    """Per query row, M_i = log2(e) (scale |q_i| max_j |k_j| + max_j |mask_ij|) >= max_j |x_ij|
    (Cauchy-Schwarz), in float64, shape (B, H, Nq)."""
    q64, k64 = q.to(torch.float64), k.to(torch.float64)
    groups = q.shape[1] // k.shape[1]
    kn = k64.norm(dim=-1).amax(dim=-1)  # (B, Hkv)
    kn = kn.repeat_interleave(groups, dim=1)[..., None]
    m = scale * q64.norm(dim=-1) * kn
    if mask is not None and mask.dtype != torch.bool:
        finite = torch.where(torch.isfinite(mask), mask.to(torch.float64), torch.zeros((), dtype=torch.float64))
        m = m + finite.abs().amax(dim=-1).expand_as(m)
    return m / LN2


# ----------------------------------------------------------------------------------------------
# Rounding-error bound of a float attention against exact arithmetic
# ----------------------------------------------------------------------------------------------


def attention_error_bound(q, k, v, dout, *, u: float, causal=False, scale=None, mask=None,
                          n_tiles: int = 1) -> dict[str, torch.Tensor]:
    """Per-element bounds on |computed - exact| of out, lse, dq, dk, dv (and ``p_rel``: the
    relative bound R_ij of a computed P_ij, shape (B, H, Nq, Nk)) for any implementation
    that computes softmax attention and its gradient in a float format of unit roundoff u,
    in any summation order, either directly (reference, torch.autograd) or tiled with online
    softmax over ``n_tiles`` key tiles, with D either as rowsum(dO o O) or sum_j P dP.

    Quantities with bars are exact (float64 from the inputs); |.| is taken elementwise.

    1. logits: |s^ - s| <= e_ij = gamma(D + 5) scale (|Q||K|ᵀ)_ij + gamma(3) |mask_ij|
       (products, D - 1 additions, the scale, log2(e), the input rounding of q and k);
    2. probabilities: P^ = P exp(xi), |xi_ij| <= e_ij + ebar_i + kappa_i with
       ebar_i = sum_j P_ij e_ij (the normalizer) and kappa_i = gamma(n + 3 n_tiles + 12)
       + 4u (M_i + log n + 1) (sums, exp within 1 ulp, division, rescales, argument roundings
       u|s - ref| <= u (2 M_i + log n), M_i = max_j |s_ij|); so |P^ - P| <= R_ij P_ij with
       R_ij = 2 |xi_ij| (|e^t - 1| <= 2|t| for |t| <= 1);
    3. out: sum_j P R |V| + gamma(n + n_tiles + 3) sum_j P |V|;  lse: ebar_i + kappa_i;
    4. dP: f_ij = gamma(Dv + 2) (|dO||V|ᵀ)_ij;
    5. D: both forms, summed: gamma(Dv + 2) |dO|.|O| + |dO|.bound(out)
       + sum_j P (R |dP| + f) + gamma(n + 2) sum_j P |dP|;
    6. dS: g_ij = P R |dP - D| + P (f + e_D) + gamma(3) P (|dP| + |D|);
    7. dQ = scale (g |K| + gamma(n + 3) |dS| |K|); dK = scale (gᵀ |Q| + gamma(Nq g + 3) |dS|ᵀ |Q|)
       summed over the heads of a group; dV = (P R)ᵀ |dO| + gamma(Nq g + 3) Pᵀ |dO|.

    First-order analysis; every result is multiplied by 1.1, which covers the second-order terms
    as long as every R_ij <= 0.05 (checked: ValueError otherwise).
    """
    shape = reference.check_attention_inputs(q, k, v, scale=scale, mask=mask, dout=dout)
    g_heads = shape.groups
    q64, k64, v64, do64 = (t.to(torch.float64) for t in (q, k, v, dout))
    kx, vx = (t.repeat_interleave(g_heads, dim=1) if g_heads > 1 else t for t in (k64, v64))
    out, lse = reference.attention_forward(q64, k64, v64, causal=causal, scale=shape.scale, mask=mask)
    s = reference.scores(q64, k64, shape, causal, mask)
    keep = torch.isfinite(s) | torch.isnan(s)
    lse_safe = torch.where(lse == -math.inf, torch.full_like(lse, math.inf), lse)[..., None]
    p = torch.exp(s - lse_safe)
    n, nq, d, dv_dim = shape.seqlen_k, shape.seqlen_q, shape.head_dim, shape.head_dim_v

    e = gamma(d + 5, u) * shape.scale * (q64.abs() @ kx.abs().transpose(-1, -2))
    if mask is not None and mask.dtype != torch.bool:
        e = e + gamma(3, u) * torch.where(torch.isfinite(mask), mask.to(torch.float64).abs(),
                                          torch.zeros((), dtype=torch.float64))
    e = torch.where(keep, e, torch.zeros_like(e))
    ebar = (p * e).sum(-1, keepdim=True)
    s_abs_max = torch.where(keep, s.abs(), torch.zeros_like(s)).amax(-1, keepdim=True)
    kappa = gamma(n + 3 * n_tiles + 12, u) + 4 * u * (s_abs_max + math.log(max(n, 2)) + 1)
    r = 2 * (e + ebar + kappa)
    r = torch.where(keep, r, torch.zeros_like(r))
    if bool((r > 0.05).any()):
        raise ValueError(f"attention_error_bound: relative P error bound {r.max().item():.3g} > 0.05; "
                         "the first-order analysis does not apply")
    pr = p * r
    b_out = pr @ vx.abs() + gamma(n + n_tiles + 3, u) * (p @ vx.abs())
    b_lse = (ebar + kappa)[..., 0]
    dp = do64 @ vx.transpose(-1, -2)
    f = gamma(dv_dim + 2, u) * (do64.abs() @ vx.abs().transpose(-1, -2))
    delta = (do64 * out).sum(-1, keepdim=True)
    e_d = (gamma(dv_dim + 2, u) * (do64.abs() * out.abs()).sum(-1, keepdim=True)
           + (do64.abs() * b_out).sum(-1, keepdim=True)
           + (pr * dp.abs() + p * f).sum(-1, keepdim=True)
           + gamma(n + 2, u) * (p * dp.abs()).sum(-1, keepdim=True))
    ds = p * (dp - delta)
    g = pr * (dp - delta).abs() + p * (f + e_d) + gamma(3, u) * p * (dp.abs() + delta.abs())
    b_dq = shape.scale * (g @ kx.abs() + gamma(n + 3, u) * (ds.abs() @ kx.abs()))
    nq_g = nq * g_heads
    b_dk = shape.scale * (g.transpose(-1, -2) @ q64.abs() + gamma(nq_g + 3, u) * (ds.abs().transpose(-1, -2) @ q64.abs()))
    b_dv = pr.transpose(-1, -2) @ do64.abs() + gamma(nq_g + 3, u) * (p.transpose(-1, -2) @ do64.abs())
    b_dk, b_dv = (reference.reduce_kv(t, g_heads) for t in (b_dk, b_dv))
    return {name: 1.1 * t for name, t in
            dict(out=b_out, lse=b_lse, dq=b_dq, dk=b_dk, dv=b_dv, p_rel=r).items()}


# ----------------------------------------------------------------------------------------------
# dQ bias along kbar
# ----------------------------------------------------------------------------------------------


def dq_bias_split(dq: torch.Tensor, dq_exact: torch.Tensor, kbar: torch.Tensor):
    """(error along kbar, the rest, fraction of the squared error along kbar), per row split of
    e_i = dq_i - dq_exact_i into (e_i . kbar_i / |kbar_i|^2) kbar_i and the remainder."""
    err = dq.to(torch.float64) - dq_exact.to(torch.float64)
    kb = kbar.to(torch.float64)
    norm2 = (kb * kb).sum(-1, keepdim=True)
    coef = torch.where(norm2 > 0, (err * kb).sum(-1, keepdim=True) / torch.where(norm2 > 0, norm2, 1), 0)
    along = coef * kb
    rest = err - along
    total = (err * err).sum().item()
    if not math.isfinite(total):  # a NaN or an infinity in the error: it has no direction
        return along, rest, math.nan
    fraction = (along * along).sum().item() / total if total > 0 else 0.0
    return along, rest, fraction


# ----------------------------------------------------------------------------------------------
# Evaluation of one recipe
# ----------------------------------------------------------------------------------------------


@dataclass
class Report:
    """One recipe on one problem. Residuals are relative to A_i = sum_j |P_ij dP^_ij|."""

    recipe: str
    rowsum_residual_max: float  #: max_i |r_i| / A_i, dS in the working precision
    rowsum_residual_mean: float  #: mean_i |r_i| / A_i
    rowsum_residual_after_quant_max: float  #: max_i |sum_j Q(dS)_ij| / A_i, dS as the dQ matmul sees it
    rowsum_residual_after_quant_mean: float  #: mean_i |sum_j Q(dS)_ij| / A_i
    rowsum_residual_after_quant_dk_max: float  #: the same for the dK matmul's dS
    rowsum_bound_max: float  #: max_i of matched_rowsum_bound / A_i (the FP32 bound Delta-Matching meets)
    rowsum_over_bound_max: float  #: max_i |r_i| / matched_rowsum_bound_i (<= 1: within the bound)
    dq_rel_err: float
    dk_rel_err: float
    dv_rel_err: float
    out_rel_err: float
    lse_rel_err: float
    dq_bias_fraction: float  #: share of dQ's squared error along kbar_i
    dq_err_along_kbar_rel: float  #: ||error along kbar||_F / ||dQ_exact||_F
    dq_err_rest_rel: float  #: ||the rest||_F / ||dQ_exact||_F
    #: the recipe's results that hold a NaN or an infinity (``out``, ``lse``, ``dq``, ``dk``,
    #: ``dv``, ``dP``: sum_j |P_ij dP^_ij|, ``dS``: the row sums of dS); every diagnostic computed
    #: from one of them is NaN (or inf), never a finite number. Empty: all finite.
    nonfinite: tuple[str, ...] = ()

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Exact:
    """The float64 reference results of one problem (and kbar), computed once per problem."""

    out: torch.Tensor
    lse: torch.Tensor
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    kbar: torch.Tensor
    #: per input (q, k, v, dout, mask, causal, scale) a digest of what it was computed from
    #: (:func:`problem_fingerprint`); :func:`evaluate` refuses the results of another problem
    problem: dict = field(default_factory=dict)


def _digest(t) -> str:
    """sha256 of a tensor's dtype, shape and bytes (or of repr for anything else)."""
    h = hashlib.sha256()
    if isinstance(t, torch.Tensor):
        h.update(f"{t.dtype} {tuple(t.shape)}".encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    else:
        h.update(repr(t).encode())
    return h.hexdigest()


def problem_fingerprint(q, k, v, dout, *, causal=False, scale=None, mask=None) -> dict:
    """{input name: digest} of one attention problem: the bytes, dtype and shape of q, k, v,
    dout and the mask, causal, and the scale as the reference resolves it (None and
    1/sqrt(head_dim) are the same problem). Costs one pass over the inputs."""
    shape = reference.check_attention_inputs(q, k, v, scale=scale, mask=mask, dout=dout)
    return {"q": _digest(q), "k": _digest(k), "v": _digest(v), "dout": _digest(dout), "mask": _digest(mask),
            "causal": _digest(reference.check_causal(causal)), "scale": _digest(shape.scale)}


def _check_finite(**tensors) -> None:
    for name, t in tensors.items():
        bad = int((~torch.isfinite(t)).sum())
        if bad:
            kinds = "/".join(k for k, f in (("NaN", torch.isnan), ("inf", torch.isinf)) if bool(f(t).any()))
            raise ValueError(f"{name} holds {bad} non-finite value(s) ({kinds}) of {t.numel()}: the "
                             "diagnostics compare against the float64 reference and need finite inputs")


def _check_dout(dout) -> None:
    if not isinstance(dout, torch.Tensor):
        raise TypeError(f"dout must be a torch.Tensor of the output's shape (batch, heads, seqlen_q, "
                        f"head_dim_v): the diagnostics need the backward; got {type(dout).__name__}")


def exact_results(q, k, v, dout, *, causal=False, scale=None, mask=None) -> Exact:
    """The float64 reference forward and backward of one problem, and kbar = P K. ``dout`` is
    required (a tensor of the output's shape); ``causal`` a bool."""
    _check_dout(dout)
    out, lse, dq, dk, dv = reference.attention_ref(q, k, v, dout, causal=causal, scale=scale, mask=mask)
    kbar, _ = reference.attention_forward(q, k, k, causal=causal, scale=scale, mask=mask)  # P K
    return Exact(out, lse, dq, dk, dv, kbar,
                 problem_fingerprint(q, k, v, dout, causal=causal, scale=scale, mask=mask))


def _relative_rows(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """|num| / den per row; rows with den = 0 and num finite (fully masked, or dO = 0) count as 0;
    rows where num or den is NaN or infinite are NaN (a max or mean over them is then NaN)."""
    rel = torch.where(den > 0, num.abs() / torch.where(den > 0, den, 1), torch.zeros_like(num))
    return torch.where(torch.isfinite(num) & torch.isfinite(den), rel, torch.full_like(rel, math.nan))


def _nonfinite(fwd, bwd, lse_finite) -> tuple[str, ...]:
    """Names of the recipe's results that hold a NaN or an infinity (Report.nonfinite)."""
    results = {"out": fwd.out, "lse": fwd.stats.lse[lse_finite], "dq": bwd.dq, "dk": bwd.dk, "dv": bwd.dv,
               "dP": bwd.rowsum.abs_pdp, "dS": bwd.rowsum.residual}
    return tuple(name for name, t in results.items() if not bool(torch.isfinite(t).all()))


def evaluate(q, k, v, dout, recipe, *, causal=False, scale=None, mask=None,
             exact: Exact | None = None) -> tuple[Report, "tiled.RowsumStats"]:
    """Run ``recipe`` (tiled forward and backward with diagnostics) and compare with the exact
    reference (computed here unless given). Returns the report and the per-row statistics.

    ``dout`` is required (a tensor of the output's shape), ``causal`` a bool, ``recipe`` a Recipe
    or a preset name, ``exact`` None or :func:`exact_results` of this very problem (checked by
    :func:`problem_fingerprint`); q, k, v and dout finite. TypeError or ValueError otherwise,
    naming the argument.

    Where the recipe itself produces a NaN or an infinity (an overflow of its float32 or FP8
    arithmetic), ``Report.nonfinite`` names the results that hold one and the diagnostics
    computed from them are NaN (or inf), never 0."""
    _check_dout(dout)
    causal = reference.check_causal(causal)
    if exact is not None and not isinstance(exact, Exact):
        raise TypeError(f"exact must be None or dmref.diagnostics.exact_results(...) of this problem, "
                        f"got {type(exact).__name__}")
    recipe = get_recipe(recipe)
    reference.check_attention_inputs(q, k, v, scale=scale, mask=mask, dout=dout)
    _check_finite(q=q, k=k, v=v, dout=dout)
    if exact is None:
        exact = exact_results(q, k, v, dout, causal=causal, scale=scale, mask=mask)
    else:
        given = problem_fingerprint(q, k, v, dout, causal=causal, scale=scale, mask=mask)
        differ = [name for name in given if exact.problem.get(name) != given[name]]
        if differ:
            raise ValueError(f"exact holds the results of another problem: its {', '.join(differ)} "
                             f"{'differs' if len(differ) == 1 else 'differ'} from the one(s) given here; "
                             "pass exact_results(...) of these inputs")
    fwd, bwd = tiled.attention(q, k, v, dout, recipe=recipe, causal=causal, scale=scale, mask=mask,
                               diagnostics=True)
    rs = bwd.rowsum
    active = ~(rs.abs_pdp == 0)  # rows with a product, and rows where sum_j |P dP^| is NaN
    rel = _relative_rows(rs.residual, rs.abs_pdp)
    rel_dq = _relative_rows(rs.residual_dq, rs.abs_pdp)
    rel_dk = _relative_rows(rs.residual_dk, rs.abs_pdp)
    bound = matched_rowsum_bound(rs)
    over = _relative_rows(rs.residual, bound)
    along, rest, fraction = dq_bias_split(bwd.dq, exact.dq, exact.kbar)
    dq_norm = exact.dq.norm().item() or 1.0
    finite = torch.isfinite(exact.lse)
    report = Report(
        recipe=recipe.name,
        rowsum_residual_max=rel.max().item(),
        rowsum_residual_mean=(rel[active].mean().item() if bool(active.any()) else 0.0),
        rowsum_residual_after_quant_max=rel_dq.max().item(),
        rowsum_residual_after_quant_mean=(rel_dq[active].mean().item() if bool(active.any()) else 0.0),
        rowsum_residual_after_quant_dk_max=rel_dk.max().item(),
        rowsum_bound_max=_relative_rows(bound, rs.abs_pdp).max().item(),
        rowsum_over_bound_max=over.max().item(),
        dq_rel_err=relative_error(bwd.dq, exact.dq),
        dk_rel_err=relative_error(bwd.dk, exact.dk),
        dv_rel_err=relative_error(bwd.dv, exact.dv),
        out_rel_err=relative_error(fwd.out, exact.out),
        lse_rel_err=relative_error(fwd.stats.lse[finite], exact.lse[finite]),
        dq_bias_fraction=fraction,
        dq_err_along_kbar_rel=along.norm().item() / dq_norm,
        dq_err_rest_rel=rest.norm().item() / dq_norm,
        nonfinite=_nonfinite(fwd, bwd, finite),
    )
    return report, rs
