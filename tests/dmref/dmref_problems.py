"""Shared by the tests of tests/dmref (imported by name: pytest puts this folder on sys.path).

Hypothesis strategies for attention problems: shapes with tails and length 1, causal, GQA/MQA,
boolean and additive masks (with fully masked rows), and the activation statistics of
dmref.demo (outlier channels, a sink key, peaked rows)."""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

from dmref import emulation


@st.composite
def attention_shapes(draw, max_seqlen: int = 40, max_head_dim: int = 24, max_batch: int = 2):
    kv_heads = draw(st.integers(1, 2))
    groups = draw(st.sampled_from([1, 2, 3]))
    return dict(
        batch=draw(st.integers(1, max_batch)),
        heads=kv_heads * groups,
        kv_heads=kv_heads,
        seqlen_q=draw(st.one_of(st.just(1), st.integers(1, max_seqlen))),
        seqlen_k=draw(st.one_of(st.just(1), st.integers(1, max_seqlen))),
        head_dim=draw(st.integers(1, max_head_dim)),
        head_dim_v=draw(st.integers(1, max_head_dim)),
    )


@st.composite
def masks(draw, shape: dict):
    """None, a boolean mask, or an additive mask (finite values and -inf), broadcastable to
    (B, H, Nq, Nk); rows may be fully masked."""
    kind = draw(st.sampled_from(["none", "bool", "additive"]))
    if kind == "none":
        return None
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    full = draw(st.booleans())
    lead = (shape["batch"], shape["heads"]) if full else (1, 1)
    size = (*lead, shape["seqlen_q"], shape["seqlen_k"])
    keep = torch.rand(size, generator=g) < draw(st.sampled_from([0.3, 0.7, 1.0]))
    if kind == "bool":
        return keep
    values = torch.randn(size, generator=g, dtype=torch.float64) * 2
    return torch.where(keep, values, torch.full_like(values, -math.inf))


def make_inputs(shape: dict, seed: int, *, dtype=torch.float64, bf16_values: bool = True):
    """q, k, v, dout with the given shape; values representable in bfloat16 (so that every
    precision sees the same inputs), stored as ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    b, h, hk = shape["batch"], shape["heads"], shape["kv_heads"]
    nq, nk, d, dv = shape["seqlen_q"], shape["seqlen_k"], shape["head_dim"], shape["head_dim_v"]
    tensors = (
        torch.randn(b, h, nq, d, generator=g),
        torch.randn(b, hk, nk, d, generator=g),
        torch.randn(b, hk, nk, dv, generator=g),
        torch.randn(b, h, nq, dv, generator=g),
    )
    if bf16_values:
        tensors = tuple(emulation.quantize(t, "bfloat16") for t in tensors)
    return tuple(t.to(dtype) for t in tensors)
