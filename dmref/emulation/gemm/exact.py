"""The ``exact`` and ``fp32`` accumulation models, and exactly rounded float32 helpers.

``exact``: the products of FP8 values are exact in float64, and so is a float64 matmul over a
slice of the operands whenever every product is a multiple of 2**L and the sum of the magnitudes
stays below 2**(L+53): then every partial sum, in whatever order BLAS (or cuBLAS) adds, is
representable. Operands whose products span too many binades (E5M2) are split by exponent into
windows, and K into chunks, so that each window pair and chunk satisfies this. The few exact
float64 partial results are then added into an exact double-double (TwoSum cascade: the
errors are multiples of 2**L and too few to round), the float32 accumulator ``c`` is added with
error-free transformations, and the result is rounded once to float32 through round-to-odd in
float64 (RN32(RO64(x)) = RN32(x) because 53 >= 24 + 2).

``fp32``: ``acc = c``; for k = 0, 1, ..., K-1: ``acc = fl32(acc + a_k * b_k)``. Products are
exact in float32, so a rank-1 update (``addr_``) is that float32 add whether or not it fuses.
"""

from __future__ import annotations

import math

import torch

from ..formats import Format
from .tables import code_table, exponent_range, lut, run_blocks

_CHUNK_BITS = 12  # K is cut into chunks of at most 2**12 products for the exact matmuls
_FLOAT64_BITS = 53


def two_sum(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Knuth's TwoSum: s = fl(a + b) and e with a + b = s + e exactly."""
    s = a + b
    bb = s - a
    e = (a - (s - bb)) + (b - bb)
    return s, e


def round_odd_to_f32(u: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
    """float32 nearest-even rounding of ``u + tail``, where ``u`` is a float64 and ``tail`` a
    value whose sign is exact and which lies strictly inside the gap between ``u`` and its
    float64 neighbour on the side of ``tail``. Round-to-odd to float64 first, then to float32."""
    odd = (u.view(torch.int64) & 1) == 1
    toward = torch.where(tail > 0, math.inf, -math.inf).to(u.dtype)
    ro = torch.where((tail != 0) & ~odd, torch.nextafter(u, toward), u)
    out = ro.to(torch.float32)
    return torch.where(torch.isfinite(u), out, u.to(torch.float32))


def fma_f32(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 ``fma(x, y, z)`` (one rounding), on any device."""
    p = x.to(torch.float64) * y.to(torch.float64)  # exact: 24 + 24 bits
    s, e = two_sum(p, z.to(torch.float64))
    return round_odd_to_f32(s, torch.where(torch.isfinite(s), e, 0.0))


def windows(fa: Format, fb: Format, chunk_bits: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Exponent windows of ``a`` and ``b`` such that for every window pair the products' bits
    span at most 53 - chunk_bits binades."""
    (la, ha), (lb, hb) = exponent_range(fa), exponent_range(fb)
    fixed = 2 + fa.mantissa_bits + fb.mantissa_bits  # significand product < 4; fraction bits
    budget = _FLOAT64_BITS - chunk_bits - fixed
    best = None
    for na in range(1, 9):
        for nb in range(1, 9):
            wa, wb = math.ceil((ha - la + 1) / na), math.ceil((hb - lb + 1) / nb)
            if (wa - 1) + (wb - 1) <= budget and (best is None or na * nb < best[0] * best[1]):
                best = (na, nb)
    na, nb = best
    split = lambda lo, hi, n: [(lo + i * math.ceil((hi - lo + 1) / n),
                                min(hi, lo + (i + 1) * math.ceil((hi - lo + 1) / n) - 1)) for i in range(n)]
    return split(la, ha, na), split(lb, hb, nb)


def exact_products_sum(a_codes: torch.Tensor, b_codes: torch.Tensor, fa: Format, fb: Format,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) float64 with hi + lo = sum_k a_k b_k exactly (finite codes; NaN/inf as 0) and
    hi = fl64(hi + lo)."""
    k = a_codes.shape[1]
    chunk_bits = min(_CHUNK_BITS, max(1, math.ceil(math.log2(max(k, 2)))))
    chunk = 1 << chunk_bits
    ta, tb = code_table(fa), code_table(fb)
    finite_value = lambda t: torch.where(torch.from_numpy(t.finite), torch.from_numpy(t.value), 0.0).double().numpy()
    va, vb = lut(finite_value(ta), a_codes), lut(finite_value(tb), b_codes)
    wa, wb = windows(fa, fb, chunk_bits)

    def sliced(values, codes, table, window_list):
        if len(window_list) == 1:
            return [values]
        e = lut(table.exponent, codes)
        return [torch.where((e >= lo) & (e <= hi), values, 0.0) for lo, hi in window_list]

    partials = []
    for xa in sliced(va, a_codes, ta, wa):
        for xb in sliced(vb, b_codes, tb, wb):
            for k0 in range(0, k, chunk):
                partials.append(xa[:, k0:k0 + chunk] @ xb[:, k0:k0 + chunk].t())
    s, lo = partials[0], torch.zeros_like(partials[0])
    for p in partials[1:]:
        s, e = two_sum(s, p)
        lo = lo + e  # exact: multiples of 2**L, far too few to round (module docstring)
    return two_sum(s, lo)


def round_sum_to_f32(hi: torch.Tensor, lo: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 nearest-even rounding of hi + lo + c (hi + lo a double-double with
    hi = fl64(hi + lo); c float32), exactly."""
    s1, e1 = two_sum(hi, c.to(torch.float64))
    t, f = two_sum(e1, lo)
    u, g = two_sum(s1, t)
    return round_odd_to_f32(u, g + f)


def exact_matmul(a_codes: torch.Tensor, b_codes: torch.Tensor, c: torch.Tensor, fa: Format,
                 fb: Format) -> torch.Tensor:
    """c + a @ b.T with exact products and sum, rounded once to float32 (nearest even).
    A NaN or infinite exact sum gives NaN or +-inf (IEEE: inf - inf and inf * 0 are NaN)."""
    hi, lo = exact_products_sum(a_codes, b_codes, fa, fb)
    out = round_sum_to_f32(hi, lo, c)
    ta, tb = code_table(fa), code_table(fb)
    finite = bool(lut(ta.finite, a_codes).all()) and bool(lut(tb.finite, b_codes).all())
    if finite and bool(torch.isfinite(c).all()):
        return out
    ieee = c.to(torch.float64) + lut(ta.value, a_codes).to(torch.float64) @ \
        lut(tb.value, b_codes).to(torch.float64).t()  # finite FP8 sums cannot overflow
    return torch.where(torch.isfinite(ieee), out, ieee.to(torch.float32))


def fp32_matmul(a_codes: torch.Tensor, b_codes: torch.Tensor, c: torch.Tensor, fa: Format,
                fb: Format, row_block: int | None = None) -> torch.Tensor:
    """acc = c; for k in order: acc = fl32(acc + a_k b_k)."""
    va = lut(code_table(fa).value, a_codes)  # (M, K) float32 with NaN/inf
    vb = lut(code_table(fb).value, b_codes)
    m, k = va.shape
    va_t, vb_t = va.t().contiguous(), vb.t().contiguous()
    out = c.clone()
    row_block = row_block or (m if va.is_cuda else max(1, (1 << 16) // max(vb.shape[0], 1)))

    def block(rows: slice) -> None:
        acc = out[rows]
        cols = va_t[:, rows]
        for kk in range(k):
            acc.addr_(cols[kk], vb_t[kk])

    run_blocks(block, [(slice(r0, r0 + row_block),) for r0 in range(0, m, row_block)], va.device)
    return out
