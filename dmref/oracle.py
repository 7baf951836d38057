"""The oracle: checks an attention implementation against float64 attention.

How to call it::

    report = dmref.oracle.check(fn)                       # exact attention at BF16 bounds
    report = dmref.oracle.check(fn, recipe="delta_matching", cases="quick", head_dim=128)
    report.raise_for_failures()                           # AssertionError naming each failure

(or ``dmref check package.module:fn`` from the shell, or the pytest fixture ``dmref_oracle``).

What fn must be: ``fn(q, k, v, *, causal, scale[, mask]) -> out``, differentiable through
autograd, with SDPA's conventions: q, dO ``(batch, heads, seqlen_q, head_dim)``; k, v
``(batch, kv_heads, seqlen_k, head_dim)``, query head h reading key/value head
``h // (heads // kv_heads)``; ``mask`` boolean (True = attend) or floating (added to the scaled
scores, -inf removes a position); rows with no key left give zero output and gradients.

What is checked, per case (:func:`dmref._oracle_cases.make_cases`: every axis an attention bug
can live on, docs/oracle.md), after one forward and one backward of fn on the case's inputs
(given in the case's memory layout):

- ``runs``: fn returned a tensor of the right shape and gradients reached q, k, v.
- ``finite``: no NaN or inf in out, dq, dk, dv.
- ``out``, ``dq``, ``dk``, ``dv``: the largest componentwise error beyond ``floor`` (the
  rigorous bound of any float32 implementation on that element), in units of the element's
  magnitude M (:func:`_exact`), is at most twice the baseline's own statistic
  (:data:`BASELINE_FACTOR`); where the baseline's excess is 0, two roundings of the element's
  value to the dtype are not counted against fn (:func:`rounding_allowance`).
- ``rowsum``: the probe's reading of sum_j dS_ij (:mod:`dmref.probe`), rms over rows relative to
  sum_j |P_ij dP_ij|, is at most the baseline's (:func:`_rowsum_check`); an unvouched reading
  fails.
- ``agree_*`` (a recipe claim only): fn makes the recipe's rounding errors, not others of the
  same size (:func:`_agreement_checks`).

The baseline runs in the same call on the same inputs: with ``recipe=None`` dmref's model of a
correct implementation in ``dtype`` (:func:`baseline_recipe`: FlashAttention-2's numerics for
BF16 and FP16), with ``recipe=R`` the emulated R.

Guarantees:

- Nothing is reported as checked that was not: a check that did not run is ``skipped`` or
  ``unsupported`` with the reason, and a report with no check run does not pass.
- An exception in a case exercising an optional feature (:data:`OPTIONAL_FEATURES`: GQA,
  masks), or a mask case for an fn without ``mask``, marks that case ``unsupported`` (named in
  the summary with the exception's message) and does not fail the verdict, unless the feature
  is in ``require``. Any other exception, ``NotImplementedError`` included, fails ``runs``.
- With ``timeout``, a case that runs longer fails ``runs`` ("timed out"), and the cases after it
  are not run (reported as skipped): the hung call cannot be stopped. Likewise after a case whose
  call faulted on the device (a CUDA error): the process's CUDA context is lost.
- Every bound is derived from the dtype, the recipe and the inputs (no typed tolerance); the
  derivations and their evidence are in docs/oracle.md.
"""

from __future__ import annotations

import functools
import inspect
import math
import time
from dataclasses import asdict, dataclass, field, replace

import torch

from . import diagnostics, probe as _probe, reference
from .emulation.constants import U_FP32, U_FP64, U_WGMMA
from ._oracle_cases import CASE_SETS, CAUSAL_ALIGNMENTS, DEFAULT_CASES, Case, check_bool, check_head_dim, check_seed, make_cases

__all__ = [
    "AGREEMENT_FRACTION",
    "BASELINE_FACTOR",
    "OPTIONAL_FEATURES",
    "ROWSUM_SAMPLING_SIGMAS",
    "CASE_SETS",
    "DEFAULT_CASES",
    "DTYPE_NAMES",
    "MAX_TIMEOUT",
    "Case",
    "CaseResult",
    "Check",
    "OracleReport",
    "baseline_recipe",
    "check",
    "check_timeout",
    "device_problem",
    "resolve_dtype",
    "emulated",
    "features_into_mask",
    "floor_unit_roundoff",
    "gqa_kwargs",
    "make_cases",
    "rounding_allowance",
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

#: optional features of an implementation; a case exercising one that fn cannot do is reported
#: ``unsupported`` unless the feature is required (``check(..., require=...)``)
OPTIONAL_FEATURES = ("gqa", "mask", "window", "documents")

_CHECK_ORDER = ("runs", "finite", "out", "dq", "dk", "dv", "rowsum", "agree_out", "agree_dq", "agree_dk", "agree_dv")
#: the checks of the calling contract (shown in one column of the table)
CONTRACT_CHECKS = ("output", "inputs", "defaults", "repeat")


# ==============================================================================================
# Report
# ==============================================================================================


@dataclass
class Check:
    """One check of one case. ``passed`` is None for a check that did not run: skipped, or
    ``unsupported`` (the case exercises an optional feature fn cannot do)."""

    case: str
    name: str  #: "runs", "finite", "out", "dq", "dk", "dv", "rowsum", "agree_out", ...
    passed: bool | None
    value: float = math.nan  #: the statistic of the implementation
    bound: float = math.nan  #: the bound it is held to
    baseline: float = math.nan  #: the baseline's own statistic the bound is derived from
    detail: str = ""
    unsupported: str = ""  #: the optional feature fn cannot do ("gqa", "mask"), when it cannot

    @property
    def status(self) -> str:
        """"passed", "FAILED", "unsupported" or "skipped"."""
        if self.passed is not None:
            return "passed" if self.passed else "FAILED"
        return "unsupported" if self.unsupported else "skipped"

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
    causal_alignment: str = "top_left"  #: the causal alignment fn was checked under

    @property
    def passed(self) -> bool:
        ran = [c for c in self.checks if c.passed is not None]
        return bool(ran) and all(c.passed for c in ran)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.passed is False]

    @property
    def skipped(self) -> list[Check]:
        """Checks that did not run, the unsupported ones included."""
        return [c for c in self.checks if c.passed is None]

    @property
    def unsupported(self) -> list[Check]:
        return [c for c in self.checks if c.unsupported and c.passed is None]

    def failed_names(self) -> set[str]:
        """The names of the checks that failed in any case ("rowsum", "dk", ...)."""
        return {c.name for c in self.failed}

    def failed_cases(self, name: str | None = None) -> set[str]:
        """The cases in which some check (or the check ``name``) failed."""
        return {c.case for c in self.failed if name is None or c.name == name}

    def as_dict(self) -> dict:
        """The report as strict-JSON data: a float that is not finite becomes the string
        ``"NaN"``, ``"Infinity"`` or ``"-Infinity"`` (JSON has no such numbers; the finite floats
        round-trip exactly through ``json.dumps``, which writes the shortest repr)."""
        def clean(x):
            if isinstance(x, float) and not math.isfinite(x):
                return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")
            if isinstance(x, dict):
                return {k: clean(v) for k, v in x.items()}
            if isinstance(x, list):
                return [clean(v) for v in x]
            return x

        return clean({
            "target": self.target, "mode": self.mode, "dtype": self.dtype, "recipe": self.recipe,
            "causal_alignment": self.causal_alignment,
            "passed": self.passed, "failed": [c.id for c in self.failed],
            "unsupported": [{"case": c.case, "feature": c.unsupported, "detail": c.detail} for c in self.unsupported],
            "checks": [asdict(c) for c in self.checks], "cases": [asdict(c) for c in self.cases],
        })

    def to_json(self, **kwargs) -> str:
        """:meth:`as_dict` as strict JSON (``allow_nan=False``)."""
        import json

        return json.dumps(self.as_dict(), allow_nan=False, **kwargs)

    def summary(self) -> str:
        """One line: verdict, counts, the failed checks."""
        ran = [c for c in self.checks if c.passed is not None]
        verdict = "PASSED" if self.passed else "FAILED"
        unsupported = self.unsupported
        line = (f"{verdict}: {self.target} ({self.mode}): {sum(bool(c.passed) for c in ran)}/{len(ran)} checks "
                f"passed, {len(self.skipped) - len(unsupported)} skipped")
        if self.failed:
            line += "; failed: " + ", ".join(c.id for c in self.failed)
        if unsupported:
            line += "; UNSUPPORTED (not counted): " + "; ".join(
                f"{c.case} ({c.unsupported}: {c.detail[:120]})" for c in unsupported)
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
        table.add_column("contract", justify="right")
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
                elif c.passed is None and c.unsupported:
                    row.append(f"[yellow]UNSUPPORTED[/yellow] {c.detail[:40]}")
                elif c.passed is None:
                    row.append("[dim]skip[/dim]")
                elif n in ("runs", "finite"):
                    row.append("[green]ok[/green]" if c.passed else f"[red]FAIL[/red] {c.detail[:40]}")
                else:
                    cell = f"{c.value:.2g} / {c.bound:.2g}"
                    row.append(f"[green]{cell}[/green]" if c.passed else f"[bold red]{cell} FAIL[/bold red]")
            contract = [checks[n] for n in CONTRACT_CHECKS if n in checks and checks[n].passed is not None]
            broken = [c.name for c in contract if not c.passed]
            row.append("" if not contract else f"[red]FAIL[/red] {', '.join(broken)}" if broken else "[green]ok[/green]")
            probe_cell = "" if math.isnan(cr.rowsum_rms) else f"{cr.rowsum_rms:.2g}"
            if cr.probe_valid is False:
                probe_cell += " [yellow](invalid)[/yellow]"
            row.append(probe_cell)
            row.append("" if math.isnan(cr.dq_bias_fraction) else f"{cr.dq_bias_fraction:.2f}")
            table.add_row(*row)
        table.caption = ("cells: statistic / bound. out..dv: max over elements of the error beyond the "
                         "float32 bound, in units of the element's magnitude; rowsum: rms over rows of "
                         "|sum_j dS_ij| / sum_j |P_ij dP_ij|, read by the probe; agree_*: rms distance to "
                         "the emulated recipe; contract: output, inputs (every case), defaults, repeat (one "
                         "case). " + self.summary())
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
# Options
# ==============================================================================================

#: dtype names :func:`check` (and ``dmref check --dtype``, the marker's ``dtype=``) accept
DTYPE_NAMES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
               "fp32": torch.float32, "float32": torch.float32, "fp64": torch.float64, "float64": torch.float64}

#: The longest per-case timeout: the runner waits on a worker thread with
#: ``threading.Thread.join(timeout)``, which takes at most ``threading.TIMEOUT_MAX`` seconds
#: (longer waits overflow the C timer: a ValueError or, through the CLI, an abort).
MAX_TIMEOUT = __import__("threading").TIMEOUT_MAX


def resolve_dtype(dtype) -> torch.dtype:
    """A torch floating dtype from a dtype or one of :data:`DTYPE_NAMES` (``"torch.float16"``
    too); TypeError naming the value otherwise."""
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPE_NAMES.values():
            return dtype
    elif isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        if name in DTYPE_NAMES:
            return DTYPE_NAMES[name]
    raise TypeError(f"dtype={dtype!r}: the oracle has a baseline for {', '.join(DTYPE_NAMES)} "
                    "(or the torch dtypes of those names)")


def check_timeout(timeout) -> float | None:
    """``timeout`` as a float in (0, :data:`MAX_TIMEOUT`], or None; TypeError or ValueError
    naming it."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout={timeout!r} must be a number of seconds, not {type(timeout).__name__}")
    if not 0 < timeout <= MAX_TIMEOUT:
        raise ValueError(f"timeout={timeout!r} must be a finite number of seconds in (0, {MAX_TIMEOUT:.0f}] "
                         "(threading.TIMEOUT_MAX: the longest wait the runner's worker thread can make)")
    return float(timeout)


def _check_accumulation_u(u) -> float | None:
    if u is None:
        return None
    if isinstance(u, bool) or not isinstance(u, (int, float)):
        raise TypeError(f"accumulation_u={u!r} must be a number, not {type(u).__name__}")
    if not 0 < u < 1:
        raise ValueError(f"accumulation_u={u!r} must be a unit roundoff in (0, 1) (float32: 2^-24, the Hopper FP8 "
                         "accumulation: 2^-13)")
    return float(u)


def device_problem(device) -> str | None:
    """Why fn cannot run on ``device`` here, or None when it can: the device must exist and
    hold data that can be read back to the CPU (``meta`` holds none)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError) as e:
        return f"device {device!r} is not a torch device ({e})"
    if dev.type == "cuda" and not torch.cuda.is_available():
        return (f"device {device!r}: no CUDA device on this machine (torch.cuda.is_available() is False, torch "
                f"{torch.__version__}); accepted here: cpu")
    try:
        back = torch.ones(2, device=dev).sum().cpu().item()
    except Exception as e:  # noqa: BLE001 - whatever torch says about the device
        return (f"device {device!r} cannot run an implementation here (the oracle computes on it and reads the "
                f"results back): {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    if back != 2.0:
        return f"device {device!r} computed 1 + 1 = {back}"
    return None


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


def _takes(fn) -> frozenset:
    """The optional arguments among mask, window and documents fn's signature takes (all of
    them when it has no signature or takes ``**kwargs``: the call decides)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return frozenset(("mask", "window", "documents"))
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return frozenset(("mask", "window", "documents"))
    return frozenset(n for n in ("mask", "window", "documents") if n in params)


def _name(fn) -> str:
    module = getattr(fn, "__module__", None) or ""
    qual = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    return f"{module}:{qual}" if module else qual


def _call(fn, case: Case, device, **overrides):
    """One forward and backward of fn on the case, inputs and dO in the case's memory layout
    (``overrides``: the keyword arguments fn gets instead of the case's; a key mapped to None is
    left out). Returns ``((out, dq, dk, dv) detached on fn's device, contract)`` with
    ``contract`` the caller-visible surprises: ``{"output": ..., "inputs": ...}``, "" where none."""
    q_, k_, v_ = (case.leaf(t, device).requires_grad_(True) for t in (case.q, case.k, case.v))
    kwargs = dict(causal=case.causal, scale=case.scale)
    mask = None
    if case.mask is not None:
        mask = case.mask.to(device).clone()  # a copy: fn writing into it cannot change the case
        kwargs["mask"] = mask
    kwargs.update({n: x.to(device).clone() if isinstance(x, torch.Tensor) else x for n, x in case.fn_kwargs().items()})
    kwargs.update(overrides)
    kwargs = {k: x for k, x in kwargs.items() if x is not None or k not in overrides}
    out = fn(q_, k_, v_, **kwargs)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"fn returned {type(out).__name__}, not a tensor")
    expected = (*case.q.shape[:-1], case.v.shape[-1])
    if tuple(out.shape) != expected:
        raise ValueError(f"fn returned shape {tuple(out.shape)}, expected {expected}")
    output = _output_problem(out, case.q.dtype, (q_, k_, v_))
    dout = case.leaf(case.dout.to(dtype=out.dtype), device)
    out.backward(dout)
    grads = (q_.grad, k_.grad, v_.grad)
    if any(g is None for g in grads):
        missing = [n for n, g in zip("qkv", grads) if g is None]
        raise ValueError(f"no gradient reached {', '.join(missing)}: fn is not differentiable in them")
    changed = [n for n, t, orig in (("q", q_, case.q), ("k", k_, case.k), ("v", v_, case.v),
                                    ("dO", dout, case.dout.to(dtype=out.dtype)), ("mask", mask, case.mask))
               if t is not None and not _same(t, orig)]
    inputs = (f"fn changed {', '.join(changed)} in place (a caller's tensors must come back as they were given)"
              if changed else "")
    return tuple(t.detach() for t in (out, *grads)), {"output": output, "inputs": inputs}


def _same(t: torch.Tensor, orig: torch.Tensor) -> bool:
    """t holds orig's values bit for bit (NaN and -0 included)."""
    a, b = t.detach().cpu(), orig.detach().cpu()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))


def _overlaps(t: torch.Tensor) -> bool:
    """Whether two elements of t share an address (a zero stride, an expand, or strides that
    interleave): sorted by stride, each dimension's stride must reach past the span of the
    dimensions below it."""
    dims = sorted((st, n) for st, n in zip(t.stride(), t.shape) if n > 1)
    span = 1
    for st, n in dims:
        if st < span:
            return True
        span = st * (n - 1) + span
    return False


def _output_problem(out: torch.Tensor, dtype: torch.dtype, inputs) -> str:
    """What in the output surprises a caller: another dtype than q's, elements that share
    memory, or memory shared with an input."""
    if out.dtype != dtype:
        return f"fn returned {str(out.dtype).replace('torch.', '')} for {str(dtype).replace('torch.', '')} inputs"
    if _overlaps(out):
        return f"fn returned an output whose elements share memory (strides {tuple(out.stride())})"
    storage = out.untyped_storage().data_ptr()
    shared = [n for n, t in zip("qkv", inputs) if t.untyped_storage().data_ptr() == storage]
    if shared:
        return f"fn returned an output in the memory of {', '.join(shared)}"
    return ""


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


def floor_unit_roundoff(dtype: torch.dtype) -> float:
    """The unit roundoff of the arithmetic the floor of the error checks allows: float32's 2^-24
    (every attention in bfloat16, float16 or float32 may accumulate in float32), float64's
    2^-53 for float64 inputs: a float64 claim is a claim to compute in float64, and an
    implementation that computes in float32 fails it."""
    return U_FP64 if dtype == torch.float64 else U_FP32


def _exact(case: Case) -> _Exact:
    u_floor = floor_unit_roundoff(case.q.dtype)
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
    bounds = diagnostics.attention_error_bound(q, k, v, do, u=u_floor, causal=case.causal, scale=case.scale,
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
            (:data:`DTYPE_NAMES`: ``"bf16"``, ``"float16"``, ...).
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
        head_dim: every case at this head dim (cases given by name or set only); None: 64,
            and 96 for the ``other_head_dim`` case.
        require: optional features (:data:`OPTIONAL_FEATURES`) fn must do: a case exercising
            one fails instead of being reported unsupported.
        timeout: seconds per case (fn's calls and the oracle's work on that case), a finite
            number in (0, :data:`MAX_TIMEOUT`]; a case that takes longer fails ``runs`` and the
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
    from .recipes import get_recipe

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
        checks = _run_case(fn, case, plan, cr, timeout)
        cr.seconds = time.perf_counter() - t0
        report.checks.extend(checks)
        if checks and checks[0].detail.startswith("timed out"):
            stopped = f"case {case.name} timed out and may still be running"
        elif any(c.detail.startswith(_DEVICE_FAULT) for c in checks):
            stopped = (f"case {case.name} left the device in an error state (a device-side fault), "
                       "so no later case can run in this process")
    return report


class TargetUnavailable(RuntimeError):
    """Raised by an implementation that cannot run on this machine at all (a package or the GPU
    is missing): :func:`check` stops and re-raises it instead of failing every case; the message
    is one line and says what is missing. A subclass that is also a ``NotImplementedError``
    declines one problem only (dmref.targets.CaseUnsupported) and is recorded per case."""


#: How a failed ``runs`` check that was a device-side fault begins (see :func:`_is_device_fault`).
_DEVICE_FAULT = "device-side fault: "


def _is_device_fault(e: BaseException) -> bool:
    """A CUDA error raised by the implementation (an illegal or misaligned access, a device-side
    assert): it leaves the process's CUDA context unusable, so every later call fails too."""
    accelerator_error = getattr(torch, "AcceleratorError", ())
    return (isinstance(e, accelerator_error) if accelerator_error else False) or "CUDA error" in str(e)


def _run_case(fn, case, plan, cr, timeout):
    """:func:`_check_case`, in a worker thread when there is a timeout."""
    if timeout is None:
        return _check_case(fn, case, plan, cr)
    import threading

    result: dict = {}

    def work():
        try:
            result["checks"] = _check_case(fn, case, plan, cr)
        except BaseException as e:  # noqa: BLE001 - handed to the calling thread
            result["error"] = e

    worker = threading.Thread(target=work, name=f"dmref-oracle-{case.name}", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        return [Check(case.name, "runs", False, detail=f"timed out after {timeout:g} s (the per-case limit)")]
    if "error" in result:
        raise result["error"]
    return result["checks"]


def _exit_detail(e: BaseException) -> str:
    return (f"fn raised {type(e).__name__}({', '.join(map(repr, e.args))}): an attention call that tries to end "
            "the process fails its case (the oracle goes on)")


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
    ex = _exact(ref)
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
            detail = "" if c.passed else (f"fn(q, k, v) without {', '.join(left_out)} is not attention with "
                                          "SDPA's defaults (causal=False, scale=1/sqrt(head_dim), no mask)")
            checks.append(Check(case.name, "defaults", c.passed, value=c.value, bound=c.bound, baseline=c.baseline,
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
        err = _max(_excess(x - e, floor + slack, mag))
        err_base = _max(base_excess)
        bound = BASELINE_FACTOR * err_base
        if cr is not None:
            cr.errors[name] = _max(_ratio((x - e).abs(), mag))
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


def _rowsum_bound(case, plan, rel_base: torch.Tensor, noise: float) -> float:
    """The rowsum bound: twice the baseline's rms plus the probe's noise and the float32 floor
    (exact mode), or the claimed recipe's rms up to its sampling error plus the noise."""
    base_rms = _rms(rel_base)
    if plan.claimed is None:
        # the float32 floor every correct float32-accumulating implementation may reach (as the
        # error checks count only the excess over the rigorous float32 bound; float64's for a
        # float64 claim): per row, relative to A_i, |1 - sigma_i| + gamma_c sigma_i + 2 gamma_2
        # with D summed over at most n keys of P V and d channels of dO O: below gamma_{2n + d + 4}
        n_keys, head_dim = case.k.shape[-2], case.v.shape[-1]
        u_floor = floor_unit_roundoff(plan.dtype)
        return BASELINE_FACTOR * base_rms + noise + diagnostics.gamma(2 * n_keys + head_dim + 4, u_floor)
    return base_rms * (1 + ROWSUM_SAMPLING_SIGMAS * _rms_sampling_rel_std(rel_base)) + noise


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
    cr.rowsum_rms, cr.rowsum_max = _rms(rel), _max(rel.abs())
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


# ==============================================================================================
# Ready-made targets (for ``dmref check dmref.oracle:sdpa_math`` and the docs)
# ==============================================================================================


def gqa_kwargs(q, k) -> dict:
    """``{"enable_gqa": True}`` when k has fewer heads than q (SDPA, torch >= 2.5, needs it to
    read key/value head h // (H // Hkv) for query head h), else ``{}`` (older torch then works
    on everything but GQA)."""
    return {"enable_gqa": True} if q.shape[-3] != k.shape[-3] else {}


def causal_into_mask(q, k, mask, causal: bool):
    """SDPA takes ``is_causal`` or ``attn_mask``, not both: with both, the causal mask (top-left
    aligned, as SDPA's ``is_causal``: query i sees keys j <= i) folded into ``mask`` (boolean:
    and-ed; floating: -inf where causal removes a position). Returns ``(mask, causal)`` for SDPA."""
    if mask is None or not causal:
        return mask, causal
    nq, nk = q.shape[-2], k.shape[-2]
    keep = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril()
    if mask.dtype == torch.bool:
        return mask & keep, False
    return mask.masked_fill(~keep, -math.inf), False


def features_into_mask(q, k, mask, window=None, documents=None):
    """A sliding ``window`` ``(left, right)`` and ``documents`` ids ((batch, seqlen)) as a mask
    combined with ``mask`` (:func:`dmref._oracle_cases.feature_mask`): how a target without
    native support for them runs them through SDPA's ``attn_mask``."""
    if window is None and documents is None:
        return mask
    from ._oracle_cases import feature_mask

    keep = feature_mask(q.shape[-2], k.shape[-2], window=window, documents=documents, device=q.device)
    if mask is None:
        return keep
    if mask.dtype == torch.bool:
        return mask & keep
    return mask.masked_fill(~keep, -math.inf)


def sdpa_math(q, k, v, *, causal=False, scale=None, mask=None, window=None, documents=None):
    """torch's scaled_dot_product_attention, math backend. ``mask``: boolean (True = attend) or
    floating (added to the scaled scores), with ``causal`` too (:func:`causal_into_mask`); a
    sliding ``window`` and ``documents`` through the mask (:func:`features_into_mask`); k, v
    may have fewer heads than q (GQA)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    mask = features_into_mask(q, k, mask, window, documents)
    mask, causal = causal_into_mask(q, k, mask, causal)
    with sdpa_kernel(SDPBackend.MATH):
        return scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                            **gqa_kwargs(q, k))


def sdpa(q, k, v, *, causal=False, scale=None, mask=None, window=None, documents=None):
    """torch's scaled_dot_product_attention, whatever backend torch picks (mask, window,
    documents and GQA as :func:`sdpa_math`)."""
    from torch.nn.functional import scaled_dot_product_attention

    mask = features_into_mask(q, k, mask, window, documents)
    mask, causal = causal_into_mask(q, k, mask, causal)
    return scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, **gqa_kwargs(q, k))


def emulated(recipe):
    """``dmref.attention`` with ``recipe`` as an oracle target (``fn(q, k, v, *, causal, scale,
    mask)``; GQA and boolean or additive masks as :func:`dmref.attention`); also reachable as
    ``dmref.oracle:emulated_<preset>`` from the command line."""
    from .api import attention

    def fn(q, k, v, *, causal=False, scale=None, mask=None, window=None, documents=None):
        mask = features_into_mask(q, k, mask, window, documents)
        return attention(q, k, v, causal=causal, scale=scale, mask=mask, recipe=recipe)

    name = recipe if isinstance(recipe, str) else recipe.name
    fn.__name__ = fn.__qualname__ = f"emulated_{name}"
    fn.causal_alignment = "bottom_right"  # dmref.attention aligns as dmref.reference (FlashAttention >= 2.1)
    return fn


def __getattr__(name: str):
    if name.startswith("emulated_"):
        from .recipes import get_recipe

        preset = name[len("emulated_"):]
        get_recipe(preset)  # raises ValueError for an unknown preset
        return emulated(preset)
    raise AttributeError(f"module 'dmref.oracle' has no attribute {name!r}")
