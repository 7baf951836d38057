"""``dmref.attention``: emulated FP8 attention as a differentiable torch function.

The forward and the backward are those of :mod:`dmref.tiled` for the given recipe, so a small
model can be trained with the exact numerics a recipe describes (on CPU or CUDA: everything is
torch code). Gradients are returned in the dtype of each input. Autocast is switched off
inside (forward and backward): under ``torch.autocast`` the recipe's float32 matmuls would
otherwise run in the autocast dtype, and the numbers would no longer be the recipe's.
"""

from __future__ import annotations

import torch

from . import tiled
from .recipes import Recipe, get_recipe
from .reference import check_causal

__all__ = ["attention"]


class _EmulatedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, causal, scale, recipe):
        with torch.autocast(q.device.type, enabled=False):
            fwd = tiled.forward(q, k, v, recipe=recipe, causal=causal, scale=scale, mask=mask)
        ctx.save_for_backward(q, k, v, fwd.out, fwd.stats.ref, fwd.stats.l, fwd.stats.lse2, mask)
        ctx.causal, ctx.scale, ctx.recipe = causal, scale, recipe
        return fwd.out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, ref, l, lse2, mask = ctx.saved_tensors
        fwd = tiled.ForwardResult(out, tiled.SoftmaxStats(ref, l, lse2))
        with torch.autocast(q.device.type, enabled=False):
            bwd = tiled.backward(q, k, v, fwd, dout.contiguous(), recipe=ctx.recipe, causal=ctx.causal,
                                 scale=ctx.scale, mask=mask)
        return bwd.dq.to(q.dtype), bwd.dk.to(k.dtype), bwd.dv.to(v.dtype), None, None, None, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              scale: float | None = None, mask: torch.Tensor | None = None,
              recipe: Recipe | str = "exact") -> torch.Tensor:
    """Softmax attention whose forward and backward follow ``recipe``.

    Args:
        q: ``(batch, heads, seqlen_q, head_dim)``, float16 / bfloat16 / float32 / float64.
        k: ``(batch, kv_heads, seqlen_k, head_dim)``; ``heads`` a multiple of ``kv_heads``.
        v: ``(batch, kv_heads, seqlen_k, head_dim_v)``.
        causal: True or False (a bool or numpy.bool_; anything else is a TypeError): keep key j
            for query i iff ``j <= i + seqlen_k - seqlen_q``.
        scale: softmax scale; default ``1 / sqrt(head_dim)``.
        mask: boolean (True = attend) or additive, broadcastable to
            ``(batch, heads, seqlen_q, seqlen_k)``; it gets no gradient.
        recipe: a :class:`~dmref.recipes.Recipe` or a preset name (``"exact"``, ``"bf16"``,
            ``"naive_fp8"``, ``"cudnn_fp8"``, ``"mxfp8_stale"``, ``"delta_matching"``,
            ``"consistent_p"``, ``"fp32"``; ``"name@model"`` for another accumulation model).

    Returns:
        ``(batch, heads, seqlen_q, head_dim_v)`` in q's dtype. Fully masked rows are zero and
        get zero gradients. Non-finite inputs propagate (see :mod:`dmref.tiled`).

    Raises:
        TypeError / ValueError: bad shapes, dtypes, devices, mask, scale or causal, unknown
            recipe (messages name the values).
    """
    causal = check_causal(causal)
    recipe = get_recipe(recipe)
    if mask is not None and isinstance(mask, torch.Tensor) and mask.requires_grad:
        mask = mask.detach()
    return _EmulatedAttention.apply(q, k, v, mask, causal, scale, recipe)
