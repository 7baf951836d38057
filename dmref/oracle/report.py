"""The oracle's report: one :class:`Check` per check and case, :class:`CaseResult` statistics,
and :class:`OracleReport` with its summary, strict JSON and rich table."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

__all__ = ["CONTRACT_CHECKS", "Check", "CaseResult", "OracleReport"]

_CHECK_ORDER = ("runs", "finite", "out", "dq", "dk", "dv", "rowsum", "agree_out", "agree_dq", "agree_dk", "agree_dv")
#: the checks of the calling contract (shown in one column of the table)
CONTRACT_CHECKS = ("output", "inputs", "defaults", "repeat")


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
    """Everything :func:`dmref.oracle.check` found. ``passed`` is True when every check that ran passed."""

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
