"""The oracle's report: one :class:`Check` per check and case, :class:`CaseResult` statistics,
and :class:`OracleReport` with its verdict (PASSED, FAILED or INCONCLUSIVE), summary, strict
JSON, and its terminal rendering (:meth:`OracleReport.render`: the verdict line, a table of one
row per case that fits 80 columns, one line per failed check saying why; ``wide=True`` the table
of every check's statistic)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

__all__ = ["CONTRACT_CHECKS", "VERDICTS", "Check", "CaseResult", "OracleReport"]

#: the three verdicts of a report (:attr:`OracleReport.verdict`)
VERDICTS = ("PASSED", "FAILED", "INCONCLUSIVE")
#: the numerical checks (a statistic against a bound)
_NUMERICAL = ("out", "dq", "dk", "dv", "rowsum", "agree_out", "agree_dq", "agree_dk", "agree_dv")

_CHECK_ORDER = ("runs", "finite", "out", "dq", "dk", "dv", "rowsum", "agree_out", "agree_dq", "agree_dk", "agree_dv")
#: the checks of the calling contract (shown in one column of the table)
CONTRACT_CHECKS = ("output", "inputs", "defaults", "repeat")


@dataclass
class Check:
    """One check of one case. ``passed`` is None for a check that gave no verdict: skipped,
    ``unsupported`` (the case exercises an optional feature fn cannot do), or ``inconclusive``
    (it ran, but its measurement cannot be vouched for: the probe's two readings disagree)."""

    case: str
    name: str  #: "runs", "finite", "out", "dq", "dk", "dv", "rowsum", "agree_out", ...
    passed: bool | None
    value: float = math.nan  #: the statistic of the implementation
    bound: float = math.nan  #: the bound it is held to
    baseline: float = math.nan  #: the baseline's own statistic the bound is derived from
    detail: str = ""
    unsupported: str = ""  #: the optional feature fn cannot do ("gqa", "mask"), when it cannot
    inconclusive: bool = False  #: ran, but the measurement cannot be vouched for (``detail`` says why)
    cause: str = ""  #: for a failed check: its most likely cause, in words

    @property
    def status(self) -> str:
        """"passed", "FAILED", "INCONCLUSIVE", "unsupported" or "skipped"."""
        if self.passed is not None:
            return "passed" if self.passed else "FAILED"
        if self.inconclusive:
            return "INCONCLUSIVE"
        return "unsupported" if self.unsupported else "skipped"

    @property
    def ratio(self) -> float:
        """value / bound (NaN without a statistic; 0 / 0 is 0, x / 0 infinite)."""
        if math.isnan(self.value) or math.isnan(self.bound):
            return math.nan
        if self.bound > 0:
            return self.value / self.bound
        return 0.0 if self.value <= 0 else math.inf

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
    #: the causal alignment the causal cases with seqlen_q != seqlen_k were checked under;
    #: None when none was declared and no case tells the two apart
    causal_alignment: str | None = "top_left"
    #: how it was chosen: "declared", "inferred", "neither" (one such case fits one alignment,
    #: another the other; checked top-left), "undetermined" (no such case fits either, and they
    #: do not agree which is closer; checked top-left) or "untested" (no such case ran, or none
    #: tells the two apart, and none declared)
    alignment_source: str = "declared"
    alignment_detail: str = ""  #: for "neither": which case fits which alignment

    @property
    def passed(self) -> bool:
        """Every check that ran passed and none was inconclusive."""
        return self.verdict == "PASSED"

    @property
    def verdict(self) -> str:
        """"FAILED" when a check failed or no check ran, else "INCONCLUSIVE" when a measurement
        could not be vouched for, else "PASSED"."""
        ran = [c for c in self.checks if c.passed is not None]
        if self.failed or not (ran or self.inconclusive):
            return "FAILED"
        return "INCONCLUSIVE" if self.inconclusive else "PASSED"

    @property
    def inconclusive(self) -> list[Check]:
        """Checks that ran but whose measurement cannot be vouched for (not a pass, not a fail)."""
        return [c for c in self.checks if c.inconclusive and c.passed is None]

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.passed is False]

    @property
    def skipped(self) -> list[Check]:
        """Checks that did not run, the unsupported ones included."""
        return [c for c in self.checks if c.passed is None and not c.inconclusive]

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
            "causal_alignment": self.causal_alignment, "alignment_source": self.alignment_source,
            "alignment_detail": self.alignment_detail,
            "verdict": self.verdict, "passed": self.passed, "failed": [c.id for c in self.failed],
            "inconclusive": [c.id for c in self.inconclusive],
            "unsupported": [{"case": c.case, "feature": c.unsupported, "detail": c.detail} for c in self.unsupported],
            "checks": [asdict(c) for c in self.checks], "cases": [asdict(c) for c in self.cases],
        })

    def to_json(self, **kwargs) -> str:
        """:meth:`as_dict` as strict JSON (``allow_nan=False``)."""
        import json

        return json.dumps(self.as_dict(), allow_nan=False, **kwargs)

    def alignment_clause(self) -> str:
        """What the verdict line says about the causal alignment ("" when no case tells the two
        apart and none was declared)."""
        a = self.causal_alignment
        name = a.replace("_", "-") if a else ""
        if self.alignment_source == "inferred":
            return (f"causal alignment: {name}, inferred; declare it with causal_alignment={a!r} "
                    f"(--causal-alignment {a})")
        if self.alignment_source == "neither":
            detail = f" ({self.alignment_detail})" if self.alignment_detail else ""
            return ("causal alignment: neither top-left nor bottom-right fits every causal case with "
                    f"seqlen_q != seqlen_k{detail}; checked {name}")
        if self.alignment_source == "undetermined":
            return (f"causal alignment: undetermined (no causal case with seqlen_q != seqlen_k fits either); "
                    f"checked {name}")
        if self.alignment_source == "declared" and a:
            return f"causal alignment: {name}, declared"
        return ""

    def verdict_line(self) -> str:
        """The verdict and its counts, and the causal alignment: the first line of the terminal
        report."""
        ran = [c for c in self.checks if c.passed is not None]
        verdict = self.verdict
        if self.failed:
            line = f"{verdict}: {len(self.failed)} of {len(ran) + len(self.inconclusive)} checks failed"
        elif verdict == "FAILED":
            line = f"{verdict}: no check ran"
        elif self.inconclusive:
            line = (f"{verdict}: {len(self.inconclusive)} of {len(ran) + len(self.inconclusive)} checks could "
                    f"not be vouched for, the other {len(ran)} passed")
        else:
            line = f"{verdict}: all {len(ran)} checks passed"
        clause = self.alignment_clause()
        return f"{line}; {clause}" if clause else line

    def summary(self) -> str:
        """One line: verdict, counts, the failed and inconclusive checks, the unsupported cases,
        the causal alignment."""
        ran = [c for c in self.checks if c.passed is not None]
        unsupported = self.unsupported
        line = (f"{self.verdict}: {self.target} ({self.mode}): {sum(bool(c.passed) for c in ran)}/{len(ran)} checks "
                f"passed, {len(self.skipped) - len(unsupported)} skipped")
        if self.failed:
            line += "; failed: " + ", ".join(c.id for c in self.failed)
        if self.inconclusive:
            line += "; INCONCLUSIVE (the measurement cannot be vouched for): " + ", ".join(
                c.id for c in self.inconclusive)
        if unsupported:
            line += "; UNSUPPORTED (not counted): " + "; ".join(
                f"{c.case} ({c.unsupported}: {_first_line(c.detail)})" for c in unsupported)
        clause = self.alignment_clause()
        return f"{line}; {clause}" if clause else line

    def reasons(self) -> list[str]:
        """One line per failed check (the case, the statistic against its bound, the most likely
        cause in words), then one per inconclusive check (what the probe did see)."""
        lines = []
        for c in self.failed:
            why = c.cause or c.detail
            if c.name in _NUMERICAL and not math.isnan(c.value):
                ratio = c.ratio
                if c.bound == 0 and c.name in ("out", "dq", "dk", "dv"):
                    # the baseline's error lies within the float32 floor there, and the statistic is
                    # the error beyond that floor and two roundings of each element to the dtype
                    # (checks.error_checks): a correct implementation has none
                    lines.append(f"{c.id}  {c.value:.3g} beyond the float32 floor and two roundings to "
                                 f"the dtype, where a correct implementation stays within them: {why}")
                    continue
                times = f" ({ratio:.3g}x)" if math.isfinite(ratio) else ""
                lines.append(f"{c.id}  {c.value:.3g} > {c.bound:.3g}{times}: {why}")
            else:
                lines.append(f"{c.id}: {why}" if why else c.id)
        for c in self.inconclusive:
            lines.append(f"{c.id}  INCONCLUSIVE: {c.detail}")
        return lines

    def table(self, *, title: str | None = None):
        """The wide table: one row per case, one column per check (statistic / bound, marked);
        needs about 160 columns (:meth:`render` with ``wide=False`` fits 80)."""
        from rich.table import Table

        names = [n for n in _CHECK_ORDER if any(c.name == n and (c.passed is not None or c.inconclusive)
                                                 for c in self.checks)]
        if any(c.name == "runs" and c.passed is not None and not c.passed for c in self.checks):
            names = [n for n in names if n != "finite"]
        table = Table(title=title or f"dmref check: {self.target} ({self.mode})", title_justify="left",
                      caption_justify="left")
        table.add_column("case", no_wrap=True)
        table.add_column("shape", no_wrap=True)
        for n in names:
            table.add_column(n, justify="right", no_wrap=True)
        table.add_column("contract", justify="right", no_wrap=True)
        table.add_column("rowsum rms (probe)", justify="right", no_wrap=True)
        table.add_column("dQ bias", justify="right", no_wrap=True)
        by_case = self._by_case()
        for cr in self.cases:
            row = [cr.name, cr.shape]
            checks = by_case.get(cr.name, {})
            for n in names:
                c = checks.get(n)
                if c is None:
                    row.append("")
                elif c.passed is None and c.unsupported:
                    row.append("[yellow]UNSUPPORTED[/yellow]")
                elif c.inconclusive:
                    row.append(f"[yellow]{c.value:.2g} / {c.bound:.2g} ?[/yellow]")
                elif c.passed is None:
                    row.append("[dim]skip[/dim]")
                elif n in ("runs", "finite"):
                    row.append("[green]ok[/green]" if c.passed else "[red]FAIL[/red]")
                else:
                    cell = f"{c.value:.2g} / {c.bound:.2g}"
                    row.append(f"[green]{cell}[/green]" if c.passed else f"[bold red]{cell} FAIL[/bold red]")
            contract = [checks[n] for n in CONTRACT_CHECKS if n in checks and checks[n].passed is not None]
            broken = [c.name for c in contract if not c.passed]
            row.append("" if not contract else f"[red]FAIL[/red] {', '.join(broken)}" if broken else "[green]ok[/green]")
            probe_cell = "" if math.isnan(cr.rowsum_rms) else f"{cr.rowsum_rms:.2g}"
            if cr.probe_valid is False:
                probe_cell += " [yellow](not vouched)[/yellow]"
            row.append(probe_cell)
            row.append("" if math.isnan(cr.dq_bias_fraction) else f"{cr.dq_bias_fraction:.2f}")
            table.add_row(*row)
        table.caption = ("cells: statistic / bound (? : inconclusive). out..dv: max over elements of the error "
                         "beyond the float32 bound, in units of the element's magnitude; rowsum: rms over rows of "
                         "|sum_j dS_ij| / sum_j |P_ij dP_ij|, read by the probe; agree_*: rms distance to the "
                         "emulated recipe; contract: output, inputs (every case), defaults, repeat (one case).")
        return table

    def summary_table(self):
        """The narrow table (fits 80 columns): one row per case, its result (ok, the failed or
        inconclusive checks, unsupported) and its largest statistic / bound."""
        from rich import box
        from rich.table import Table

        rows = []
        by_case = self._by_case()
        for cr in self.cases:
            checks = list(by_case.get(cr.name, {}).values())
            failed = [c.name for c in checks if c.passed is False]
            unknown = [c.name for c in checks if c.inconclusive and c.passed is None]
            unsupported = [c.unsupported for c in checks if c.unsupported and c.passed is None]
            if failed:
                result = "[bold red]FAIL[/bold red] " + " ".join(failed)
            elif unsupported:
                result = "[yellow]UNSUPPORTED[/yellow] " + " ".join(sorted(set(unsupported)))
            elif unknown:
                result = "[yellow]INCONCLUSIVE[/yellow] " + " ".join(unknown)
            elif any(c.passed for c in checks):
                result = "[green]ok[/green]"
            else:
                result = "[dim]not run[/dim]"
            stats = [c for c in checks if c.name in _NUMERICAL and not math.isnan(c.ratio)
                     and (c.passed is not None or c.inconclusive)]
            worst = max(stats, key=lambda c: c.ratio, default=None)
            if worst is None:
                cell = ""
            elif worst.bound > 0 or worst.ratio == 0:
                cell = f"{worst.ratio:.2g} {worst.name}"
            else:  # a bound of 0: the statistic itself
                cell = f"{worst.value:.2g}/0 {worst.name}"
            rows.append((cr.name, cr.shape, result, cell))
        table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1))
        # names, shapes and numbers are never wrapped or cut: their columns are as wide as
        # their longest cell; the result column wraps between check names
        for header, cells, justify in (("case", [r[0] for r in rows], "left"), ("shape", [r[1] for r in rows], "left")):
            table.add_column(header, justify=justify, no_wrap=True, min_width=max(map(len, [header, *cells])))
        table.add_column("result", overflow="fold", ratio=1)
        width = max(map(len, ["stat/bound", *(r[3] for r in rows)]))
        table.add_column("stat/bound", justify="right", no_wrap=True, min_width=width)
        for r in rows:
            table.add_row(*r)
        return table

    def render(self, console, *, wide: bool = False) -> None:
        """Print the report on a rich ``console``: the verdict line first, the target, the table
        (the narrow summary; ``wide``: every check's statistic), then why each failed check
        failed, what each inconclusive one saw, and the unsupported cases."""
        style = {"PASSED": "bold green", "FAILED": "bold red", "INCONCLUSIVE": "bold yellow"}[self.verdict]
        console.print(self.verdict_line(), style=style, highlight=False)
        console.print(f"{self.target} ({self.mode}), {len(self.cases)} case{'s' if len(self.cases) != 1 else ''}", highlight=False)
        if wide:
            table = self.table(title="")
            width = console.width
            natural = console.measure(table, options=console.options.update_width(1 << 16)).maximum
            console.width = max(width, natural)  # every cell whole (the terminal may wrap the lines)
            try:
                console.print(table)
            finally:
                console.width = width
        else:
            console.print(self.summary_table())
        reasons = self.reasons()
        if reasons:
            console.print()
            console.print("Why:" if self.failed else "What the probe saw:", style="bold", highlight=False)
            for line in reasons:
                console.print(line, highlight=False)
        if self.unsupported:
            console.print()
            console.print("Unsupported (not counted; --require FEATURE to fail them):", style="bold", highlight=False)
            for c in self.unsupported:
                console.print(f"{c.case} ({c.unsupported}): {_first_line(c.detail)}", highlight=False)
        if not wide:
            console.print("stat/bound: the case's largest statistic over its bound (above 1 fails); "
                          "--wide: every check's statistic and bound; docs/oracle.md: the bounds.",
                          style="dim", highlight=False)

    def _by_case(self) -> dict[str, dict[str, Check]]:
        by_case: dict[str, dict[str, Check]] = {}
        for c in self.checks:
            by_case.setdefault(c.case, {})[c.name] = c
        return by_case

    def raise_for_failures(self) -> None:
        """Raise AssertionError with the summary and one line per failed check (why it failed)
        when a check failed or none ran. An INCONCLUSIVE report (no failure; a measurement the
        probe cannot vouch for) does not raise: read :attr:`verdict` or :attr:`inconclusive`."""
        if self.verdict != "FAILED":
            return
        lines = [self.summary()]
        lines += [f"  {line}" for line in self.reasons()]
        if not self.failed:
            lines.append("  no check ran")
        raise AssertionError("\n".join(lines))


def _first_line(text: str) -> str:
    return text.splitlines()[0] if text else ""
