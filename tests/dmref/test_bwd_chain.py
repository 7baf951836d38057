"""``Recipe.bwd_chain``: the chained backward of ``dmref.tiled`` (dV, dK, dQ and the deferred dQ's
kbar each one wgmma chain across the tiles, dS against a running scale).

- Under the ``hopper`` model the reference's dQ, dK and dV equal, bit for bit, a direct loop in the
  kernels' units and order: per key/value head, its query heads one after another and 64 queries
  a tile (dK, dV), 64 keys a tile (dQ, kbar); the accumulator in code units, rescaled by
  2^max(drop, -126) when a row's running exponent drops, the emulated wgmma with it fed in; on
  inputs whose token magnitudes span 2^-12 .. 2^12 (so the running scale drops mid-chain),
  with GQA, tails and causal masks (all-zero tiles).
- A recipe that cannot chain says why.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from dmref import tiled
from dmref.emulation import gemm
from dmref.emulation.blocked import scales_from_amax
from dmref.kernels.config import RECIPES
from dmref.recipes import Granularity, QuantPoint, ScaleRule


def _inputs(b, h, hkv, n, d, seed):
    g = torch.Generator().manual_seed(seed)
    spread = lambda heads: torch.exp2(torch.empty(b, heads, n, 1).uniform_(-12, 12, generator=g))  # noqa: E731
    q = torch.randn(b, h, n, d, generator=g) * 0.3
    k = torch.randn(b, hkv, n, d, generator=g) * 0.3
    v = torch.randn(b, hkv, n, d, generator=g) * spread(hkv)
    do = torch.randn(b, h, n, d, generator=g) * spread(h)
    return [t.bfloat16().float() for t in (q, k, v, do)]


def _running_chain(rows, b_deq, tile=64, running=True):
    """The kernels' chain, written out: rows (R, K) float, b_deq (K, C) exact FP8 values times one
    power of two per column; returns sum over K of Q(rows) b in float32."""
    r, kk = rows.shape
    b_amax = b_deq.abs().amax(0)
    b_s = scales_from_amax(b_amax, "float8_e4m3fn", "pow2_down").float()
    b_codes = (b_deq / b_s).T.contiguous()
    acc = torch.zeros(r, b_deq.shape[1])
    k_run = torch.full((r, 1), 126.0)
    for c0 in range(0, kk, tile):
        x = rows[:, c0:c0 + tile]
        if running:
            amax = x.abs().amax(-1, keepdim=True)
            k_t = -torch.log2(scales_from_amax(amax, "float8_e4m3fn", "pow2_down").float())
            k_new = torch.where(amax > 0, torch.minimum(k_run, k_t), k_run)
            acc = acc * torch.exp2((k_new - k_run).clamp(min=-126))
            k_run = k_new
            codes = (x * torch.exp2(k_run)).to(torch.float8_e4m3fn).float()
        else:
            codes = x.to(torch.float8_e4m3fn).float()
        acc = gemm.matmul(codes.contiguous(), b_codes[:, c0:c0 + tile].contiguous(), acc.contiguous(),
                          fa="e4m3", fb="e4m3", model="hopper")
    return acc * (torch.exp2(-k_run) if running else 1.0) * b_s


@pytest.mark.parametrize("causal,delta", [(True, "kernels_chained_delta_matching"), (False, "kernels_chained_naive_fp8")])
def test_the_chained_backward_is_the_kernels_loop_in_their_units(causal, delta):
    b, h, hkv, n, d = 1, 4, 2, 150, 32
    g = h // hkv
    q, k, v, do = _inputs(b, h, hkv, n, d, seed=1 if causal else 2)
    recipe = RECIPES[delta].reference_recipe("hopper")
    assert recipe.bwd_chain
    scale = 1 / math.sqrt(d)
    fwd, bwd = tiled.attention(q, k, v, do, recipe=recipe, causal=causal, scale=scale)
    # the reference's own P, dP and D (tested elsewhere), whole rows at once
    pb = tiled._problem(q, k, v, recipe, causal, scale, None, dout=do)
    ops = tiled._backward_operands(pb, q, k, v, do)
    x = tiled._logits(pb, ops.q_hat, ops.k_hat, 0, 0, n, recipe.accumulation.qk_bwd)
    p = tiled._backward_p(pb, fwd.stats)(x, 0)
    dp = tiled._matmul(ops.do_dp, ops.v_dp.transpose(-1, -2), recipe.accumulation.dp, torch.float32,
                       (recipe.do_dp, recipe.v_dp))
    deferred = recipe.delta.deferred_dq
    d_stale = (do * fwd.out).sum(-1, keepdim=True)
    if deferred is not None:
        # the matched D as the reference forms it, key tile by key tile (its sweep order)
        d_matched = sum((p[..., j0:j0 + 128] * dp[..., j0:j0 + 128]).sum(-1, keepdim=True) for j0 in range(0, n, 128))
    delta = d_matched if deferred is not None else d_stale
    ds = p * (dp - delta)
    ds_q = p * (dp - d_stale) if deferred is not None else ds
    pad = -(-n // 64) * 64
    for bi in range(b):
        for kv in range(hkv):
            heads = range(kv * g, (kv + 1) * g)
            # dK, dV: one chain per key over the group's queries, each head padded to 64
            cat = lambda t: torch.cat([torch.nn.functional.pad(t[bi, hh], (0, 0, 0, pad - n)) for hh in heads])  # noqa: E731
            want_dv = _running_chain(cat(p * 2.0**8).T, cat(ops.do_dv), running=False) / 2.0**8
            want_dk = _running_chain(cat(ds).T, cat(ops.q_dk)) * scale
            assert torch.equal(bwd.dv[bi, kv].view(torch.int32), want_dv.view(torch.int32))
            assert torch.equal(bwd.dk[bi, kv].view(torch.int32), want_dk.view(torch.int32))
            for hh in heads:
                want_dq = _running_chain(ds_q[bi, hh], ops.k_dq[bi, hh])
                if deferred is not None:
                    kbar = _running_chain(p[bi, hh] * 2.0**deferred.p_offset_log2, ops.k_dq[bi, hh], running=False)
                    want_dq = want_dq - (delta - d_stale)[bi, hh] * (kbar / 2.0**deferred.p_offset_log2)
                want_dq = want_dq * scale
                assert torch.equal(bwd.dq[bi, hh].view(torch.int32), want_dq.view(torch.int32)), hh


def test_a_recipe_that_cannot_chain_says_why():
    recipe = RECIPES["kernels_chained_delta_matching"].recipe
    tile = QuantPoint("float8_e4m3fn", Granularity.TILE_1x128, ScaleRule.POW2_DOWN)
    with pytest.raises(ValueError, match="bwd_chain: q_dk"):
        dataclasses.replace(recipe, q_dk=tile)
    with pytest.raises(ValueError, match="bwd_chain: ds_dq"):
        dataclasses.replace(recipe, ds_dq=QuantPoint("float8_e4m3fn", Granularity.TILE_1x128, ScaleRule.POW2_DOWN))
    assert "chained across tiles" in recipe.describe()
