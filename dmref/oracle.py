"""The oracle: is *your* attention implementation right?

``dmref.oracle.check(fn, recipe=None, cases="standard", dtype=torch.bfloat16)`` runs
``fn(q, k, v, *, causal, scale) -> out`` (any differentiable torch attention) forward and,
through autograd, backward on the problems of :func:`dmref._oracle_cases.make_cases` (realistic
inputs, outlier channels, peaked and flat rows, a long sequence, tail lengths, extreme
magnitudes, GQA, fully masked rows, an additive mask), and compares against the float64
reference. It returns a
:class:`OracleReport`: every check passed or failed with its bound, the error statistics and
the implementation's row-sum residual measured by the black-box probe (:mod:`dmref.probe`).

What fn is given (SDPA's conventions):

- q, dO ``(batch, heads, seqlen_q, head_dim)``; k, v ``(batch, kv_heads, seqlen_k, head_dim)``
  with ``heads % kv_heads == 0`` (the ``gqa`` case has kv_heads < heads): query head h reads
  key/value head ``h // (heads // kv_heads)``, as ``repeat_interleave`` and SDPA's
  ``enable_gqa``; k.grad and v.grad have kv_heads heads.
- ``mask`` (only if fn has a parameter of that name; without one the masked cases are skipped)
  is boolean (True = attend; ``fully_masked_rows``) or floating in the input dtype, added to the
  scaled scores with -inf removing a position (``additive_mask``: SDPA's float ``attn_mask``).
  Both have rows with no key left: their output and every gradient must be exactly zero.
- An implementation that cannot do a case (no GQA, no float mask, ...) raises
  ``NotImplementedError``: the case is recorded as skipped, not failed.

Errors are componentwise, each element against its own magnitude from the exact problem (the
condition-number-like factor of that element)::

    out:  |O - O*|_id  / (P |V|)_id             dV: |dV - dV*|_jd / (Pᵀ |dO|)_jd
    dQ:   |dQ - dQ*|_id / tau (W |K|)_id         dK: |dK - dK*|_jd / tau (Wᵀ |Q|)_jd
    W_ij = P_ij (|dP_ij| + |D_i|)

(0/0 counts as 0: an element whose magnitude is zero, e.g. a fully masked row, must be exactly
zero.) The statistic of a check is the largest such ratio over the case.

Bounds (module constant :data:`BASELINE_FACTOR` = 2, FlashAttention's test convention). Every
statistic is an *excess*: the part of each element's error beyond ``floor``, the rigorous
a-priori bound of any float32 implementation of attention on that element
(:func:`dmref.diagnostics.attention_error_bound` with u = 2^-24), so an error float32 rounding
can explain never counts, and ill-conditioned elements are judged by their own floor.

- *No recipe* (the implementation claims only to compute attention in its input dtype): the
  baseline is dmref's model of a correct implementation in that dtype, run in the same call on
  the same inputs -- the ``bf16`` preset for bfloat16 (FlashAttention-2's numerics: every matmul
  operand, P, dS and O rounded to BF16, D from the BF16 O), the same with float16, ``fp32`` for
  float32, ``exact`` for float64 -- with outputs rounded to the dtype. A check passes when

      max_e (|X - X*|_e - floor_e)+ / M_e  <=  2 max_e (|X_base - X*|_e - floor_e)+ / M_e.

  In this mode the floor of dQ and dK also holds the delta from the output rounded to the dtype
  (FlashAttention's D_i = dO_i . O_i with its own BF16 O): |D_i - D*_i| <= u a_i,
  a_i = sum_d |dO_id| (|O*_id| + floor_out_id), u the dtype's unit roundoff, which moves dQ_i by
  tau (D_i - D*_i) (P K)_i and dK_j by tau sum_i (D_i - D*_i) P_ij Q_i. Its size and sign depend
  on how each implementation's O happens to round: the baseline realizes one instance (on the
  H200, torch's flash backend rounds 19 of 64 channels of one peaked row of O the other way
  than the bf16 preset, so its D error there is 0.023 against the preset's 0.002, within
  u a_i = 0.12; docs/oracle.md), so it is a bound, not a baseline statistic.

- *Row-sum residual* (both modes): the probe's r^_i = sum_j dS_ij relative to
  A_i = sum_j |P_ij dP_ij| (exact), as a root mean square over the rows, against the
  baseline's residual read from the inside of :mod:`dmref.tiled` (``RowsumStats.residual_dq``:
  dS as the dQ matmul sees it, the same quantity the probe reads), plus the probe's own noise
  as measured by the spread of its two readings (``noise`` = rms_i |r^_a,i - r^_b,i| / A_i)::

      no recipe:  rms_i |r^_i| / A_i <= 2 rms_i |r^base_i| / A_i + noise + gamma_{2n+d+4}(2^-24)
      recipe R:   rms_i |r^_i| / A_i <= rms_R (1 + 3 sigma_rel) + noise

  where sigma_rel is the relative sampling error of an rms over that many rows, from R's own
  rows (:data:`ROWSUM_SAMPLING_SIGMAS`): an implementation of R rounds dS like R, so its
  residual is R's up to sampling, and a stale delta of any size above that shows. A reading the
  probe cannot vouch for (its worst-case bound, :mod:`dmref.probe`) fails the check.
- *Recipe* (``recipe=R``: the implementation claims R's quantization): the baseline is the
  emulated R. The error checks are as above with that baseline. In addition, the
  ``agree_*`` checks ask whether fn makes *R's* rounding errors rather than errors of the same
  size elsewhere (a wrong block axis, a different delta):

      rms_e d(X, X_R)_e <= 2 rms_e d(X_R', X_R)_e + 1/2 rms_e d(X_R, X*)_e,
      d(A, B)_e = (|A - B|_e - floor_e)+ / M_e,

  where R' is R with every matmul accumulated exactly (float64, rounded once): the spread
  between two faithful implementations of R that differ only in accumulation, and the last term
  (:data:`AGREEMENT_FRACTION`) admits the rare FP8 rounding flips another accumulation order or
  exp2 causes, while an implementation whose errors are independent of R's (distance sqrt(2)
  times R's error) fails. Claim ``"name@hopper"`` for an implementation on Hopper FP8 tensor
  cores, whose accumulation is far from float32.
"""

from __future__ import annotations

import inspect
import math
import time
from dataclasses import asdict, dataclass, field, replace

import torch

from . import diagnostics, probe as _probe, reference
from ._oracle_cases import CASE_SETS, Case, make_cases

__all__ = [
    "AGREEMENT_FRACTION",
    "BASELINE_FACTOR",
    "ROWSUM_SAMPLING_SIGMAS",
    "CASE_SETS",
    "Case",
    "CaseResult",
    "Check",
    "OracleReport",
    "baseline_recipe",
    "check",
    "emulated",
    "gqa_kwargs",
    "make_cases",
    "sdpa",
    "sdpa_math",
    "validate_signature",
]

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

_U_FP32 = 2.0**-24
_CHECK_ORDER = ("runs", "finite", "out", "dq", "dk", "dv", "rowsum", "agree_out", "agree_dq", "agree_dk", "agree_dv")


# ==============================================================================================
# Report
# ==============================================================================================


@dataclass
class Check:
    """One check of one case. ``passed`` is None for a skipped check."""

    case: str
    name: str  #: "runs", "finite", "out", "dq", "dk", "dv", "rowsum", "agree_out", ...
    passed: bool | None
    value: float = math.nan  #: the statistic of the implementation
    bound: float = math.nan  #: the bound it is held to
    baseline: float = math.nan  #: the baseline's own statistic the bound is derived from
    detail: str = ""

    @property
    def id(self) -> str:
        return f"{self.case}:{self.name}"


@dataclass
class CaseResult:
    """Statistics of one case beyond pass/fail."""

    name: str
    description: str
    shape: str
    causal: bool
    scale: float
    errors: dict = field(default_factory=dict)  #: check name -> componentwise max error
    rowsum_rms: float = math.nan  #: rms_i |r^_i| / A_i from the probe
    rowsum_max: float = math.nan  #: max_i |r^_i| / A_i
    rowsum_mean_signed: float = math.nan  #: mean_i r^_i / A_i (a persistent sign shows here)
    probe_valid: bool | None = None
    probe_note: str = ""
    dq_bias_fraction: float = math.nan  #: share of dQ's squared error along kbar_i
    seconds: float = 0.0


@dataclass
class OracleReport:
    """Everything :func:`check` found. ``passed`` is True when every check that ran passed."""

    target: str
    mode: str  #: "exact at <dtype> bounds" or "recipe <name>"
    dtype: str
    recipe: str | None
    checks: list[Check] = field(default_factory=list)
    cases: list[CaseResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        ran = [c for c in self.checks if c.passed is not None]
        return bool(ran) and all(c.passed for c in ran)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.passed is False]

    @property
    def skipped(self) -> list[Check]:
        return [c for c in self.checks if c.passed is None]

    def failed_names(self) -> set[str]:
        """The names of the checks that failed in any case ("rowsum", "dk", ...)."""
        return {c.name for c in self.failed}

    def failed_cases(self, name: str | None = None) -> set[str]:
        """The cases in which some check (or the check ``name``) failed."""
        return {c.case for c in self.failed if name is None or c.name == name}

    def as_dict(self) -> dict:
        def clean(x):
            if isinstance(x, float) and not math.isfinite(x):
                return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
            if isinstance(x, dict):
                return {k: clean(v) for k, v in x.items()}
            if isinstance(x, list):
                return [clean(v) for v in x]
            return x

        return clean({
            "target": self.target, "mode": self.mode, "dtype": self.dtype, "recipe": self.recipe,
            "passed": self.passed, "failed": [c.id for c in self.failed],
            "checks": [asdict(c) for c in self.checks], "cases": [asdict(c) for c in self.cases],
        })

    def summary(self) -> str:
        """One line: verdict, counts, the failed checks."""
        ran = [c for c in self.checks if c.passed is not None]
        verdict = "PASSED" if self.passed else "FAILED"
        line = (f"{verdict}: {self.target} ({self.mode}): {sum(bool(c.passed) for c in ran)}/{len(ran)} checks "
                f"passed, {len(self.skipped)} skipped")
        if self.failed:
            line += "; failed: " + ", ".join(c.id for c in self.failed)
        return line

    def table(self, *, title: str | None = None):
        """A rich Table: one row per case, one column per check (value / bound, marked)."""
        from rich.table import Table

        names = [n for n in _CHECK_ORDER if any(c.name == n and c.passed is not None for c in self.checks)]
        if any(c.name == "runs" and c.passed is not None and not c.passed for c in self.checks):
            names = [n for n in names if n != "finite"]
        table = Table(title=title or f"dmref check: {self.target} ({self.mode})", title_justify="left")
        table.add_column("case")
        table.add_column("shape")
        for n in names:
            table.add_column(n, justify="right")
        table.add_column("rowsum rms (probe)", justify="right")
        table.add_column("dQ bias", justify="right")
        by_case: dict[str, dict[str, Check]] = {}
        for c in self.checks:
            by_case.setdefault(c.case, {})[c.name] = c
        for cr in self.cases:
            row = [cr.name, cr.shape]
            checks = by_case.get(cr.name, {})
            for n in names:
                c = checks.get(n)
                if c is None:
                    row.append("")
                elif c.passed is None:
                    row.append("[dim]skip[/dim]")
                elif n in ("runs", "finite"):
                    row.append("[green]ok[/green]" if c.passed else f"[red]FAIL[/red] {c.detail[:40]}")
                else:
                    cell = f"{c.value:.2g} / {c.bound:.2g}"
                    row.append(f"[green]{cell}[/green]" if c.passed else f"[bold red]{cell} FAIL[/bold red]")
            probe_cell = "" if math.isnan(cr.rowsum_rms) else f"{cr.rowsum_rms:.2g}"
            if cr.probe_valid is False:
                probe_cell += " [yellow](invalid)[/yellow]"
            row.append(probe_cell)
            row.append("" if math.isnan(cr.dq_bias_fraction) else f"{cr.dq_bias_fraction:.2f}")
            table.add_row(*row)
        table.caption = ("cells: statistic / bound. out..dv: max over elements of the error beyond the "
                         "float32 bound, in units of the element's magnitude; rowsum: rms over rows of "
                         "|sum_j dS_ij| / sum_j |P_ij dP_ij|, read by the probe; agree_*: rms distance to "
                         "the emulated recipe. " + self.summary())
        return table

    def raise_for_failures(self) -> None:
        """Raise AssertionError with the summary and each failed check when a check failed."""
        if self.passed:
            return
        lines = [self.summary()]
        for c in self.failed:
            if math.isnan(c.value):
                lines.append(f"  {c.id}: {c.detail}")
            else:
                lines.append(f"  {c.id}: {c.value:.3g} > bound {c.bound:.3g} (baseline {c.baseline:.3g}) {c.detail}")
        if not self.failed:
            lines.append("  no check ran")
        raise AssertionError("\n".join(lines))


# ==============================================================================================
# The implementation under test
# ==============================================================================================


def validate_signature(fn) -> bool:
    """Check that ``fn(q, k, v, causal=..., scale=...)`` is a valid call. Returns whether fn
    also takes ``mask``. Raises TypeError naming what is wrong."""
    if not callable(fn):
        raise TypeError(f"the attention implementation must be callable, got {type(fn).__name__}")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: trust the call
        return False
    try:
        sig.bind(None, None, None, causal=False, scale=1.0)
    except TypeError as e:
        raise TypeError(
            f"{_name(fn)}{sig} cannot be called as fn(q, k, v, *, causal, scale): {e}. The oracle "
            "calls fn(q, k, v, causal=bool, scale=float) with (batch, heads, seqlen, head_dim) tensors "
            "and expects the attention output."
        ) from None
    return "mask" in sig.parameters


def _name(fn) -> str:
    module = getattr(fn, "__module__", None) or ""
    qual = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    return f"{module}:{qual}" if module else qual


def _call(fn, case: Case, k, device):
    q_, k_, v_ = (t.detach().clone().to(device).requires_grad_(True) for t in (case.q, k, case.v))
    kwargs = dict(causal=case.causal, scale=case.scale)
    if case.mask is not None:
        kwargs["mask"] = case.mask.to(device)
    out = fn(q_, k_, v_, **kwargs)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"fn returned {type(out).__name__}, not a tensor")
    expected = (*case.q.shape[:-1], case.v.shape[-1])
    if tuple(out.shape) != expected:
        raise ValueError(f"fn returned shape {tuple(out.shape)}, expected {expected}")
    out.backward(case.dout.to(device=device, dtype=out.dtype))
    grads = (q_.grad, k_.grad, v_.grad)
    if any(g is None for g in grads):
        missing = [n for n, g in zip("qkv", grads) if g is None]
        raise ValueError(f"no gradient reached {', '.join(missing)}: fn is not differentiable in them")
    return tuple(t.detach() for t in (out, *grads))


def _cpu64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", torch.float64)


# ==============================================================================================
# Baselines and magnitudes
# ==============================================================================================


def baseline_recipe(dtype: torch.dtype):
    """dmref's model of a correct attention computed in ``dtype`` (see the module docstring)."""
    from .recipes import PRESETS, QuantPoint

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
class _Exact:
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


def _exact(case: Case) -> _Exact:
    q, k, v, do = (_cpu64(t) for t in (case.q, case.k, case.v, case.dout))
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
    bounds = diagnostics.attention_error_bound(q, k, v, do, u=_U_FP32, causal=case.causal, scale=case.scale,
                                               mask=mask, n_tiles=k.shape[-2])
    kbar, _ = reference.attention_forward(q, k, k, causal=case.causal, scale=case.scale, mask=mask)
    # a delta from the output rounded to the dtype: |D_i - D*_i| <= u_out a_i with
    # a_i = sum_d |dO_id| (|O*_id| + floor_out_id); it moves dS_ij by P_ij (D_i - D*_i), so dQ_i by
    # tau (D_i - D*_i) (P K)_i and dK_j by tau sum_i (D_i - D*_i) P_ij Q_i (per unit of u_out)
    a = (do.abs() * (out.abs() + bounds["out"])).sum(-1, keepdim=True)
    stale = {"dq": tau * a * (p @ kx.abs()),
             "dk": reference.reduce_kv(tau * (p * a).transpose(-1, -2) @ q.abs(), g)}
    return _Exact(out, dq, dk, dv, mags, {n: bounds[n] for n in mags}, (p * dp).abs().sum(-1),
                  w.sum(-1), kbar, stale)


def _ratio(err: torch.Tensor, mag: torch.Tensor) -> torch.Tensor:
    """err / mag elementwise with 0/0 = 0 and x/0 = inf (NaN stays NaN)."""
    safe = torch.where(mag > 0, mag, torch.ones_like(mag))
    r = err / safe
    return torch.where(mag > 0, r, torch.where(err == 0, torch.zeros_like(err), torch.full_like(err, math.inf)))


def _excess(diff: torch.Tensor, floor: torch.Tensor, mag: torch.Tensor) -> torch.Tensor:
    """(|diff| - floor)+ / mag elementwise, the error float32 rounding cannot explain, in units
    of each element's magnitude (NaN stays NaN)."""
    over = diff.abs() - floor
    return _ratio(torch.where(over > 0, over, torch.where(torch.isnan(over), over, torch.zeros_like(over))), mag)


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


def _max(t: torch.Tensor) -> float:
    if t.numel() == 0:
        return 0.0
    if bool(torch.isnan(t).any()):
        return math.nan
    return t.max().item()


def _rms(t: torch.Tensor) -> float:
    if t.numel() == 0:
        return 0.0
    return t.pow(2).mean().sqrt().item()


def _run_recipe(case: Case, recipe, dtype):
    """The emulated ``recipe`` on the case: outputs rounded to ``dtype`` (as dmref.attention
    returns them) and the row statistics."""
    from . import tiled

    q, k, v, do = (t.detach().cpu() for t in (case.q, case.k, case.v, case.dout))
    fwd, bwd = tiled.attention(q, k, v, do, recipe=recipe, causal=case.causal, scale=case.scale, mask=case.mask,
                               diagnostics=True)
    outs = tuple(_cpu64(t.to(dtype)) for t in (fwd.out, bwd.dq, bwd.dk, bwd.dv))
    return outs, bwd.rowsum


# ==============================================================================================
# check
# ==============================================================================================


def _dq_accumulation_u(claimed) -> float:
    """The probe's accumulation unit roundoff for a claim (see :func:`check`)."""
    if claimed is None:
        return _U_FP32
    fp8 = [p for p in (claimed.ds_dq, claimed.k_dq)
           if p.quantized and p.fmt.is_fp8]
    return 2.0**-13 if fp8 else _U_FP32


def check(fn, *, recipe=None, cases="standard", dtype: torch.dtype = torch.bfloat16, device="cpu",
          seed: int = 0, probe: bool = True, accumulation_u: float | None = None, progress=None,
          target: str | None = None) -> OracleReport:
    """Run the oracle on ``fn(q, k, v, *, causal, scale[, mask]) -> out``.

    Args:
        fn: a differentiable attention; tensors ``(batch, heads, seqlen, head_dim)``, k and v
            possibly with fewer heads (GQA); ``mask``, if fn takes it, boolean (True = attend) or
            floating (additive, in the input dtype). fn raises ``NotImplementedError`` for a
            case it cannot do (the case is skipped). See the module docstring.
        recipe: a :class:`dmref.recipes.Recipe` or preset name the implementation claims to
            implement (``"naive_fp8@hopper"`` ...), or None: exact attention at ``dtype``'s bounds.
        cases: a case-set name (``"quick"``, ``"standard"``, ``"thorough"``), a list of case
            names of the standard set, or a list of :class:`Case`.
        dtype: the input dtype (bfloat16 by default; every case is rounded to it).
        device: where fn runs (the reference runs on the CPU in float64).
        probe: measure the row-sum residual with :mod:`dmref.probe` (two more fn calls per case
            become one: the probe reuses the main run).
        accumulation_u: unit roundoff of fn's dQ accumulation for the probe's error bound
            (default: 2^-13, the Hopper FP8 tensor core's 13 kept fractional bits, when the
            claimed recipe feeds FP8 dS and K to the dQ matmul, whatever accumulation model it
            names; else float32's 2^-24).
        progress: called as ``progress(case_name, index, total)`` before each case.
        target: the name shown in the report (default: fn's module and name).

    Returns:
        :class:`OracleReport`; ``report.raise_for_failures()`` turns it into an assertion.
    """
    from .recipes import get_recipe

    takes_mask = validate_signature(fn)
    claimed = get_recipe(recipe) if recipe is not None else None
    base = claimed if claimed is not None else baseline_recipe(dtype)
    spread_recipe = None
    if claimed is not None:
        spread_recipe = claimed.with_accumulation("exact")
    if accumulation_u is None:
        accumulation_u = _dq_accumulation_u(claimed)
    if isinstance(cases, str):
        case_list = make_cases(cases, dtype=dtype, seed=seed, probe=probe)
    elif cases and all(isinstance(c, str) for c in cases):
        case_list = make_cases("standard", dtype=dtype, seed=seed, names=list(cases), probe=probe)
    else:
        case_list = list(cases)
    dtype_name = str(dtype).replace("torch.", "")
    mode = f"recipe {claimed.name}" if claimed is not None else f"exact at {dtype_name} bounds"
    report = OracleReport(target or _name(fn), mode, dtype_name, claimed.name if claimed else None)

    for index, case in enumerate(case_list):
        if progress is not None:
            progress(case.name, index, len(case_list))
        t0 = time.perf_counter()
        cr = CaseResult(case.name, case.description, case.shape, case.causal, case.scale)
        report.cases.append(cr)
        checks = _check_case(fn, case, base, claimed, spread_recipe, dtype, device, takes_mask, probe,
                             accumulation_u, cr)
        report.checks.extend(checks)
        cr.seconds = time.perf_counter() - t0
    return report


def _check_case(fn, case, base, claimed, spread_recipe, dtype, device, takes_mask, probe, u_acc, cr):
    checks: list[Check] = []
    add = lambda name, passed, **kw: checks.append(Check(case.name, name, passed, **kw))  # noqa: E731
    if case.mask is not None and not takes_mask:
        add("runs", None, detail="fn takes no mask argument")
        return checks
    try:
        got = _call(fn, case, case.k, device)
    except NotImplementedError as e:
        add("runs", None, detail=f"fn raised NotImplementedError: {e}")
        return checks
    except Exception as e:  # noqa: BLE001 - any failure of the implementation is a finding
        add("runs", False, detail=f"{type(e).__name__}: {e}")
        return checks
    add("runs", True)
    got64 = tuple(_cpu64(t) for t in got)
    ex = _exact(case)
    exact = (ex.out, ex.dq, ex.dk, ex.dv)
    finite = all(bool(torch.isfinite(t).all()) for t in got64)
    add("finite", finite, detail="" if finite else "NaN or inf in " + ", ".join(
        n for n, t in zip(("out", "dq", "dk", "dv"), got64) if not bool(torch.isfinite(t).all())))

    base_outs, base_rows = _run_recipe(case, base, dtype)
    u_out = torch.finfo(dtype).eps / 2
    for name, x, b, e in zip(("out", "dq", "dk", "dv"), got64, base_outs, exact):
        mag, floor = ex.mags[name], ex.floors[name]
        if claimed is None and name in ex.stale_per_u:
            floor = floor + u_out * ex.stale_per_u[name]  # D from the output rounded to the dtype
        err = _max(_excess(x - e, floor, mag))
        err_base = _max(_excess(b - e, floor, mag))
        bound = BASELINE_FACTOR * err_base
        cr.errors[name] = _max(_ratio((x - e).abs(), mag))
        add(name, bool(err <= bound), value=err, bound=bound, baseline=err_base)

    if claimed is not None:
        spread_outs, _ = _run_recipe(case, spread_recipe, dtype)
        for name, x, b, s, e in zip(("out", "dq", "dk", "dv"), got64, base_outs, spread_outs, exact):
            mag, floor = ex.mags[name], ex.floors[name]
            dist = _rms(_excess(x - b, floor, mag))
            spread = _rms(_excess(s - b, floor, mag))
            own = _rms(_excess(b - e, floor, mag))
            bound = BASELINE_FACTOR * spread + AGREEMENT_FRACTION * own
            add(f"agree_{name}", bool(dist <= bound), value=dist, bound=bound, baseline=own)

    # dQ's error along kbar_i (a stale delta puts it there)
    _, _, frac = diagnostics.dq_bias_split(got64[1], ex.dq, ex.kbar)
    cr.dq_bias_fraction = frac

    if probe and case.probe is not None:
        try:
            pr = _probe.run_probe(
                fn, case.q.to(device), case.k.to(device), case.v.to(device), case.dout.to(device),
                case.probe, causal=case.causal, scale=case.scale,
                mask=case.mask.to(device) if case.mask is not None else None, base=got,
                abs_ds_bound=2 * ex.abs_ds, u_acc=u_acc)
        except Exception as e:  # noqa: BLE001
            add("rowsum", False, detail=f"probe run failed: {type(e).__name__}: {e}")
            return checks
        active = ex.abs_pdp > 0
        a = ex.abs_pdp[active]
        rel = pr.residual.cpu()[active] / a
        rel_base = base_rows.residual_dq[active] / a
        # the probe's own noise, measured: two null channels read the same sum with different
        # roundings (the worst-case bound pe_i only decides whether the reading is valid)
        noise = _rms(pr.spread.cpu()[active] / a)
        cr.rowsum_rms, cr.rowsum_max = _rms(rel), _max(rel.abs())
        cr.rowsum_mean_signed = rel.mean().item() if rel.numel() else 0.0
        cr.probe_valid = pr.valid
        notes = []
        if not pr.zero_before:
            notes.append("dQ was not zero on the null channels")
        if not pr.consistent:
            notes.append("the two null channels disagree beyond the bound")
        if pr.invariance_detail:
            notes.append("shifting K changed " + pr.invariance_detail)
        cr.probe_note = "; ".join(notes)
        base_rms = _rms(rel_base)
        if claimed is None:
            # plus the float32 floor every correct float32-accumulating implementation may reach
            # (as the error checks count only the excess over the rigorous float32 bound): per
            # row, relative to A_i, |1 - sigma_i| + gamma_c sigma_i + 2 gamma_2 with D summed
            # over at most n keys of P V and d channels of dO O: below gamma_{2n + d + 4}
            n_keys, head_dim = case.k.shape[-2], case.q.shape[-1]
            fp32_floor = diagnostics.gamma(2 * n_keys + head_dim + 4, _U_FP32)
            bound = BASELINE_FACTOR * base_rms + noise + fp32_floor
        else:
            bound = base_rms * (1 + ROWSUM_SAMPLING_SIGMAS * _rms_sampling_rel_std(rel_base)) + noise
        value = cr.rowsum_rms
        if pr.valid:
            add("rowsum", bool(value <= bound), value=value, bound=bound, baseline=base_rms, detail=cr.probe_note)
        else:
            add("rowsum", False, value=value, bound=bound, baseline=base_rms,
                detail="probe not valid for this implementation: " + cr.probe_note)
    return checks


# ==============================================================================================
# Ready-made targets (for ``dmref check dmref.oracle:sdpa_math`` and the docs)
# ==============================================================================================


def gqa_kwargs(q, k) -> dict:
    """``{"enable_gqa": True}`` when k has fewer heads than q (SDPA, torch >= 2.5, needs it to
    read key/value head h // (H // Hkv) for query head h), else ``{}`` (older torch then works
    on everything but GQA)."""
    return {"enable_gqa": True} if q.shape[-3] != k.shape[-3] else {}


def sdpa_math(q, k, v, *, causal=False, scale=None, mask=None):
    """torch's scaled_dot_product_attention, math backend. ``mask``: boolean (True = attend) or
    floating (added to the scaled scores); k, v may have fewer heads than q (GQA)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    with sdpa_kernel(SDPBackend.MATH):
        return scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                            **gqa_kwargs(q, k))


def sdpa(q, k, v, *, causal=False, scale=None, mask=None):
    """torch's scaled_dot_product_attention, whatever backend torch picks (mask and GQA as
    :func:`sdpa_math`)."""
    from torch.nn.functional import scaled_dot_product_attention

    return scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, **gqa_kwargs(q, k))


def emulated(recipe):
    """``dmref.attention`` with ``recipe`` as an oracle target (``fn(q, k, v, *, causal, scale,
    mask)``; GQA and boolean or additive masks as :func:`dmref.attention`); also reachable as
    ``dmref.oracle:emulated_<preset>`` from the command line."""
    from .api import attention

    def fn(q, k, v, *, causal=False, scale=None, mask=None):
        return attention(q, k, v, causal=causal, scale=scale, mask=mask, recipe=recipe)

    name = recipe if isinstance(recipe, str) else recipe.name
    fn.__name__ = fn.__qualname__ = f"emulated_{name}"
    return fn


def __getattr__(name: str):
    if name.startswith("emulated_"):
        from .recipes import get_recipe

        preset = name[len("emulated_"):]
        get_recipe(preset)  # raises ValueError for an unknown preset
        return emulated(preset)
    raise AttributeError(f"module 'dmref.oracle' has no attribute {name!r}")
