"""The oracle: checks an attention implementation against float64 attention.

How to call it::

    report = dmref.oracle.check(fn)                       # exact attention at BF16 bounds
    report = dmref.oracle.check(fn, recipe="delta_matching", cases="quick", head_dim=128)
    report.raise_for_failures()                           # AssertionError naming each failure

(or ``dmref check package.module:fn`` from the shell, or the pytest fixture ``dmref_oracle``;
all three default to the ``standard`` cases, :data:`DEFAULT_CASES`).

What fn must be: ``fn(q, k, v, *, causal, scale[, mask][, window][, documents]) -> out``,
differentiable through autograd, with SDPA's conventions: q, dO ``(batch, heads, seqlen_q,
head_dim)``; k ``(batch, kv_heads, seqlen_k, head_dim)``, v ``(batch, kv_heads, seqlen_k,
head_dim_v)``, query head h reading key/value head ``h // (heads // kv_heads)``; ``mask``
boolean (True = attend) or floating (added to the scaled scores, -inf removes a position);
``window=(left, right)`` a sliding window (FlashAttention's ``window_size``); ``documents`` a
(batch, seqlen) tensor of document ids (packed sequences); rows with no key left give zero
output and gradients (the convention: such a row's output and its dQ are zero, and it adds
nothing to dK and dV). Causal with seqlen_q != seqlen_k is aligned as declared
(``causal_alignment``: top-left as SDPA's ``is_causal``, or bottom-right as FlashAttention >=
2.1); undeclared, the oracle judges the cases where the two differ under both and checks fn
under the one it follows (named in the verdict line), failing those cases when it follows
neither.

What is checked, per case (:func:`dmref.oracle.cases.make_cases`: every axis an attention bug
can live on, docs/oracle.md), after one forward and one backward of fn on the case's inputs
(given in the case's memory layout):

- ``runs``: fn returned a tensor of the right shape and gradients reached q, k, v.
- ``output``, ``inputs`` (the calling contract): the output has q's dtype and memory of its own;
  q, k, v, dO and the mask are unchanged by the call.
- ``finite``: no NaN or inf in out, dq, dk, dv.
- ``out``, ``dq``, ``dk``, ``dv``: the largest componentwise error beyond ``floor`` (the
  rigorous bound of any float32 implementation on that element; float64's for float64 inputs),
  in units of the element's magnitude M, is at most twice the baseline's own statistic
  (:data:`BASELINE_FACTOR`); where the baseline's excess is 0, two roundings of the element's
  value to the dtype are not counted against fn (:func:`rounding_allowance`).
- ``rowsum``: the probe's reading of sum_j dS_ij (:mod:`dmref.oracle.probe`), rms over rows relative to
  sum_j |P_ij dP_ij|, is at most the baseline's; a reading the probe cannot vouch for is
  INCONCLUSIVE (neither passed nor failed), reported with what the probe read.
- ``agree_*`` (a recipe claim only): fn makes the recipe's rounding errors, not others of the
  same size.
- once per check, on the first plain case: ``defaults`` (arguments left out mean SDPA's
  defaults) and ``repeat`` (a second call within the same bounds, the first call's results
  untouched).

The baseline runs in the same call on the same inputs: with ``recipe=None`` dmref's model of a
correct implementation in ``dtype`` (:func:`baseline_recipe`: FlashAttention-2's numerics for
BF16 and FP16), with ``recipe=R`` the emulated R.

The verdict (``report.verdict``): FAILED when a check failed (or none ran), else INCONCLUSIVE
when a reading could not be vouched for, else PASSED (``report.passed``). Each failed check
carries its most likely cause in words (``Check.cause``; ``report.reasons()``: one line per
failed check); the causal alignment is named as a cause only where the other alignment's
reference fits.

Guarantees:

- Nothing is reported as checked that was not: a check that did not run is ``skipped`` or
  ``unsupported`` with the reason, and a report with no check run does not pass.
- An exception in a case exercising an optional feature (:data:`OPTIONAL_FEATURES`: GQA,
  masks, sliding windows, documents), or a case whose argument fn does not take, marks that
  case ``unsupported`` (named in the summary with the exception's message) and does not fail
  the verdict, unless the feature is in ``require``. Any other exception, ``NotImplementedError``
  included, fails ``runs``; any exit of fn (``SystemExit``) fails its case.
- With ``timeout``, a case that runs longer fails ``runs`` ("timed out"), and the cases after it
  are not run (reported as skipped): the hung call cannot be stopped. Likewise after a case whose
  call faulted on the device (a CUDA error): the process's CUDA context is lost.
- Every bound is derived from the dtype, the recipe and the inputs (no typed tolerance); the
  derivations and their evidence are in docs/oracle.md.

Where things live: :mod:`dmref.oracle.report` (the report and its rendering), :mod:`dmref.oracle.bounds` (magnitudes,
floors, baselines, the factors), :mod:`dmref.oracle.runner` (options, calling fn, timeouts, exits and device
faults), :mod:`dmref.oracle.checks` (:func:`dmref.oracle.check` and every check); the ready-made targets are in
:mod:`dmref.oracle.targets` (re-exported here: ``dmref.oracle:sdpa_math``, ``emulated_<preset>``).
"""

from __future__ import annotations

from .bounds import (AGREEMENT_FRACTION, BASELINE_FACTOR, ROWSUM_SAMPLING_SIGMAS, baseline_recipe, elementwise_ratio,
                     exact_reference, floor_unit_roundoff, max_value, rounding_allowance)
from .cases import CASE_SETS, CAUSAL_ALIGNMENTS, DEFAULT_CASES, Case, check_seed, make_cases
from .checks import OPTIONAL_FEATURES, check
from .report import CONTRACT_CHECKS, VERDICTS, CaseResult, Check, OracleReport
from .runner import (DTYPE_NAMES, MAX_TIMEOUT, TargetUnavailable, check_timeout, device_problem, resolve_dtype,
                     validate_signature)
from .targets import causal_into_mask, emulated, features_into_mask, gqa_kwargs, sdpa, sdpa_math

__all__ = [
    "AGREEMENT_FRACTION",
    "BASELINE_FACTOR",
    "CASE_SETS",
    "CAUSAL_ALIGNMENTS",
    "CONTRACT_CHECKS",
    "DEFAULT_CASES",
    "DTYPE_NAMES",
    "MAX_TIMEOUT",
    "OPTIONAL_FEATURES",
    "ROWSUM_SAMPLING_SIGMAS",
    "Case",
    "CaseResult",
    "Check",
    "OracleReport",
    "TargetUnavailable",
    "VERDICTS",
    "baseline_recipe",
    "causal_into_mask",
    "check",
    "check_seed",
    "check_timeout",
    "device_problem",
    "emulated",
    "features_into_mask",
    "floor_unit_roundoff",
    "gqa_kwargs",
    "make_cases",
    "resolve_dtype",
    "rounding_allowance",
    "sdpa",
    "sdpa_math",
    "validate_signature",
]


def __getattr__(name: str):
    if name.startswith("emulated_"):
        from . import targets

        return getattr(targets, name)  # ValueError for an unknown preset
    raise AttributeError(f"module 'dmref.oracle' has no attribute {name!r}")
