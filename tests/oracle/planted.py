"""Attention implementations for the oracle's tests: a correct FlashAttention-style one and the
same with one planted bug each, as small torch autograd Functions (imported by name: the
conftest beside this file puts this folder on sys.path; the ``dmref check`` test imports it in a
subprocess the same way).

``flash(q, k, v, *, causal, scale)``: forward and backward written out in float32 from inputs of
any dtype, O rounded to the input dtype and saved rounded (as FlashAttention-2 saves it), D from
that rounded O (a BF16-level stale delta, as in FlashAttention-2), gradients returned in the
input dtype. Bugs (``flash_<bug>``):

- ``stale_delta``: D from an E4M3 copy of O (one power-of-two scale per row), as cuDNN's FP8
  backward forms it, in an otherwise BF16-accurate implementation;
- ``bwd_scale``: the backward recomputes P with the default 1/sqrt(head_dim) instead of the
  forward's scale;
- ``bwd_causal``: the backward drops the causal mask;
- ``dk_transpose``: dK = scale dS Q instead of scale dSᵀ Q;

and ``naive_fp8_wrong_axis``: dmref's emulated ``naive_fp8`` except that K is quantized for
Q Kᵀ in 1x128 blocks along the sequence instead of along the head dim.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from dmref import emulation, recipes, tiled
from dmref.emulation import Block, dequantize_blocked, quantize_blocked

E4M3 = emulation.get_format("float8_e4m3fn")


def _causal_fill(s: torch.Tensor) -> torch.Tensor:
    nq, nk = s.shape[-2:]
    i = torch.arange(nq)[:, None]
    j = torch.arange(nk)[None, :]
    return s.masked_fill(j > i + (nk - nq), float("-inf"))


def _e4m3_rows(x: torch.Tensor) -> torch.Tensor:
    """x quantized to E4M3 with one power-of-two (pow2_down) scale per row."""
    codes, scales = quantize_blocked(x, E4M3, block=Block.rows(), scale_rule="pow2_down", saturate=True)
    return dequantize_blocked(codes, scales, E4M3, block=Block.rows()).to(x.dtype)


class _Flash(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, bug):
        q32, k32, v32 = (t.float() for t in (q, k, v))
        s = scale * (q32 @ k32.transpose(-1, -2))
        if causal:
            s = _causal_fill(s)
        lse = torch.logsumexp(s, dim=-1, keepdim=True)
        out = (torch.exp(s - lse) @ v32).to(q.dtype)  # O rounded to the input dtype, saved so
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale, ctx.bug = causal, scale, bug
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        bug = ctx.bug
        q32, k32, v32, o32, do32 = (t.float() for t in (q, k, v, out, dout))
        scale = 1.0 / math.sqrt(q.shape[-1]) if bug == "bwd_scale" else ctx.scale
        causal = ctx.causal and bug != "bwd_causal"
        # in the forward P = exp(S - lse), so now
        s = scale * (q32 @ k32.transpose(-1, -2))
        if causal:
            s = _causal_fill(s)
        p = torch.exp(s - lse)
        dv = p.transpose(-1, -2) @ do32
        dp = do32 @ v32.transpose(-1, -2)
        o_delta = _e4m3_rows(o32) if bug == "stale_delta" else o32
        delta = (do32 * o_delta).sum(-1, keepdim=True)
        ds = p * (dp - delta)
        dq = scale * (ds @ k32)
        dk = scale * (ds @ q32) if bug == "dk_transpose" else scale * (ds.transpose(-1, -2) @ q32)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def _make(bug):
    def fn(q, k, v, *, causal=False, scale=None):
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        return _Flash.apply(q, k, v, causal, scale, bug)

    fn.__name__ = fn.__qualname__ = "flash" if bug is None else f"flash_{bug}"
    return fn


flash = _make(None)
flash_stale_delta = _make("stale_delta")
flash_bwd_scale = _make("bwd_scale")
flash_bwd_causal = _make("bwd_causal")
flash_dk_transpose = _make("dk_transpose")

#: the planted bug -> (implementation, the check that must fail)
BUGS = {
    "stale_delta": (flash_stale_delta, "rowsum"),
    "bwd_scale": (flash_bwd_scale, "dq"),
    "bwd_causal": (flash_bwd_causal, "dq"),
    "dk_transpose": (flash_dk_transpose, "dk"),
}

_NAIVE_NO_K = replace(recipes.get_recipe("naive_fp8"), name="naive_fp8_k_prequantized", k=recipes.NONE)


def _k_along_sequence(k: torch.Tensor) -> torch.Tensor:
    """K quantized as naive_fp8 quantizes it (E4M3, 1x128 tiles, pow2_down) but with the tiles
    along the sequence (128 keys of one channel) instead of along the head dim."""
    block = Block.tile(128, 1)
    point = recipes.get_recipe("naive_fp8").k
    codes, scales = quantize_blocked(k.float(), point.fmt, block=block, scale_rule=point.scale_rule.value,
                                     saturate=point.saturate)
    # E4M3 values times power-of-two scales: exact in bfloat16 and wider
    return dequantize_blocked(codes, scales, point.fmt, block=block).to(k.dtype)


class _WrongAxis(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        k_hat = _k_along_sequence(k)
        fwd = tiled.forward(q, k_hat, v, recipe=_NAIVE_NO_K, causal=causal, scale=scale)
        ctx.save_for_backward(q, k, v, fwd.out, fwd.stats.ref, fwd.stats.l, fwd.stats.lse2)
        ctx.causal, ctx.scale = causal, scale
        return fwd.out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, ref, l, lse2 = ctx.saved_tensors
        fwd = tiled.ForwardResult(out, tiled.SoftmaxStats(ref, l, lse2))
        # the recompute sees the same wrongly blocked K; dS K quantizes K along the keys as the
        # recipe says (its blocks already are 128 keys of one channel: idempotent)
        bwd = tiled.backward(q, _k_along_sequence(k), v, fwd, dout.contiguous(), recipe=_NAIVE_NO_K,
                             causal=ctx.causal, scale=ctx.scale)
        return bwd.dq.to(q.dtype), bwd.dk.to(k.dtype), bwd.dv.to(v.dtype), None, None


def naive_fp8_wrong_axis(q, k, v, *, causal=False, scale=None):
    return _WrongAxis.apply(q, k, v, causal, scale)


def wrong_signature(q, k):
    """Not an attention: the CLI must say so."""
    return q
