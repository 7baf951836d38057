"""The attention problem the demo and the oracle's cases draw: :func:`make_problem`, float32
tensors holding BF16 values with the activation statistics that make FP8 attention hard (outlier
channels, an attention sink, sharply peaked rows, per-token gradient scales)."""

from __future__ import annotations

import math

import torch

from . import emulation

__all__ = ["make_problem"]


def make_problem(batch: int = 1, heads: int = 4, seqlen: int = 1024, head_dim: int = 64, *,
                 kv_heads: int | None = None, seed: int = 0, outlier_channels: int = 4,
                 qk_outlier_scale: float = 3.0, v_outlier_scale: float = 8.0,
                 peaked_fraction: float = 0.1, peak_logit: float = 12.0, sink_logit: float = 4.0,
                 grad_scale: float = 1e-3):
    """(q, k, v, dout), float32 tensors holding BF16 values (rounded by dmref.emulation), shapes
    ``(batch, heads, seqlen, head_dim)`` (k, v with ``kv_heads``).

    - ``outlier_channels`` channels of q and k are ``qk_outlier_scale`` times larger, of v
      ``v_outlier_scale`` times (the massive activations of LLMs);
    - queries share a mean direction mu; key 0 is an attention sink, shifted along mu so that
      its logit is about ``sink_logit`` above the rest;
    - a ``peaked_fraction`` of query rows point at one earlier key with logit ``peak_logit``;
    - dout has per-token scales drawn log-normally around ``grad_scale``.
    """
    kv_heads = kv_heads or heads
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    chan = torch.ones(head_dim, dtype=torch.float64)
    outliers = torch.randperm(head_dim, generator=g)[:outlier_channels]
    q_scale, v_scale = chan.clone(), chan.clone()
    q_scale[outliers], v_scale[outliers] = qk_outlier_scale, v_outlier_scale
    tau = 1.0 / math.sqrt(head_dim)
    groups = heads // kv_heads
    # queries share a mean direction mu (|mu| about half a token's norm), as in trained models
    mu = randn(batch, kv_heads, 1, head_dim)
    mu = 0.5 * math.sqrt(head_dim) * mu / mu.norm(dim=-1, keepdim=True)
    q = randn(batch, heads, seqlen, head_dim) * q_scale + mu.repeat_interleave(groups, dim=1)
    k = randn(batch, kv_heads, seqlen, head_dim) * q_scale
    v = randn(batch, kv_heads, seqlen, head_dim) * v_scale
    # attention sink: key 0 gains sink_logit / scale along mu, so its logit is ~sink_logit higher
    k[:, :, 0] += sink_logit * mu[:, :, 0] / (tau * (mu[:, :, 0] * mu[:, :, 0]).sum(-1, keepdim=True))
    # peaked rows: q_i points at one earlier key j (causal-safe) with logit ~ peak_logit
    n_peaked = int(peaked_fraction * seqlen)
    if n_peaked and seqlen > 1:
        rows = torch.randperm(seqlen - 1, generator=g)[:n_peaked] + 1
        for r in rows.tolist():
            j = int(torch.randint(0, r + 1, (1,), generator=g))
            kj = k[:, :, j].repeat_interleave(groups, dim=1)
            q[:, :, r] = peak_logit * kj / (tau * (kj * kj).sum(-1, keepdim=True).clamp_min(1e-12))
    token_scale = torch.exp(randn(batch, heads, seqlen, 1) * 0.5) * grad_scale
    dout = randn(batch, heads, seqlen, head_dim) * token_scale
    return tuple(emulation.quantize(t.to(torch.float32), "bfloat16") for t in (q, k, v, dout))
