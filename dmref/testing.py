"""Test helpers for code that uses or implements FP8 attention: hypothesis strategies, assertions
with useful messages, and the oracle in one call.

Strategies (need ``hypothesis``)::

    fp8_codes(fmt)               uint8 tensors of codes (NaN codes optional)
    block_scaled_tensors(...)    (x, codes, scales, block): x float32 and its block-scaled FP8 form
    attention_problems(...)      dmref.oracle.Case: random shapes (tails, length 1, causal,
                                 cross attention), inputs in the given dtype, probe-ready

Assertions::

    assert_codes_equal(a, b, fmt)            FP8/BF16 results compared as integer codes
    assert_within_ulps(a, b, fmt, ulps)      distance in steps of the format's grid
    assert_within_bound(a, b, bound)         |a - b| <= bound elementwise, worst element named
    assert_attention_correct(fn, **kwargs)   dmref.oracle.check(fn, ...) must pass

The pytest plugin (:mod:`dmref.oracle.pytest_plugin`, registered as an entry point) adds the fixture
``dmref_oracle`` and the marker ``dmref_attention``, so a user's test is three lines::

    from mypkg import my_attention
    def test_my_attention(dmref_oracle):
        dmref_oracle(my_attention)
"""

from __future__ import annotations

import math

import torch

from . import emulation

__all__ = [
    "assert_attention_correct",
    "assert_codes_equal",
    "assert_within_bound",
    "assert_within_ulps",
    "attention_problems",
    "block_scaled_tensors",
    "fp8_codes",
    "ulp_distance",
]

_SHOW = 5  # mismatching elements listed in a failure message


# ==============================================================================================
# Assertions
# ==============================================================================================


def _codes(x, fmt) -> torch.Tensor:
    """Integer codes of x: x itself when it already holds codes (uint8 / int16 / uint16), else
    the codes of its values, which must be exactly representable in fmt."""
    if isinstance(x, torch.Tensor) and x.dtype in (torch.uint8, torch.int16, torch.uint16):
        return x.to(torch.int32) & ((1 << fmt.bits) - 1)
    t = torch.as_tensor(x)
    if t.dtype == fmt.torch_dtype:  # a torch FP8 tensor of this format holds its codes
        return t.view(torch.uint8).to(torch.int32)
    codes = emulation.encode(t.to(torch.float64) if t.dtype != torch.float64 else t, fmt)
    back = emulation.decode(codes, fmt).to(torch.float64)
    t64 = t.to(torch.float64)
    exact = (back == t64) | (torch.isnan(back) & torch.isnan(t64))
    if not bool(exact.all()):
        bad = t64[~exact].flatten()[:_SHOW].tolist()
        raise ValueError(f"values {bad} are not exactly representable in {fmt.name}: compare codes, or round first")
    return codes.to(torch.int32) & ((1 << fmt.bits) - 1)


def _describe(idx, fmt, ca, cb) -> str:
    a, b = fmt.value(int(ca)), fmt.value(int(cb))
    return f"  at {tuple(idx)}: 0x{int(ca):02x} ({a!r}) vs 0x{int(cb):02x} ({b!r})"


def assert_codes_equal(actual, expected, fmt="float8_e4m3fn") -> None:
    """Assert that two FP8 (or BF16 / FP16) results are the same codes.

    ``actual`` / ``expected``: code tensors (uint8, int16) or values exactly representable in
    ``fmt`` (torch float8 tensors are viewed as codes). Comparing codes makes NaN equal NaN (of
    the same code) and -0 differ from +0, which float comparison gets wrong both ways."""
    fmt = emulation.get_format(fmt)
    ca, cb = _codes(actual, fmt), _codes(expected, fmt)
    if ca.shape != cb.shape:
        raise AssertionError(f"shapes differ: {tuple(ca.shape)} vs {tuple(cb.shape)}")
    diff = ca != cb
    if bool(diff.any()):
        idx = diff.nonzero()[:_SHOW]
        lines = [_describe(i, fmt, ca[tuple(i)], cb[tuple(i)]) for i in idx]
        raise AssertionError(f"{int(diff.sum())} of {diff.numel()} {fmt.name} codes differ:\n" + "\n".join(lines))


def ulp_distance(actual, expected, fmt) -> torch.Tensor:
    """Steps of ``fmt``'s grid between two values (int64; 0 for +0 vs -0; a huge number when
    exactly one is NaN, 0 when both are). Codes are mapped to a signed order that is monotone in
    value (sign-magnitude to two's complement), so the distance counts representable values
    between the two, crossing zero."""
    fmt = emulation.get_format(fmt)
    ca, cb = _codes(actual, fmt), _codes(expected, fmt)
    sign = fmt.sign_bit
    mag_mask = sign - 1 if sign else (1 << fmt.bits) - 1

    def order(c):
        mag = (c & mag_mask).to(torch.int64)
        return torch.where((c & sign) != 0, -mag, mag) if sign else mag

    dist = (order(ca) - order(cb)).abs()
    nan_codes = torch.tensor(sorted(fmt.nan_codes) or [-1], dtype=torch.int32)
    na, nb = torch.isin(ca, nan_codes), torch.isin(cb, nan_codes)
    dist = torch.where(na & nb, torch.zeros_like(dist), dist)
    return torch.where(na ^ nb, torch.full_like(dist, 2**62), dist)


def assert_within_ulps(actual, expected, fmt, ulps: int = 1) -> None:
    """Assert that ``actual`` is within ``ulps`` steps of ``fmt``'s grid of ``expected``
    (values exactly representable in fmt, or codes)."""
    fmt = emulation.get_format(fmt)
    dist = ulp_distance(actual, expected, fmt)
    bad = dist > ulps
    if bool(bad.any()):
        ca, cb = _codes(actual, fmt), _codes(expected, fmt)
        idx = bad.nonzero()[:_SHOW]
        lines = [_describe(i, fmt, ca[tuple(i)], cb[tuple(i)]) + f"  ({int(dist[tuple(i)])} ulps)" for i in idx]
        raise AssertionError(f"{int(bad.sum())} of {bad.numel()} values are more than {ulps} {fmt.name} ulps "
                             f"apart (max {int(dist.max())}):\n" + "\n".join(lines))


def assert_within_bound(actual, expected, bound, *, what: str = "value") -> None:
    """Assert |actual - expected| <= bound elementwise (bound broadcasts; a derived bound, e.g.
    from :func:`dmref.diagnostics.attention_error_bound` or :mod:`dmref.proofs.bounds`). NaN in
    either fails. The message names the worst element by error / bound."""
    a = torch.as_tensor(actual).to(torch.float64)
    e = torch.as_tensor(expected).to(torch.float64)
    b = torch.as_tensor(bound).to(torch.float64).expand_as(a) if torch.as_tensor(bound).dim() else \
        torch.full_like(a, float(bound))
    err = (a - e).abs()
    ok = err <= b
    if bool(ok.all()):
        return
    ratio = torch.where(b > 0, err / torch.where(b > 0, b, torch.ones_like(b)), torch.full_like(err, math.inf))
    ratio = torch.where(torch.isnan(err), torch.full_like(err, math.inf), ratio)
    worst = int(ratio.flatten().argmax())
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), a.shape)) if a.dim() else ()
    raise AssertionError(
        f"{what}: {int((~ok).sum())} of {ok.numel()} elements exceed the bound; worst at {idx}: "
        f"|{a[idx].item()!r} - {e[idx].item()!r}| = {err[idx].item():.6g} > bound {b[idx].item():.6g} "
        f"({ratio[idx].item():.3g}x)")


def assert_attention_correct(fn, **check_kwargs):
    """Run :func:`dmref.oracle.check` on ``fn`` (keyword arguments passed on) and raise
    AssertionError listing every failed check, each with its most likely cause, when one fails.
    Returns the report (an INCONCLUSIVE one too: read ``report.verdict``)."""
    from . import oracle

    report = oracle.check(fn, **check_kwargs)
    report.raise_for_failures()
    return report


# ==============================================================================================
# Hypothesis strategies
# ==============================================================================================


def _st():
    try:
        from hypothesis import strategies as st
    except ImportError as e:  # pragma: no cover - hypothesis is in the test extra
        raise ImportError("dmref.testing's strategies need hypothesis: pip install 'dmref[test]'") from e
    return st


def fp8_codes(fmt="float8_e4m3fn", *, shape=None, allow_nan: bool = False):
    """Strategy: a uint8 tensor (``shape``; default 1-64 elements) of ``fmt`` codes, every code
    equally likely; NaN codes only with ``allow_nan``."""
    st = _st()
    fmt = emulation.get_format(fmt)
    if fmt.bits > 8:
        raise ValueError(f"fp8_codes is for 8-bit formats, got {fmt.name}")
    codes = [c for c in range(fmt.n_codes) if allow_nan or c not in fmt.nan_codes]
    size = st.just(shape) if shape is not None else st.integers(1, 64).map(lambda n: (n,))

    @st.composite
    def draw_codes(draw):
        shp = draw(size)
        n = math.prod(shp)
        values = draw(st.lists(st.sampled_from(codes), min_size=n, max_size=n))
        return torch.tensor(values, dtype=torch.uint8).reshape(shp)

    return draw_codes()


def block_scaled_tensors(fmt="float8_e4m3fn", *, block="1x32", scale_rule="pow2_down", max_rows: int = 8,
                         max_cols: int = 96, max_log2_range: int = 20):
    """Strategy: ``(x, codes, scales, block)`` with x a float32 (rows, cols) tensor (tails
    included: sizes not multiples of the block) whose magnitudes span up to 2^max_log2_range,
    and its :func:`dmref.emulation.quantize_blocked` form."""
    st = _st()
    fmt = emulation.get_format(fmt)
    block = emulation.Block.get(block)

    @st.composite
    def draw(draw):
        rows = draw(st.integers(1, max_rows))
        cols = draw(st.integers(1, max_cols))
        seed = draw(st.integers(0, 2**31 - 1))
        spread = draw(st.integers(0, max_log2_range))
        g = torch.Generator().manual_seed(seed)
        mant = torch.randn(rows, cols, generator=g)
        exps = torch.randint(-spread // 2 - 1, spread // 2 + 1, (rows, cols), generator=g).to(torch.float32)
        x = (mant * torch.exp2(exps)).to(torch.float32)
        if draw(st.booleans()):  # a few exact zeros
            x[torch.rand(rows, cols, generator=g) < 0.1] = 0.0
        codes, scales = emulation.quantize_blocked(x, fmt, block=block, scale_rule=scale_rule)
        return x, codes, scales, block

    return draw()


def attention_problems(*, dtype: torch.dtype = torch.bfloat16, max_seqlen: int = 48, head_dims=(16, 32, 64),
                       max_heads: int = 2, causal: bool | None = None, probe: bool = True,
                       gqa: bool = False, masks: bool = False):
    """Strategy: a :class:`dmref.oracle.Case` with random sizes (length 1 and tails included;
    causal cases have seqlen_q == seqlen_k), Gaussian inputs at a random magnitude and softmax
    scale, inputs rounded to ``dtype`` and made probe-ready (head_dim >= 16).

    ``gqa=True`` also draws key/value heads that a multiple of them of query heads share (k, v
    have ``heads // group`` heads); ``masks=True`` also draws a boolean or an additive mask
    (finite ALiBi-like biases and -inf, rounded to ``dtype``) with fully masked rows, for an
    ``fn`` that takes ``mask=``; a drawn causal problem then carries its causality in the mask
    (``causal=False``), as SDPA takes one or the other. ``causal`` is None (drawn) or a bool;
    ``probe``, ``gqa`` and ``masks`` are bools (TypeError otherwise)."""
    from .emulation.formats import check_bool

    causal = None if causal is None else check_bool(causal, "causal")
    probe, gqa, masks = (check_bool(f, n) for f, n in ((probe, "probe"), (gqa, "gqa"), (masks, "masks")))
    st = _st()
    from .oracle.cases import Case
    from . import probe as _probe

    @st.composite
    def draw(draw):
        is_causal = draw(st.booleans()) if causal is None else causal
        nq = draw(st.one_of(st.just(1), st.integers(1, max_seqlen)))
        nk = nq if is_causal else draw(st.one_of(st.just(1), st.integers(1, max_seqlen)))
        d = draw(st.sampled_from(list(head_dims)))
        hkv = draw(st.integers(1, max_heads))
        group = draw(st.sampled_from([1, 2, 4])) if gqa else 1
        h = hkv * group
        seed = draw(st.integers(0, 2**31 - 1))
        log2_scale = draw(st.integers(-4, 3))
        log2_mag = draw(st.integers(-6, 6))
        g = torch.Generator().manual_seed(seed)
        randn = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
        q, k, v = randn(1, h, nq, d), randn(1, hkv, nk, d), randn(1, hkv, nk, d) * 2.0**log2_mag
        dout = randn(1, h, nq, d) * 2.0**log2_mag
        q, k, v, dout = (t.to(dtype) for t in (q, k, v, dout))
        mask = None
        kind = draw(st.sampled_from(["none", "bool", "additive"])) if masks else "none"
        if kind != "none":
            keep = torch.rand(1, h, nq, nk, generator=g) < 0.7
            keep[..., :: max(2, nq // 3), :] = False  # fully masked rows
            if is_causal:  # SDPA takes a mask or is_causal, not both: the mask carries causality
                keep &= torch.ones(nq, nk, dtype=torch.bool).tril()
                is_causal = False
            if kind == "bool":
                mask = keep
            else:
                dist = (torch.arange(nq)[:, None] - torch.arange(nk)[None, :]).abs().to(torch.float64)
                slopes = 2.0 ** -(torch.arange(h, dtype=torch.float64) + 3)
                bias = -(slopes[:, None, None] * dist)[None]
                mask = torch.where(keep, bias, torch.full_like(bias, -math.inf)).to(dtype)
        setup = None
        if probe and d >= _probe.GROUP:
            q, k, setup = _probe.prepare(q, k)
        scale = 2.0**log2_scale / math.sqrt(d)
        heads = f"{h}/{hkv}h" if hkv != h else f"{h}h"
        name = f"drawn_{'causal_' if is_causal else ''}{heads}_{nq}x{nk}x{d}"
        if mask is not None:
            name += f"_{kind}_mask"
        tags = ("drawn",) + (("gqa",) if hkv != h else ()) + (("mask",) if mask is not None else ())
        return Case(name, "drawn by dmref.testing.attention_problems", q, k, v, dout, is_causal, scale,
                    mask, setup, tags)

    return draw()
