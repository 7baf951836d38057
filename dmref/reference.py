"""Exact attention: forward and backward in float64, written to be read.

Layout ``(batch, heads, seqlen, head_dim)`` throughout::

    q: (B, H,   Nq, D)      k: (B, Hkv, Nk, D)      v: (B, Hkv, Nk, Dv)
    out: (B, H, Nq, Dv)     lse: (B, H, Nq)         mask: broadcastable to (B, H, Nq, Nk)

GQA/MQA: ``H`` must be a multiple of ``Hkv``; query head ``h`` reads key/value head
``h // (H // Hkv)`` (``torch.repeat_interleave``, as SDPA's ``enable_gqa``).

Masking. ``causal=True`` keeps key j for query i iff ``j <= i + (Nk - Nq)`` (aligned to the
bottom-right corner, as FlashAttention >= 2.1; with ``Nq == Nk`` the usual lower triangle). A
boolean ``mask`` keeps the positions where it is True (SDPA's convention); a floating ``mask`` is
added to the scaled scores (``-inf`` removes a position). Both combine with ``causal``.

A query row with no key left is *fully masked*: its output is zero, its ``lse`` is ``-inf``, and
it contributes zero to every gradient (never NaN).

Non-finite inputs are not checked. They propagate by IEEE rules through the matmuls: a NaN or
inf in ``q[b, h, i]`` makes output row i NaN; a NaN or inf in ``k[b, g, j]`` or ``v[b, g, j]``
makes NaN every output row of the heads reading group g, masked or not (P_ij V_j with P_ij = 0
and V_j = inf is NaN, as in every matmul-based kernel). Gradients follow the same rule.

The additive mask gets no gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .emulation.formats import check_bool

__all__ = [
    "AttentionShape",
    "attention_backward",
    "attention_forward",
    "attention_ref",
    "check_attention_inputs",
    "check_causal",
    "expand_kv",
    "keep_mask",
    "mask_window",
    "reduce_kv",
    "scores",
]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class AttentionShape:
    """The validated sizes of one attention call."""

    batch: int
    heads: int
    kv_heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    head_dim_v: int
    scale: float

    @property
    def groups(self) -> int:
        """Query heads per key/value head (1: MHA; heads: MQA)."""
        return self.heads // self.kv_heads


def _check_scale(scale, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"scale must be a number, got a tensor of shape {tuple(scale.shape)}")
        scale = scale.item()
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float, got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale) or scale <= 0.0:
        raise ValueError(f"scale={scale!r} must be finite and positive")
    return scale


def check_causal(causal) -> bool:
    """``causal`` as a bool. Raises TypeError unless it is a bool or a numpy.bool_: a string
    ("yes", "False"), a number or a tensor would otherwise be taken by its truth value."""
    return check_bool(causal, "causal")


def check_attention_inputs(q, k, v, *, scale=None, mask=None, dout=None) -> AttentionShape:
    """Validate shapes, dtypes and the scale; return the sizes. Raises TypeError or ValueError
    with a message naming the offending values."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must have shape (batch, heads, seqlen, head_dim), got {tuple(t.shape)}"
            )
        if 0 in t.shape:
            raise ValueError(f"{name} has an empty dimension: shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    batch, heads, seqlen_q, head_dim = q.shape
    if k.shape[0] != batch or v.shape[0] != batch:
        raise ValueError(f"batch sizes differ: q {batch}, k {k.shape[0]}, v {v.shape[0]}")
    kv_heads, seqlen_k = k.shape[1], k.shape[2]
    if v.shape[1] != kv_heads or v.shape[2] != seqlen_k:
        raise ValueError(
            f"k and v must agree in (kv_heads, seqlen_k): k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if heads % kv_heads:
        raise ValueError(f"heads={heads} of q must be a multiple of kv_heads={kv_heads} of k and v")
    if k.shape[3] != head_dim:
        raise ValueError(f"head_dim of q ({head_dim}) and k ({k.shape[3]}) must be equal")
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"mask must be a torch.Tensor or None, got {type(mask).__name__}")
        if mask.dtype != torch.bool and mask.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"mask must be bool (True = attend) or floating (additive), got {mask.dtype}")
        target = (batch, heads, seqlen_q, seqlen_k)
        try:
            torch.broadcast_shapes(mask.shape, target)
            ok = mask.dim() <= 4 and torch.broadcast_shapes(mask.shape, target) == target
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to {target}")
        if mask.device != q.device:
            raise ValueError(f"mask is on {mask.device}, q on {q.device}")
    if dout is not None:
        expected = (batch, heads, seqlen_q, v.shape[3])
        if not isinstance(dout, torch.Tensor) or tuple(dout.shape) != expected:
            got = tuple(dout.shape) if isinstance(dout, torch.Tensor) else type(dout).__name__
            raise ValueError(f"dout must have the output's shape {expected}, got {got}")
    return AttentionShape(
        batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, v.shape[3], _check_scale(scale, head_dim)
    )


def mask_window(mask: torch.Tensor, rows: slice, cols: slice) -> torch.Tensor:
    """The (rows, cols) window of a mask broadcastable to (B, H, Nq, Nk); broadcast dims stay."""
    m = mask
    if m.dim() >= 2 and m.shape[-2] != 1:
        m = m[..., rows, :]
    if m.shape[-1] != 1:
        m = m[..., cols]
    return m


def keep_mask(seqlen_q: int, seqlen_k: int, *, causal: bool, mask=None, device=None,
              rows: slice | None = None, cols: slice | None = None):
    """Boolean "attend" mask of the (rows, cols) window from ``causal`` and a *boolean* mask,
    broadcastable to (B, H, rows, cols); None when every position is kept."""
    causal = check_causal(causal)
    rows = rows or slice(0, seqlen_q)
    cols = cols or slice(0, seqlen_k)
    keep = None
    if causal:
        i = torch.arange(rows.start, rows.stop, device=device)[:, None]
        j = torch.arange(cols.start, cols.stop, device=device)[None, :]
        keep = j <= i + (seqlen_k - seqlen_q)
    if mask is not None:
        if mask.dtype != torch.bool:
            raise TypeError("keep_mask takes a boolean mask; add an additive mask to the scores")
        m = mask_window(mask, rows, cols)
        keep = m if keep is None else keep & m
    return keep


def expand_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Repeat each key/value head for the ``groups`` query heads that read it (GQA): dim 1 of
    (B, Hkv, N, D) becomes H = Hkv * groups."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def reduce_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Sum the gradients of the query heads that share one key/value head."""
    if groups == 1:
        return t
    b, h, n, d = t.shape
    return t.view(b, h // groups, groups, n, d).sum(dim=2)


def scores(q64, k64, shape: AttentionShape, causal: bool, mask):
    """S = scale * Q Kᵀ (+ additive mask), masked positions -inf, from float64 ``q64`` (B, H, Nq,
    D) and ``k64`` (B, Hkv, Nk, D); float64 (B, H, Nq, Nk)."""
    s = shape.scale * (q64 @ expand_kv(k64, shape.groups).transpose(-1, -2))
    if mask is not None and mask.dtype != torch.bool:
        s = s + mask.to(torch.float64)
    keep = keep_mask(shape.seqlen_q, shape.seqlen_k, causal=causal,
                     mask=mask if mask is not None and mask.dtype == torch.bool else None,
                     device=s.device)
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    return s


def attention_forward(q, k, v, *, causal: bool = False, scale=None, mask=None):
    """Exact forward. Returns ``(out, lse)`` in float64: ``out = softmax(S) V``,
    ``lse_i = log sum_j exp(S_ij)`` (natural log; ``-inf`` for fully masked rows)."""
    causal = check_causal(causal)
    shape = check_attention_inputs(q, k, v, scale=scale, mask=mask)
    q64, k64, v64 = (t.to(torch.float64) for t in (q, k, v))
    s = scores(q64, k64, shape, causal, mask)
    m = s.amax(dim=-1, keepdim=True)
    m_safe = torch.where(m == float("-inf"), torch.zeros_like(m), m)  # fully masked rows
    e = torch.exp(s - m_safe)
    l = e.sum(dim=-1, keepdim=True)
    p = torch.where(l == 0, torch.zeros_like(e), e / l)  # l = 0: fully masked; NaN stays NaN
    out = p @ expand_kv(v64, shape.groups)
    lse = (m_safe + torch.log(l)).squeeze(-1)  # log(0) = -inf for fully masked rows
    return out, lse


def attention_backward(q, k, v, out, lse, dout, *, causal: bool = False, scale=None, mask=None):
    """Exact backward from the forward's ``out`` and ``lse``. Returns ``(dq, dk, dv)`` in float64.

    In the forward P = exp(S - lse), so now::

        dV = Pᵀ dO      dP = dO Vᵀ      D_i = sum_d dO_id O_id      dS = P ∘ (dP - D)
        dQ = scale dS K                 dK = scale dSᵀ Q
    """
    causal = check_causal(causal)
    shape = check_attention_inputs(q, k, v, scale=scale, mask=mask, dout=dout)
    q64, k64, v64 = (t.to(torch.float64) for t in (q, k, v))
    do64, o64 = dout.to(torch.float64), out.to(torch.float64)
    lse64 = lse.to(torch.float64)[..., None]
    s = scores(q64, k64, shape, causal, mask)
    # fully masked rows: lse = -inf; use +inf so that P = exp(-inf - inf) = 0
    lse_safe = torch.where(lse64 == float("-inf"), torch.full_like(lse64, float("inf")), lse64)
    p = torch.exp(s - lse_safe)
    kx, vx = expand_kv(k64, shape.groups), expand_kv(v64, shape.groups)
    dv = reduce_kv(p.transpose(-1, -2) @ do64, shape.groups)
    dp = do64 @ vx.transpose(-1, -2)
    delta = (do64 * o64).sum(dim=-1, keepdim=True)
    ds = p * (dp - delta)
    dq = shape.scale * (ds @ kx)
    dk = reduce_kv(shape.scale * (ds.transpose(-1, -2) @ q64), shape.groups)
    return dq, dk, dv


def attention_ref(q, k, v, dout=None, *, causal: bool = False, scale=None, mask=None):
    """Forward, and backward when ``dout`` is given: ``(out, lse)`` or ``(out, lse, dq, dk, dv)``.
    ``causal`` must be a bool (:func:`check_causal`)."""
    out, lse = attention_forward(q, k, v, causal=causal, scale=scale, mask=mask)
    if dout is None:
        return out, lse
    dq, dk, dv = attention_backward(q, k, v, out, lse, dout, causal=causal, scale=scale, mask=mask)
    return out, lse, dq, dk, dv
