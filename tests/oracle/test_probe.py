"""The black-box row-sum probe (dmref.oracle.probe): its input preparation keeps every quantizer's
scales, it reads a planted delta back, it reads the emulated recipes' own residual from outside,
and it refuses a quantizer that moves."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dmref import emulation, oracle, probe, recipes, tiled
from dmref.diagnostics import matched_rowsum_bound
from dmref.emulation import Block, dequantize_blocked, quantize_blocked

U64 = 2.0**-53


# ----------------------------------------------------------------------------------------------
# prepare(): K + 1 cᵀ is exactly K^ + 1 c^ᵀ under every block quantizer of 16+ aligned channels
# ----------------------------------------------------------------------------------------------

_QUANTIZERS = [
    ("float8_e4m3fn", "1x16", "pow2_down"),
    ("float8_e4m3fn", "1x128", "pow2_down"),
    ("float8_e4m3fn", "mx32", "mx_nvidia"),
    ("float8_e4m3fn", "mx32", "mx_ocp"),
    ("float8_e5m2", "mx32", "mx_nvidia"),
    ("float8_e4m3fn", "row", "pow2_down"),
    ("float8_e4m3fn", "128x128", "pow2_down"),
    ("float8_e4m3fn", "tensor", "amax"),  # cuDNN's per-tensor current scaling
    ("float8_e5m2", "tensor", "amax"),
    ("float8_e4m3fn", "128x1", "pow2_down"),  # blocks along the keys (K for dS K)
    ("float8_e4m3fn", "col", "amax"),  # a non-power-of-two scale per channel over all keys
]


def _dequantized(k, fmt, block, rule):
    codes, scales = quantize_blocked(k, fmt, block=block, scale_rule=rule, saturate=True)
    return dequantize_blocked(codes, scales, fmt, block=block)


@pytest.mark.parametrize("fmt,block,rule", _QUANTIZERS)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 200), log2_mag=st.integers(-12, 12))
@settings(max_examples=15)
def test_shifted_keys_quantize_to_the_quantized_keys_plus_the_shift(fmt, block, rule, seed, n, log2_mag):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, 8, 64, generator=g).to(torch.bfloat16)
    k = (torch.randn(1, 2, n, 64, generator=g) * 2.0**log2_mag).to(torch.bfloat16)
    _, k0, setup = probe.prepare(q, k)
    k1 = setup.shifted(k0)
    base = _dequantized(k0.float(), fmt, block, rule)
    moved = _dequantized(k1.float(), fmt, block, rule)
    others = [d for d in range(64) if d not in setup.channels]
    assert torch.equal(moved[..., others], base[..., others])  # no other element moved
    for d in setup.channels:
        c = setup.shift[d].item()
        col = moved[..., d]
        assert bool((col == col.flatten()[0]).all())  # one value for every key: a rank-one shift
        # c^ = c (1 + eps): eps = 0 for power-of-two scales, |eps| <= 2^-24 for RN32(c / max)
        assert abs(col.flatten()[0].item() - c) <= 2.0**-24 * c
        assert bool((base[..., d] == 0).all())


def test_shifts_have_two_significant_bits_and_a_ratio_that_is_not_a_power_of_two():
    g = torch.Generator().manual_seed(1)
    _, _, setup = probe.prepare(torch.randn(1, 1, 4, 64, generator=g), torch.randn(1, 1, 9, 64, generator=g))
    a, b = (setup.shift[d].item() for d in setup.channels)
    for c in (a, b):
        m, _ = math.frexp(c)
        assert (m * 4) == int(m * 4)  # two significant bits
    assert not math.log2(a / b).is_integer()


# ----------------------------------------------------------------------------------------------
# Known delta, planted in an exact implementation: read back to float64 accuracy, and to the
# output dtype's unit roundoff
# ----------------------------------------------------------------------------------------------


def _causal_scores(s: torch.Tensor, causal: bool) -> torch.Tensor:
    if not causal:
        return s
    keep = torch.ones(s.shape[-2:], dtype=torch.bool).tril(s.shape[-1] - s.shape[-2])
    return s.masked_fill(~keep, -math.inf)


class _PlantedDelta(torch.autograd.Function):
    """Exact attention in float64 whose backward uses D_i + delta_i (outputs in the input dtype);
    GQA: query head h reads key/value head h // groups, dK and dV summed over each group."""

    @staticmethod
    def forward(ctx, q, k, v, scale, causal, delta):
        groups = q.shape[1] // k.shape[1]
        q64 = q.double()
        k64, v64 = (t.double().repeat_interleave(groups, dim=1) for t in (k, v))
        p = torch.softmax(_causal_scores(scale * q64 @ k64.transpose(-1, -2), causal), dim=-1)
        out = p @ v64
        ctx.save_for_backward(q64, k64, v64, p, out, delta)
        ctx.scale, ctx.dtype, ctx.groups = scale, q.dtype, groups
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, p, out, delta = ctx.saved_tensors
        do = dout.double()
        dp = do @ v.transpose(-1, -2)
        d = (do * out).sum(-1, keepdim=True) + delta[..., None]
        ds = p * (dp - d)
        dq, dk, dv = ctx.scale * ds @ k, ctx.scale * ds.transpose(-1, -2) @ q, p.transpose(-1, -2) @ do
        b, h, n, dim = dk.shape
        dk, dv = (t.view(b, h // ctx.groups, ctx.groups, n, -1).sum(dim=2) for t in (dk, dv))
        return dq.to(ctx.dtype), dk.to(ctx.dtype), dv.to(ctx.dtype), None, None, None


@pytest.mark.parametrize("name", ["realistic", "gqa"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_probe_recovers_a_planted_delta_to_the_output_precision(dtype, name):
    """Also under GQA (the gqa case: 8 query heads on 2 key/value heads, causal): the null
    channels are zero in every query and key/value head, the shift reaches every query head's dQ
    through its group's keys, and each query head's delta is read back separately."""
    case = oracle.make_cases("quick", dtype=dtype, names=[name])[0]
    g = torch.Generator().manual_seed(7)
    ex = oracle.exact_reference(case)
    delta = torch.randn(ex.abs_pdp.shape, generator=g, dtype=torch.float64) * ex.abs_pdp * 0.1

    def fn(q, k, v, *, causal, scale):
        return _PlantedDelta.apply(q, k, v, scale, causal, delta)

    s_bound = 2 * (ex.abs_ds + delta.abs())
    pr = probe.run_probe(fn, case.q, case.k, case.v, case.dout, case.probe, causal=case.causal, scale=case.scale,
                         abs_ds_bound=s_bound, u_acc=U64)
    assert pr.valid
    assert pr.residual.shape == case.q.shape[:-1]  # one reading per query head and row
    # the implementation's own residual: sum_j P_ij (dP_ij - D_i) = -delta_i sigma_i up to float64
    # rounding of n + d + 4 chained operations on terms bounded by s_bound
    own = probe.accumulation_bound(2 * case.k.shape[-2] + case.q.shape[-1] + 4, U64) * s_bound
    err = (pr.residual + delta).abs()
    # the stated accuracy: the probe's bound (relative (2 u_acc + u_out + 2^-24) of the reading,
    # plus gamma_n(u_acc) S_i) plus the implementation's own float64 residual
    assert bool((err <= pr.error_bound + own).all())


# ----------------------------------------------------------------------------------------------
# From outside, the probe reads what dmref.tiled reports from inside, for every preset
# ----------------------------------------------------------------------------------------------

_PRESETS = ["bf16", "naive_fp8", "cudnn_fp8", "mxfp8_stale", "delta_matching", "consistent_p"]


@pytest.fixture(scope="module")
def probe_cases():
    # GQA: the probe's channels are null in every key/value head; the additive mask (with fully
    # masked rows) reaches fn, the probe's second run and dmref.tiled alike
    return oracle.make_cases("quick", dtype=torch.float32, names=["realistic_causal", "tail_lengths", "gqa",
                                                                  "additive_mask"])


@pytest.mark.parametrize("recipe", _PRESETS)
def test_probe_reads_the_emulated_recipes_residual_from_outside(recipe, probe_cases):
    for case in probe_cases:
        ex = oracle.exact_reference(case)
        pr = probe.run_probe(oracle.emulated(recipe), case.q, case.k, case.v, case.dout, case.probe,
                             causal=case.causal, scale=case.scale, mask=case.mask, abs_ds_bound=2 * ex.abs_ds)
        assert pr.valid, pr.invariance_detail
        _, bwd = tiled.attention(case.q, case.probe.shifted(case.k), case.v, case.dout, recipe=recipe,
                                 causal=case.causal, scale=case.scale, mask=case.mask, diagnostics=True)
        inside = bwd.rowsum.residual_dq
        assert bool(((pr.residual - inside).abs() <= pr.error_bound).all())


def test_probe_recovers_the_known_stale_delta_of_an_fp8_recipe(probe_cases):
    """naive_fp8 with dS left unquantized: its stale D differs from the matched D of the very
    same P and dP^ by a known delta_i (white box: the two recipes' D); from outside the probe
    reads -delta_i sigma_i, to within its own bound plus the matched residual's FP32 bound."""
    stale = replace(recipes.get_recipe("naive_fp8"), name="stale_fp32_ds", ds_dq=recipes.NONE, ds_dk=recipes.NONE)
    matched = replace(stale, name="matched_fp32_ds", delta=recipes.MATCHED)
    for case in probe_cases:
        k1 = case.probe.shifted(case.k)
        _, b_stale = tiled.attention(case.q, k1, case.v, case.dout, recipe=stale, causal=case.causal,
                                     scale=case.scale, mask=case.mask, diagnostics=True)
        _, b_matched = tiled.attention(case.q, k1, case.v, case.dout, recipe=matched, causal=case.causal,
                                       scale=case.scale, mask=case.mask, diagnostics=True)
        rs_m = b_matched.rowsum
        delta = b_stale.rowsum.delta - rs_m.delta  # the planted-by-the-recipe stale delta
        ex = oracle.exact_reference(case)
        pr = probe.run_probe(oracle.emulated(stale), case.q, case.k, case.v, case.dout, case.probe,
                             causal=case.causal, scale=case.scale, mask=case.mask, abs_ds_bound=2 * ex.abs_ds)
        assert pr.valid
        active = rs_m.abs_pdp > 0
        # the delta is real: far above the matched bound on most rows
        assert (delta.abs()[active] > matched_rowsum_bound(rs_m)[active]).float().mean() > 0.5
        expected = -delta * rs_m.psum
        assert bool(((pr.residual - expected).abs() <= pr.error_bound + matched_rowsum_bound(rs_m)).all())


# ----------------------------------------------------------------------------------------------
# A quantizer that rounds the shift makes the probe refuse, not misread
# ----------------------------------------------------------------------------------------------


class _PerKeyAmaxK(torch.autograd.Function):
    """Float32 attention whose K is first rounded to E4M3 with one non-power-of-two (amax)
    scale per key: the shift c_d is rounded differently for every key."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        codes, scales = quantize_blocked(k.float(), "float8_e4m3fn", block=Block.rows(), scale_rule="amax")
        k_hat = dequantize_blocked(codes, scales, "float8_e4m3fn", block=Block.rows()).float()
        p = torch.softmax(scale * q.float() @ k_hat.transpose(-1, -2), dim=-1)
        ctx.save_for_backward(q.float(), k_hat, v.float(), p)
        ctx.scale = scale
        return (p @ v.float()).to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, p = ctx.saved_tensors
        do = dout.float()
        dp = do @ v.transpose(-1, -2)
        ds = p * (dp - (p * dp).sum(-1, keepdim=True))
        return ctx.scale * ds @ k, ctx.scale * ds.transpose(-1, -2) @ q, p.transpose(-1, -2) @ do, None


def test_probe_refuses_a_quantizer_that_rounds_the_shift():
    case = oracle.make_cases("quick", dtype=torch.float32, names=["realistic"])[0]

    def fn(q, k, v, *, causal, scale):
        return _PerKeyAmaxK.apply(q, k, v, scale)

    ex = oracle.exact_reference(case)
    pr = probe.run_probe(fn, case.q, case.k, case.v, case.dout, case.probe, scale=case.scale,
                         abs_ds_bound=2 * ex.abs_ds)
    assert not pr.consistent and not pr.valid


def test_prepare_rejects_head_dims_below_one_group():
    with pytest.raises(ValueError, match="head_dim >= 16"):
        probe.prepare(torch.zeros(1, 1, 2, 8), torch.ones(1, 1, 2, 8))


def test_unit_roundoff_of_matches_the_formats():
    for dtype, name in ((torch.bfloat16, "bfloat16"), (torch.float16, "float16")):
        assert probe.unit_roundoff_of(dtype) == emulation.get_format(name).unit_roundoff
    assert probe.unit_roundoff_of(torch.float32) == torch.finfo(torch.float32).eps / 2
