"""Magnitudes and bounds: the exact problem (float64), the floor of rigorous float32 (float64)
error bounds, the baseline recipe the bounds are derived from, and the factors they use
(docs/oracle.md, "The checks and their bounds")."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from .. import diagnostics, reference
from .cases import Case
from ..emulation.constants import U_FP32, U_FP64, U_WGMMA

__all__ = ["AGREEMENT_FRACTION", "BASELINE_FACTOR", "ROWSUM_SAMPLING_SIGMAS", "baseline_recipe",
           "floor_unit_roundoff", "rounding_allowance"]

#: An implementation may err up to this many times its baseline's own error (FlashAttention's
#: tests use 2 for the kernel against a plain PyTorch implementation in the same precision).
BASELINE_FACTOR = 2.0

#: A faithful implementation of a recipe makes the recipe's rounding errors: its distance to the
#: emulated recipe is at most this fraction of the recipe's own error against exact attention
#: (rms). An implementation whose errors are independent of the recipe's but of the same size
#: sits at sqrt(2); one that rounds the same values differently in rare places (another
#: accumulation order or exp2 moving P across an FP8 rounding boundary) near 0.
AGREEMENT_FRACTION = 0.5

#: In recipe mode the implementation's dS rounding noise must match the recipe's: its row-sum rms
#: may exceed the emulated recipe's by this many standard deviations of an rms estimated from
#: that many rows (the sampling error of the statistic, measured from the recipe's own rows).
ROWSUM_SAMPLING_SIGMAS = 3.0


def cpu64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", torch.float64)


def baseline_recipe(dtype: torch.dtype):
    """dmref's model of a correct attention computed in ``dtype`` (see the module docstring)."""
    from ..recipes import PRESETS, QuantPoint

    if dtype == torch.bfloat16:
        return PRESETS["bf16"]
    if dtype == torch.float16:
        fp16 = QuantPoint("float16")
        bf16 = PRESETS["bf16"]
        points = {name: fp16 for name, p in bf16.points().items() if p.quantized}
        delta = replace(bf16.delta, do=fp16)
        return replace(bf16, name="fp16", delta=delta, **points)
    if dtype == torch.float32:
        return PRESETS["fp32"]
    if dtype == torch.float64:
        return PRESETS["exact"]
    raise TypeError(f"no baseline for input dtype {dtype}")


@dataclass
class ExactReference:
    out: torch.Tensor
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    mags: dict  #: check name -> per-element magnitude
    floors: dict  #: check name -> per-element float32 bound
    abs_pdp: torch.Tensor  #: A_i
    abs_ds: torch.Tensor  #: sum_j P_ij (|dP_ij| + |D_i|) >= sum_j |dS_ij|
    kbar: torch.Tensor
    stale_per_u: dict  #: check name -> per-element allowance of a delta from the rounded O, per unit of u_out


def floor_unit_roundoff(dtype: torch.dtype) -> float:
    """The unit roundoff of the arithmetic the floor of the error checks allows: float32's 2^-24
    (every attention in bfloat16, float16 or float32 may accumulate in float32), float64's
    2^-53 for float64 inputs: a float64 claim is a claim to compute in float64, and an
    implementation that computes in float32 fails it."""
    return U_FP64 if dtype == torch.float64 else U_FP32


def exact_reference(case: Case) -> ExactReference:
    """The float64 reference of a case (``dmref.reference.attention_ref`` on the CPU): out, dQ,
    dK, dV, each element's magnitude (the sums its error bounds scale with), the float32 floors,
    sum_j |P dP| per row, k-bar and the stale-delta terms; what every check compares fn with."""
    u_floor = floor_unit_roundoff(case.q.dtype)
    q, k, v, do = (cpu64(t) for t in (case.q, case.k, case.v, case.dout))
    mask = case.mask
    out, lse, dq, dk, dv = reference.attention_ref(q, k, v, do, causal=case.causal, scale=case.scale, mask=mask)
    shape = reference.check_attention_inputs(q, k, v, scale=case.scale, mask=mask)
    s = reference.scores(q, k, shape, case.causal, mask)
    lse_safe = torch.where(lse == -math.inf, torch.full_like(lse, math.inf), lse)[..., None]
    p = torch.exp(s - lse_safe)
    # GQA: every query head against its key/value head; dK's and dV's magnitudes summed over
    # the query heads of a group, as the gradients are
    g = shape.groups
    kx, vx = reference.expand_kv(k, g), reference.expand_kv(v, g)
    dp = do @ vx.transpose(-1, -2)
    delta = (do * out).sum(-1, keepdim=True)
    w = p * (dp.abs() + delta.abs())
    tau = shape.scale
    mags = {
        "out": p @ vx.abs(),
        "dq": tau * (w @ kx.abs()),
        "dk": reference.reduce_kv(tau * (w.transpose(-1, -2) @ q.abs()), g),
        "dv": reference.reduce_kv(p.transpose(-1, -2) @ do.abs(), g),
    }
    bounds = diagnostics.attention_error_bound(q, k, v, do, u=u_floor, causal=case.causal, scale=case.scale,
                                               mask=mask, n_tiles=k.shape[-2])
    kbar, _ = reference.attention_forward(q, k, k, causal=case.causal, scale=case.scale, mask=mask)
    # a delta from the output rounded to the dtype: |D_i - D*_i| <= u_out a_i with
    # a_i = sum_d |dO_id| (|O*_id| + floor_out_id); it moves dS_ij by P_ij (D_i - D*_i), so dQ_i by
    # tau (D_i - D*_i) (P K)_i and dK_j by tau sum_i (D_i - D*_i) P_ij Q_i (per unit of u_out)
    a = (do.abs() * (out.abs() + bounds["out"])).sum(-1, keepdim=True)
    stale = {"dq": tau * a * (p @ kx.abs()),
             "dk": reference.reduce_kv(tau * (p * a).transpose(-1, -2) @ q.abs(), g)}
    return ExactReference(out, dq, dk, dv, mags, {n: bounds[n] for n in mags}, (p * dp).abs().sum(-1),
                  w.sum(-1), kbar, stale)


def elementwise_ratio(err: torch.Tensor, mag: torch.Tensor) -> torch.Tensor:
    """err / mag elementwise with 0/0 = 0 and x/0 = inf (NaN stays NaN)."""
    safe = torch.where(mag > 0, mag, torch.ones_like(mag))
    r = err / safe
    return torch.where(mag > 0, r, torch.where(err == 0, torch.zeros_like(err), torch.full_like(err, math.inf)))


def excess_beyond(diff: torch.Tensor, floor: torch.Tensor, mag: torch.Tensor) -> torch.Tensor:
    """(|diff| - floor)+ / mag elementwise, the error float32 rounding cannot explain, in units
    of each element's magnitude (NaN stays NaN)."""
    over = diff.abs() - floor
    return elementwise_ratio(torch.where(over > 0, over, torch.where(torch.isnan(over), over, torch.zeros_like(over))), mag)


def _rms_sampling_rel_std(x: torch.Tensor) -> float:
    """Relative standard deviation of rms(x) as an estimate from len(x) samples (delta method:
    var(mean x^2) = var(x^2) / n, and rms = sqrt(mean x^2) halves the relative spread)."""
    n = x.numel()
    if n < 2:
        return math.inf
    x2 = x.to(torch.float64) ** 2
    mean = x2.mean().item()
    if mean == 0:
        return 0.0
    return 0.5 * x2.std().item() / (mean * math.sqrt(n))


def max_value(t: torch.Tensor) -> float:
    """The largest element as a float: 0 for an empty tensor, NaN if any element is NaN."""
    if t.numel() == 0:
        return 0.0
    if bool(torch.isnan(t).any()):
        return math.nan
    return t.max().item()


def root_mean_square(t: torch.Tensor) -> float:
    if t.numel() == 0:
        return 0.0
    return t.pow(2).mean().sqrt().item()


def run_recipe(case: Case, recipe, dtype):
    """The emulated ``recipe`` on the case: outputs rounded to ``dtype`` (as dmref.attention
    returns them) and the row statistics."""
    from .. import tiled

    q, k, v, do = (t.detach().cpu() for t in (case.q, case.k, case.v, case.dout))
    fwd, bwd = tiled.attention(q, k, v, do, recipe=recipe, causal=case.causal, scale=case.scale, mask=case.mask,
                               diagnostics=True)
    outs = tuple(cpu64(t.to(dtype)) for t in (fwd.out, bwd.dq, bwd.dk, bwd.dv))
    return outs, bwd.rowsum


def dq_accumulation_u(claimed) -> float:
    """The probe's accumulation unit roundoff for a claim (see :func:`dmref.oracle.check`)."""
    if claimed is None:
        return U_FP32
    fp8 = [p for p in (claimed.ds_dq, claimed.k_dq)
           if p.quantized and p.fmt.is_fp8]
    return U_WGMMA if fp8 else U_FP32


def rounding_allowance(dtype: torch.dtype) -> float:
    """The unit roundoff u of ``dtype``: an implementation rounds each result to its output
    dtype, an error of up to u |X*_e|. On the elements where the baseline's error lies within the
    float32 floor (its excess is exactly 0, a bound of 2 x 0), the error checks do not count
    2 u |X*_e| of fn's error (:data:`BASELINE_FACTOR` roundings of the element's own value), so
    that an implementation that rounds as its dtype allows passes there."""
    return torch.finfo(dtype).eps / 2


def rowsum_bound(case, plan, rel_base: torch.Tensor, noise: float) -> float:
    """The rowsum bound: twice the baseline's rms plus the probe's noise and the float32 floor
    (exact mode), or the claimed recipe's rms up to its sampling error plus the noise."""
    base_rms = root_mean_square(rel_base)
    if plan.claimed is None:
        # the float32 floor every correct float32-accumulating implementation may reach (as the
        # error checks count only the excess over the rigorous float32 bound; float64's for a
        # float64 claim): per row, relative to A_i, |1 - sigma_i| + gamma_c sigma_i + 2 gamma_2
        # with D summed over at most n keys of P V and d channels of dO O: below gamma_{2n + d + 4}
        n_keys, head_dim = case.k.shape[-2], case.v.shape[-1]
        u_floor = floor_unit_roundoff(plan.dtype)
        return BASELINE_FACTOR * base_rms + noise + diagnostics.gamma(2 * n_keys + head_dim + 4, u_floor)
    return base_rms * (1 + ROWSUM_SAMPLING_SIGMAS * _rms_sampling_rel_std(rel_base)) + noise
