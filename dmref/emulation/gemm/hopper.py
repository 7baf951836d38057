"""The ``hopper`` accumulation model, vectorised with torch (CPU or CUDA).

One k-step (see :mod:`dmref.emulation.gemm.spec` for the plain-Python specification):

    E   = max(e(a_k) + e(b_k) over the nonzero products, e(C))
    S   = trunc(C / 2**(E-13)) + sum_k trunc(a_k b_k / 2**(E-13))        (an integer)
    out = trunc_to_14_significant_bits(S) * 2**(E-13)

How it is made fast (the plain NumPy vectorisation runs ~46 MMAC/s on two cores):

1. E without touching the (M, N, 32) products: ``sum_k 64**(e(a_k)+e(b_k))`` is one float32
   (or float64) matmul of ``64**e(a)`` by ``64**e(b)``. At most 32 powers of 64 add up to less
   than 64 times the largest, so ``floor(log2(sum)) // 6`` *is* the largest exponent. Rounding
   cannot break this: every term is >= 0, so every rounded partial sum stays >= the largest term
   and < 64 times it. The exponent comes from ``frexp`` (bits), never from a float log2.
2. The truncation of a product relative to 2**E is ``trunc(a_k * b_k * 2**(13-E))``, and every
   intermediate is exact in float32: ``a_k * b_k`` has at most 8 significant bits (4 x 4) and lies
   in float32's normal range; multiplying by a power of two is exact; the truncated terms are
   integers below 2**15, 32 of them sum below 2**20 < 2**24. (Products far below 2**E simply
   truncate to 0: no case analysis is needed for "which products are affected".) So a k-step is
   four elementwise passes over a (32, TI, TJ) block: outer product, scale, trunc, sum. The
   blocks are sized to stay in the CPU's L2 cache and torch spreads each pass over both threads.
   On CUDA the same code runs with blocks as large as memory allows.
3. Everything per output element and step (E, the accumulator's exponent, the truncation of C
   and of the result) is a handful of int32 ops on (TI, TJ) tensors: 1/32 of the per-product cost.

NaN and inf never enter the fast path (their codes are zeroed there); where an operand or the
accumulator is not finite, the step's result is the IEEE value of ``C + sum_k a_k b_k`` (NaN or
+-inf), computed with a float32 matmul of the decoded values, and NaN is the GPU's 0x7FFFFFFF.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats import Format, Rounding
from .tables import NO_EXPONENT, code_table, exponent_range, lut, pow2_f32, pow2_f64

_LOG_BASE = 6  # weights are 64**e: 64 > 32 terms per k-step


@dataclass
class Operand:
    """One FP8 operand (rows, K), prepared for the hopper model. K is padded with zero codes to
    a multiple of the k-step."""

    values_kmajor: torch.Tensor  #: (Kp, R) float32; NaN/inf codes zeroed
    weight: torch.Tensor  #: (R, Kp) 64**(e - offset) for codes in the maximum, else 0
    raw: torch.Tensor | None  #: (R, Kp) float32 with NaN/inf; None when every code is finite
    exponent: torch.Tensor | None  #: (R, Kp) int32, only for the normalised-products rule


@dataclass(frozen=True)
class Alignment:
    """How E is found for a pair of formats: weight dtype and exponent offsets."""

    dtype: torch.dtype
    offset_a: int
    offset_b: int


def alignment(fa: Format, fb: Format, rules) -> Alignment:
    lo_a, hi_a = exponent_range(fa, rules.subnormals_at_emin)
    lo_b, hi_b = exponent_range(fb, rules.subnormals_at_emin)
    lo_a, lo_b = min(lo_a, fa.emin), min(lo_b, fb.emin)  # zero codes use emin
    off_a, off_b = (lo_a + hi_a) // 2, (lo_b + hi_b) // 2
    lo, hi = lo_a + lo_b - off_a - off_b, hi_a + hi_b - off_a - off_b
    fits_f32 = _LOG_BASE * lo >= -126 and _LOG_BASE * hi + 5 <= 126
    return Alignment(torch.float32 if fits_f32 else torch.float64, off_a, off_b)


def prepare(codes: torch.Tensor, fmt: Format, rules, offset: int, dtype: torch.dtype,
            k_padded: int) -> Operand:
    """``codes`` (R, K) uint8 on any device."""
    rows, k = codes.shape
    if k_padded != k:
        codes = torch.nn.functional.pad(codes, (0, k_padded - k))  # code 0 is +0 in every format
    t = code_table(fmt, rules.subnormals_at_emin)
    values = lut(t.value, codes)
    finite = lut(t.finite, codes)
    in_max = finite if rules.zeros_in_max else lut(t.nonzero, codes)
    exponent = lut(t.exponent, codes)
    pow2 = pow2_f32 if dtype == torch.float32 else pow2_f64
    weight = torch.where(in_max, pow2(_LOG_BASE * (exponent - offset)), 0.0).to(dtype)
    all_finite = bool(finite.all())
    return Operand(
        values_kmajor=torch.where(finite, values, 0.0).t().contiguous(),
        weight=weight.contiguous(),
        raw=None if all_finite else values.contiguous(),
        exponent=torch.where(in_max, exponent, NO_EXPONENT).contiguous()
        if rules.normalised_products else None,
    )


class TileKernel:
    """The hopper k-steps for one (TI, TJ) block of the output.

    Exponents are kept *biased* (E + 127, as in float32 bits) so that 2**(13-E) and 2**(E-13)
    are one shift each. "No nonzero product in this step" is biased exponent 1 (E = -126, below
    every FP8 product exponent), so E = max(E_products, e(C)) needs no special case.
    """

    def __init__(self, a: Operand, b: Operand, rows: slice, cols: slice, align: Alignment, rules,
                 step_block: int, specials: bool):
        self.rules = rules
        self.k_step = rules.k_step
        self.frac = rules.term_frac_bits
        self.fast = (rules.term_rounding is Rounding.TOWARD_ZERO
                     and rules.result_rounding is Rounding.TOWARD_ZERO
                     and rules.truncate_accumulator and rules.accumulator_in_max
                     and rules.subnormal_accumulator_at_emin
                     and rules.result_bits > rules.term_frac_bits)
        self.result_mask = ~((1 << (24 - rules.result_bits)) - 1)
        # C alone (no product): S = C's significand without its low 23 - frac bits, which has at
        # most frac + 1 <= result_bits bits, so the result is C with those bits cleared
        self.alone_mask = ~((1 << (23 - rules.term_frac_bits)) - 1)
        self.a_vals = a.values_kmajor[:, rows]  # (Kp, TI)
        self.b_vals = b.values_kmajor[:, cols]  # (Kp, TJ)
        self.a_w, self.b_w = a.weight[rows], b.weight[cols]
        # NaN/inf codes, or a non-finite initial accumulator: the IEEE path of _specials
        self.specials = specials or a.raw is not None or b.raw is not None
        if self.specials:
            self.a_raw = a.raw[rows] if a.raw is not None else self.a_vals.t()
            self.b_raw = b.raw[cols] if b.raw is not None else self.b_vals.t()
        self.a_exp = None if a.exponent is None else a.exponent[rows]
        self.b_exp = None if b.exponent is None else b.exponent[cols]
        self.offset = align.offset_a + align.offset_b
        ti, tj = self.a_vals.shape[1], self.b_vals.shape[1]
        self.shape = (ti, tj)
        self.tmp = torch.empty((self.k_step, ti, tj), dtype=torch.float32, device=self.a_vals.device)
        self.step_block = step_block
        self._cache: tuple[int, int, torch.Tensor, bool] | None = None

    # ---- the alignment exponent of the products, a block of steps at a time ------------------
    def _product_exponents(self, step: int, last_step: int) -> tuple[torch.Tensor, bool]:
        """(biased E of the products of k-step ``step`` (TI, TJ) int32, whether every output
        of the block has a nonzero product in that block of steps)."""
        cache = self._cache
        if cache is None or not cache[0] <= step < cache[1]:
            s0, s1 = step, min(last_step, step + self.step_block)
            ks, (ti, tj) = self.k_step, self.shape
            k0, k1 = s0 * ks, s1 * ks
            if self.a_exp is not None:
                e, has = self._normalised_product_exponents(k0, k1)
                eb = e + 127
            else:
                aw = self.a_w[:, k0:k1].reshape(ti, s1 - s0, ks).transpose(0, 1)
                bw = self.b_w[:, k0:k1].reshape(tj, s1 - s0, ks).permute(1, 2, 0)
                total = torch.bmm(aw, bw)  # (steps, TI, TJ): sum of 64**(ea+eb-offset) >= 0
                if total.dtype == torch.float32:
                    bexp, bias = (total.view(torch.int32) >> 23), 127
                else:
                    bexp, bias = (total.view(torch.int64) >> 52).to(torch.int32), 1023
                has = bexp > 0  # a zero sum: no nonzero product
                # floor((bexp - bias) / 6): lift the numerator to non-negative values below 2**12,
                # where x // 6 == (x * 43691) >> 18 in int32 (the tests check all x < 2**15)
                lift = -(-(bias + 6 * 200) // _LOG_BASE) * _LOG_BASE
                eb = (((bexp + (lift - bias)) * 43691) >> 18) + (self.offset + 127 - lift // _LOG_BASE)
            every = bool(has.all())
            if not every:
                eb = torch.where(has, eb, 1)
            cache = self._cache = (s0, s1, eb.to(torch.int32), every)
        return cache[2][step - cache[0]], cache[3]

    def _normalised_product_exponents(self, k0: int, k1: int):
        """Rule variant: a product's exponent is floor(log2 |a b|) (normalised), found
        elementwise (slow; used to show that the variant fails on captured data)."""
        ks, (ti, tj) = self.k_step, self.shape
        av = self.a_vals[k0:k1].reshape(-1, ks, ti)
        bv = self.b_vals[k0:k1].reshape(-1, ks, tj)
        p = av[:, :, :, None] * bv[:, :, None, :]  # (steps, 32, TI, TJ)
        _, x = torch.frexp(p.abs())
        e = torch.where(p != 0, x - 1, NO_EXPONENT).amax(dim=1)
        return e, e > NO_EXPONENT

    def _truncated_products(self, step: int, w: torch.Tensor) -> torch.Tensor:
        """sum_k trunc(a_k b_k * w) (or round) over the step: four passes over (32, TI, TJ)."""
        k0 = step * self.k_step
        tmp = self.tmp
        torch.mul(self.a_vals[k0:k0 + self.k_step, :, None],
                  self.b_vals[k0:k0 + self.k_step, None, :], out=tmp)
        tmp.mul_(w)
        if self.rules.term_rounding is Rounding.TOWARD_ZERO:
            tmp.trunc_()
        else:
            tmp.round_()  # nearest, ties to even
        return tmp.sum(dim=0)

    # ---- one k-step ----------------------------------------------------------------------------
    def step(self, c: torch.Tensor, step: int, last_step: int) -> torch.Tensor:
        """The accumulator after k-step ``step`` (products 32*step ... 32*step+31), given the
        accumulator ``c`` (TI, TJ) float32."""
        eb_p, every_output_has_products = self._product_exponents(step, last_step)
        c_bits = c.view(torch.int32)
        eb_c = ((c_bits >> 23) & 0xFF).clamp_(min=1)  # -126 for subnormal (and zero) C
        if self.fast:
            out = self._step_fast(c, c_bits, eb_p, eb_c, step, every_output_has_products)
        else:
            if not self.rules.subnormal_accumulator_at_emin:  # rule variant: true exponent
                _, x = torch.frexp(c)
                eb_c = torch.where(c != 0, x - 1 + 127, 1)
            out = self._step_general(c, eb_p, eb_c, step)
        if self.specials:
            out = self._specials(c, out, step * self.k_step)
        return out

    def _step_fast(self, c, c_bits, eb_p, eb_c, step, every_output_has_products):
        frac = self.frac
        eb = torch.maximum(eb_p, eb_c)  # biased E
        if every_output_has_products:  # then frac - 126 <= E <= 127: both powers are normal
            unscale_bits = (eb - frac) << 23  # 2**(E - frac)
            w = ((254 << 23) - unscale_bits).view(torch.float32)  # 2**(frac - E)
        else:
            unscale_bits = (eb - frac).clamp_(min=1) << 23
            w = ((254 + frac - eb).clamp_(1, 254) << 23).view(torch.float32)
        s = self._truncated_products(step, w)  # integers below 2**20: exact
        # C's term: |C * w| < 2**14; converting to int truncates toward zero, and adding an
        # integer 0 turns a -0 sum into +0 (an exact zero sum is +0)
        s.add_((c * w).to(torch.int32))  # below 2**21: exact
        s = (s.view(torch.int32) & self.result_mask).view(torch.float32)
        out = s * unscale_bits.view(torch.float32)
        if not every_output_has_products:
            # E < frac - 126 happens only with no product and a tiny C (E = e(C)): then the step
            # just truncates C to its leading bits, and 2**(+-(frac - E)) would leave float32
            alone = (c_bits & self.alone_mask).view(torch.float32) + 0.0  # +0, never -0
            out = torch.where(eb - frac < 1, alone, out)
        return out

    def _step_general(self, c, eb_p, eb_c, step):
        """Any rule variant; the accumulator's arithmetic in float64."""
        rules, frac = self.rules, self.frac
        has_p = eb_p > 1
        if rules.accumulator_in_max:
            eb = torch.where(has_p, torch.maximum(eb_p, eb_c), eb_c)
        else:
            eb = torch.where(has_p, eb_p, eb_c)
        e = eb - 127
        w = pow2_f32(torch.clamp(frac - e, -149, 127))
        s = self._truncated_products(step, w)
        c_scaled = c.to(torch.float64) * pow2_f64(frac - e)
        if rules.truncate_accumulator:
            c_scaled = c_scaled.trunc() if rules.term_rounding is Rounding.TOWARD_ZERO else c_scaled.round()
        hi, lo = _two_sum(s.to(torch.float64), c_scaled)  # the exact sum (C may be far from E)
        out = _round_sum_significant(hi, lo, rules.result_bits, rules.result_rounding)
        out = (out * pow2_f64(e - frac)).to(torch.float32)
        return torch.where(out == 0, 0.0, out)

    def _specials(self, c: torch.Tensor, out: torch.Tensor, k0: int) -> torch.Tensor:
        a = self.a_raw[:, k0:k0 + self.k_step]
        b = self.b_raw[:, k0:k0 + self.k_step]
        ieee = c + a @ b.t()  # float32; finite FP8 products cannot overflow it
        return torch.where(torch.isfinite(ieee), out, ieee)


def _two_sum(a: torch.Tensor, b: torch.Tensor):
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def _round_significant(s: torch.Tensor, bits: int, rounding: Rounding) -> torch.Tensor:
    """``s`` (float64, exact) rounded to ``bits`` significant bits."""
    _, x = torch.frexp(s)
    scaled = s * pow2_f64(bits - x)
    scaled = scaled.trunc() if rounding is Rounding.TOWARD_ZERO else scaled.round()
    return scaled * pow2_f64(x - bits)


def _round_sum_significant(hi: torch.Tensor, lo: torch.Tensor, bits: int, rounding: Rounding):
    """hi + lo (|lo| <= half an ulp of hi) rounded to ``bits`` significant bits. No rounding
    boundary lies strictly between hi and its float64 neighbours, so only a boundary *at* hi
    needs lo: its sign says on which side of hi the exact sum lies."""
    t = _round_significant(hi, bits, Rounding.TOWARD_ZERO)
    inward = (lo != 0) & ((lo < 0) != (hi < 0))  # the exact sum is nearer zero than hi
    outward = (lo != 0) & ~inward
    if rounding is Rounding.TOWARD_ZERO:
        below = _round_significant(torch.nextafter(hi, torch.zeros_like(hi)), bits, rounding)
        return torch.where((t == hi) & inward, below, t)
    r = _round_significant(hi, bits, rounding)
    _, x = torch.frexp(t)
    half = pow2_f64(x - bits - 1)  # half the spacing of bits-bit numbers at |t|
    tie = (hi - t).abs() == half
    away = t + torch.sign(hi) * 2 * half
    return torch.where(tie & outward, away, torch.where(tie & inward, t, r))
