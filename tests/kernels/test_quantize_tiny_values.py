"""The kernels' quantization of tiny values against ``dmref.emulation.quantize_blocked``.

The kernels' POW2_DOWN rule (``_common.pow2_down_exponent``) keeps k <= 126, so that 2**-k is a
normal float32; the emulation's scales go down to 2**-127. So the two agree code for code on
blocks whose amax is at least fmax * 2**-127 (2.6e-36 for E4M3, BF16 subnormal elements
included: in the interpreter these are read through ``_common.from_bf16``), and below that the
kernels' scale is 2**-126 where the emulation's is 2**-127 (docs/kernels.md, "What the kernels
compute").
"""

from __future__ import annotations

import pytest
import torch

from dmref.emulation import get_format
from kernel_inputs import require_backend

E4M3_MAX = get_format("float8_e4m3fn").max
#: the smallest block amax at which the kernels' scale is the emulation's (E4M3)
DOMAIN_AMAX = E4M3_MAX * 2.0**-127


def _block(amax: float, shape, seed: int = 0) -> torch.Tensor:
    """BF16 randn values of magnitude below ``amax`` (near the domain's edge, some of them below
    float32's normal range, 2**-126), with element (t, t mod D) of every head set to +-amax: so
    every scale block of the kernels (a token, a head, a channel, 128 tokens of a channel when
    the token count is a multiple of D) has exactly that amax."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x = x / x.abs().amax() * (amax * 0.99)
    n, d = shape[-2:]
    t = torch.arange(n)
    x[..., t, t % d] = torch.where(x[..., t, t % d] < 0, -amax, amax)
    x = x.to(torch.bfloat16)
    assert x.float()[..., t, t % d].abs().eq(torch.tensor(amax).to(torch.bfloat16).float()).all()
    return x


def _subnormal_fraction(x: torch.Tensor) -> float:
    xf = x.float()
    return ((xf != 0) & (xf.abs() < 2.0**-126)).double().mean().item()


@pytest.mark.parametrize("backend", ["interpreter", pytest.param("gpu", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("amax", [1.2 * DOMAIN_AMAX, 4 * DOMAIN_AMAX, 1e-30])
def test_folded_kv_codes_of_tiny_blocks_equal_the_emulation(backend, amax):
    device = require_backend(backend)  # before importing the kernels: it skips without triton
    from dmref.emulation import Block, quantize_blocked
    from dmref.kernels.quantize import quantize_kv_folded

    k = _block(amax, (1, 2, 192, 64), seed=1)
    v = _block(amax, (1, 2, 192, 64), seed=2)
    if amax < 1e-30:
        assert _subnormal_fraction(k) > 0  # BF16 subnormal elements in the block
    got = quantize_kv_folded(k.to(device), v.to(device))
    kc, ks = quantize_blocked(k.float().reshape(2, 192, 64), "float8_e4m3fn", block=Block.matrix(),
                              scale_rule="pow2_down")
    vc, vs = quantize_blocked(v.float().reshape(2, 192, 64), "float8_e4m3fn", block=Block.cols(),
                              scale_rule="pow2_down")
    assert torch.equal(got.k8.cpu().view(torch.uint8), torch.as_tensor(kc).to(torch.uint8))
    assert torch.equal(got.vt8.cpu().view(torch.uint8)[..., :192].transpose(1, 2), torch.as_tensor(vc).to(torch.uint8))
    assert torch.equal(got.k_scale.cpu(), torch.as_tensor(ks).reshape(2).float())
    assert torch.equal(got.v_scale.cpu(), torch.as_tensor(vs).reshape(2, 64).float())


@pytest.mark.parametrize("backend", ["interpreter", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_row_and_column_copies_of_tiny_values_equal_the_emulation(backend):
    device = require_backend(backend)  # before importing the kernels: it skips without triton
    from dmref.emulation import Block, quantize_blocked
    from dmref.kernels.quantize import quantize

    # one head per magnitude: at the domain's edge, and well inside it
    x = torch.cat([_block(1.2 * DOMAIN_AMAX, (1, 1, 192, 64), seed=3), _block(1e-33, (1, 1, 192, 64), seed=4)], 1)
    got, _ = quantize(x.to(device), "float8_e4m3fn", rows=True, cols=True)
    xf = x.float().reshape(2, 192, 64)
    rc, rs = quantize_blocked(xf, "float8_e4m3fn", block=Block.rows(), scale_rule="pow2_down")
    assert torch.equal(got.rows.cpu().view(torch.uint8), torch.as_tensor(rc).to(torch.uint8))
    assert torch.equal(got.row_scale.cpu(), torch.as_tensor(rs).reshape(2, 192).float())
    # the transposed copy: one scale per 128 tokens of one channel (the tail block padded with 0)
    padded = torch.nn.functional.pad(xf, (0, 0, 0, 256 - 192))
    cc, cs = quantize_blocked(padded, "float8_e4m3fn", block=Block(128, 1), scale_rule="pow2_down")
    assert torch.equal(got.cols.cpu().view(torch.uint8), torch.as_tensor(cc).to(torch.uint8).transpose(1, 2))
    assert torch.equal(got.col_scale.cpu(), torch.as_tensor(cs).reshape(2, 2, 64).float())


@pytest.mark.parametrize("backend", ["interpreter", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_below_the_domain_the_kernels_scale_stops_at_two_to_the_minus_126(backend):
    """The known departure: a block amax below fmax * 2**-127 gets the kernels' scale 2**-126,
    the emulation's 2**-127."""
    device = require_backend(backend)  # before importing the kernels: it skips without triton
    from dmref.emulation import Block, quantize_blocked
    from dmref.kernels.quantize import quantize_kv_folded

    k = _block(0.5 * DOMAIN_AMAX, (1, 1, 64, 64))
    got = quantize_kv_folded(k.to(device), k.to(device))
    _, ks = quantize_blocked(k.float().reshape(1, 64, 64), "float8_e4m3fn", block=Block.matrix(), scale_rule="pow2_down")
    assert float(torch.as_tensor(ks).reshape(-1)[0]) == 2.0**-127
    assert float(got.k_scale[0]) == 2.0**-126
