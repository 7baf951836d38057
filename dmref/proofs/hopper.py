"""A small, self-contained model of Hopper FP8 wgmma accumulation (docs/gemm.md).

It exists so that the bounds of ``rounding_bounds.md`` (Lemma 7, Theorem 8) can be checked
against the model they are proved for, without depending on the full emulated GEMM of
``dmref.emulation`` (only its bit counts, :data:`dmref.emulation.gemm.HOPPER`, are shared). tests/proofs/test_hopper_model.py checks it bit for bit against the real
H200 outputs in tests/data/h200_fp8_gemm.npz.

The model, for ``out = a @ bt.T + c`` with FP8 values ``a (M, K)`` and ``bt (N, K)``:

- one k-step takes 32 exact products and the accumulator C;
- the alignment exponent E is the largest of the product exponents e(a_k) + e(b_k) (FP8
  exponents, emin for subnormals: products are kept unnormalised) and of C's exponent
  (floor(log2 |C|), -126 for a subnormal float32);
- every term, C included, is truncated toward zero to a multiple of 2**(E - 13); the truncated
  terms are added exactly;
- the sum is truncated toward zero to 14 significant bits (it is then a float32);
- promotion every N products: a zeroed partial accumulator runs N/32 steps and is added to the
  float32 accumulator with a round-to-nearest float32 add. Without promotion the chain runs from
  C = c through every step.

All arithmetic below is exact in float64: products of two FP8 values have at most 8 significant
bits, and a step's truncated terms are multiples of 2**(E-13) below 2**(E+8).
"""

from __future__ import annotations

import numpy as np

from dmref.emulation import get_format

from dmref.emulation import WgmmaRules
from dmref.emulation.constants import FP32_EMIN

from .bounds import HOPPER, check_wgmma_rules

_NO_EXPONENT = -(1 << 20)  # exponent given to zero terms: never the maximum


def fp8_exponents(values: np.ndarray, fmt) -> np.ndarray:
    """e(x) = floor(log2 |x|) for normal FP8 values, emin for subnormals, a very negative number
    for zero."""
    fmt = get_format(fmt)
    v = np.asarray(values, dtype=np.float64)
    _, e = np.frexp(np.abs(v))
    return np.where(v == 0, _NO_EXPONENT, np.maximum(e - 1, fmt.emin)).astype(np.int64)


def _float32_exponents(c: np.ndarray) -> np.ndarray:
    _, e = np.frexp(np.abs(c))
    return np.where(c == 0, _NO_EXPONENT, np.maximum(e - 1, FP32_EMIN)).astype(np.int64)


def _truncate(x: np.ndarray, quantum: np.ndarray) -> np.ndarray:
    return np.trunc(x / quantum) * quantum


def wgmma_step(c: np.ndarray, products: np.ndarray, product_exponents: np.ndarray,
               model: WgmmaRules = HOPPER) -> np.ndarray:
    """One k-step: ``c (...)`` float32 values, ``products (..., k)`` exact, their exponents."""
    product_exponents = np.where(products == 0, _NO_EXPONENT, product_exponents)
    big_e = np.maximum(product_exponents.max(axis=-1), _float32_exponents(c))
    empty = big_e <= _NO_EXPONENT // 2  # every term is zero: the step leaves C as it is
    quantum = np.ldexp(1.0, np.where(empty, 0, big_e) - model.term_frac_bits)
    total = _truncate(c, quantum) + _truncate(products, quantum[..., None]).sum(axis=-1)
    _, e = np.frexp(np.abs(total))
    result_quantum = np.ldexp(1.0, np.maximum(e - 1, FP32_EMIN) - (model.result_bits - 1))
    out = _truncate(total, result_quantum)
    return np.where(empty, c, out)


def _padded(x: np.ndarray, k_step: int) -> np.ndarray:
    pad = (-x.shape[1]) % k_step
    return np.pad(x, ((0, 0), (0, pad))) if pad else x


def hopper_matmul(a, bt, fmt_a, fmt_b, *, promote_every: int | None = None, c=None,
                  model: WgmmaRules = HOPPER, max_block_bytes: int = 1 << 26) -> np.ndarray:
    """``a @ bt.T + c`` under the wgmma model, as float32. ``a`` and ``bt`` hold FP8 *values*
    (already decoded, unscaled); K is padded with zeros to a multiple of 32."""
    k = check_wgmma_rules(model).k_step
    a = _padded(np.asarray(a, dtype=np.float64), k)
    bt = _padded(np.asarray(bt, dtype=np.float64), k)
    if a.shape[1] != bt.shape[1]:
        raise ValueError(f"inner dimensions differ: {a.shape=} {bt.shape=}")
    if promote_every is not None and promote_every % k:
        raise ValueError(f"{promote_every=} must be a multiple of the k-step {k}")
    ea, eb = fp8_exponents(a, fmt_a), fp8_exponents(bt, fmt_b)
    m_rows, n_cols, steps = a.shape[0], bt.shape[0], a.shape[1] // k
    c = (np.zeros((m_rows, n_cols)) if c is None
         else np.asarray(c, dtype=np.float32).astype(np.float64))
    steps_per_chunk = steps if promote_every is None else promote_every // k
    rows_per_block = max(1, max_block_bytes // (8 * n_cols * k * 2))
    out = np.empty((m_rows, n_cols), dtype=np.float32)
    for r0 in range(0, m_rows, rows_per_block):
        rs = slice(r0, r0 + rows_per_block)
        acc = c[rs].astype(np.float32)
        chain = c[rs] if promote_every is None else None
        for s0 in range(0, steps, steps_per_chunk):
            partial = chain if chain is not None else np.zeros_like(c[rs])
            for s in range(s0, min(steps, s0 + steps_per_chunk)):
                ks = slice(s * k, (s + 1) * k)
                products = a[rs, None, ks] * bt[None, :, ks]
                exponents = ea[rs, None, ks] + eb[None, :, ks]
                partial = wgmma_step(partial, products, exponents, model)
            if chain is not None:
                chain = partial
            else:
                acc = (acc + partial.astype(np.float32)).astype(np.float32)
        out[rs] = chain.astype(np.float32) if chain is not None else acc
    return out


def fp8_magnitudes(values, fmt) -> np.ndarray:
    """mu(x) = max(|x|, 2**e(x)): |x| for a normal FP8 value, 2**emin for a subnormal, 0 for 0."""
    v = np.asarray(values, dtype=np.float64)
    return np.where(v == 0, 0.0, np.maximum(np.abs(v), np.ldexp(1.0, fp8_exponents(v, fmt))))


def hopper_magnitude(a, bt, fmt_a, fmt_b) -> np.ndarray:
    """W of Lemma 7 for every output: ``sum_k mu(a_k) mu(b_k)`` >= ``sum_k max(|a_k b_k|,
    2**(e(a_k) + e(b_k)))``; equal to ``|a| @ |bt|.T`` when no operand is subnormal."""
    return fp8_magnitudes(a, fmt_a) @ fp8_magnitudes(bt, fmt_b).T
