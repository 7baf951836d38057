"""The a-priori error bound of each accumulation model (dmref.emulation.gemm.bounds) holds against
the exact value on adversarial inputs: the widest exponent spread, near-cancellation, long K,
block scales. The exact value is computed with rationals."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dmref.emulation import decode
from dmref.emulation.gemm import error_bound, matmul

FORMATS = ["e4m3", "e5m2"]
_FINITE = {f: np.flatnonzero(np.isfinite(decode(np.arange(256, dtype=np.uint8), f))) for f in FORMATS}


@st.composite
def adversarial(draw):
    """(a, bt, c, fa, fb): 'spread' draws codes from the whole finite range; 'cancel' pairs
    every product with one that (nearly) cancels it and sets c to minus the rounded total;
    'long' is one or two long dot products (K up to 4096) of lognormal-like magnitudes."""
    fa, fb = draw(st.sampled_from(FORMATS)), draw(st.sampled_from(FORMATS))
    style = draw(st.sampled_from(["spread", "cancel", "long"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if style == "long":
        m = n = draw(st.integers(1, 2))
        k = draw(st.integers(1024, 4096))
    else:
        m, n, k = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(2, 300))
    a = rng.choice(_FINITE[fa], size=(m, k)).astype(np.uint8)
    b = rng.choice(_FINITE[fb], size=(n, k)).astype(np.uint8)
    c = (rng.standard_normal((m, n)) * 10.0 ** rng.integers(-3, 4, (m, n))).astype(np.float32)
    if style == "long":  # magnitudes within a few binades, random signs: long, growing sums
        a = (rng.choice(_FINITE[fa][(_FINITE[fa] & 0x7F) > 0x30], size=(m, k)) ^ (rng.integers(0, 2, (m, k)) << 7)).astype(np.uint8)
        b = (rng.choice(_FINITE[fb][(_FINITE[fb] & 0x7F) > 0x30], size=(n, k)) ^ (rng.integers(0, 2, (n, k)) << 7)).astype(np.uint8)
    if style == "cancel":
        half = k // 2
        a[:, half:2 * half] = a[:, :half]
        b[:, half:2 * half] = b[:, :half] ^ 0x80  # exact negation
        nudge = rng.integers(0, 2, (n, half)).astype(np.uint8)  # some pairs one code apart
        moved = (b[:, half:2 * half] & 0x7F) + nudge
        ok = np.isfinite(decode((moved | (b[:, half:2 * half] & 0x80)).astype(np.uint8), fb))
        b[:, half:2 * half] = np.where(ok, moved | (b[:, half:2 * half] & 0x80), b[:, half:2 * half])
        c = -matmul(a, b, fa=fa, fb=fb, model="exact")
    return a, b, c, fa, fb


def exact_values(a, b, c, fa, fb, sa=None, sb=None, block=128):
    va, vb = decode(a, fa), decode(b, fb)
    m, k = va.shape
    out = []
    for i in range(m):
        row = []
        for j in range(vb.shape[0]):
            total = Fraction(float(c[i, j]))
            for t, k0 in enumerate(range(0, k, block)):
                tile = sum(Fraction(float(x)) * Fraction(float(y))
                           for x, y in zip(va[i, k0:k0 + block], vb[j, k0:k0 + block]))
                scale = 1 if sa is None else Fraction(float(sa[i, t])) * Fraction(float(sb[j, t]))
                total += scale * tile
            row.append(total)
        out.append(row)
    return out


def assert_within_bound(out, exact, bound):
    for i, row in enumerate(exact):
        for j, x in enumerate(row):
            err = abs(Fraction(float(out[i, j])) - x)
            assert err <= Fraction(float(bound[i, j])), (
                f"[{i},{j}] error {float(err):.3e} exceeds the bound {bound[i, j]:.3e}")


schedules = st.sampled_from([{}, {"promote_every": 128}, {"promote_every": 32},
                             {"tile_k": 128, "chain": False}, {"tile_k": 64, "promote_every": 32}])


@settings(max_examples=40)
@given(adversarial(), st.sampled_from(["hopper", "exact", "fp32"]), schedules)
def test_each_model_stays_within_its_a_priori_bound(problem, model, schedule):
    a, b, c, fa, fb = problem
    kwargs = schedule if model == "hopper" else {}
    out = matmul(a, b, c, fa=fa, fb=fb, model=model, **kwargs)
    bound = error_bound(a, b, c, fa=fa, fb=fb, model=model, **kwargs)
    assert_within_bound(out, exact_values(a, b, c, fa, fb), bound)


@settings(max_examples=20)
@given(adversarial(), st.sampled_from(["hopper", "exact", "fp32"]),
       st.lists(st.floats(2.0 ** -10, 2.0 ** 10, width=32), min_size=8, max_size=8))
def test_block_scaled_models_stay_within_their_bound(problem, model, pool):
    a, b, c, fa, fb = problem
    t = -(-a.shape[1] // 128)
    sa = np.resize(np.array(pool, np.float32), (a.shape[0], t))
    sb = np.resize(np.array(pool[::-1], np.float32), (b.shape[0], t))
    out = matmul(a, b, c, fa=fa, fb=fb, model=model, scale_a=sa, scale_b=sb)
    bound = error_bound(a, b, c, fa=fa, fb=fb, model=model, scale_a=sa, scale_b=sb)
    assert_within_bound(out, exact_values(a, b, c, fa, fb, sa, sb), bound)


def test_the_bounds_order_the_models():
    """On the same inputs: exact <= fp32 <= hopper with promotion <= hopper without."""
    rng = np.random.default_rng(3)
    a = rng.choice(_FINITE["e4m3"], size=(4, 1024)).astype(np.uint8)
    b = rng.choice(_FINITE["e4m3"], size=(4, 1024)).astype(np.uint8)
    bounds = [error_bound(a, b, fa="e4m3", fb="e4m3", model=m, **kw).max() for m, kw in (
        ("exact", {}), ("fp32", {}), ("hopper", {"promote_every": 128}), ("hopper", {}))]
    assert bounds == sorted(bounds), bounds
