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


def test_stale_error_stays_above_its_noise_line_while_delta_matching_follows_it(averaged):
    """Noise averages like 1/sqrt(T): the error of the averaged dQ stays within the noise band
    around its noise-only value (:func:`dmref.demo.noise_ratio_band`, derived from the single
    draws); a bias does not: the stale recipes end above their bands, and above their own
    1/sqrt(T) extrapolation from T = 1, while Delta-Matching stays within its band at every T."""
    t_max = averaged.draws[-1]
    assert t_max == demo.DemoConfig.accum_draws
    dm_band = demo.noise_ratio_band(averaged.sq_norms["delta_matching"])
    for err, noise in zip(averaged.err["delta_matching"], averaged.noise_only["delta_matching"]):
        assert 1 / dm_band <= err / noise <= dm_band
    for stale in ("cudnn_fp8", "mxfp8_stale"):
        band = demo.noise_ratio_band(averaged.sq_norms[stale])
        err = averaged.err[stale]
        assert err[-1] > band * averaged.noise_only[stale][-1], (stale, err, averaged.noise_only[stale])
        assert err[-1] > band * err[0] / math.sqrt(t_max)
        assert err[-1] > averaged.err["delta_matching"][-1]
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
    exact_line = next(line for line in out.getvalue().splitlines() if "exact" in line and "│" in line)
    assert exact_line.rstrip(" │").endswith("—")


def test_json_rows_carry_the_accumulation_series(small_result):
    rows = {r["recipe"]: r for r in small_result.json_rows()}
    for name in ("naive_fp8", "delta_matching"):
        acc = rows[name]["accumulation"]
        assert acc["draws"] == [1, 2]
        assert len(acc["err"]) == len(acc["noise_only"]) == len(acc["err_along_kbar"]) == 2
        assert len(acc["single_draw_sq_err"]) == len(acc["noise_only_along_kbar"]) == 2
        assert acc["err"][0] == pytest.approx(math.sqrt(acc["single_draw_sq_err"][0]), rel=1e-12)
    assert "accumulation" not in rows["exact"]
