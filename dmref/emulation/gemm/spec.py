"""The accumulation models in plain Python with exact rationals: the readable specification
that the vectorised :func:`dmref.emulation.gemm.matmul` must equal on every input.

Slow (about a million products per ten seconds); the tests run it on small shapes.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from ..formats import Format, Rounding, get_format
from .model import HOPPER, Accumulation, WgmmaRules, plan_k_tiles

NAN = float(np.array(0x7FFFFFFF, dtype=np.uint32).view(np.float32))  # the GPU's NaN


def floor_log2(x: Fraction) -> int:
    """floor(log2 |x|) of a nonzero rational, exactly."""
    x = abs(x)
    e = x.numerator.bit_length() - x.denominator.bit_length()
    return e if Fraction(2) ** e <= x else e - 1


def round_integer(x: Fraction, rounding: Rounding) -> int:
    if rounding is Rounding.TOWARD_ZERO:
        return math.trunc(x)
    return round(x)  # Fraction.__round__: nearest, ties to even


def round_float32(x: Fraction) -> float:
    """x rounded to float32, nearest even, overflow to +-inf."""
    if x == 0:
        return 0.0
    e = max(floor_log2(x), -126)
    quantum = Fraction(2) ** (e - 23)
    n = round(x / quantum)
    if abs(n) * quantum >= Fraction(2) ** 128:
        return math.copysign(math.inf, x)
    return float(n * quantum)


def f32_add(x: float, y: float) -> float:
    """float32 + float32, round to nearest even; NaN is the GPU's."""
    with np.errstate(all="ignore"):
        s = float(np.float32(x) + np.float32(y))
    return NAN if math.isnan(s) else s


def fma_f32(x: float, y: float, z: float) -> float:
    """float32 fma(x, y, z): one rounding."""
    x, y, z = float(x), float(y), float(z)
    if not all(math.isfinite(v) for v in (x, y, z)):
        s = x * y + z
        return NAN if math.isnan(s) else s
    return round_float32(Fraction(x) * Fraction(y) + Fraction(z))


def ieee_sum(c: float, a, b) -> float:
    """c + sum a_k b_k when some value is NaN or inf (finite FP8 sums never overflow)."""
    total = c
    for x, y in zip(a, b):
        total += x * y
    return total


def exponent(x: float, fmt: Format, rules: WgmmaRules) -> int:
    """The exponent an FP8 operand contributes to a product's exponent."""
    if x == 0:
        return fmt.emin
    e = floor_log2(Fraction(x))
    return max(e, fmt.emin) if rules.subnormals_at_emin else e


def wgmma_step(c: float, a, b, fa, fb, rules: WgmmaRules = HOPPER) -> float:
    """One k-step: float32 accumulator ``c`` and FP8 values ``a``, ``b`` (up to k_step each)."""
    fa, fb = get_format(fa), get_format(fb)
    if not (math.isfinite(c) and all(map(math.isfinite, a)) and all(map(math.isfinite, b))):
        s = ieee_sum(c, a, b)
        if not math.isfinite(s):
            return NAN if math.isnan(s) else s
    a = [x if math.isfinite(x) else 0.0 for x in a]  # (only reached when the IEEE sum is finite:
    b = [y if math.isfinite(y) else 0.0 for y in b]  #  impossible for NaN/inf operands)

    products = [Fraction(x) * Fraction(y) for x, y in zip(a, b)]
    exps = []
    for x, y, p in zip(a, b, products):
        if p == 0 and not rules.zeros_in_max:
            continue
        if rules.normalised_products:
            if p != 0:
                exps.append(floor_log2(p))
        else:
            exps.append(exponent(x, fa, rules) + exponent(y, fb, rules))
    c_exp = None
    if c != 0:
        c_exp = floor_log2(Fraction(c))
        c_exp = max(c_exp, -126) if rules.subnormal_accumulator_at_emin else c_exp
    candidates = exps + ([c_exp] if c_exp is not None and (rules.accumulator_in_max or not exps) else [])
    if not candidates:
        return 0.0
    big_e = max(candidates)
    quantum = Fraction(2) ** (big_e - rules.term_frac_bits)

    total = sum(round_integer(p / quantum, rules.term_rounding) for p in products)
    if rules.truncate_accumulator:
        total += round_integer(Fraction(c) / quantum, rules.term_rounding)
    else:
        total = total + Fraction(c) / quantum
    if total == 0:
        return 0.0
    # the sum, normalised and cut to result_bits significant bits
    keep = Fraction(2) ** (floor_log2(Fraction(total)) - rules.result_bits + 1)
    result = round_integer(Fraction(total) / keep, rules.result_rounding) * keep * quantum
    return float(result) if result != 0 else 0.0


def hopper_dot(c: float, a, b, fa, fb, rules: WgmmaRules = HOPPER, promote_every=None, tile_k=None,
               chain: bool = True, scales=None) -> float:
    """One output of the hopper model: row ``a`` and column ``b`` (length K), accumulator ``c``.
    ``scales``: (list of sx per K tile, list of sw per K tile, block)."""
    ks = rules.k_step
    k = len(a)
    k_padded = -(-k // ks) * ks
    a = list(a) + [0.0] * (k_padded - k)
    b = list(b) + [0.0] * (k_padded - k)
    if scales is not None:
        tile_k, chain = scales[2], False

    def run(acc, k0, k1):
        for s in range(k0, k1, ks):
            acc = wgmma_step(acc, a[s:s + ks], b[s:s + ks], fa, fb, rules)
        return acc

    acc = c
    for t, tile in enumerate(plan_k_tiles(k_padded, ks, promote_every, tile_k)):
        if chain and tile.segments is None:
            acc = run(acc, tile.k0, tile.k1)
        elif chain:
            for s0, s1 in tile.segments:
                acc = f32_add(acc, run(0.0, s0, s1))
        else:
            d = None
            for s0, s1 in tile.segments or ((tile.k0, tile.k1),):
                p = run(0.0, s0, s1)
                d = p if d is None else f32_add(d, p)
            if scales is None:
                acc = f32_add(acc, d)
            else:
                acc = fma_f32(float(np.float32(d) * np.float32(scales[0][t])), scales[1][t], acc)
    return acc


def exact_dot(c: float, a, b) -> float:
    if not (math.isfinite(c) and all(map(math.isfinite, a)) and all(map(math.isfinite, b))):
        s = ieee_sum(c, a, b)
        if not math.isfinite(s):
            return NAN if math.isnan(s) else s
    return round_float32(Fraction(c) + sum(Fraction(x) * Fraction(y) for x, y in zip(a, b)))


def fp32_dot(c: float, a, b) -> float:
    acc = c
    for x, y in zip(a, b):
        acc = f32_add(acc, x * y)  # the product is exact in float32
    return acc


def matmul(a_values, bt_values, c, fa, fb, model="hopper", **kwargs) -> np.ndarray:
    """The specification of :func:`dmref.emulation.gemm.matmul` on decoded values (2-D)."""
    model = Accumulation(model)
    m, n = len(a_values), len(bt_values)
    c = np.broadcast_to(np.asarray(c, dtype=np.float32), (m, n))
    out = np.zeros((m, n), dtype=np.float32)
    scales = kwargs.pop("scales", None)
    with np.errstate(over="ignore"):  # a result that rounds past the float32 range is +-inf
        _fill(out, a_values, bt_values, c, fa, fb, model, scales, kwargs)
    bits = out.view(np.uint32)
    bits[np.isnan(out)] = 0x7FFFFFFF
    return out


def _fill(out, a_values, bt_values, c, fa, fb, model, scales, kwargs):
    m, n = out.shape
    for i in range(m):
        for j in range(n):
            row, col = [float(x) for x in a_values[i]], [float(y) for y in bt_values[j]]
            sc = None if scales is None else (scales[0][i], scales[1][j], scales[2])
            if model is Accumulation.HOPPER:
                out[i, j] = hopper_dot(float(c[i, j]), row, col, fa, fb, scales=sc, **kwargs)
            elif sc is not None:
                out[i, j] = _scaled_dot(float(c[i, j]), row, col, model, sc)
            elif model is Accumulation.EXACT:
                out[i, j] = exact_dot(float(c[i, j]), row, col)
            else:
                out[i, j] = fp32_dot(float(c[i, j]), row, col)


def _scaled_dot(c, row, col, model, scales):
    sx, sw, block = scales
    y = c
    for t, k0 in enumerate(range(0, len(row), block)):
        ra, cb = row[k0:k0 + block], col[k0:k0 + block]
        p = exact_dot(0.0, ra, cb) if model is Accumulation.EXACT else fp32_dot(0.0, ra, cb)
        y = fma_f32(float(np.float32(p) * np.float32(sx[t])), sw[t], y)
    return y
