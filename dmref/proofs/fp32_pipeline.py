"""A small emulated float32 backward, self-contained, to check the bounds of
``rounding_bounds.md`` against the arithmetic they are proved for.

Only the quantization comes from ``dmref.emulation`` (``quantize``); everything else is plain
torch float32 on the CPU, written so that each line is one of the operations the proofs model:

- block-scaled FP8 Q, K, V, dO, power-of-two scales (OCP MX rule, 2**(floor(log2 amax) - emax)),
  blocks along the head dim (the contraction dim of QK^T and dO V^T);
- ``S = fl(tau * (Q_hat K_hat^T))``, masked entries -inf;
- forward LSE, two-pass: ``L = fl(m + fl_log(fl(sum_j fl_exp(fl(S_j - m)))))``  (Lemma 5);
- recompute ``P = fl_exp(fl(S - L))``                                           (Lemma 4);
- ``dP = dO_hat V_hat^T`` in float32 (torch) or under the Hopper wgmma model;
- delta by one of :data:`DELTA_STRATEGIES`; ``dS = fl(P * fl(dP - D))``.

The row-sum residual is the *exact* sum of the float32 dS entries (``math.fsum``, correctly
rounded), and ``A_i = sum_j |P_ij dP_ij|`` likewise (float32 products are exact in float64).
The full recipe-driven reference lives in ``dmref``; this file is deliberately independent of
it so that the proofs check the mathematics, not one implementation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from dmref.emulation import FLOAT8_E4M3FN, FLOAT8_E5M2, FLOAT8_E8M0FNU, Block, ScaleRule, decode, quantize
from dmref.emulation.blocked_fast import fake_quantize_blocked, quantize_blocked_fast

from .bounds import (
    FP32,
    FP64,
    gamma,
    hopper_dot_error_bound,
    matched_residual_bound,
    matched_residual_bound_a_priori,
    normalized_matched_residual_bound,
    operand_matched_residual_bound,
)

#: How D is formed. ``matched``: D_i = sum_j P_ij dP_ij (Delta-Matching); ``matched_normalized``:
#: that divided by sum_j P_ij (Corollary 6); ``operand_matched``: D_i = dO_hat_i . (P V_hat)_i,
#: equal in exact arithmetic, not in rounded (Theorem 8); ``stale_bf16``: D = rowsum(bf16(dO) *
#: bf16(O)) with O from an FP8 forward (cuDNN MXFP8 style); ``stale_fp8``: D from per-tensor FP8
#: dO and O (cuDNN per-tensor style).
DELTA_STRATEGIES = ("matched", "matched_normalized", "operand_matched", "stale_bf16", "stale_fp8")


# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------
def attention_inputs(seed: int, *, batch: int = 1, heads: int = 2, kv_heads: int | None = None,
                     seqlen: int = 64, head_dim: int = 64, outlier_channels: int = 0,
                     outlier_scale: float = 20.0, peaked: float = 0.0):
    """q, do (batch, heads, seqlen, head_dim) and k, v (batch, kv_heads, seqlen, head_dim),
    float32. ``outlier_channels`` channels of q and k are multiplied by ``outlier_scale``;
    ``peaked`` > 0 adds ``peaked`` times a random key (of the same kv head) to every query, so
    attention rows concentrate on one key."""
    kv_heads = heads if kv_heads is None else kv_heads
    if heads % kv_heads:
        raise ValueError(f"{heads=} must be a multiple of {kv_heads=}")
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seqlen, head_dim, generator=g)
    k = torch.randn(batch, kv_heads, seqlen, head_dim, generator=g)
    v = torch.randn(batch, kv_heads, seqlen, head_dim, generator=g)
    do = torch.randn(batch, heads, seqlen, head_dim, generator=g)
    if outlier_channels:
        ch = torch.randperm(head_dim, generator=g)[:outlier_channels]
        q[..., ch] *= outlier_scale
        k[..., ch] *= outlier_scale
    if peaked:
        kk = k.repeat_interleave(heads // kv_heads, dim=1)
        pick = torch.randint(0, seqlen, (batch, heads, seqlen), generator=g)
        q = q + peaked * torch.gather(kk, 2, pick[..., None].expand(-1, -1, -1, head_dim))
    return q, k, v, do


def pow2_block_quantize(x: torch.Tensor, fmt, block: int):
    """Block-scaled FP8 along the last dim, ``ScaleRule.MX_OCP`` of :mod:`dmref.emulation` (scale
    2**(floor(log2 amax) - emax) per block of ``block``, saturating): (dequantized values, scales
    broadcast to x's shape), both float32 and exact."""
    codes, e8m0 = quantize_blocked_fast(x, fmt, block=Block.tile(1, block), scale_rule=ScaleRule.MX_OCP)
    scale = decode(e8m0, FLOAT8_E8M0FNU).repeat_interleave(block, dim=-1)[..., : x.shape[-1]].contiguous()
    return decode(codes, fmt) * scale, scale


def tensor_quantize(x: torch.Tensor, fmt):
    """Per-tensor FP8 with scale RN32(amax / max) (cuDNN per-tensor style, ``ScaleRule.AMAX``),
    dequantized."""
    return fake_quantize_blocked(x, fmt, block=Block.tensor(), scale_rule=ScaleRule.AMAX)


def make_mask(n_q: int, n_k: int, causal: bool, padding: int = 0) -> torch.Tensor:
    """True where key j is visible to query i (causal bottom-right aligned); the last
    ``padding`` keys are masked for every query."""
    m = torch.ones(n_q, n_k, dtype=torch.bool)
    if causal:
        m = torch.ones(n_q, n_k, dtype=torch.bool).tril(diagonal=n_k - n_q)
    if padding:
        m[:, n_k - padding:] = False
    return m


# ----------------------------------------------------------------------------------------------
# The float32 backward
# ----------------------------------------------------------------------------------------------
def forward_lse(s: torch.Tensor) -> torch.Tensor:
    """Two-pass log-sum-exp in float32, the form of Lemma 5; +inf for a fully masked row (so the
    recomputed P is 0 there, never NaN)."""
    m = s.amax(dim=-1)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    l = torch.exp(s - m_safe[..., None]).sum(dim=-1)
    return torch.where(l > 0, m_safe + torch.log(l), torch.full_like(m, math.inf))


def _hopper_dp(do_codes, do_scale_row, v_codes, v_scale_row, fmt_do, fmt_v, promote_every):
    from .hopper import hopper_matmul

    out = np.empty(do_codes.shape[:-1] + (v_codes.shape[-2],), dtype=np.float32)
    for idx in np.ndindex(*do_codes.shape[:-2]):
        out[idx] = hopper_matmul(do_codes[idx], v_codes[idx], fmt_do, fmt_v,
                                 promote_every=promote_every)
    # per-row power-of-two scales applied outside the dot: exact
    return torch.from_numpy(out) * do_scale_row[..., :, None] * v_scale_row[..., None, :]


@dataclass
class Fp32Backward:
    """Tensors (batch, heads, n_q, n_k) and per-row statistics (numpy, flattened rows)."""

    s: torch.Tensor  #: the float32 logits (masked entries -inf)
    p: torch.Tensor
    dp: torch.Tensor
    delta: torch.Tensor
    ds: torch.Tensor
    residual: np.ndarray  #: exact sum_j dS_ij (correctly rounded to float64)
    abs_products: np.ndarray  #: A_i = sum_j |P_ij dP_ij|
    mass: np.ndarray  #: sigma_i = sum_j P_ij
    visible: np.ndarray  #: n_i, the number of unmasked keys
    row_max: np.ndarray  #: |m_i|, the row maximum of S (0 for a fully masked row)
    hopper_magnitude: np.ndarray | None = None  #: sum_j P_ij W_ij (Theorem 8), rounded up
    operand_magnitude: np.ndarray | None = None  #: sum_jk P_ij |dO_ik| |V_jk|, rounded up
    do_abs_sum: np.ndarray | None = None  #: sum_k |dO_hat_ik|
    head_dim: int = 0
    promote_every: int | None = None

    @property
    def relative_residual(self) -> np.ndarray:
        """|r_i| / A_i (0 where A_i = 0)."""
        a = self.abs_products
        return np.where(a > 0, np.abs(self.residual) / np.where(a > 0, a, 1.0), 0.0)

    def bound(self, strategy: str = "matched") -> np.ndarray:
        """The per-row bound of ``rounding_bounds.md`` for this run's delta strategy."""
        a, n, sigma = self.abs_products, self.visible, self.mass
        if strategy == "matched":
            return matched_residual_bound(a, n, sigma)
        if strategy == "matched_a_priori":
            return matched_residual_bound_a_priori(a, n, self.row_max)
        if strategy == "matched_normalized":
            return normalized_matched_residual_bound(a, n, sigma)
        if strategy == "operand_matched":
            d = self.head_dim
            if self.hopper_magnitude is not None:  # dP from the wgmma model: Lemma 7
                beta = hopper_dot_error_bound(d, self.promote_every)
                bw, c = self.hopper_magnitude, 0.0
            else:  # dP from a float32 dot: gamma_d, plus underflow of its products
                beta, bw = gamma(d), self.operand_magnitude
                c = d * FP32.eta * (1.0 + gamma(max(d - 1, 0)))
            return operand_matched_residual_bound(a, bw, self.operand_magnitude, n, d, sigma,
                                                  self.do_abs_sum, beta, dp_abs_err=c)
        raise ValueError(f"no bound for {strategy=}")


def _exact_row_sums(x: torch.Tensor) -> np.ndarray:
    rows = x.detach().to(torch.float64).reshape(-1, x.shape[-1]).numpy()
    return np.array([math.fsum(r) for r in rows])


def _rounded_up(x: np.ndarray, terms: int) -> np.ndarray:
    """A float64 sum of ``terms`` non-negative products, inflated to an upper bound of the exact
    value (gamma_terms in float64)."""
    return x * (1.0 + gamma(terms + 1, FP64.u))


def fp32_backward(q, k, v, do, *, tau: float | None = None, causal: bool = False,
                  padding: int = 0, fmt_qk=FLOAT8_E4M3FN, fmt_v=FLOAT8_E4M3FN, fmt_do=FLOAT8_E5M2,
                  block: int = 32, delta: str = "matched", dp_accumulation: str = "fp32",
                  promote_every: int | None = None) -> Fp32Backward:
    """Run the float32 backward of one batch of heads (see the module docstring)."""
    if delta not in DELTA_STRATEGIES:
        raise ValueError(f"unknown {delta=}; known: {DELTA_STRATEGIES}")
    b, h, n, d = q.shape
    kv = k.shape[1]
    tau = 1.0 / math.sqrt(d) if tau is None else tau
    k = k.repeat_interleave(h // kv, dim=1)  # GQA: each query head reads its kv head
    v = v.repeat_interleave(h // kv, dim=1)
    if dp_accumulation == "hopper":
        block = d  # one scale per row, so the dot's scales factor out of the wgmma chain
    qh, _ = pow2_block_quantize(q, fmt_qk, block)
    kh, _ = pow2_block_quantize(k, fmt_qk, block)
    vh, v_scale = pow2_block_quantize(v, fmt_v, block)
    doh, do_scale = pow2_block_quantize(do, fmt_do, block)
    mask = make_mask(n, k.shape[2], causal, padding)

    s = torch.tensor(tau, dtype=torch.float32) * (qh @ kh.transpose(-1, -2))
    s = s.masked_fill(~mask, -math.inf)
    lse = forward_lse(s)
    p = torch.exp(s - lse[..., None])  # the recomputed P: the one D and dS both use

    hopper_mag = None
    if dp_accumulation == "fp32":
        dp = doh @ vh.transpose(-1, -2)
    elif dp_accumulation == "hopper":
        from .hopper import hopper_magnitude

        do_codes = (doh / do_scale).numpy().astype(np.float64)
        v_codes = (vh / v_scale).numpy().astype(np.float64)
        dp = _hopper_dp(do_codes, do_scale[..., 0], v_codes, v_scale[..., 0], fmt_do, fmt_v,
                        promote_every)
        w = np.stack([hopper_magnitude(do_codes[i], v_codes[i], fmt_do, fmt_v)
                      for i in np.ndindex(*do_codes.shape[:-2])]).reshape(dp.shape)
        w = w * (do_scale[..., 0, None].double() * v_scale[..., 0][..., None, :].double()).numpy()
        hopper_mag = _rounded_up((p.double().numpy() * w).sum(-1).reshape(-1), n + d)
    else:
        raise ValueError(f"unknown {dp_accumulation=}; use 'fp32' or 'hopper'")

    if delta == "matched":
        dlt = (p * dp).sum(dim=-1)
    elif delta == "matched_normalized":
        dlt = (p * dp).sum(dim=-1) / p.sum(dim=-1)
        dlt = torch.nan_to_num(dlt, nan=0.0)  # fully masked rows: 0 / 0
    elif delta == "operand_matched":
        dlt = (doh * (p @ vh)).sum(dim=-1)
    else:
        o = _fp8_forward_output(p, v, fmt_v, block)
        if delta == "stale_bf16":
            dlt = (do.bfloat16().float() * o.bfloat16().float()).sum(dim=-1)
        else:
            dlt = (tensor_quantize(do, fmt_do) * tensor_quantize(o, fmt_qk)).sum(dim=-1)
    ds = p * (dp - dlt[..., None])

    p64, dp64 = p.double(), dp.double()
    abs_p = (p64 * dp64).abs().reshape(-1, p.shape[-1]).numpy()
    s_max = s.amax(dim=-1).reshape(-1)
    op_mag = _rounded_up(((p64 @ vh.double().abs()) * doh.double().abs()).sum(-1)
                         .reshape(-1).numpy(), n + d)
    return Fp32Backward(
        s, p, dp, dlt, ds,
        residual=_exact_row_sums(ds),
        abs_products=np.array([math.fsum(r) for r in abs_p]),
        mass=_exact_row_sums(p),
        visible=mask.sum(-1).expand(p.shape[:-1]).reshape(-1).numpy().astype(float),
        row_max=torch.where(torch.isfinite(s_max), s_max.abs(), 0.0).numpy().astype(float),
        hopper_magnitude=hopper_mag,
        operand_magnitude=op_mag,
        do_abs_sum=doh.double().abs().sum(-1).reshape(-1).numpy(),
        head_dim=d,
        promote_every=promote_every,
    )


def _fp8_forward_output(p: torch.Tensor, v: torch.Tensor, fmt_v, block: int) -> torch.Tensor:
    """O of an FP8 forward for the stale strategies: P quantized to e4m3 against a 2**8 offset
    (FA3 style), V blocked along the sequence (the PV contraction dim), and the normalizer left
    unquantized (so the effective weights do not sum to 1: sources 2-4 of stale_delta.md)."""
    p_q = quantize(p * 256.0, FLOAT8_E4M3FN, saturate=True) / 256.0
    v_seq, _ = pow2_block_quantize(v.transpose(-1, -2), fmt_v, block)
    return p_q @ v_seq.transpose(-1, -2)
