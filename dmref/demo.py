"""``dmref demo``: every preset recipe on a realistic attention problem, on the CPU.

The problem (:func:`dmref.problems.make_problem`) has the activation statistics that make FP8 attention hard:
a few outlier channels in Q, K and V, an attention-sink key, query rows that attend sharply to
one key, and output gradients whose scale varies by token. For each preset the demo runs the
tiled forward and backward with diagnostics (:func:`dmref.diagnostics.evaluate`) and reports the
row-sum residual of dS (before and after dS's quantization), the output and gradient errors
against the float64 reference, and the share of dQ's error along kbar. It repeats the errors
over sequence lengths, and it measures whether dQ's error averages away (:func:`accumulate`).

Why the last part: in one step the stale-delta recipes and Delta-Matching have dQ errors of the
same size (about 1e-1, FP8 rounding). What differs is their kind. A stale delta adds
-scale * delta_i * kbar_i to dQ (dmref/proofs/stale_delta.md, Proposition 2); where delta_i keeps its sign from step to
step this is a bias, and a bias survives averaging over many training steps, while rounding
noise averages away like 1/sqrt(T). :func:`accumulate` therefore averages dQ's error over T
independent roundings of one problem and reports the relative error of that average against T.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from . import diagnostics, emulation, reference, tiled
from .problems import make_problem  # noqa: F401 (dmref.problems.make_problem: the demo's problem)
from .recipes import PRESETS, DeltaKind, get_recipe

__all__ = [
    "AccumulationSeries", "DemoConfig", "DemoResult", "accumulate", "dither", "dq_rounding_level",
    "bias_estimate", "make_problem", "noise_ratio_band", "peak_bytes", "problem_bytes", "run_demo", "write_plot",
]

#: Keys every ``dmref demo --json`` object carries, with float values.
JSON_KEYS = (
    "recipe", "rowsum_residual_max", "rowsum_residual_mean", "rowsum_residual_after_quant_max",
    "dq_rel_err", "dk_rel_err", "dv_rel_err", "out_rel_err", "dq_rounding_level",
)
#: Recipes averaged by :func:`accumulate` by default: two stale FP8 presets and Delta-Matching.
#: naive_fp8 (Delta-Matching's quantization with a stale delta) is left out to keep the demo near
#: half a minute of CPU (DemoConfig.accum_recipes adds it back).
ACCUMULATION_RECIPES = ("cudnn_fp8", "mxfp8_stale", "delta_matching")


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
    sweep_heads: int | None = None  #: heads of the sweep's problems; None: ``heads``
    accum_draws: int = 256  #: T_max of :func:`accumulate`; 0 skips it
    accum_seqlen: int = 256  #: sequence length of the averaged problem
    accum_heads: int = 1  #: heads of the averaged problem (``batch`` and ``head_dim`` as above)
    #: share of the averaged problem's query rows that attend sharply to one key
    #: (:func:`make_problem`'s ``peaked_fraction``): low-entropy rows, as in trained models, where
    #: most P_ij are tiny and the stale delta's systematic part is largest
    accum_peaked_fraction: float = 1.0
    accum_recipes: tuple[str, ...] = ACCUMULATION_RECIPES


#: float64 arrays of (batch, heads, seqlen, seqlen) alive at once at the demo's peak: the float64
#: error bound of :func:`dq_rounding_level` (dmref.diagnostics.attention_error_bound: logits, P,
#: their error bounds, dP, dS and the temporaries of each line; 13-14 measured), with a margin
SQUARE_ARRAYS = 16
#: float64 arrays of (batch, heads, seqlen, head_dim) alive at once: inputs, outputs, gradients
#: and their bounds in float32 and float64 copies, with a margin
ROW_ARRAYS = 48


def problem_bytes(batch: int, heads: int, seqlen: int, head_dim: int) -> int:
    """Estimated peak memory of one problem of the demo (exact reference, error bound, recipes):
    8 bytes x batch x heads x seqlen x (SQUARE_ARRAYS seqlen + ROW_ARRAYS head_dim)."""
    return 8 * batch * heads * seqlen * (SQUARE_ARRAYS * seqlen + ROW_ARRAYS * head_dim)


def peak_bytes(config: "DemoConfig") -> int:
    """Estimated peak memory of :func:`run_demo` on ``config``: its problems run one at a time
    (the main problem, each sweep length, the averaged problem), so the largest of them."""
    sizes = [(config.heads, config.seqlen)]
    sizes += [(config.sweep_heads or config.heads, n) for n in config.sweep_seqlens]
    if config.accum_draws:
        sizes.append((config.accum_heads, config.accum_seqlen))
    return max(problem_bytes(config.batch, h, n, config.head_dim) for h, n in sizes)


@dataclass
class AccumulationSeries:
    """dQ's error averaged over T independent roundings of one problem (:func:`accumulate`).

    For each recipe and each T in ``draws``, with e_t = dQ_t - dQ*_t the error of draw t against
    the float64 reference of that draw:

    - ``err``: || (1/T) sum_t e_t ||_F / || (1/T) sum_t dQ*_t ||_F, the error of the averaged dQ;
    - ``err_along_kbar``: the part of it along kbar_i = sum_j P_ij K_j (row by row);
    - ``noise_only``: sqrt(sum_t ||e_t||^2) / T / || (1/T) sum_t dQ*_t ||_F, what ``err`` is
      expected to be if the e_t were independent with mean zero (E||sum_t e_t||^2 =
      sum_t E||e_t||^2): it falls exactly like 1/sqrt(T) times the typical one-draw error;
    - ``noise_only_along_kbar``: the same for the parts along kbar;
    - ``sq_norms``: ||e_t||_F^2 / ||dQ*_t||_F^2 of every single draw (for :func:`noise_ratio_band`).
    """

    shape: tuple[int, int, int, int]  #: (batch, heads, seqlen, head_dim) of the averaged problem
    draws: list[int] = field(default_factory=list)
    err: dict = field(default_factory=dict)
    err_along_kbar: dict = field(default_factory=dict)
    noise_only: dict = field(default_factory=dict)
    noise_only_along_kbar: dict = field(default_factory=dict)
    sq_norms: dict = field(default_factory=dict)

    def as_dict(self, recipe: str) -> dict:
        """The series of ``recipe`` and what panel A reads from it at T_max: ``ratio`` (err /
        noise_only), ``noise_band`` (:func:`noise_ratio_band` at :data:`BAND_SIGMAS`),
        ``bias_resolved`` (ratio above the band), ``bias`` (:func:`bias_estimate`, null unless
        resolved) and ``verdict`` (:func:`verdict`, the legend's words)."""
        ratio = self.err[recipe][-1] / self.noise_only[recipe][-1]
        band = noise_ratio_band(self.sq_norms[recipe], BAND_SIGMAS)
        return dict(shape=list(self.shape), draws=list(self.draws), err=self.err[recipe],
                    err_along_kbar=self.err_along_kbar[recipe], noise_only=self.noise_only[recipe],
                    noise_only_along_kbar=self.noise_only_along_kbar[recipe],
                    single_draw_sq_err=self.sq_norms[recipe], ratio=ratio, noise_band=band,
                    band_sigmas=BAND_SIGMAS, bias_resolved=ratio > band,
                    bias=bias_estimate(self, recipe) if ratio > band else None, verdict=verdict(self, recipe))


@dataclass
class DemoResult:
    config: DemoConfig
    reports: list = field(default_factory=list)  #: diagnostics.Report per recipe
    residuals: dict = field(default_factory=dict)  #: recipe -> per-row |r_i| / A_i (numpy)
    residuals_after_quant: dict = field(default_factory=dict)
    sweep: dict = field(default_factory=dict)  #: recipe -> list of (seqlen, Report)
    dq_rounding_level: float = 0.0  #: :func:`dq_rounding_level` of the main problem
    accumulation: AccumulationSeries | None = None

    def bias_fraction(self, report) -> float | None:
        """The report's dq_bias_fraction, or None where its dQ error is at most twice the float64
        reference's own rounding level (the recipe's float64 rounding plus the reference's): an
        error that small is rounding of the reference, and its direction says nothing."""
        return None if report.dq_rel_err <= 2 * self.dq_rounding_level else report.dq_bias_fraction

    def json_rows(self) -> list[dict]:
        rows = []
        for r in self.reports:
            row = r.as_dict()
            row["dq_bias_fraction"] = self.bias_fraction(r)
            row["dq_rounding_level"] = self.dq_rounding_level
            if self.accumulation is not None and r.recipe in self.accumulation.err:
                row["accumulation"] = self.accumulation.as_dict(r.recipe)
            rows.append(row)
        return rows


def _relative_rows(stats, which: str):
    num = getattr(stats, which).abs()
    den = stats.abs_pdp
    keep = den > 0
    return (num[keep] / den[keep]).flatten().numpy()


def dq_rounding_level(q, k, v, dout, dq_exact, *, causal: bool) -> float:
    """How far the float64 reference's dQ may be from exact arithmetic, relative:
    || B ||_F / || dQ ||_F with B = :func:`dmref.diagnostics.attention_error_bound` at the float64
    unit roundoff (2^-53 times the problem's condition: the sums of |P||dP| and |dS||K| that the
    bound carries). Below about this level a measured error is rounding, not a property of the
    recipe."""
    bound = diagnostics.attention_error_bound(q, k, v, dout, u=diagnostics.U_FP64, causal=causal)["dq"]
    den = dq_exact.to(torch.float64).norm().item()
    return bound.norm().item() / den if den > 0 else math.inf


def _coarsest_mantissa_bits(recipes) -> int:
    """The fewest mantissa bits among the formats the recipes round to (2 when one uses E5M2)."""
    bits = []
    for r in recipes:
        points = [*r.points().values(), r.delta.do, r.delta.o]
        bits += [emulation.get_format(p.fmt).mantissa_bits for p in points if p.fmt is not None]
    return min(bits) if bits else emulation.get_format("float8_e4m3fn").mantissa_bits


def dither(x: torch.Tensor, generator: torch.Generator, mantissa_bits: int) -> torch.Tensor:
    """x + z w(x), z standard normal, w(x) = 2^(floor(log2|x|) - mantissa_bits): one grid step, at
    x's binade, of a format with ``mantissa_bits`` bits (0 stays 0), as float32.

    Why this gives independent roundings of one problem whose errors average to zero: the
    rounding error of x + z w against x + z w has a mean that is periodic in x with the grid
    step, and a Gaussian dither of standard deviation one step damps that period by
    exp(-2 pi^2) ~ 3e-9 (the classical dither result; it holds whatever the grid's offset, so
    for power-of-two and other scales alike, and a step of the coarsest format covers several
    steps of every finer one). What is left is second order in the step: a floating-point grid
    doubles its step at each binade edge. The exact answer is recomputed for every draw, so the
    dither is not an error; quantities formed inside a recipe (P, dS) are re-rounded because
    they move with the inputs by many grid steps. A uniform dither one step wide is unbiased
    only on a uniform grid; at the binade edges it left Delta-Matching's averaged dQ error at
    1.8x its noise-only value after 256 draws, the Gaussian at 1.2x. Cheaper transformations
    give the same codes every time, not new draws: power-of-two rescalings (Q(2^k x) = 2^k Q(x)),
    sign flips and permutations; stochastic rounding is not in dmref.tiled; and a rotation of the
    head dimension would remove the outlier channels that make the problem hard. The price: each
    draw moves the inputs by about one coarse grid step (12-25% of |x| for E5M2), so the draws
    are like T training steps on the same kind of data rather than T roundings of identical
    numbers.
    """
    x64 = x.to(torch.float64)
    _, e = torch.frexp(x64)  # x = m 2^e with 1/2 <= |m| < 1: the binade starts at 2^(e - 1)
    step = torch.where(x64 == 0, torch.zeros_like(x64), torch.ldexp(torch.ones_like(x64), e - 1 - mantissa_bits))
    u = torch.randn(x.shape, generator=generator, dtype=torch.float64)
    return (x64 + u * step).to(torch.float32)


def accumulate(config: DemoConfig, progress=None) -> AccumulationSeries:
    """dQ's error averaged over T = 1 .. ``config.accum_draws`` independent roundings of one
    problem (:func:`make_problem` at ``config.accum_seqlen``), each draw :func:`dither`-ed, for
    every recipe of ``config.accum_recipes`` that is also in ``config.recipes``. Records at
    T = 1, 2, 4, ... and at T_max. Like T training steps accumulating a gradient: a part of the
    error that keeps its sign from draw to draw (a bias) stays, the rest falls like 1/sqrt(T)."""
    recipes = [get_recipe(r) for r in config.accum_recipes if r in config.recipes]
    shape = (config.batch, config.accum_heads, config.accum_seqlen, config.head_dim)
    series = AccumulationSeries(shape)
    if not recipes or config.accum_draws <= 0:
        return series
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # many small problems: intra-op threads cost more than they save
    try:
        _accumulate(config, recipes, series, progress)
    finally:
        torch.set_num_threads(threads)
    return series


def _accumulate(config: DemoConfig, recipes, series: AccumulationSeries, progress) -> None:
    shape = series.shape
    base = make_problem(*shape, seed=config.seed + 2, peaked_fraction=config.accum_peaked_fraction)
    kbar = diagnostics.exact_results(*base, causal=config.causal).kbar
    bits = _coarsest_mantissa_bits(recipes)
    g = torch.Generator().manual_seed(config.seed + 3)
    err_sum = {r.name: torch.zeros(base[0].shape, dtype=torch.float64) for r in recipes}
    sq = {r.name: [] for r in recipes}
    sq_abs = dict.fromkeys(err_sum, 0.0)
    sq_along = dict.fromkeys(err_sum, 0.0)
    dq_sum = torch.zeros(base[0].shape, dtype=torch.float64)
    task = progress.add_task("averaging over roundings", total=config.accum_draws) if progress else None
    for t in range(1, config.accum_draws + 1):
        problem = tuple(dither(x, g, bits) for x in base)
        dq_exact = reference.attention_ref(*problem, causal=config.causal)[2]
        dq_sum += dq_exact
        for r in recipes:
            _, bwd = tiled.attention(*problem, recipe=r, causal=config.causal)
            e = bwd.dq.to(torch.float64) - dq_exact
            err_sum[r.name] += e
            sq[r.name].append((e.norm().item() / dq_exact.norm().item()) ** 2)
            sq_abs[r.name] += e.norm().item() ** 2
            sq_along[r.name] += diagnostics.dq_bias_split(e, torch.zeros_like(e), kbar)[0].norm().item() ** 2
        if t & (t - 1) == 0 or t == config.accum_draws:
            series.draws.append(t)
            den = dq_sum.norm().item() / t
            for r in recipes:
                mean = err_sum[r.name] / t
                along, _, _ = diagnostics.dq_bias_split(mean, torch.zeros_like(mean), kbar)
                series.err.setdefault(r.name, []).append(mean.norm().item() / den)
                series.err_along_kbar.setdefault(r.name, []).append(along.norm().item() / den)
                series.noise_only.setdefault(r.name, []).append(math.sqrt(sq_abs[r.name]) / t / den)
                series.noise_only_along_kbar.setdefault(r.name, []).append(math.sqrt(sq_along[r.name]) / t / den)
        if progress:
            progress.advance(task)
    series.sq_norms = sq


def noise_ratio_band(sq_norms, sigmas: float = 4.0) -> float:
    """How far err / noise_only may stray from 1 at any T if the draws are noise only: for
    independent Gaussian errors of covariance C, ||sum_t e_t||^2 / T has the distribution of one
    draw's ||e||^2 (mean tr C, relative standard deviation s = sqrt(2 tr C^2) / tr C), so
    (err / noise_only)^2 = 1 +- s, and s is estimated from the single draws' squared errors.
    Returns sqrt(1 + ``sigmas`` s): a ratio above it is a bias, not chance."""
    x = torch.tensor(sq_norms, dtype=torch.float64)
    s = (x.std() / x.mean()).item() if len(sq_norms) > 1 else math.inf
    return math.sqrt(1 + sigmas * s)


def run_demo(config: DemoConfig, progress=None) -> DemoResult:
    """Run every recipe of ``config`` on the main problem, then the sequence-length sweep and the
    averaging over roundings. ``progress``: a rich Progress (or None)."""
    result = DemoResult(config)
    recipes = [get_recipe(r) for r in config.recipes]
    q, k, v, dout = make_problem(config.batch, config.heads, config.seqlen, config.head_dim, seed=config.seed)
    task = progress.add_task("main problem", total=len(recipes) + 1) if progress else None
    exact = diagnostics.exact_results(q, k, v, dout, causal=config.causal)
    result.dq_rounding_level = dq_rounding_level(q, k, v, dout, exact.dq, causal=config.causal)
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
    _sweep(config, recipes, result, progress)
    result.accumulation = accumulate(config, progress)
    return result


def _sweep(config: DemoConfig, recipes, result: DemoResult, progress) -> None:
    """The main problem's errors again at each sweep length (same seed and statistics); the
    length of the main problem reuses its reports when the head count is the same."""
    if not config.sweep_seqlens:
        return
    heads = config.sweep_heads or config.heads
    task = progress.add_task("sequence-length sweep", total=len(recipes) * len(config.sweep_seqlens)) if progress else None
    for n in config.sweep_seqlens:
        if (n, heads) == (config.seqlen, config.heads):
            for report in result.reports:
                result.sweep.setdefault(report.recipe, []).append((n, report))
            if progress:
                progress.advance(task, len(recipes))
            continue
        problem = make_problem(config.batch, heads, n, config.head_dim, seed=config.seed)
        exact_n = diagnostics.exact_results(*problem, causal=config.causal)
        for recipe in recipes:
            if progress:
                progress.update(task, description=f"{recipe.name} (N={n})")
            report, _ = diagnostics.evaluate(*problem, recipe, causal=config.causal, exact=exact_n)
            result.sweep.setdefault(recipe.name, []).append((n, report))
            if progress:
                progress.advance(task)


def _colors(names) -> dict:
    """One colour per recipe, the same in every panel (by position in PRESETS)."""
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    order = list(PRESETS)
    return {n: cmap(order.index(n.partition("@")[0]) % 10 if n.partition("@")[0] in order else 9) for n in names}


def bias_estimate(series: AccumulationSeries, recipe: str) -> float:
    """sqrt(err^2 - noise_only^2) at T_max, 0 where err is below its noise-only value: the size
    (relative to ||dQ*||) of the part of dQ's error that averaging does not remove, since
    E||mean error||^2 = ||bias||^2 + (noise-only value)^2."""
    e, n = series.err[recipe][-1], series.noise_only[recipe][-1]
    return math.sqrt(e * e - n * n) if e > n else 0.0


#: how each kind of delta is named in the figure
_DELTA_WORDS = {DeltaKind.STALE: "stale delta", DeltaKind.MATCHED: "matched delta",
                DeltaKind.CONSISTENT_P: "consistent P"}
#: standard deviations of the noise band drawn in panel A (:func:`noise_ratio_band`'s ``sigmas``)
BAND_SIGMAS = 4.0
#: what kbar_i is, in words, wherever the figure uses it
KBAR_WORDS = "kbar_i = sum_j P_ij K_j, query i's attention-weighted mean key"


def delta_words(name: str) -> str:
    """'stale delta', 'matched delta' or 'consistent P': how the recipe forms delta_i."""
    return _DELTA_WORDS[get_recipe(name).delta.kind]


def recipe_words(name: str) -> str:
    """'FP8, stale delta' (and the like) for a recipe with an FP8 quantization point; 'no FP8'
    for the others, where the kind of delta makes no visible difference."""
    recipe = get_recipe(name)
    fp8 = any(p.fmt is not None and p.fmt.is_fp8 for p in recipe.points().values())
    return f"FP8, {delta_words(name)}" if fp8 else "no FP8"


def _wrap(title: str, body: str, width: int = 80) -> str:
    import textwrap

    return "\n".join([title, *textwrap.wrap(body, width)])


def _problem_words(batch, heads, seqlen, head_dim, causal, peaked: float) -> str:
    rows = "every query row" if peaked >= 1 else f"{peaked:.0%} of query rows"
    return (f"B={batch} H={heads} N={seqlen} D={head_dim}{' causal' if causal else ''}, "
            f"{rows} attending sharply to one key")


def main_problem_words(config: DemoConfig) -> str:
    """The main problem (the table's, panels B-D) in words."""
    peaked = make_problem.__kwdefaults__["peaked_fraction"]
    return _problem_words(config.batch, config.heads, config.seqlen, config.head_dim, config.causal, peaked)


def averaged_problem_words(config: DemoConfig) -> str:
    """The averaged problem (panel A) in words."""
    return _problem_words(config.batch, config.accum_heads, config.accum_seqlen, config.head_dim, config.causal,
                          config.accum_peaked_fraction)


def verdict(series: AccumulationSeries, name: str) -> str:
    """What panel A says about one recipe at T_max, in words that do not claim more than the
    measurement: above the noise band a bias is measured; inside it none is resolved, which for
    a stale delta (which predicts one) means it is smaller than the draws' scatter, not absent."""
    ratio = series.err[name][-1] / series.noise_only[name][-1]
    t_max = series.draws[-1]
    head = f"{name} ({delta_words(name)}): {ratio:.2f}x"
    if ratio > noise_ratio_band(series.sq_norms[name], BAND_SIGMAS):
        return f"{head}, above its band: a bias of {bias_estimate(series, name):.1e} of ||dQ*||"
    if get_recipe(name).delta.kind is DeltaKind.STALE:
        return f"{head}, inside its band: its bias is not resolved at T={t_max} (smaller than the scatter)"
    return f"{head}, inside its band: no bias seen"


def _plot_accumulation(ax, ax_ratio, result: DemoResult, colors) -> tuple[list, list]:
    """Panel A: above, the error of the T-averaged dQ against T with each recipe's noise-only
    line; below, their ratio with each recipe's noise band (:func:`noise_ratio_band`). Returns
    the recipes that end above their band and those within it."""
    acc = result.accumulation
    ts, t_max = acc.draws, acc.draws[-1]
    above, within = [], []
    for name in acc.err:
        err, noise = acc.err[name], acc.noise_only[name]
        band = noise_ratio_band(acc.sq_norms[name], BAND_SIGMAS)
        (above if err[-1] / noise[-1] > band else within).append(name)
        ax.plot(ts, err, marker="o", color=colors[name], linewidth=2, label=verdict(acc, name))
        ax.plot(ts, noise, linestyle=":", color=colors[name], linewidth=1.5)
        ax_ratio.plot(ts, [e / n for e, n in zip(err, noise)], marker="o", color=colors[name], linewidth=2)
        ax_ratio.plot(ts, [e / n for e, n in zip(acc.err_along_kbar[name], acc.noise_only_along_kbar[name])],
                      linestyle="--", color=colors[name], linewidth=1.2)
        ax_ratio.axhline(band, color=colors[name], linestyle=":", linewidth=1.2)
    ax.plot([], [], linestyle=":", color="gray",
            label="dotted: noise-only error = what the average would be if every draw's error were "
                  "independent noise (falls like 1/sqrt(T))")
    for a in (ax, ax_ratio):
        a.set_xscale("log", base=2)
        a.grid(True, which="both", alpha=0.25)
    ax.set_yscale("log")
    low, high = ax.get_ylim()
    ax.set_ylim(low, high * (high / low) ** 0.6)  # room above the curves for the legend
    ax.tick_params(labelbottom=False)
    ax.set_ylabel("relative error of the averaged dQ\n||mean_t (dQ_t - dQ*_t)||_F / ||dQ*||_F")
    ax.set_title(_wrap("A. Does dQ's error average away over many training steps?",
                       f"A smaller problem than B-D, so that {t_max} draws run in seconds: "
                       f"{averaged_problem_words(result.config)}. Each draw re-rounds it (inputs jittered "
                       "by about one FP8 grid step; the exact dQ* recomputed)."), fontsize=11)
    ax.legend(loc="upper right", fontsize=8, title=f"at T={t_max}: error / noise-only error", title_fontsize=8)
    ax_ratio.axhline(1.0, color="k", linewidth=0.8)
    ax_ratio.set_ylabel("error / noise-only error")
    ax_ratio.set_xlabel("T: number of independent roundings averaged (like T training steps)")
    top = max(max(e / n for e, n in zip(acc.err[x] + acc.err_along_kbar[x], acc.noise_only[x] + acc.noise_only_along_kbar[x]))
              for x in acc.err)
    top = max(top, *(noise_ratio_band(acc.sq_norms[x], BAND_SIGMAS) for x in acc.err))
    ax_ratio.set_ylim(top=1 + 1.6 * (top - 1))
    ax_ratio.text(0.02, 0.96,
                  f"1 = pure noise. Dotted: each recipe's noise band, which pure noise stays below ({BAND_SIGMAS:g} "
                  "standard deviations,\nfrom the spread of the single draws' errors); above it = a bias that "
                  "averaging does not remove.\nDashed: the same ratio for the error's component along "
                  f"{KBAR_WORDS},\nthe direction in which a stale delta moves dQ_i",
                  transform=ax_ratio.transAxes, va="top", fontsize=8)
    return above, within


def _plot_residuals(ax, result: DemoResult, colors) -> None:
    """Panel B: per recipe, the distribution over rows of log10 |r_i| / A_i; rows whose residual
    is exactly 0 have no logarithm and are counted in a marker at the bottom of the axis."""
    import numpy as np

    names = [r.recipe for r in result.reports]
    logs = {n: np.log10(result.residuals[n][result.residuals[n] > 0]) for n in names}
    zeros = {n: int((result.residuals[n] == 0).sum()) for n in names}
    with_data = [i for i, n in enumerate(names) if logs[n].size]
    parts = ax.violinplot([logs[names[i]] for i in with_data], positions=[i + 1 for i in with_data],
                          showmedians=True, showextrema=True)
    for i, body in zip(with_data, parts["bodies"]):
        body.set_facecolor(colors[names[i]])
        body.set_alpha(0.6)
    lows = [logs[n].min() for n in names if logs[n].size]
    bottom = math.floor(min(lows)) - 1.5 if lows else -18
    by_name = {r.recipe: r for r in result.reports}
    ref = by_name.get("delta_matching", result.reports[0])
    ax.axhline(math.log10(ref.rowsum_bound_max), color="k", linestyle="--", linewidth=1,
               label=f"FP32 rounding bound that Delta-Matching meets (largest row): {ref.rowsum_bound_max:.1e}")
    for i, n in enumerate(names):
        if zeros[n]:
            ax.plot(i + 1, bottom + 0.4, marker="v", color=colors[n], markersize=9)
            ax.text(i + 1, bottom + 0.9, f"{zeros[n]} rows\nexactly 0", ha="center", fontsize=7)
    ax.plot([], [], "v", color="gray", label="rows whose residual is exactly 0 (no log; counted)")
    ax.set_ylim(bottom=bottom)
    ax.set_xticks(range(1, len(names) + 1), [f"{n}\n{recipe_words(n)}" for n in names], rotation=25, ha="right",
                  fontsize=8.5)
    ax.set_ylabel("log10 of  |sum_j dS_ij| / sum_j |P_ij dP_ij|   (one value per query row)")
    ax.set_title(_wrap("B. Why: the rows of dS = P * (dP - delta) sum to zero in exact arithmetic. Here?",
                       f"The table's problem: {main_problem_words(result.config)}. dS in FP32, before it is "
                       "cast to FP8 for the dQ and dK matmuls."), fontsize=11)
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(True, axis="y", alpha=0.25)


def _plot_sweep(ax, result: DemoResult, colors, key: str, title: str, ylabel: str) -> None:
    """Panels C and D: one report field against N; a value that is exactly 0 is drawn as a
    marker at the bottom of the axis."""
    cfg = result.config
    zero_points = []
    for name, rows in result.sweep.items():
        ns = [n for n, _ in rows]
        ys = [getattr(r, key) for _, r in rows]
        ax.plot([n for n, y in zip(ns, ys) if y > 0], [y for y in ys if y > 0], marker="o",
                color=colors[name], label=name)
        zero_points += [(n, name) for n, y in zip(ns, ys) if y == 0]
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    if zero_points:
        low, high = ax.get_ylim()
        ax.set_ylim(low, high)  # fixed: the zero markers sit on the bottom edge, below every value
        for n, name in zero_points:
            ax.plot(n, low, marker="v", color=colors[name], clip_on=False, markersize=9)
        ax.plot([], [], "v", color="gray", label="exactly 0 (drawn at the axis bottom)")
    ax.set_xlabel("sequence length N (keys per query row)")
    ax.set_ylabel(ylabel)
    ax.set_title(f"{title}\nThe table's problem at each N: B={cfg.batch} H={cfg.sweep_heads or cfg.heads} "
                 f"D={cfg.head_dim}, same statistics", fontsize=11)
    ax.legend(fontsize=7, ncol=2, loc="center right", bbox_to_anchor=(1.0, 0.35))
    ax.grid(True, which="both", alpha=0.25)


def _caption(result: DemoResult, above, within) -> str:
    """The figure's caption: the notation and the mechanism, then what panel A measured (from the
    data)."""
    first = ("dQ* = the float64 reference. The backward forms dS = P * (dP - delta) with a per-row constant "
             "delta_i; in exact arithmetic delta_i = sum_j P_ij dP_ij = rowsum(dO_i * O_i), so each row of dS "
             "sums to zero. A stale delta computes rowsum(dO_i * O_i) from the forward's saved output; with FP8 "
             "P and dP it no longer equals sum_j P_ij dP_ij, the rows of dS no longer sum to zero (B), and dQ_i "
             "picks up "
             f"-scale (error of delta_i) kbar_i, {KBAR_WORDS}. In one step (C) this hides in FP8 rounding "
             "of the same size. A matched delta (Delta-Matching) takes delta_i from the backward's own P and "
             "dP: its rows sum to zero up to FP32 rounding (B).")
    acc = result.accumulation
    if acc is None or not acc.draws:
        return first
    t_max = acc.draws[-1]
    parts = [f"{n} {acc.err[n][-1] / acc.noise_only[n][-1]:.2f}x" for n in above + within]
    stale_within = [n for n in within if get_recipe(n).delta.kind is DeltaKind.STALE]
    second = (f"Averaged over T={t_max} roundings (A), error / noise-only error: {', '.join(parts)}. "
              + (f"Above the noise band ({', '.join(above)}): the part of the delta error that keeps its sign is "
                 "a bias, and averaging removes only the noise." if above else "No recipe ends above its noise band.")
              + (f" Inside their bands ({', '.join(within)}): no bias resolved at T={t_max}"
                 + (f"; for {', '.join(stale_within)}, whose stale delta predicts one, it is smaller than the "
                    "draws' scatter, not shown absent." if stale_within else ".") if within else ""))
    import textwrap

    return "\n".join(textwrap.wrap(first + " " + second, 190))


def figure(result: DemoResult):
    """The demo's figure (a matplotlib Figure): A, dQ's error averaged over T roundings against T
    (a bias stays, noise falls like 1/sqrt(T)); B, the row-sum residual of dS per recipe (where
    the bias comes from); C and D, dQ's one-step error and the largest row-sum residual against
    sequence length; a caption that defines the notation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.recipe for r in result.reports]
    colors = _colors(names)
    fig, axes = plt.subplots(2, 2, figsize=(17, 13.5))
    (ax_a, ax_b), (ax_c, ax_d) = axes
    acc = result.accumulation
    if acc is not None and acc.draws:
        spec = ax_a.get_subplotspec().subgridspec(2, 1, height_ratios=(2.0, 1.2), hspace=0.06)
        ax_a.remove()
        ax_a = fig.add_subplot(spec[0])
        ax_ratio = fig.add_subplot(spec[1], sharex=ax_a)
        above, within = _plot_accumulation(ax_a, ax_ratio, result, colors)
    else:
        ax_a.set_axis_off()
        ax_a.text(0.5, 0.5, "averaging over roundings skipped (--draws 0)", ha="center")
        above, within = [], []
    _plot_residuals(ax_b, result, colors)
    if result.sweep:
        _plot_sweep(ax_c, result, colors, "dq_rel_err",
                    "C. One step: dQ's error is about the same for every FP8 recipe",
                    "relative error of dQ:  ||dQ - dQ*||_F / ||dQ*||_F")
        _plot_sweep(ax_d, result, colors, "rowsum_residual_max",
                    "D. Largest row-sum residual of dS against N",
                    "max_i |sum_j dS_ij| / sum_j |P_ij dP_ij|")
    else:
        ax_c.set_axis_off()
        ax_d.set_axis_off()
    fig.text(0.5, 0.004, _caption(result, above, within), ha="center", va="bottom", fontsize=10)
    fig.tight_layout(rect=(0, 0.075, 1, 1))
    return fig


def write_plot(result: DemoResult, path: str) -> None:
    """Write :func:`figure` to ``path`` (the suffix picks the format)."""
    import matplotlib.pyplot as plt

    fig = figure(result)
    try:
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)


def _number(x: float) -> str:
    """A table entry: three significant digits and the exponent, so that 1.08e-14 and 1.08e+00
    never read alike."""
    return f"{x:.2e}"


def print_table(result: DemoResult, console) -> None:
    """The demo's results as three tables that each fit 80 columns: the row sums of dS, the
    errors against the float64 reference (both on the main problem, figure panels B-D), and dQ's
    error averaged over roundings (panel A); each with its notes."""
    from dmref.cli import _tables

    cfg = result.config
    console.print(f"dmref demo: {main_problem_words(cfg)}, outlier channels, a sink key (figure panels B-D)",
                  highlight=False)
    console.print()
    rowsum = _tables.table("Row sums of dS, |sum_j dS_ij| / sum_j |P_ij dP_ij|, over the query rows")
    _tables.text_column(rowsum, "recipe", no_wrap=True)
    for header in ("max", "mean", "max / FP32 bound", "max after dS->FP8"):
        _tables.number_column(rowsum, header)
    errors = _tables.table("Relative errors against the float64 reference, ||X - X*||_F / ||X*||_F")
    _tables.text_column(errors, "recipe", no_wrap=True)
    for header in ("O", "dQ", "dK", "dV", "dQ bias frac"):
        _tables.number_column(errors, header)
    for r in result.reports:
        d = r.as_dict()
        rowsum.add_row(d["recipe"], *(_number(d[k]) for k in ("rowsum_residual_max", "rowsum_residual_mean",
                                                              "rowsum_over_bound_max",
                                                              "rowsum_residual_after_quant_max")))
        frac = result.bias_fraction(r)
        errors.add_row(d["recipe"], *(_number(d[k]) for k in ("out_rel_err", "dq_rel_err", "dk_rel_err",
                                                              "dv_rel_err")),
                       "—" if frac is None else f"{frac:.2f}")
    console.print(rowsum)
    console.print("Of the FP32 dS before its quantization; 'after dS->FP8': of dS as the dQ matmul sees it. "
                  "'max / FP32 bound' <= 1: every row within Delta-Matching's FP32 bound "
                  "(dmref.diagnostics.matched_rowsum_bound).", highlight=False)
    console.print()
    console.print(errors)
    console.print(f"dQ bias frac: share of dQ's squared error along {KBAR_WORDS}; '—': dQ's error is at most "
                  f"twice the float64 reference's own rounding level ({result.dq_rounding_level:.1e}, "
                  "dmref.demo.dq_rounding_level), so its direction means nothing.", highlight=False)
    acc = result.accumulation
    if acc is None or not acc.draws:
        return
    t = acc.draws[-1]
    averaged = _tables.table("dQ's error averaged over T roundings (figure panel A)")
    _tables.text_column(averaged, "recipe", no_wrap=True)
    for header in ("T=1", f"T={t}", "noise only", "ratio", "band", "bias"):
        _tables.number_column(averaged, header)
    for name in acc.err:
        ratio = acc.err[name][-1] / acc.noise_only[name][-1]
        band = noise_ratio_band(acc.sq_norms[name], BAND_SIGMAS)
        averaged.add_row(name, _number(acc.err[name][0]), _number(acc.err[name][-1]),
                         _number(acc.noise_only[name][-1]), f"{ratio:.2f}", f"{band:.2f}",
                         _number(bias_estimate(acc, name)) if ratio > band else "—")
    console.print()
    console.print(averaged)
    console.print(f"The averaged problem (figure panel A, a smaller problem: {averaged_problem_words(cfg)}). "
                  "Errors relative to "
                  f"||dQ*||_F of the averaged dQ*; noise only: the error "
                  f"at T={t} if every draw's error were independent noise (falls like 1/sqrt(T)); ratio: "
                  f"T={t} / noise only; band: how far pure noise may lift the ratio ({BAND_SIGMAS:g} standard "
                  "deviations of the single draws' errors). A ratio above its band is a bias that averaging does "
                  "not remove, its size in 'bias'; '—': none resolved.", highlight=False)
