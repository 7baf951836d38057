"""A-priori error bounds of the accumulation models: ``|matmul(...) - X| <= error_bound(...)``
elementwise, where X = c + sum_k a_k b_k (times the block scales) is the exact value. Every
quantity is computed from the inputs alone. With u = 2**-24 and gamma_n = n u / (1 - n u):

``exact``
    u |X| + 2**-150 <= u A + 2**-150, A = |c| + sum_k |a_k b_k| (one rounding; 2**-150 is half
    the smallest float32 subnormal).

``fp32``
    gamma_K A (recursive summation of K + 1 terms whose products are exact; float32 additions
    whose result is subnormal are exact, so underflow adds nothing).

``hopper`` (the default :data:`HOPPER` rules)
    One k-step with accumulator C and products p_k: every term is truncated toward zero to a
    multiple of q = 2**(E - 13), losing less than q; the sum S is then cut to 14 significant bits,
    losing less than 2**-13 |S|. Truncation never increases a magnitude, so |S| and every later
    accumulator stay below the running sum of magnitudes A_s = |C_0| + sum of |p_k| so far.
    And 2**E <= max(W_s, |C|, 2**-126), with W_s = max over the step's nonzero products of
    2**(e(a_k) + e(b_k)) (exponent sums, not magnitudes: a subnormal operand makes the product
    smaller than its exponent). So one step errs by less than

        n_s 2**-13 max(W_s, A_{s-1}, 2**-126) + 2**-13 A_s,

    n_s = nonzero products of the step + 1 (for C); a chain's errors add. Partial accumulators
    (promotion, ``acc += dot``) are then summed in float32: + gamma_m A for m float32 adds.

block scales (every model)
    y = fma(fl(P_t sx_t) , sw_t, y) over T tiles with tile partials P^_t, |P^_t - P_t| <= B_t:
    sum_t |sx_t sw_t| (B_t + gamma_{T+1} (A_t + B_t)) + gamma_{T+1} |c|.

The bound is evaluated in float64 and enlarged by a factor (1 + 2**-40) that covers the
rounding of its own evaluation.
"""

from __future__ import annotations

import numpy as np
import torch

from ..constants import FP32_MIN_NORMAL, U_FP32, gamma
from .model import HOPPER, Accumulation, WgmmaRules, plan_k_tiles
from .operands import as_codes, as_float32, expand_scale
from .tables import code_table, lut

_SLACK = 1 + 2.0 ** -40




def _magnitudes(a_codes, b_codes, fa, fb):
    ta, tb = code_table(fa), code_table(fb)
    va = torch.where(lut(ta.finite, a_codes), lut(ta.value, a_codes), 0.0).abs().double()
    vb = torch.where(lut(tb.finite, b_codes), lut(tb.value, b_codes), 0.0).abs().double()
    ea = torch.where(lut(ta.nonzero, a_codes), lut(ta.exponent, a_codes), -2000)
    eb = torch.where(lut(tb.nonzero, b_codes), lut(tb.exponent, b_codes), -2000)
    return va, vb, ea, eb


def _chain_bound(va, vb, ea, eb, c_abs, k0, k1, ks, rules) -> tuple[torch.Tensor, torch.Tensor]:
    """(bound, magnitude sum) of one wgmma chain over products [k0, k1) starting from an
    accumulator of magnitude at most ``c_abs``."""
    frac, res = 2.0 ** -rules.term_frac_bits, 2.0 ** (1 - rules.result_bits)
    running = c_abs.clone()
    bound = torch.zeros_like(running)
    for s in range(k0, k1, ks):
        a, b = va[:, s:s + ks], vb[:, s:s + ks]
        step_mag = a @ b.t()
        nonzero = (a > 0).double() @ (b > 0).double().t()
        # W_s = max 2**(ea+eb): exponents are small integers, so do the max exactly with int ops
        e = (ea[:, None, s:s + ks] + eb[None, :, s:s + ks]).amax(dim=-1)
        w = torch.where(e > -1000, torch.ldexp(torch.ones_like(step_mag), e.double()), 0.0)
        big = torch.maximum(torch.maximum(w, running), torch.full_like(w, FP32_MIN_NORMAL))
        running = running + step_mag
        bound = bound + (nonzero + 1) * frac * big + res * running
    return bound, running


def error_bound(a, bt, c=None, *, fa=None, fb=None, model="hopper", promote_every=None,
                tile_k=None, chain=True, scale_a=None, scale_b=None, scale_block_k=128,
                rules: WgmmaRules = HOPPER) -> np.ndarray:
    """(M, N) float64: an upper bound on |matmul(same arguments) - exact value|. 2-D only."""
    model = Accumulation(model)
    a, fa = as_codes(a, fa, "a")
    bt, fb = as_codes(bt, fb, "bt")
    if model is Accumulation.HOPPER and rules != HOPPER:
        raise ValueError("the hopper bound is proved for the HOPPER rules only")
    m, k = a.shape
    n = bt.shape[0]
    c_abs = torch.zeros((m, n), dtype=torch.float64) if c is None else \
        as_float32(c, "cpu", "c").double().abs().expand(m, n).clone()
    va, vb, ea, eb = _magnitudes(a.cpu(), bt.cpu(), fa, fb)
    ks = rules.k_step

    def tile_bound(k0, k1, start_abs, tile_chain):
        """(bound, magnitude) of the model over products [k0, k1) from ``start_abs``."""
        if model is Accumulation.EXACT:
            mag = start_abs + va[:, k0:k1] @ vb[:, k0:k1].t()
            return U_FP32 * mag + 2.0 ** -150, mag
        if model is Accumulation.FP32:
            mag = start_abs + va[:, k0:k1] @ vb[:, k0:k1].t()
            return gamma(k1 - k0) * mag, mag
        kp = -(-k1 // ks) * ks
        plan = plan_k_tiles(kp - k0, ks, promote_every, tile_k)
        total_b, total_mag, adds = torch.zeros_like(start_abs), start_abs.clone(), 0
        for tile in plan:
            for s0, s1 in tile.segments or ((tile.k0, tile.k1),):
                from_acc = tile_chain and tile.segments is None
                b, mag = _chain_bound(va, vb, ea, eb, total_mag if from_acc else torch.zeros_like(start_abs),
                                      k0 + s0, min(k1, k0 + s1), ks, rules)
                total_b = total_b + b
                if from_acc:
                    total_mag = mag
                else:
                    total_mag, adds = total_mag + mag, adds + 1
        return total_b + gamma(adds) * (total_mag + total_b), total_mag

    if scale_a is None:
        bound, _ = tile_bound(0, k, c_abs, chain)
        return (bound * _SLACK).numpy()
    tiles = -(-k // scale_block_k)
    sa = expand_scale(scale_a, m, tiles, "cpu", "scale_a").double().abs()
    sb = expand_scale(scale_b, n, tiles, "cpu", "scale_b").double().abs()
    g = gamma(tiles + 1)
    bound = g * c_abs
    zero = torch.zeros_like(c_abs)
    for t, k0 in enumerate(range(0, k, scale_block_k)):
        b_t, mag_t = tile_bound(k0, min(k, k0 + scale_block_k), zero, False)
        bound = bound + sa[:, t, None] * sb[None, :, t] * (b_t + g * (mag_t + b_t))
    return (bound * _SLACK).numpy()
