"""The checks: :func:`check` runs every case (:mod:`dmref.oracle.runner`), holds fn's results to the bounds
(:mod:`dmref.oracle.bounds`) and the calling contract, reads the row sums with the probe, and writes the
report (:mod:`dmref.oracle.report`)."""

from __future__ import annotations

import functools
import inspect
import math
import time
from dataclasses import dataclass, replace

import torch

from .. import diagnostics
from . import probe as _probe
from .probe import unit_roundoff_of
from .cases import CAUSAL_ALIGNMENTS, DEFAULT_CASES, Case, check_bool, check_head_dim, check_seed, make_cases
from .bounds import (AGREEMENT_FRACTION, BASELINE_FACTOR, cpu64, dq_accumulation_u, excess_beyond, exact_reference, max_value, elementwise_ratio, root_mean_square,
                     rowsum_bound, run_recipe, baseline_recipe, rounding_allowance)
from .report import CaseResult, Check, OracleReport
from .runner import (DEVICE_FAULT, TargetUnavailable, call_once, check_accumulation_u, exit_detail,
                     is_device_fault, target_name, same_bits, optional_arguments, check_timeout, device_problem, resolve_dtype, run_case,
                     validate_signature)

__all__ = ["OPTIONAL_FEATURES", "check"]

#: optional features of an implementation; a case exercising one that fn cannot do is reported
#: ``unsupported`` unless the feature is required (``check(..., require=...)``)
OPTIONAL_FEATURES = ("gqa", "mask", "window", "documents")


@dataclass
class Plan:
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
    alignment: str | None = None  #: the declared causal alignment; None: inferred (:func:`_settle_alignment`)
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
        probe: measure the row-sum residual with :mod:`dmref.oracle.probe` (one more fn call per
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
        seed: an int in [0, :data:`dmref.oracle.cases.MAX_SEED`].
        causal_alignment: how fn aligns a causal mask when seqlen_q != seqlen_k:
            ``"top_left"`` (SDPA's ``is_causal``: query i sees keys j <= i) or
            ``"bottom_right"`` (FlashAttention >= 2.1: j <= i + seqlen_k - seqlen_q), checked
            strictly. None: fn's attribute ``causal_alignment`` if it has one (dmref's
            ``emulated_<preset>`` targets declare ``"bottom_right"``), else inferred: the cases
            where the two differ are judged under both and fn is checked under the one it
            follows (:func:`_settle_alignment`; ``report.alignment_source``).

    Returns:
        :class:`OracleReport`; ``report.raise_for_failures()`` turns it into an assertion.
    """
    from ..recipes import get_recipe

    validate_signature(fn)
    takes = optional_arguments(fn)
    claimed = get_recipe(recipe) if recipe is not None else None
    dtype = resolve_dtype(dtype)
    check_bool("probe", probe)
    timeout = check_timeout(timeout)
    accumulation_u = check_accumulation_u(accumulation_u)
    check_seed(seed)
    check_head_dim(head_dim)
    problem = device_problem(device)
    if problem:
        raise ValueError(problem)
    alignment = causal_alignment if causal_alignment is not None else getattr(fn, "causal_alignment", None)
    if alignment is not None and alignment not in CAUSAL_ALIGNMENTS:
        raise ValueError(f"causal_alignment={alignment!r}; accepted: {', '.join(CAUSAL_ALIGNMENTS)}")
    case_list = _case_list(cases, dtype, seed, probe, head_dim)
    plan = Plan(claimed if claimed is not None else baseline_recipe(dtype), claimed,
                 claimed.with_accumulation("exact") if claimed is not None else None, dtype, device, takes,
                 probe, dq_accumulation_u(claimed) if accumulation_u is None else accumulation_u,
                 _check_require(require), alignment, _contract_case(case_list))
    dtype_name = str(dtype).replace("torch.", "")
    mode = f"recipe {claimed.name}" if claimed is not None else f"exact at {dtype_name} bounds"
    report = OracleReport(target or target_name(fn), mode, dtype_name, claimed.name if claimed else None,
                          causal_alignment=alignment, alignment_source="declared" if alignment else "untested")

    stopped = ""
    results: list = []  # per case: its checks, or {alignment: _Judged} where the alignment matters
    for index, case in enumerate(case_list):
        if progress is not None:
            progress(case.name, index, len(case_list))
        cr = CaseResult(case.name, case.description, case.shape, case.causal, case.scale)
        report.cases.append(cr)
        if stopped:
            results.append([Check(case.name, "runs", None, detail=f"not run: {stopped}")])
            continue
        t0 = time.perf_counter()
        result = run_case(functools.partial(_check_case, fn, case, plan, cr), case.name, timeout)
        if result is None:
            result = [Check(case.name, "runs", False, detail=f"timed out after {timeout:g} s (the per-case limit)")]
        cr.seconds = time.perf_counter() - t0
        results.append(result)
        checks = result if isinstance(result, list) else next(iter(result.values())).checks
        if checks and checks[0].detail.startswith("timed out"):
            stopped = f"case {case.name} timed out and may still be running"
        elif any(c.detail.startswith(DEVICE_FAULT) for c in checks):
            stopped = (f"case {case.name} left the device in an error state (a device-side fault), "
                       "so no later case can run in this process")
    _settle_alignment(report, plan, case_list, results)
    for case, cr, result in zip(case_list, report.cases, results):
        _explain(case, result, cr, plan)
        report.checks.extend(result)
    return report


@dataclass
class _Judged:
    """A case's checks under one causal alignment (where the alignment matters)."""

    checks: list
    stats: CaseResult
    beyond: float  #: the share of output elements beyond the out check's bound (which alignment fn follows)

    @property
    def fits(self) -> bool:
        """fn ran and no numerical check failed under this alignment."""
        return (any(c.name == "runs" and c.passed for c in self.checks)
                and not any(c.passed is False for c in self.checks if c.name in _NUMERICAL))


_NUMERICAL = ("out", "dq", "dk", "dv", "rowsum", "agree_out", "agree_dq", "agree_dk", "agree_dv")
_RULES = {"top_left": "j <= i, as SDPA's is_causal",
          "bottom_right": "j <= i + seqlen_k - seqlen_q, as FlashAttention >= 2.1"}


def _alignment_matters(case) -> bool:
    """The two causal alignments give different problems: causal with seqlen_q != seqlen_k."""
    return (case.causal and case.q.shape[-2] != case.k.shape[-2] and case.window is None
            and case.documents is None)


def _pretty(alignment: str) -> str:
    return alignment.replace("_", "-")


def _settle_alignment(report, plan, case_list, results) -> None:
    """Choose the causal alignment of the cases where it matters (each judged under both) and put
    their checks under it in ``results``: the declared one; else the one under which every such
    case fits (inferred); else the one that the cases fitting any alignment fit (inferred: the
    others fail for another reason); else, when no case fits either and all agree on which
    alignment's output is closer (fewer output elements beyond the bound), that one (inferred);
    else top-left, "undetermined" when no case fits either, "neither" when one case fits one
    alignment and another the other. A failed numerical check of a case that the other alignment fits
    says so in its cause (the only place the alignment is named as a cause)."""
    pending = {i: r for i, r in enumerate(results) if isinstance(r, dict)}
    if not pending:
        return
    ran = [i for i, r in pending.items() if any(c.name == "runs" and c.passed for c in r["top_left"].checks)]
    fits = {i: [a for a in CAUSAL_ALIGNMENTS if pending[i][a].fits] for i in ran}
    source, detail = "declared", ""
    if plan.alignment is not None:
        chosen = plan.alignment
    elif not ran:
        chosen, source = "top_left", "untested"
    else:
        every = [a for a in CAUSAL_ALIGNMENTS if all(a in fits[i] for i in ran)]
        fitting = {a for i in ran for a in fits[i]}
        closer = set()
        for i in ran:
            b = {a: pending[i][a].beyond for a in CAUSAL_ALIGNMENTS}
            closer.add(min(b, key=b.get) if b["top_left"] != b["bottom_right"] else None)
        if len(every) == 1:
            chosen, source = every[0], "inferred"
        elif len(every) == 2:  # no case here tells the two apart
            chosen, source = "top_left", "untested"
        elif len(fitting) == 1:  # the cases that fit one alignment agree; the others fail for another reason
            chosen, source = fitting.pop(), "inferred"
        elif not fitting and len(closer) == 1 and None not in closer:  # none fits, but one is closer in all
            chosen, source = closer.pop(), "inferred"
        elif not fitting:
            chosen, source = "top_left", "undetermined"
        else:  # one case fits one alignment, another the other
            chosen, source = "top_left", "neither"
            detail = ", ".join(f"{case_list[i].name} fits " + (" and ".join(map(_pretty, fits[i])) or "neither")
                               for i in ran)
    report.causal_alignment, report.alignment_source, report.alignment_detail = chosen, source, detail
    other = next(a for a in CAUSAL_ALIGNMENTS if a != chosen)
    for i, judged in pending.items():
        mine, theirs = judged[chosen], judged[other]
        results[i] = mine.checks
        stats = mine.stats
        stats.seconds = report.cases[i].seconds
        report.cases[i] = stats
        if mine.fits or not theirs.fits:
            continue
        if source == "declared":
            hint = (f"fits the {_pretty(other)} causal alignment here ({_RULES[other]}), not the declared "
                    f"{_pretty(chosen)}: declare causal_alignment={other!r} (--causal-alignment {other})")
        else:
            hint = (f"fits the {_pretty(other)} causal alignment here ({_RULES[other]}) but not in every causal "
                    "case with seqlen_q != seqlen_k: its causal mask follows neither convention")
        for c in mine.checks:
            if c.passed is False and c.name in _NUMERICAL:
                c.cause = hint


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
        return [Check(case.name, name, False, detail=exit_detail(e))]
    if isinstance(e, TargetUnavailable) and not isinstance(e, NotImplementedError):
        raise e
    if is_device_fault(e):  # a crash, never an unsupported feature
        return [Check(case.name, name, False, detail=DEVICE_FAULT + detail)]
    unsupported = _unsupported(case, plan, detail) if name == "runs" else None
    return [unsupported or Check(case.name, name, False, detail=detail)]


def _check_case(fn, case, plan, cr):
    """Every check of one case (module docstring): a list of checks, or, for a case whose
    problem depends on the causal alignment, ``{alignment: _Judged}`` (fn called once, judged
    under both)."""
    needed = [n for n, x in (("mask", case.mask), ("window", case.window), ("documents", case.documents))
              if x is not None and n not in plan.takes]
    if needed:
        detail = f"fn takes no {needed[0]} argument"
        return [_unsupported(case, plan, detail) or Check(case.name, "runs", False, detail=detail + " (required)")]
    try:
        got, contract = call_once(fn, case, plan.device)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - any failure of the implementation is a finding
        return _failed_call(e, case, plan)
    common = [Check(case.name, "runs", True)]
    for name in ("output", "inputs"):
        common.append(Check(case.name, name, not contract[name], detail=contract[name]))
    got64 = tuple(cpu64(t) for t in got)
    bad = [n for n, t in zip(("out", "dq", "dk", "dv"), got64) if not bool(torch.isfinite(t).all())]
    common.append(Check(case.name, "finite", not bad, detail="NaN or inf in " + ", ".join(bad) if bad else ""))
    shifted = None
    if plan.probe and case.probe is not None:
        shifted = _shifted_run(fn, case, plan)
    if _alignment_matters(case):
        judged = {}
        for a in CAUSAL_ALIGNMENTS:
            stats = replace(cr, errors={})
            checks, beyond, _, _ = _judge(fn, case, plan, a, got, got64, shifted, stats)
            judged[a] = _Judged(common + checks, stats, beyond)
        return judged
    # the alignment does not matter here: both give this problem
    checks, _, ex, base_outs = _judge(fn, case, plan, "top_left", got, got64, shifted, cr)
    checks = common + checks
    if case.name == plan.contract_case:
        errors = [c for c in checks if c.name in ("out", "dq", "dk", "dv")]
        checks += _once_checks(fn, case, plan, ex, got, base_outs, errors)
    return checks


def _shifted_run(fn, case, plan):
    """The probe's second run of fn (K shifted on the null channels): its outputs, or the failed
    rowsum check when fn raised."""
    device = plan.device
    try:
        extra = case.fn_kwargs()
        probed = functools.partial(fn, **{n: x.to(device) if isinstance(x, torch.Tensor) else x
                                          for n, x in extra.items()}) if extra else fn
        return _probe.run_shifted(probed, case.q.to(device), case.k.to(device), case.v.to(device),
                                  case.dout.to(device), case.probe, causal=case.causal, scale=case.scale,
                                  mask=case.mask.to(device) if case.mask is not None else None, leaf=case.leaf)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - SystemExit included: any exit of fn fails the check
        detail = exit_detail(e) if not isinstance(e, Exception) else f"{type(e).__name__}: {e}"
        prefix = DEVICE_FAULT if is_device_fault(e) else ""
        return Check(case.name, "rowsum", False, detail=f"{prefix}probe run failed: {detail}")


def _judge(fn, case, plan, alignment, got, got64, shifted, cr):
    """The numerical checks of fn's results on ``case`` under a causal ``alignment``, the share
    of output elements beyond the out check's bound, the exact reference and the baseline's
    outputs."""
    ref = case.for_reference(alignment)  # the problem fn claims to solve
    ex = exact_reference(ref)
    base_outs, base_rows = run_recipe(ref, plan.base, plan.dtype)
    beyond: dict = {}
    checks = error_checks(case, plan, ex, got64, base_outs, cr, beyond=beyond)
    if plan.claimed is not None:
        spread_outs, _ = run_recipe(ref, plan.spread_recipe, plan.dtype)
        checks += _agreement_checks(case, ex, got64, base_outs, spread_outs)
    if isinstance(shifted, Check):
        checks.append(shifted)
    elif shifted is not None:
        checks.append(_rowsum_check(fn, case, plan, ex, got, shifted, base_rows, cr))
    # dQ's error along kbar_i (a stale delta puts it there)
    _, _, cr.dq_bias_fraction = diagnostics.dq_bias_split(got64[1], ex.dq, ex.kbar)
    return checks, beyond.get("out", math.nan), ex, base_outs


def _once_checks(fn, case, plan, ex, got, base_outs, first) -> list[Check]:
    """The checks run on one case per check (:attr:`Plan.contract_case`: the first case that
    is not causal, has no mask and the default scale): ``defaults`` and ``repeat``."""
    checks = []
    # defaults: the arguments fn has defaults for (causal, scale, mask) left out must mean
    # SDPA's: not causal, scale 1/sqrt(head_dim), no mask
    left_out = _defaulted(fn)
    if not left_out:
        checks.append(Check(case.name, "defaults", None, detail="fn has no default for causal, scale or mask"))
    else:
        try:
            (out, *_), _ = call_once(fn, case, plan.device, **{n: None for n in left_out})
            (c,) = error_checks(case, plan, ex, (cpu64(out),), base_outs[:1], None, names=("out",))
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
        again, _ = call_once(fn, case, plan.device)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001
        return checks + _failed_call(e, case, plan, "repeat")
    overwritten = [n for n, t, k in zip(("out", "dq", "dk", "dv"), got, kept) if not same_bits(t, k)]
    differs = [n for n, t, k in zip(("out", "dq", "dk", "dv"), again, kept) if not same_bits(t, k)]
    second = error_checks(case, plan, ex, tuple(cpu64(t) for t in again), base_outs, None)
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


def error_checks(case, plan, ex, got64, base_outs, cr, names=("out", "dq", "dk", "dv"), beyond=None) -> list[Check]:
    """out, dq, dk, dv: the largest excess error against twice the baseline's (beyond the floor,
    and beyond two roundings of the element to the dtype where the baseline's excess is 0:
    :func:`rounding_allowance`). ``beyond``: a dict to receive, per check, the share of elements
    beyond the bound."""
    checks = []
    u_out = rounding_allowance(plan.dtype)
    exact = {"out": ex.out, "dq": ex.dq, "dk": ex.dk, "dv": ex.dv}
    for name, x, b in zip(names, got64, base_outs):
        e = exact[name]
        mag, floor = ex.mags[name], ex.floors[name]
        if plan.claimed is None and name in ex.stale_per_u:
            floor = floor + u_out * ex.stale_per_u[name]  # D from the output rounded to the dtype
        base_excess = excess_beyond(b - e, floor, mag)
        # where the baseline's error lies within the floor (excess exactly 0), the bound 2 x 0
        # would let no rounding through: there fn's rounding of the element to the dtype, up to
        # BASELINE_FACTOR roundings of its value, is not counted
        slack = torch.where(base_excess == 0, BASELINE_FACTOR * u_out * e.abs(), torch.zeros_like(e))
        excess = excess_beyond(x - e, floor + slack, mag)
        err = max_value(excess)
        err_base = max_value(base_excess)
        bound = BASELINE_FACTOR * err_base
        if beyond is not None:  # NaN counts as beyond
            beyond[name] = (~(excess <= bound)).double().mean().item() if excess.numel() else 0.0
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
        dist = root_mean_square(excess_beyond(x - b, floor, mag))
        spread = root_mean_square(excess_beyond(s - b, floor, mag))
        own = root_mean_square(excess_beyond(b - e, floor, mag))
        bound = BASELINE_FACTOR * spread + AGREEMENT_FRACTION * own
        checks.append(Check(case.name, f"agree_{name}", bool(dist <= bound), value=dist, bound=bound, baseline=own))
    return checks


def _probe_notes(pr) -> str:
    notes = []
    if not pr.zero_before:
        notes.append("dQ was not zero on the null channels (where K is zero)")
    if not pr.consistent:
        notes.append(f"the two null channels' readings differ by up to {pr.disagreement:.3g} times the probe's "
                     "error bound (e.g. dQ rounded more than once to its dtype, or summed in less than float32)")
    if pr.invariance_detail:
        notes.append("shifting K changed " + pr.invariance_detail)
    return "; ".join(notes)


def _rowsum_check(fn, case, plan, ex, got, shifted, base_rows, cr) -> Check:
    """rowsum: the probe's reading of sum_j dS_ij (from fn's run ``got`` and the shifted run)
    against :func:`rowsum_bound`; INCONCLUSIVE (neither passed nor failed) when the probe
    cannot vouch for its reading, with what it read."""
    device = plan.device
    pr = _probe.run_probe(
        fn, case.q.to(device), case.k.to(device), case.v.to(device), case.dout.to(device),
        case.probe, causal=case.causal, scale=case.scale, base=got, shifted=shifted,
        abs_ds_bound=2 * ex.abs_ds, u_acc=plan.u_acc, leaf=case.leaf)
    active = ex.abs_pdp > 0
    a = ex.abs_pdp[active]
    rel = pr.residual.cpu()[active] / a
    rel_base = base_rows.residual_dq[active] / a
    # the probe's own noise, measured: two null channels read the same sum with different
    # roundings (the worst-case bound pe_i only decides whether the reading is valid)
    noise = root_mean_square(pr.spread.cpu()[active] / a)
    cr.rowsum_rms, cr.rowsum_max = root_mean_square(rel), max_value(rel.abs())
    cr.rowsum_mean_signed = rel.mean().item() if rel.numel() else 0.0
    cr.probe_valid = pr.valid
    cr.probe_note = _probe_notes(pr)
    bound = rowsum_bound(case, plan, rel_base, noise)
    value, base_rms = cr.rowsum_rms, root_mean_square(rel_base)
    if pr.valid:
        return Check(case.name, "rowsum", bool(value <= bound), value=value, bound=bound, baseline=base_rms,
                     detail=cr.probe_note)
    side = "below" if value <= bound else "above"
    return Check(case.name, "rowsum", None, value=value, bound=bound, baseline=base_rms, inconclusive=True,
                 detail=(f"the probe read sum_j dS_ij at {value:.3g} (rms over rows, in units of sum_j |P dP|), "
                         f"{side} its bound {bound:.3g}, but cannot vouch for the reading: {cr.probe_note} "
                         "(the dq, dk and dv checks judge the gradients themselves)"))


def _explain(case, checks, cr, plan) -> None:
    """Write each failed check's most likely cause (``Check.cause``), from which checks of the
    case failed together and how large the error is: beyond what rounding in the dtype can make
    (a wrong result) or within it (more rounding than a correct implementation). A cause set
    already (the causal alignment, where the other alignment's reference fits) is kept."""
    failed = {c.name: c for c in checks if c.passed is False}
    grads = {n for n in ("dq", "dk", "dv") if n in failed}
    dtype = _SHORT.get(plan.dtype, str(plan.dtype))
    # the rounding error of the longest sums an implementation computing wholly in the dtype
    # would make, probabilistically (sqrt(n) u, Higham and Mary 2019): an error beyond it is a
    # wrong result, not rounding (this only chooses the words; the bounds decide the verdict)
    nq, nk, d = case.q.shape[-2], case.k.shape[-2], case.v.shape[-1]
    n = nq * (case.q.shape[1] // case.kv_heads) + nk + d
    rounding = math.sqrt(n) * unit_roundoff_of(plan.dtype)
    for c in failed.values():
        if c.cause:
            continue
        wrong = not c.value <= rounding  # NaN: wrong
        if c.name == "out":
            c.cause = ("the forward is wrong, not rounded: the softmax's maximum or rescale, the keys a row sees "
                       "(mask, a dropped tile) or P·V" if wrong else
                       f"the forward's error is larger than a correct {dtype} forward's, though within what {dtype} rounding "
                       "can make: "
                       f"more rounding (P, the running sum or P·V kept in {dtype}) or a small systematic error "
                       "(a scale slightly off)")
        elif c.name in (*grads, "rowsum") and "out" in failed:
            c.cause = "may follow from the forward's error (out failed)"
        elif c.name in grads:
            c.cause = _gradient_cause(c.name, grads, wrong, dtype, cr)
        elif c.name == "rowsum":
            c.cause = "sum_j dS_ij is not 0: D_i = dO_i·O_i does not match dS's P and dP (a stale D)"
        elif c.name.startswith("agree_"):
            c.cause = "not the recipe's errors: another quantization (block axis, scale rule) or delta"


_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}


def _gradient_cause(name, grads, wrong, dtype, cr) -> str:
    """The most likely cause of a failed gradient check when the forward passed."""
    if grads == {"dk"}:
        return ("dK alone is wrong: its scale (missing or doubled) or dSᵀ·Q" if wrong else
                f"dK alone rounds more: its sum over query blocks kept in {dtype}")
    if grads == {"dv"}:
        return ("dV alone is wrong: Pᵀ·dO" if wrong else
                f"dV alone rounds more: its sum over query blocks kept in {dtype}")
    if grads == {"dq"}:
        cause = ("dQ alone is wrong: its scale or dS·K" if wrong else
                 f"dQ alone rounds more: its sum over key blocks kept in {dtype}, or a stale D")
        if not math.isnan(cr.dq_bias_fraction) and cr.dq_bias_fraction > 0.5:
            cause += f"; {cr.dq_bias_fraction:.0%} of its error lies along kbar_i (an error in D)"
        return cause
    if "dv" not in grads:  # dq and dk: dS
        return ("dS = P (dP - D) is wrong, dV right: D, dP or dS's scale" if wrong else
                f"dS rounds more, dV right: D from an output rounded more, or dS kept in {dtype}")
    return ("the backward's P differs from the forward's: the saved LSE, the scale or the mask" if wrong else
            f"the backward's P rounds more than the forward's: the LSE (or max and sum) saved in {dtype}")
