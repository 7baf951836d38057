"""A FlashAttention-2-style attention written out here in float32 (online softmax over key tiles
of 64, the LSE saved, P recomputed from it in the backward, D from the output rounded to the
input dtype, every result rounded once to the input dtype), in either causal alignment and with
no ``causal_alignment`` attribute: the oracle must find the alignment itself. The same with one
planted bug each, which inference must not turn into a pass:

- ``dk_scale``: dK without the softmax scale (dSᵀ Q instead of tau dSᵀ Q);
- ``dropped_tile``: the second key tile (keys 64 to 127) left out, forward and backward;
- ``lse_bf16``: the LSE saved in bfloat16, so the backward's P is off by a factor per row;
- ``no_rescale``: the running sum of P V not rescaled when the row maximum grows;
- ``dq_rounded_twice``: dQ summed over the two halves of the keys with the first half's sum
  rounded to the input dtype, then rounded again (the row-sum probe cannot vouch for its
  reading; every error check passes);

and ``mixed``: bottom-right when seqlen_k > seqlen_q, top-left when seqlen_q > seqlen_k (follows
neither convention). Imported by name (the conftest beside this file puts this folder on
sys.path; ``dmref check aligned:bottom_right`` with it on PYTHONPATH).
"""

from __future__ import annotations

import math

import torch

TILE = 64


def _keep(nq: int, nk: int, alignment: str) -> torch.Tensor:
    """The causal "attend" mask: top-left (j <= i) or bottom-right (j <= i + nk - nq)."""
    if alignment == "mixed":
        alignment = "bottom_right" if nk > nq else "top_left"
    return torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq if alignment == "bottom_right" else 0)


def _scores(q32, k32, causal, scale, alignment, bug):
    s = scale * (q32 @ k32.transpose(-1, -2))
    nq, nk = s.shape[-2:]
    if causal:
        s = s.masked_fill(~_keep(nq, nk, alignment), -math.inf)
    if bug == "dropped_tile" and nk > TILE:
        s[..., TILE:2 * TILE] = -math.inf
    return s


class _Flash(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, alignment, bug):
        q32, k32, v32 = q.float(), k.float(), v.float()
        s = _scores(q32, k32, causal, scale, alignment, bug)
        m = torch.full(s.shape[:-1] + (1,), -math.inf)
        l = torch.zeros_like(m)
        acc = torch.zeros(*s.shape[:-1], v.shape[-1])
        for j in range(0, s.shape[-1], TILE):  # the online softmax over key tiles
            sb = s[..., j:j + TILE]
            m_new = torch.maximum(m, sb.amax(-1, keepdim=True))
            m_safe = torch.where(torch.isinf(m_new), 0.0, m_new)
            p = torch.exp(sb - m_safe)
            alpha = torch.exp(m - m_safe)
            l = alpha * l + p.sum(-1, keepdim=True)
            acc_alpha = torch.where(torch.isinf(m), 0.0, 1.0) if bug == "no_rescale" else alpha
            acc = acc_alpha * acc + p @ v32[..., j:j + TILE, :]
            m = m_new
        out32 = torch.where(l > 0, acc / torch.where(l > 0, l, 1.0), 0.0)  # rows with no key: zero
        lse = torch.where(l > 0, m + torch.log(torch.where(l > 0, l, 1.0)), -math.inf)
        if bug == "lse_bf16":
            lse = lse.to(torch.bfloat16).float()
        out = out32.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale, ctx.alignment, ctx.bug = causal, scale, alignment, bug
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        bug, scale = ctx.bug, ctx.scale
        q32, k32, v32, do32 = q.float(), k.float(), v.float(), dout.float()
        s = _scores(q32, k32, ctx.causal, scale, ctx.alignment, bug)
        p = torch.exp(s - torch.where(torch.isinf(lse), math.inf, lse))
        dv = p.transpose(-1, -2) @ do32
        dp = do32 @ v32.transpose(-1, -2)
        delta = (do32 * out.float()).sum(-1, keepdim=True)
        ds = p * (dp - delta)
        if bug == "dq_rounded_twice":
            half = k.shape[-2] // 2
            first = (scale * (ds[..., :half] @ k32[..., :half, :])).to(q.dtype).float()
            dq = first + scale * (ds[..., half:] @ k32[..., half:, :])
        else:
            dq = scale * (ds @ k32)
        dk = ds.transpose(-1, -2) @ q32
        if bug != "dk_scale":
            dk = scale * dk
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def _make(alignment: str, bug: str | None = None):
    def fn(q, k, v, *, causal=False, scale=None):
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        return _Flash.apply(q, k, v, causal, scale, alignment, bug)

    fn.__name__ = fn.__qualname__ = alignment + (f"_{bug}" if bug else "")
    return fn


top_left = _make("top_left")
bottom_right = _make("bottom_right")
mixed = _make("mixed")

#: planted bug -> (the bug in a bottom-right implementation, what is wrong)
BUGS = {
    "dk_scale": (_make("bottom_right", "dk_scale"), "dK without the softmax scale"),
    "dropped_tile": (_make("bottom_right", "dropped_tile"), "keys 64 to 127 left out"),
    "lse_bf16": (_make("bottom_right", "lse_bf16"), "the LSE saved in bfloat16"),
    "no_rescale": (_make("bottom_right", "no_rescale"), "the running sum not rescaled when the maximum grows"),
}
bottom_right_lse_bf16 = BUGS["lse_bf16"][0]
top_left_dq_rounded_twice = _make("top_left", "dq_rounded_twice")
