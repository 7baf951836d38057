"""dmref.emulation.matmul refuses arguments it cannot honour with one ValueError or TypeError
that names the value: a scale format as an operand format, a block-scale K extent that is not a
positive int, and a c that does not broadcast to the result."""

from __future__ import annotations

import re

import pytest
import torch

from dmref.emulation import FORMATS, matmul

_A = torch.full((4, 64), 0x38, dtype=torch.uint8)  # E4M3 1.0
_ONE = torch.ones((), dtype=torch.float32)
_SCALE_FORMATS = sorted(f.name for f in FORMATS.values() if f.bits == 8 and (not f.signed or not f.has_zero))


def test_the_scale_formats_are_known():
    assert _SCALE_FORMATS == ["float8_e8m0fnu"]


@pytest.mark.parametrize("fmt", [*_SCALE_FORMATS, "e8m0"])
@pytest.mark.parametrize("operand", ["fa", "fb"])
def test_a_scale_format_is_refused_as_an_operand_format(fmt, operand):
    formats = {"fa": "e4m3", "fb": "e4m3", operand: fmt}
    with pytest.raises(ValueError, match=rf"^{operand}=float8_e8m0fnu: .* it is a scale format"):
        matmul(_A, _A, **formats)


@pytest.mark.parametrize("model", ["hopper", "fp32", "exact"])
@pytest.mark.parametrize("bad", [0, -128])
def test_a_non_positive_scale_block_k_is_refused(model, bad):
    for scales in ({}, {"scale_a": _ONE, "scale_b": _ONE}):
        with pytest.raises(ValueError, match=rf"^scale_block_k={bad} must be positive"):
            matmul(_A, _A, fa="e4m3", fb="e4m3", model=model, scale_block_k=bad, **scales)


@pytest.mark.parametrize("bad", [1.5, 128.0, True, "128"])
def test_a_scale_block_k_that_is_not_an_int_is_refused(bad):
    with pytest.raises(TypeError, match=r"^scale_block_k must be an int .*got " + re.escape(repr(bad))):
        matmul(_A, _A, fa="e4m3", fb="e4m3", scale_a=_ONE, scale_b=_ONE, scale_block_k=bad)


def test_a_scale_block_k_off_the_k_step_is_refused_under_hopper():
    with pytest.raises(ValueError, match=r"^scale_block_k=48 must be a multiple of the k-step 32"):
        matmul(_A, _A, fa="e4m3", fb="e4m3", scale_a=_ONE, scale_b=_ONE, scale_block_k=48)
    # the fp32 model sums each block exactly once: any positive extent is a schedule
    matmul(_A, _A, fa="e4m3", fb="e4m3", model="fp32", scale_a=_ONE, scale_b=_ONE, scale_block_k=48)


@pytest.mark.parametrize("shape", [(3, 3), (4, 5), (2, 4, 4), (4,) * 3])
def test_c_of_a_shape_that_does_not_broadcast_is_refused(shape):
    with pytest.raises(ValueError, match="^" + re.escape(f"c has shape {tuple(shape)}; expected the result's shape (4, 4)")):
        matmul(_A, _A, torch.zeros(shape), fa="e4m3", fb="e4m3")


@pytest.mark.parametrize("shape", [(), (1,), (4, 1), (1, 4), (4, 4)])
def test_c_that_broadcasts_is_added_to_every_element(shape):
    base = matmul(_A, _A, fa="e4m3", fb="e4m3")
    out = matmul(_A, _A, torch.full(shape, 2.0), fa="e4m3", fb="e4m3")
    assert torch.equal(out, base + 2)  # 64 + 2 is exact in float32
