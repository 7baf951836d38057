"""dmref demo's figure and table: the averaging over roundings shows the stale delta's bias, zero
residuals are drawn as zeros, and no bias fraction is reported at rounding level."""

from __future__ import annotations

import dataclasses
import math

import matplotlib
import pytest

from dmref import demo

matplotlib.use("Agg")

_SMALL = dict(batch=1, heads=1, seqlen=128, head_dim=32, sweep_seqlens=(64, 128), accum_draws=2,
              accum_seqlen=64, recipes=("exact", "fp32", "naive_fp8", "delta_matching"),
              accum_recipes=("naive_fp8", "delta_matching"))


@pytest.fixture(scope="module")
def small_result():
    return demo.run_demo(demo.DemoConfig(**_SMALL))


@pytest.fixture(scope="module")
def averaged():
    """The demo's default averaged problem and draws, for the recipes the test looks at."""
    return demo.accumulate(demo.DemoConfig(accum_recipes=("cudnn_fp8", "mxfp8_stale", "delta_matching")))


def test_dither_is_one_grid_step_of_gaussian_noise_and_keeps_zeros():
    """(y - x) / step over many draws: mean 0 and standard deviation 1 within 5 standard errors
    of the sample (1/sqrt(n) for the mean, sqrt(2/n) for the deviation of a normal sample)."""
    import torch

    n, bits = 4000, 2
    x = torch.tensor([0.0, 1.0, -1.5, 3.0e-3, 448.0, -0.75], dtype=torch.float32).repeat(n)
    y = demo.dither(x, torch.Generator().manual_seed(0), bits)
    assert y.dtype == torch.float32 and bool((y[x == 0] == 0).all())
    x64 = x.double()[x != 0]
    step = torch.ldexp(torch.ones_like(x64), torch.frexp(x64)[1] - 1 - bits)
    z = (y.double()[x != 0] - x64) / step
    m = z.numel()
    assert abs(z.mean().item()) <= 5 / math.sqrt(m)
    assert abs(z.std().item() - 1) <= 5 * math.sqrt(2 / m) + 2 ** -24 * 4 ** bits  # + float32 storage


def _plateaus(series, name) -> bool:
    """Whether ``name``'s averaged error ends above its noise band around the noise-only line
    (which falls exactly like 1/sqrt(T) times the draws' root-mean-square error): a bias that
    averaging does not remove."""
    band = demo.noise_ratio_band(series.sq_norms[name])
    return series.err[name][-1] > band * series.noise_only[name][-1]


def _follows_noise(series, name) -> bool:
    """Whether ``name``'s averaged error stays within its noise band around the noise-only
    (1/sqrt(T)) line at every recorded T."""
    band = demo.noise_ratio_band(series.sq_norms[name])
    return all(1 / band <= e / n <= band for e, n in zip(series.err[name], series.noise_only[name]))


@pytest.mark.slow
def test_stale_error_plateaus_while_delta_matching_falls_like_noise(averaged):
    """Noise averages like 1/sqrt(T): the error of the averaged dQ stays within the noise band
    around its noise-only value (:func:`dmref.demo.noise_ratio_band`, derived from the single
    draws); a bias does not. On the demo's peaked problem cudnn_fp8 (stale delta) ends above its
    band and above its 1/sqrt(T) extrapolation, also in the part along kbar_i (the stale delta's
    direction), while Delta-Matching follows its noise line at every T. The two predicates are
    exclusive, so substituting one recipe for the other fails the test."""
    assert averaged.draws[-1] == demo.DemoConfig.accum_draws
    assert _follows_noise(averaged, "delta_matching") and not _plateaus(averaged, "delta_matching")
    assert _plateaus(averaged, "cudnn_fp8") and not _follows_noise(averaged, "cudnn_fp8")
    band = demo.noise_ratio_band(averaged.sq_norms["cudnn_fp8"])
    assert averaged.err_along_kbar["cudnn_fp8"][-1] > band * averaged.noise_only_along_kbar["cudnn_fp8"][-1]
    for stale in ("cudnn_fp8", "mxfp8_stale"):
        assert demo.bias_estimate(averaged, stale) > demo.bias_estimate(averaged, "delta_matching")


def test_noise_ratio_band_is_wider_for_scattered_draws():
    assert demo.noise_ratio_band([1.0, 1.0, 1.0]) == 1.0
    assert demo.noise_ratio_band([0.5, 1.0, 1.5]) > demo.noise_ratio_band([0.9, 1.0, 1.1]) > 1.0


def _lines_y(ax):
    return [y for line in ax.get_lines() for y in line.get_ydata()]


def test_zero_residuals_are_counted_not_drawn_at_a_floor(small_result):
    import matplotlib.pyplot as plt
    import numpy as np

    result = dataclasses.replace(small_result, residuals=dict(small_result.residuals))
    rows = result.residuals["delta_matching"].copy()
    rows[:3] = 0.0
    result.residuals["delta_matching"] = rows
    fig, ax = plt.subplots()
    demo._plot_residuals(ax, result, demo._colors([r.recipe for r in result.reports]))
    texts = [t.get_text() for t in ax.texts]
    zeros = int((rows == 0).sum())
    assert zeros >= 3 and f"{zeros} rows\nexactly 0" in texts
    lowest_positive = min(np.log10(r[r > 0]).min() for r in result.residuals.values())
    for coll in ax.collections:  # violin bodies and their bars: positive residuals only
        ys = [p[1] for path in coll.get_paths() for p in path.vertices]
        assert min(ys) >= lowest_positive - 1e-9 * abs(lowest_positive)
    # the zero markers sit at the axis bottom, chosen from the data, not at a fixed 1e-18
    assert ax.get_ylim()[0] > lowest_positive - 2
    plt.close(fig)


def test_zero_in_the_sweep_is_a_marker_at_the_axis_bottom(small_result):
    import matplotlib.pyplot as plt

    sweep = {k: list(v) for k, v in small_result.sweep.items()}
    n, report = sweep["exact"][0]
    sweep["exact"][0] = (n, dataclasses.replace(report, rowsum_residual_max=0.0))
    result = dataclasses.replace(small_result, sweep=sweep)
    fig, ax = plt.subplots()
    demo._plot_sweep(ax, result, demo._colors(list(sweep)), "rowsum_residual_max", "t", "y")
    bottom = ax.get_ylim()[0]
    marked = [line for line in ax.get_lines() if line.get_marker() == "v" and len(line.get_xdata())]
    assert [tuple(line.get_ydata()) for line in marked] == [(bottom,)]
    positive = [y for line in ax.get_lines() if line not in marked for y in line.get_ydata()]
    assert positive and min(positive) > 0
    plt.close(fig)


def test_side_panels_use_the_main_problems_head_count():
    cfg = demo.DemoConfig(**{**_SMALL, "heads": 2, "accum_draws": 0, "recipes": ("exact",)})
    result = demo.run_demo(cfg)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    demo._plot_sweep(ax, result, demo._colors(["exact"]), "dq_rel_err", "t", "y")
    assert "H=2" in ax.get_title()
    plt.close(fig)


def test_no_bias_fraction_at_rounding_level(small_result):
    import io

    from rich.console import Console

    by = {r.recipe: r for r in small_result.reports}
    level = small_result.dq_rounding_level
    assert 0 < level  # float64 roundoff times the problem's condition
    assert by["exact"].dq_rel_err <= 2 * level and small_result.bias_fraction(by["exact"]) is None
    for name in ("fp32", "naive_fp8", "delta_matching"):
        assert by[name].dq_rel_err > 2 * level
        assert small_result.bias_fraction(by[name]) == by[name].dq_bias_fraction
    rows = {r["recipe"]: r for r in small_result.json_rows()}
    assert rows["exact"]["dq_bias_fraction"] is None
    assert isinstance(rows["fp32"]["dq_bias_fraction"], float)
    out = io.StringIO()
    demo.print_table(small_result, Console(file=out, width=250))
    # the exact recipe's rows: in the row-sum table, then in the error table, whose last column is the fraction
    exact_lines = [line for line in out.getvalue().splitlines() if line.startswith("exact ")]
    assert len(exact_lines) == 2 and exact_lines[1].rstrip().endswith("—")


def test_json_rows_carry_the_accumulation_series(small_result):
    rows = {r["recipe"]: r for r in small_result.json_rows()}
    for name in ("naive_fp8", "delta_matching"):
        acc = rows[name]["accumulation"]
        assert acc["draws"] == [1, 2]
        assert len(acc["err"]) == len(acc["noise_only"]) == len(acc["err_along_kbar"]) == 2
        assert len(acc["single_draw_sq_err"]) == len(acc["noise_only_along_kbar"]) == 2
        assert acc["err"][0] == pytest.approx(math.sqrt(acc["single_draw_sq_err"][0]), rel=1e-12)
    assert "accumulation" not in rows["exact"]


# ----------------------------------------------------------------------------------------------
# The figure read by someone who knows attention but not dmref
# ----------------------------------------------------------------------------------------------


def _figure_text(result) -> str:
    import matplotlib.pyplot as plt
    from matplotlib.text import Text

    fig = demo.figure(result)
    try:
        return " ".join(" ".join(t.get_text().split()) for t in fig.findobj(Text))
    finally:
        plt.close(fig)


def _titles(result) -> dict[str, str]:
    import matplotlib.pyplot as plt

    fig = demo.figure(result)
    try:
        titles = [" ".join(ax.get_title().split()) for ax in fig.axes]
        return {t[0]: t for t in titles if t[:2] in ("A.", "B.", "C.", "D.")}
    finally:
        plt.close(fig)


def test_each_panel_states_its_own_problem(small_result):
    """Panel A averages a smaller problem than the table and panels B-D: each says which."""
    cfg = small_result.config
    assert cfg.accum_seqlen != cfg.seqlen  # otherwise the test could not tell them apart
    titles = _titles(small_result)
    assert f"N={cfg.accum_seqlen} " in titles["A"] and f"H={cfg.accum_heads} " in titles["A"]
    assert "smaller problem" in titles["A"]
    assert f"N={cfg.seqlen} " in titles["B"] and f"H={cfg.heads} " in titles["B"] and "table's problem" in titles["B"]
    for panel in "CD":
        assert f"H={cfg.heads} " in titles[panel] and "table's problem" in titles[panel]


def test_the_table_names_both_problems(small_result):
    import io

    from rich.console import Console

    out = io.StringIO()
    demo.print_table(small_result, Console(file=out, width=400))
    text = " ".join(out.getvalue().split())
    assert demo.main_problem_words(small_result.config) in text
    assert f"figure panel A, a smaller problem: {demo.averaged_problem_words(small_result.config)}" in text


def _series(ratio: float) -> demo.AccumulationSeries:
    """Two recipes, a stale and a matched one, whose averaged error ends at ``ratio`` times its
    noise-only value, with single draws scattered by +-10%."""
    s = demo.AccumulationSeries((1, 1, 8, 8), draws=[1, 2, 4])
    for name in ("naive_fp8", "delta_matching"):
        s.noise_only[name] = [1.0, 0.7, 0.5]
        s.err[name] = [1.0, 0.7, 0.5 * ratio]
        s.sq_norms[name] = [0.9, 1.0, 1.1, 1.0]
    return s


def test_a_stale_recipe_inside_its_band_is_not_labelled_bias_free():
    inside = _series(1.0)
    assert 1.0 < demo.noise_ratio_band(inside.sq_norms["naive_fp8"], demo.BAND_SIGMAS)
    stale, matched = demo.verdict(inside, "naive_fp8"), demo.verdict(inside, "delta_matching")
    assert "stale delta" in stale and "not resolved at T=4" in stale and "no bias" not in stale
    assert "matched delta" in matched and "no bias seen" in matched
    above = _series(10.0)
    for name in ("naive_fp8", "delta_matching"):
        assert "above its band: a bias of" in demo.verdict(above, name)


def test_the_figure_defines_the_notation_it_uses(small_result):
    text = _figure_text(small_result)
    uses_and_defines = {
        "kbar_i": "query i's attention-weighted mean key",
        "noise-only error": "if every draw's error were independent noise",
        "noise band": "standard deviations",
        "delta_i": "dS = P * (dP - delta) with a per-row constant delta_i",
        "stale delta": "A stale delta computes rowsum(dO_i * O_i) from the forward's saved output",
        "dQ*": "dQ* = the float64 reference",
    }
    for term, definition in uses_and_defines.items():
        assert term in text and definition in text, term
    for undefined in ("Q(dS)", "sigma band", "noise-only:"):
        assert undefined not in text, undefined
