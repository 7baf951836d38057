"""``dmref demo``: every preset recipe on a realistic attention problem, on the CPU.

The problem (:func:`make_problem`) has the activation statistics that make FP8 attention hard:
a few outlier channels in Q, K and V, an attention-sink key, query rows that attend sharply to
one key, and output gradients whose scale varies by token. For each preset the demo runs the
tiled forward and backward with diagnostics (:func:`dmref.diagnostics.evaluate`) and reports the
row-sum residual of dS (before and after dS's quantization), the output and gradient errors
against the float64 reference, and the share of dQ's error along kbar. It then repeats the
errors over sequence lengths and draws both in one PNG.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field

import torch

from . import diagnostics, emulation
from .recipes import PRESETS, get_recipe

__all__ = ["DemoConfig", "DemoResult", "make_problem", "run_demo", "write_plot"]

#: Keys every ``dmref demo --json`` object carries.
JSON_KEYS = (
    "recipe", "rowsum_residual_max", "rowsum_residual_mean", "rowsum_residual_after_quant_max",
    "dq_rel_err", "dk_rel_err", "dv_rel_err", "out_rel_err", "dq_bias_fraction",
)


def make_problem(batch: int = 1, heads: int = 4, seqlen: int = 1024, head_dim: int = 64, *,
                 kv_heads: int | None = None, seed: int = 0, outlier_channels: int = 4,
                 qk_outlier_scale: float = 3.0, v_outlier_scale: float = 8.0,
                 peaked_fraction: float = 0.1, peak_logit: float = 12.0, sink_logit: float = 4.0,
                 grad_scale: float = 1e-3):
    """(q, k, v, dout), float32 tensors holding BF16 values (rounded by dmref.emulation), shapes
    ``(batch, heads, seqlen, head_dim)`` (k, v with ``kv_heads``).

    - ``outlier_channels`` channels of q and k are ``qk_outlier_scale`` times larger, of v
      ``v_outlier_scale`` times (the massive activations of LLMs);
    - queries share a mean direction mu; key 0 is an attention sink, shifted along mu so that
      its logit is about ``sink_logit`` above the rest;
    - a ``peaked_fraction`` of query rows point at one earlier key with logit ``peak_logit``;
    - dout has per-token scales drawn log-normally around ``grad_scale``.
    """
    kv_heads = kv_heads or heads
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    chan = torch.ones(head_dim, dtype=torch.float64)
    outliers = torch.randperm(head_dim, generator=g)[:outlier_channels]
    q_scale, v_scale = chan.clone(), chan.clone()
    q_scale[outliers], v_scale[outliers] = qk_outlier_scale, v_outlier_scale
    tau = 1.0 / math.sqrt(head_dim)
    groups = heads // kv_heads
    # queries share a mean direction mu (|mu| about half a token's norm), as in trained models
    mu = randn(batch, kv_heads, 1, head_dim)
    mu = 0.5 * math.sqrt(head_dim) * mu / mu.norm(dim=-1, keepdim=True)
    q = randn(batch, heads, seqlen, head_dim) * q_scale + mu.repeat_interleave(groups, dim=1)
    k = randn(batch, kv_heads, seqlen, head_dim) * q_scale
    v = randn(batch, kv_heads, seqlen, head_dim) * v_scale
    # attention sink: key 0 gains sink_logit / scale along mu, so its logit is ~sink_logit higher
    k[:, :, 0] += sink_logit * mu[:, :, 0] / (tau * (mu[:, :, 0] * mu[:, :, 0]).sum(-1, keepdim=True))
    # peaked rows: q_i points at one earlier key j (causal-safe) with logit ~ peak_logit
    n_peaked = int(peaked_fraction * seqlen)
    if n_peaked and seqlen > 1:
        rows = torch.randperm(seqlen - 1, generator=g)[:n_peaked] + 1
        for r in rows.tolist():
            j = int(torch.randint(0, r + 1, (1,), generator=g))
            kj = k[:, :, j].repeat_interleave(groups, dim=1)
            q[:, :, r] = peak_logit * kj / (tau * (kj * kj).sum(-1, keepdim=True).clamp_min(1e-12))
    token_scale = torch.exp(randn(batch, heads, seqlen, 1) * 0.5) * grad_scale
    dout = randn(batch, heads, seqlen, head_dim) * token_scale
    return tuple(emulation.quantize(t.to(torch.float32), "bfloat16") for t in (q, k, v, dout))


@dataclass
class DemoConfig:
    batch: int = 1
    heads: int = 4
    seqlen: int = 1024
    head_dim: int = 64
    causal: bool = True
    seed: int = 0
    recipes: tuple[str, ...] = tuple(PRESETS)
    sweep_seqlens: tuple[int, ...] = (128, 256, 512, 1024)
    sweep_heads: int = 2


@dataclass
class DemoResult:
    config: DemoConfig
    reports: list = field(default_factory=list)  #: diagnostics.Report per recipe
    residuals: dict = field(default_factory=dict)  #: recipe -> per-row |r_i| / A_i (numpy)
    residuals_after_quant: dict = field(default_factory=dict)
    sweep: dict = field(default_factory=dict)  #: recipe -> list of (seqlen, Report)

    def json_rows(self) -> list[dict]:
        return [r.as_dict() for r in self.reports]


def _relative_rows(stats, which: str):
    num = getattr(stats, which).abs()
    den = stats.abs_pdp
    keep = den > 0
    return (num[keep] / den[keep]).flatten().numpy()


def run_demo(config: DemoConfig, progress=None) -> DemoResult:
    """Run every recipe of ``config`` on the main problem, then the sequence-length sweep.
    ``progress``: a rich Progress (or None)."""
    result = DemoResult(config)
    recipes = [get_recipe(r) for r in config.recipes]
    q, k, v, dout = make_problem(config.batch, config.heads, config.seqlen, config.head_dim, seed=config.seed)
    sweep_steps = len(recipes) * len(config.sweep_seqlens) if config.sweep_seqlens else 0
    task = progress.add_task("main problem", total=len(recipes) + 1) if progress else None
    exact = diagnostics.exact_results(q, k, v, dout, causal=config.causal)
    if progress:
        progress.advance(task)
    for recipe in recipes:
        if progress:
            progress.update(task, description=f"{recipe.name} (N={config.seqlen})")
        report, stats = diagnostics.evaluate(q, k, v, dout, recipe, causal=config.causal, exact=exact)
        result.reports.append(report)
        result.residuals[recipe.name] = _relative_rows(stats, "residual")
        result.residuals_after_quant[recipe.name] = _relative_rows(stats, "residual_dq")
        if progress:
            progress.advance(task)
    if sweep_steps:
        task2 = progress.add_task("sequence-length sweep", total=sweep_steps) if progress else None
        for n in config.sweep_seqlens:
            problem = make_problem(config.batch, config.sweep_heads, n, config.head_dim, seed=config.seed + 1)
            exact_n = diagnostics.exact_results(*problem, causal=config.causal)
            for recipe in recipes:
                if progress:
                    progress.update(task2, description=f"{recipe.name} (N={n})")
                report, _ = diagnostics.evaluate(*problem, recipe, causal=config.causal, exact=exact_n)
                result.sweep.setdefault(recipe.name, []).append((n, report))
                if progress:
                    progress.advance(task2)
    return result


def write_plot(result: DemoResult, path: str) -> None:
    """Three panels: per recipe, the distribution over rows of |r_i| / A_i of the FP32 dS (with
    the FP32 bound Delta-Matching meets, dashed); then dQ's error and the largest row-sum
    residual against sequence length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = [r.recipe for r in result.reports]
    cfg = result.config
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(18, 5.5), gridspec_kw=dict(width_ratios=[1.4, 1, 1]))
    floor = 1e-18
    data = [np.log10(np.maximum(result.residuals[n], floor)) for n in names]
    parts = ax1.violinplot(data, showmedians=True, showextrema=True)
    for body in parts["bodies"]:
        body.set_alpha(0.5)
    by_name = {r.recipe: r for r in result.reports}
    reference = by_name.get("delta_matching", result.reports[0])
    bound = reference.rowsum_bound_max
    ax1.axhline(math.log10(bound), color="k", linestyle="--", linewidth=1,
                label=f"FP32 bound met by Delta-Matching (largest row) {bound:.1e}")
    ax1.set_xticks(range(1, len(names) + 1), names, rotation=30, ha="right")
    ax1.set_ylabel("log10 |sum_j dS_ij| / sum_j |P_ij dP_ij|   (one value per row)")
    ax1.set_title(f"row-sum residual of FP32 dS, before its quantization\n"
                  f"B={cfg.batch} H={cfg.heads} N={cfg.seqlen} D={cfg.head_dim}"
                  f"{' causal' if cfg.causal else ''} (zero residuals drawn at 1e-18)")
    ax1.legend(loc="lower left", fontsize=8)
    for name, rows in result.sweep.items():
        ns = [n for n, _ in rows]
        ax2.plot(ns, [max(r.dq_rel_err, floor) for _, r in rows], marker="o", label=name)
        ax3.plot(ns, [max(r.rowsum_residual_max, floor) for _, r in rows], marker="o", label=name)
    for ax, what in ((ax2, "dQ relative error (Frobenius)"), (ax3, "largest row-sum residual of FP32 dS")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N")
        ax.set_title(f"{what}\nagainst N (H={cfg.sweep_heads}, same statistics)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(result: DemoResult, console) -> None:
    from rich.table import Table

    cfg = result.config
    table = Table(title=f"dmref demo: B={cfg.batch} H={cfg.heads} N={cfg.seqlen} D={cfg.head_dim}"
                        f"{' causal' if cfg.causal else ''}, outlier channels, sink key, peaked rows")
    cols = [("recipe", "recipe"), ("rowsum max", "rowsum_residual_max"),
            ("rowsum mean", "rowsum_residual_mean"), ("max / FP32 bound", "rowsum_over_bound_max"),
            ("after Q(dS) max", "rowsum_residual_after_quant_max"), ("out err", "out_rel_err"),
            ("dQ err", "dq_rel_err"), ("dK err", "dk_rel_err"), ("dV err", "dv_rel_err"),
            ("dQ bias frac", "dq_bias_fraction")]
    for title, _ in cols:
        table.add_column(title, justify="left" if title == "recipe" else "right")
    for r in result.reports:
        d = r.as_dict()
        table.add_row(*[d["recipe"]] + [f"{d[key]:.2e}" if key != "dq_bias_fraction" else f"{d[key]:.2f}"
                                        for _, key in cols[1:]])
    console.print(table)
    console.print("rowsum: |sum_j dS_ij| / sum_j |P_ij dP_ij| of the FP32 dS before its quantization; "
                  "'max / FP32 bound' <= 1 means every row is within Delta-Matching's FP32 bound "
                  "(dmref.diagnostics.matched_rowsum_bound); errors are relative Frobenius norms "
                  "against the float64 reference; dQ bias frac: share of dQ's squared error along "
                  "kbar_i = sum_j P_ij K_j.")


def main(args) -> int:
    import json

    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    torch.set_num_threads(max(1, torch.get_num_threads()))
    config = DemoConfig(
        batch=args.batch, heads=args.heads, seqlen=args.seqlen, head_dim=args.head_dim,
        causal=not args.no_causal, seed=args.seed,
        recipes=tuple(args.recipes) if args.recipes else tuple(PRESETS),
        sweep_seqlens=tuple(args.sweep) if args.sweep is not None else DemoConfig.sweep_seqlens,
        sweep_heads=args.sweep_heads,
    )
    err = Console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=err, transient=args.json) as progress:
        result = run_demo(config, progress)
    if args.out:
        write_plot(result, args.out)
    if args.json:
        json.dump(result.json_rows(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        out = Console(width=None if sys.stdout.isatty() else 200)  # no wrapped rows in a log file
        print_table(result, out)
        if args.out:
            out.print(f"plot written to {args.out}")
    return 0
