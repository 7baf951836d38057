"""The checks: :func:`check` runs every case (:mod:`dmref.oracle.runner`), holds fn's results to the bounds
(:mod:`dmref.oracle.bounds`) and the calling contract, reads the row sums with the probe, and writes the
report (:mod:`dmref.oracle.report`)."""

from __future__ import annotations

import functools
import inspect
import math
import time
from dataclasses import dataclass

import torch

from .. import diagnostics, probe as _probe
from .._oracle_cases import CAUSAL_ALIGNMENTS, DEFAULT_CASES, Case, check_bool, check_head_dim, check_seed, make_cases
from .bounds import (AGREEMENT_FRACTION, BASELINE_FACTOR, _cpu64, _dq_accumulation_u, _excess, exact_reference, max_value, elementwise_ratio, _rms,
                     _rowsum_bound, _run_recipe, baseline_recipe, rounding_allowance)
from .report import CaseResult, Check, OracleReport
from .runner import (_DEVICE_FAULT, TargetUnavailable, _call, _check_accumulation_u, _exit_detail,
                     _is_device_fault, _name, _same, _takes, check_timeout, device_problem, resolve_dtype, run_case,
                     validate_signature)

__all__ = ["OPTIONAL_FEATURES", "check"]

#: optional features of an implementation; a case exercising one that fn cannot do is reported
#: ``unsupported`` unless the feature is required (``check(..., require=...)``)
OPTIONAL_FEATURES = ("gqa", "mask", "window", "documents")


@dataclass
class _Plan:
    """What :func:`check` holds every case to."""

    base: object  #: the baseline recipe
    claimed: object  #: the claimed recipe or None
    spread_recipe: object  #: the claimed recipe accumulated exactly (agreement checks) or None
    dtype: torch.dtype
    device: object
    takes: frozenset  #: the optional arguments fn takes (mask, window, documents)
    probe: bool
    u_acc: float
    require: frozenset
    alignment: str = "top_left"  #: the causal alignment fn is checked under
    contract_case: str | None = None  #: the case the once-per-check checks run on (:func:`_once_checks`)


def _case_list(cases, dtype, seed, probe, head_dim) -> list[Case]:
    if isinstance(cases, str):
        return make_cases(cases, dtype=dtype, seed=seed, probe=probe, head_dim=head_dim)
    if cases and all(isinstance(c, str) for c in cases):
        return make_cases("standard", dtype=dtype, seed=seed, names=list(cases), probe=probe, head_dim=head_dim)
    return list(cases)


def _contract_case(cases) -> str | None:
    """The first case that is not causal, has no mask, the default scale and contiguous inputs:
    where a call that leaves out causal, scale and mask must give the case's result."""
    for c in cases:
        if (not c.causal and c.mask is None and not c.fn_kwargs() and c.layout == "contiguous"
                and c.scale == 1 / math.sqrt(c.q.shape[-1])):
            return c.name
    return None


def _check_require(require) -> frozenset:
    require = frozenset([require] if isinstance(require, str) else (require or ()))
    unknown = sorted(require - set(OPTIONAL_FEATURES))
    if unknown:
        raise ValueError(f"require={unknown} names no optional feature; known: {', '.join(OPTIONAL_FEATURES)}")
    return require


def check(fn, *, recipe=None, cases=DEFAULT_CASES, dtype: torch.dtype | str = torch.bfloat16, device="cpu",
          seed: int = 0, probe: bool = True, accumulation_u: float | None = None, progress=None,
          target: str | None = None, head_dim: int | None = None, require=(),
          timeout: float | None = None, causal_alignment: str | None = None) -> OracleReport:
    """Run the oracle on ``fn(q, k, v, *, causal, scale[, mask]) -> out`` (module docstring).

    Args:
        fn: a differentiable attention (module docstring: what fn must be).
        recipe: a :class:`dmref.recipes.Recipe` or preset name the implementation claims to
            implement (``"naive_fp8@hopper"`` ...), or None: exact attention at ``dtype``'s bounds.
        cases: a case-set name (``"quick"``, ``"standard"`` (the default,
            :data:`DEFAULT_CASES`), ``"thorough"``), a list of case names of the standard set
            (each at most once), or a list of :class:`Case`.
        dtype: the input dtype (bfloat16 by default; every case is rounded to it): a torch
            floating dtype or one of the names ``dmref check --dtype`` takes
            (:data:`dmref.oracle.runner.DTYPE_NAMES`: ``"bf16"``, ``"float16"``, ...).
        device: where fn runs (the reference runs on the CPU in float64); a device that
            cannot hold and return data here (``"meta"``, ``"cuda"`` without a GPU) is
            refused (ValueError).
        probe: measure the row-sum residual with :mod:`dmref.probe` (one more fn call per
            case); True or False only.
        accumulation_u: unit roundoff of fn's dQ accumulation for the probe's error bound, a
            number in (0, 1) (default: 2^-13, the Hopper FP8 tensor core's 13 kept fractional
            bits, when the claimed recipe feeds FP8 dS and K to the dQ matmul; else float32's
            2^-24).
        progress: called as ``progress(case_name, index, total)`` before each case.
        target: the name shown in the report (default: fn's module and name).
        head_dim: every case at this head dim, Q, K and V alike (cases given by name or set
            only); None: each case's own (64; 96, 256, 192 and 128 in the head-dim cases).
        require: optional features (:data:`OPTIONAL_FEATURES`) fn must do: a case exercising
            one fails instead of being reported unsupported.
        timeout: seconds per case (fn's calls and the oracle's work on that case), a finite
            number in (0, :data:`dmref.oracle.runner.MAX_TIMEOUT`]; a case that takes longer fails ``runs`` and the
            remaining cases are not run.
        seed: an int in [0, :data:`dmref._oracle_cases.MAX_SEED`].
        causal_alignment: how fn aligns a causal mask when seqlen_q != seqlen_k:
            ``"top_left"`` (SDPA's ``is_causal``: query i sees keys j <= i) or
            ``"bottom_right"`` (FlashAttention >= 2.1: j <= i + seqlen_k - seqlen_q). None:
            fn's attribute ``causal_alignment`` if it has one (dmref's ``emulated_<preset>``
            targets declare ``"bottom_right"``), else ``"top_left"``.

    Returns:
        :class:`OracleReport`; ``report.raise_for_failures()`` turns it into an assertion.
    """
    from ..recipes import get_recipe

    validate_signature(fn)
    takes = _takes(fn)
    claimed = get_recipe(recipe) if recipe is not None else None
    dtype = resolve_dtype(dtype)
    check_bool("probe", probe)
    timeout = check_timeout(timeout)
    accumulation_u = _check_accumulation_u(accumulation_u)
    check_seed(seed)
    check_head_dim(head_dim)
    problem = device_problem(device)
    if problem:
        raise ValueError(problem)
    alignment = causal_alignment if causal_alignment is not None else getattr(fn, "causal_alignment", "top_left")
    if alignment not in CAUSAL_ALIGNMENTS:
        raise ValueError(f"causal_alignment={alignment!r}; accepted: {', '.join(CAUSAL_ALIGNMENTS)}")
    case_list = _case_list(cases, dtype, seed, probe, head_dim)
    plan = _Plan(claimed if claimed is not None else baseline_recipe(dtype), claimed,
                 claimed.with_accumulation("exact") if claimed is not None else None, dtype, device, takes,
                 probe, _dq_accumulation_u(claimed) if accumulation_u is None else accumulation_u,
                 _check_require(require), alignment, _contract_case(case_list))
    dtype_name = str(dtype).replace("torch.", "")
    mode = f"recipe {claimed.name}" if claimed is not None else f"exact at {dtype_name} bounds"
    report = OracleReport(target or _name(fn), mode, dtype_name, claimed.name if claimed else None,
                          causal_alignment=alignment)

    stopped = ""
    for index, case in enumerate(case_list):
        if progress is not None:
            progress(case.name, index, len(case_list))
        cr = CaseResult(case.name, case.description, case.shape, case.causal, case.scale)
        report.cases.append(cr)
        if stopped:
            report.checks.append(Check(case.name, "runs", None, detail=f"not run: {stopped}"))
            continue
        t0 = time.perf_counter()
        checks = run_case(functools.partial(_check_case, fn, case, plan, cr), case.name, timeout)
        if checks is None:
            checks = [Check(case.name, "runs", False, detail=f"timed out after {timeout:g} s (the per-case limit)")]
        cr.seconds = time.perf_counter() - t0
        report.checks.extend(checks)
        if checks and checks[0].detail.startswith("timed out"):
            stopped = f"case {case.name} timed out and may still be running"
        elif any(c.detail.startswith(_DEVICE_FAULT) for c in checks):
            stopped = (f"case {case.name} left the device in an error state (a device-side fault), "
                       "so no later case can run in this process")
    return report


def _unsupported(case, plan, detail) -> Check | None:
    """An ``unsupported`` runs check when the case exercises an optional feature that is not
    required, else None."""
    feature = case.feature
    if feature is None or feature in plan.require:
        return None
    return Check(case.name, "runs", None, detail=detail, unsupported=feature)


def _failed_call(e: BaseException, case, plan, name="runs") -> list[Check]:
    """The failed (or unsupported) check of a call of fn that raised ``e``."""
    detail = f"{type(e).__name__}: {e}"
    if not isinstance(e, Exception):  # SystemExit and the like: fn tried to end the process
        return [Check(case.name, name, False, detail=_exit_detail(e))]
    if isinstance(e, TargetUnavailable) and not isinstance(e, NotImplementedError):
        raise e
    if _is_device_fault(e):  # a crash, never an unsupported feature
        return [Check(case.name, name, False, detail=_DEVICE_FAULT + detail)]
    unsupported = _unsupported(case, plan, detail) if name == "runs" else None
    return [unsupported or Check(case.name, name, False, detail=detail)]


def _check_case(fn, case, plan, cr) -> list[Check]:
    """Every check of one case (module docstring)."""
    needed = [n for n, x in (("mask", case.mask), ("window", case.window), ("documents", case.documents))
              if x is not None and n not in plan.takes]
    if needed:
        detail = f"fn takes no {needed[0]} argument"
        return [_unsupported(case, plan, detail) or Check(case.name, "runs", False, detail=detail + " (required)")]
    try:
        got, contract = _call(fn, case, plan.device)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - any failure of the implementation is a finding
        return _failed_call(e, case, plan)
    checks = [Check(case.name, "runs", True)]
    for name in ("output", "inputs"):
        checks.append(Check(case.name, name, not contract[name], detail=contract[name]))
    got64 = tuple(_cpu64(t) for t in got)
    ref = case.for_reference(plan.alignment)  # the problem fn claims to solve
    ex = exact_reference(ref)
    bad = [n for n, t in zip(("out", "dq", "dk", "dv"), got64) if not bool(torch.isfinite(t).all())]
    checks.append(Check(case.name, "finite", not bad, detail="NaN or inf in " + ", ".join(bad) if bad else ""))
    base_outs, base_rows = _run_recipe(ref, plan.base, plan.dtype)
    errors = _error_checks(case, plan, ex, got64, base_outs, cr)
    checks += errors
    if plan.claimed is not None:
        spread_outs, _ = _run_recipe(ref, plan.spread_recipe, plan.dtype)
        checks += _agreement_checks(case, ex, got64, base_outs, spread_outs)
    # dQ's error along kbar_i (a stale delta puts it there)
    _, _, cr.dq_bias_fraction = diagnostics.dq_bias_split(got64[1], ex.dq, ex.kbar)
    if plan.probe and case.probe is not None:
        checks.append(_rowsum_check(fn, case, plan, ex, got, base_rows, cr))
    if case.name == plan.contract_case:
        checks += _once_checks(fn, case, plan, ex, got, base_outs, errors)
    if ref is not case or "alignment" in case.tags:
        for c in errors:
            if c.passed is False:
                c.detail = (f"causal with seqlen_q != seqlen_k checked {plan.alignment.replace('_', '-')} aligned; "
                            f"{_ALIGNMENT_HINT}")
    return checks


_ALIGNMENT_HINT = ("SDPA's is_causal is top-left (query i sees keys j <= i), FlashAttention >= 2.1 bottom-right "
                   "(j <= i + seqlen_k - seqlen_q): declare yours with causal_alignment= (--causal-alignment)")


def _once_checks(fn, case, plan, ex, got, base_outs, first) -> list[Check]:
    """The checks run on one case per check (:attr:`_Plan.contract_case`: the first case that
    is not causal, has no mask and the default scale): ``defaults`` and ``repeat``."""
    checks = []
    # defaults: the arguments fn has defaults for (causal, scale, mask) left out must mean
    # SDPA's: not causal, scale 1/sqrt(head_dim), no mask
    left_out = _defaulted(fn)
    if not left_out:
        checks.append(Check(case.name, "defaults", None, detail="fn has no default for causal, scale or mask"))
    else:
        try:
            (out, *_), _ = _call(fn, case, plan.device, **{n: None for n in left_out})
            (c,) = _error_checks(case, plan, ex, (_cpu64(out),), base_outs[:1], None, names=("out",))
            # failed only where worse than the call with the arguments given (an out error of
            # every call is the out check's finding)
            passed = bool(c.passed or c.value <= max(first[0].value, first[0].bound))
            detail = "" if passed else (f"fn(q, k, v) without {', '.join(left_out)} is not attention with "
                                        "SDPA's defaults (causal=False, scale=1/sqrt(head_dim), no mask)")
            checks.append(Check(case.name, "defaults", passed, value=c.value, bound=c.bound, baseline=c.baseline,
                                detail=detail))
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # noqa: BLE001
            checks += _failed_call(e, case, plan, "defaults")
    # repeat: a second call on the same inputs must give results within the same bounds and
    # leave the first call's results as they were
    kept = tuple(t.clone() for t in got)
    try:
        again, _ = _call(fn, case, plan.device)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001
        return checks + _failed_call(e, case, plan, "repeat")
    overwritten = [n for n, t, k in zip(("out", "dq", "dk", "dv"), got, kept) if not _same(t, k)]
    differs = [n for n, t, k in zip(("out", "dq", "dk", "dv"), again, kept) if not _same(t, k)]
    second = _error_checks(case, plan, ex, tuple(_cpu64(t) for t in again), base_outs, None)
    # worse than the first call where that one passed, or beyond its statistic where it failed
    # (a bug of every call is the error checks' finding, not repeat's)
    worse = [c for c, c1 in zip(second, first) if not c.passed and not c.value <= max(c1.value, c1.bound)]
    if overwritten:
        detail = f"the second call overwrote the first call's {', '.join(overwritten)} (fn returns memory it reuses)"
    elif worse:
        detail = ("a second call on the same inputs fails " + ", ".join(f"{c.name} ({c.value:.3g} > {c.bound:.3g})"
                                                                       for c in worse))
    elif differs:
        detail = f"{', '.join(differs)} differ between two calls on the same inputs, within the bounds"
    else:
        detail = "bit for bit the same"
    passed = not overwritten and not worse
    value = max((c.value / c.bound if c.bound > 0 else (0.0 if c.value == 0 else math.inf)) for c in second)
    checks.append(Check(case.name, "repeat", passed, value=value, bound=1.0, detail=detail))
    return checks


def _defaulted(fn) -> tuple[str, ...]:
    """The arguments among causal, scale and mask that fn's signature gives a default."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return ()
    return tuple(n for n in ("causal", "scale", "mask") if n in params
                 and params[n].default is not inspect.Parameter.empty)


def _error_checks(case, plan, ex, got64, base_outs, cr, names=("out", "dq", "dk", "dv")) -> list[Check]:
    """out, dq, dk, dv: the largest excess error against twice the baseline's (beyond the floor,
    and beyond two roundings of the element to the dtype where the baseline's excess is 0:
    :func:`rounding_allowance`)."""
    checks = []
    u_out = rounding_allowance(plan.dtype)
    exact = {"out": ex.out, "dq": ex.dq, "dk": ex.dk, "dv": ex.dv}
    for name, x, b in zip(names, got64, base_outs):
        e = exact[name]
        mag, floor = ex.mags[name], ex.floors[name]
        if plan.claimed is None and name in ex.stale_per_u:
            floor = floor + u_out * ex.stale_per_u[name]  # D from the output rounded to the dtype
        base_excess = _excess(b - e, floor, mag)
        # where the baseline's error lies within the floor (excess exactly 0), the bound 2 x 0
        # would let no rounding through: there fn's rounding of the element to the dtype, up to
        # BASELINE_FACTOR roundings of its value, is not counted
        slack = torch.where(base_excess == 0, BASELINE_FACTOR * u_out * e.abs(), torch.zeros_like(e))
        err = max_value(_excess(x - e, floor + slack, mag))
        err_base = max_value(base_excess)
        bound = BASELINE_FACTOR * err_base
        if cr is not None:
            cr.errors[name] = max_value(elementwise_ratio((x - e).abs(), mag))
        checks.append(Check(case.name, name, bool(err <= bound), value=err, bound=bound, baseline=err_base))
    return checks


def _agreement_checks(case, ex, got64, base_outs, spread_outs) -> list[Check]:
    """agree_*: rms distance to the emulated recipe within twice the spread of two faithful
    implementations plus :data:`AGREEMENT_FRACTION` of the recipe's own error."""
    checks = []
    exact = (ex.out, ex.dq, ex.dk, ex.dv)
    for name, x, b, s, e in zip(("out", "dq", "dk", "dv"), got64, base_outs, spread_outs, exact):
        mag, floor = ex.mags[name], ex.floors[name]
        dist = _rms(_excess(x - b, floor, mag))
        spread = _rms(_excess(s - b, floor, mag))
        own = _rms(_excess(b - e, floor, mag))
        bound = BASELINE_FACTOR * spread + AGREEMENT_FRACTION * own
        checks.append(Check(case.name, f"agree_{name}", bool(dist <= bound), value=dist, bound=bound, baseline=own))
    return checks


def _probe_notes(pr) -> str:
    notes = []
    if not pr.zero_before:
        notes.append("dQ was not zero on the null channels")
    if not pr.consistent:
        notes.append("the two null channels disagree beyond the bound")
    if pr.invariance_detail:
        notes.append("shifting K changed " + pr.invariance_detail)
    return "; ".join(notes)


def _rowsum_check(fn, case, plan, ex, got, base_rows, cr) -> Check:
    """rowsum: the probe's reading of sum_j dS_ij against :func:`_rowsum_bound`."""
    device = plan.device
    try:
        extra = case.fn_kwargs()
        probed = functools.partial(fn, **{n: x.to(device) if isinstance(x, torch.Tensor) else x
                                          for n, x in extra.items()}) if extra else fn
        pr = _probe.run_probe(
            probed, case.q.to(device), case.k.to(device), case.v.to(device), case.dout.to(device),
            case.probe, causal=case.causal, scale=case.scale,
            mask=case.mask.to(device) if case.mask is not None else None, base=got,
            abs_ds_bound=2 * ex.abs_ds, u_acc=plan.u_acc, leaf=case.leaf)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - SystemExit included: any exit of fn fails the check
        detail = _exit_detail(e) if not isinstance(e, Exception) else f"{type(e).__name__}: {e}"
        prefix = _DEVICE_FAULT if _is_device_fault(e) else ""
        return Check(case.name, "rowsum", False, detail=f"{prefix}probe run failed: {detail}")
    active = ex.abs_pdp > 0
    a = ex.abs_pdp[active]
    rel = pr.residual.cpu()[active] / a
    rel_base = base_rows.residual_dq[active] / a
    # the probe's own noise, measured: two null channels read the same sum with different
    # roundings (the worst-case bound pe_i only decides whether the reading is valid)
    noise = _rms(pr.spread.cpu()[active] / a)
    cr.rowsum_rms, cr.rowsum_max = _rms(rel), max_value(rel.abs())
    cr.rowsum_mean_signed = rel.mean().item() if rel.numel() else 0.0
    cr.probe_valid = pr.valid
    cr.probe_note = _probe_notes(pr)
    bound = _rowsum_bound(case, plan, rel_base, noise)
    value, base_rms = cr.rowsum_rms, _rms(rel_base)
    if pr.valid:
        return Check(case.name, "rowsum", bool(value <= bound), value=value, bound=bound, baseline=base_rms,
                     detail=cr.probe_note)
    return Check(case.name, "rowsum", False, value=value, bound=bound, baseline=base_rms,
                 detail="probe not valid for this implementation: " + cr.probe_note)
