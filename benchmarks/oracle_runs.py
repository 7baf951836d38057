"""The module that benchmarks/cpu_oracle.py and benchmarks/gpu_oracle.py share (not a script): run
dmref.oracle.check on a list of targets, print one summary table, write every report into one JSON
file. The two scripts import it as ``oracle_runs``: Python puts a script's own folder first on
sys.path."""

from __future__ import annotations

import datetime
import json
import math
import platform
import statistics
import time
import traceback
from dataclasses import dataclass, field

import torch


@dataclass
class Target:
    label: str  #: the name in the tables
    fn: object  #: fn(q, k, v, *, causal, scale[, mask])
    recipe: str | None = None  #: the claim (None: exact attention at the dtype's bounds)
    cases: object = "standard"  #: a case-set name or a list of case names
    dtype: torch.dtype = torch.bfloat16
    device: str = "cpu"
    note: str = ""
    kwargs: dict = field(default_factory=dict)


def summarize(report, seconds: float) -> dict:
    """One row per target: verdict, failed check names and cases, probe statistics."""
    rms = [c.rowsum_rms for c in report.cases if not math.isnan(c.rowsum_rms)]
    bias = [c.dq_bias_fraction for c in report.cases if not math.isnan(c.dq_bias_fraction)]
    ran = [c for c in report.checks if c.passed is not None]
    return {
        "target": report.target, "mode": report.mode, "passed": report.passed,
        "checks_passed": sum(bool(c.passed) for c in ran), "checks_run": len(ran), "skipped": len(report.skipped),
        "unsupported": sorted({f"{c.case} ({c.unsupported})" for c in report.unsupported}),
        "failed_checks": sorted(report.failed_names()), "failed_cases": sorted(report.failed_cases()),
        "rowsum_rms_median": statistics.median(rms) if rms else None,
        "rowsum_rms_max": max(rms) if rms else None,
        "probe_valid": all(c.probe_valid for c in report.cases if c.probe_valid is not None),
        "dq_bias_fraction_median": statistics.median(bias) if bias else None,
        "seconds": round(seconds, 1),
    }


def run(targets: list[Target], out_path: str, *, title: str, seed: int = 0) -> list[dict]:
    from rich.console import Console
    from rich.table import Table

    from dmref import oracle

    console = Console(width=220)
    rows, reports = [], []
    for t in targets:
        t0 = time.perf_counter()
        console.print(f"[bold]{t.label}[/bold] ({getattr(t.recipe, 'name', t.recipe) or 'exact'}, {t.dtype}, {t.device}) ...")
        try:
            report = oracle.check(t.fn, recipe=t.recipe, cases=t.cases, dtype=t.dtype, device=t.device, seed=seed,
                                  target=t.label, **t.kwargs)
        except Exception as e:  # noqa: BLE001 - record and go on with the other targets
            rows.append({"target": t.label, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
            console.print(f"[red]{t.label}: {type(e).__name__}: {e}[/red]")
            continue
        seconds = time.perf_counter() - t0
        console.print(report.table(title=f"{t.label} ({report.mode})"))
        row = summarize(report, seconds)
        row["note"] = t.note
        rows.append(row)
        reports.append(report.as_dict())
    table = Table(title=title, title_justify="left")
    for col in ("target", "mode", "verdict", "checks", "failed checks", "rowsum rms median / max", "dQ bias", "s"):
        table.add_column(col)
    for r in rows:
        if "error" in r:
            table.add_row(r["target"], "", "[red]error[/red]", "", r["error"][:60], "", "", "")
            continue
        rs = "" if r["rowsum_rms_median"] is None else f"{r['rowsum_rms_median']:.2g} / {r['rowsum_rms_max']:.2g}"
        bias = "" if r["dq_bias_fraction_median"] is None else f"{r['dq_bias_fraction_median']:.2f}"
        table.add_row(r["target"], r["mode"], "[green]pass[/green]" if r["passed"] else "[red]FAIL[/red]",
                      f"{r['checks_passed']}/{r['checks_run']}", ", ".join(r["failed_checks"]), rs, bias,
                      f"{r['seconds']}")
    console.print(table)
    meta = {
        "title": title, "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
        "cuda_device": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "seed": seed,
    }
    with open(out_path, "w") as f:
        json.dump({"meta": meta, "summary": rows, "reports": reports}, f, indent=1)
    console.print(f"written {out_path}")
    return rows
