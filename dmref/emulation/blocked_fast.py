"""The fast blocked quantizer: :func:`~dmref.emulation.blocked.quantize_blocked`'s codes and
scales, computed with fewer passes, for torch tensors.

:mod:`dmref.emulation.blocked` is the specification (its module docstring and
``docs/block_scaling.md`` state every rule); this module restates none of it. It takes the scales
from the specification's own :func:`~dmref.emulation.blocked.scales_from_amax`, the quotient from
its ``_quotient`` and the codes from :func:`~dmref.emulation.encode`, and differs only in how the
work is laid out:

- one zero-padded blocked view ``(B, nR, br, nC, bc)`` serves the amax, the quotient and the
  dequantization (zeros change no amax), and ``fake_quantize_blocked`` decodes and scales in
  that view before dropping the padding once;
- the amax is ``max(max x, -min x)``, with no ``|x|`` temporary; a caller may pass the block
  amaxes instead (blocks that span more than ``x``: a whole sweep of key tiles);
- a scale of 1 (FIXED, margin 0) divides nothing;
- for a power-of-two scale, nearest-even, a target whose smallest subnormal is at least
  2**-125 (the 8-bit formats, float16; not bfloat16) and an input of at most 24 significant bits
  (float32, bfloat16, float16), the quotient ``x / s`` is formed in float32: it is exact where it
  is a normal float32; where it underflows (|x / s| < 2**-126) the exact quotient lies below half
  the target's smallest subnormal, so both round to a zero of x's sign; where it overflows to
  +-inf, nearest-even gives inf the code it gives every finite value past the overflow
  threshold, with either saturation;
- for a power-of-two scale and float64 input, the plain float64 quotient when it encodes as the
  exact one (``_rounds_like_the_exact_quotient``: no nonzero quotient became zero, none
  overflowed), else the specification's round-to-odd one;
- every other quotient is the specification's own;
- decoding gathers from a table of :func:`~dmref.emulation.decode` over all codes, two 8-bit
  codes per gather on the CPU, with a power-of-two scale folded into the table (FIXED); on CUDA
  torch's own widening of :attr:`Format.torch_dtype` (exact).

Domain: every input of the specification except stochastic rounding (``rbits``) and numpy
arrays. On it the codes and the stored scales equal the specification's bit for bit
(tests/emulation/test_blocked_fast.py runs both on the same inputs: every rule, block, format,
rounding mode and saturation; float16, bfloat16, float32 and float64 inputs with exponents across
their whole range, zero blocks, NaN and +-inf, tails).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from .blocked import Block, ScaleRule, _check_margin, _element_format, _from_blocks, _quotient, _to_blocks, scales_from_amax
from .cast import decode, encode
from .formats import FLOAT8_E8M0FNU, Format, Rounding, get_rounding

__all__ = ["abs_amax", "fake_quantize_blocked", "quantize_blocked_fast"]

#: The float32 quotient serves targets whose smallest subnormal is at least this: an exact
#: quotient below the float32 normal range (2**-126) then lies below half of it.
_FLOAT32_ROUTE_MIN_SUBNORMAL = 2.0**-125
_INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# ----------------------------------------------------------------------------------------------
# Decoding
# ----------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _decode_table(fmt: Format, scale: float = 1.0) -> np.ndarray:
    """``decode`` of every code of ``fmt``, times ``scale`` (float32), as a table."""
    dtype = torch.uint8 if fmt.bits <= 8 else torch.int16
    codes = torch.arange(fmt.n_codes, dtype=torch.int32).to(dtype)
    return (decode(codes, fmt) * scale).numpy()


@functools.lru_cache(maxsize=None)
def _decode_pair_table(fmt: Format, scale: float = 1.0) -> np.ndarray:
    """For 8-bit formats: the float32 pair (value of the low byte, value of the high byte) of
    every uint16, as uint64, so that one gather decodes two codes (little-endian layout)."""
    bits = _decode_table(fmt, scale).view(np.uint32).astype(np.uint64)
    pairs = np.arange(1 << 16)
    return bits[pairs & 0xFF] | (bits[pairs >> 8] << np.uint64(32))


def _decode(codes: torch.Tensor, fmt: Format, scale: float = 1.0) -> torch.Tensor:
    """``decode(codes, fmt) * scale`` (one float32 multiply), faster: on the CPU a gather from a
    table (torch's own uint8 -> float conversions run at ~5-10 ns per value on a 2-core CPU,
    numpy's take at ~1); on CUDA torch's exact FP8 widening."""
    if codes.device.type == "cpu":
        out = torch.empty(codes.shape, dtype=torch.float32)
        flat = codes.contiguous().numpy().reshape(-1)
        dst = out.numpy().reshape(-1)
        if flat.dtype == np.uint8 and flat.size % 2 == 0:
            np.take(_decode_pair_table(fmt, scale), flat.view(np.uint16), out=dst.view(np.uint64), mode="clip")
            return out
        if flat.dtype == np.int16:
            flat = flat.view(np.uint16)
        np.take(_decode_table(fmt, scale), flat, out=dst, mode="clip")  # codes are in range
        return out
    if fmt.is_fp8 and fmt.torch_dtype is not None:
        values = codes.view(fmt.torch_dtype).to(torch.float32)
    else:
        values = decode(codes, fmt)
    return values * scale if scale != 1.0 else values


# ----------------------------------------------------------------------------------------------
# Blocks and amaxes
# ----------------------------------------------------------------------------------------------

def abs_amax(x: torch.Tensor, dim=None, keepdim: bool = False) -> torch.Tensor:
    """max |x| over ``dim`` (all dims when None), in x's dtype, without an |x| temporary; NaN
    propagates."""
    if dim is None:
        return torch.maximum(x.amax(), x.amin().neg())
    return torch.maximum(x.amax(dim=dim, keepdim=keepdim), x.amin(dim=dim, keepdim=keepdim).neg())


def _blocked(x: torch.Tensor, block: Block) -> torch.Tensor:
    """x (..., R, C) as zero-padded blocks (B, nR, br, nC, bc), batch dims flattened."""
    n_rb, n_cb = block.scale_shape(tuple(x.shape))[-2:]
    r, c = x.shape[-2:]
    br, bc = block.extent(r, c)
    return _to_blocks(x.reshape(-1, r, c), br, bc, n_rb, n_cb)


# ----------------------------------------------------------------------------------------------
# Quantization
# ----------------------------------------------------------------------------------------------

def _codes_in_blocks(x: torch.Tensor, fmt: Format, block, scale_rule, margin, rounding, saturate, amax):
    """(codes, s, stored, blocked): the codes in the blocked layout (``blocked``) or in x's shape
    (Block.tensor(), a FIXED rule, an empty x); the scale values s (float32) broadcasting against
    them; the stored scales (float32 values or E8M0 codes) in the shape of the scales."""
    block = Block.get(block)
    rule = ScaleRule.get(scale_rule)
    margin = _check_margin(margin)
    rounding = get_rounding(rounding)
    if rounding is Rounding.STOCHASTIC:
        raise NotImplementedError("the fast blocked quantizer has no stochastic rounding (random bits per "
                                  "element); dmref.emulation.quantize_blocked takes rbits")
    if not isinstance(x, torch.Tensor) or x.dtype not in _INPUT_DTYPES:
        kind = f"a tensor of {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"x must be a float16, bfloat16, float32 or float64 torch tensor, got {kind}")
    scale_shape = block.scale_shape(tuple(x.shape))  # raises for too few dims
    # one scale for all blocks (FIXED) or one block: no blocked layout needed
    blocked = rule.is_dynamic and not block.spans_batch and x.numel() > 0
    xb = _blocked(x, block) if blocked else x
    if amax is not None and tuple(amax.shape) != scale_shape:
        raise ValueError(f"amax of shape {tuple(amax.shape)} must have the shape of the scales, {scale_shape}")
    if not rule.is_dynamic:  # FIXED: the scale ignores the amax
        a = torch.zeros((), dtype=torch.float32, device=x.device)
    elif amax is not None:
        a = amax.reshape(xb.shape[0], xb.shape[1], 1, xb.shape[3], 1) if blocked else amax
    elif blocked:
        a = abs_amax(xb, dim=(2, 4), keepdim=True)
    elif x.numel() > 0:  # Block.tensor()
        a = abs_amax(x)
    else:  # an empty x: amax 0, scale 1
        a = torch.zeros(scale_shape, dtype=torch.float32, device=x.device)
    stored = scales_from_amax(a, fmt, rule, margin=margin)
    s = _decode(stored, FLOAT8_E8M0FNU) if rule.is_e8m0 else stored
    if rule is ScaleRule.FIXED and margin == 0:  # s = 1
        y = xb
    elif (rule.is_pow2 and rounding is Rounding.NEAREST_EVEN and fmt.min_subnormal >= _FLOAT32_ROUTE_MIN_SUBNORMAL
          and x.dtype != torch.float64):
        y = _quotient(xb.to(torch.float32), s, wide_input=False)  # see the module docstring
    elif rule.is_pow2 and x.dtype == torch.float64:
        y = _quotient(xb, s.to(torch.float64), wide_input=False)
        if not _rounds_like_the_exact_quotient(xb, y, a, s.to(torch.float64), rule, margin):
            y = _quotient(xb, s.to(torch.float64), wide_input=True)
    else:
        y = _quotient(xb.to(torch.float64), s.to(torch.float64), wide_input=x.dtype == torch.float64)
    codes = encode(y, fmt, rounding=rounding, saturate=saturate)
    stored = stored.reshape(scale_shape) if blocked else stored.expand(scale_shape)
    return codes, s, stored, blocked


def _rounds_like_the_exact_quotient(x: torch.Tensor, y: torch.Tensor, amax: torch.Tensor, s: torch.Tensor,
                                     rule: ScaleRule, margin: int) -> bool:
    """Whether the float64 quotients y = x / s (s a power of two) encode as the exact ones: a
    quotient is exact unless it leaves the float64 normal range, and one below it (inexact, or
    zero below 2**-1075) rounds like the exact one, in every format and mode, as long as it keeps
    its sign and stays nonzero (every format's smallest subnormal is above 2**-150); one past it
    must not become inf."""
    if torch.count_nonzero(y) != torch.count_nonzero(x):  # a nonzero x / s became zero
        return False
    if rule is ScaleRule.FIXED:  # s = 2^margin: only a margin below 0 can overflow
        return margin >= 0 or bool(torch.isinf(y).sum() == torch.isinf(x).sum())
    # a block's largest quotient is amax / s (a non-finite amax makes the whole block's s NaN)
    largest = amax.to(torch.float64) / s
    return not bool((torch.isinf(largest) & torch.isfinite(amax)).any())


def quantize_blocked_fast(x: torch.Tensor, fmt: Format | str, *, block: Block | str,
                          scale_rule: ScaleRule | str, margin: int = 0,
                          rounding: Rounding | str = Rounding.NEAREST_EVEN, saturate: bool = True,
                          amax: torch.Tensor | None = None):
    """``(codes, scales)`` equal to :func:`~dmref.emulation.quantize_blocked`'s (same arguments,
    no ``rbits``), for a float torch tensor ``x``.

    ``amax``: the block amaxes to use instead of x's own, in the shape of the scales (as
    :func:`~dmref.emulation.block_amax` gives them), for blocks that span more than ``x``.

    Raises what :func:`~dmref.emulation.quantize_blocked` raises, and NotImplementedError for
    stochastic rounding.
    """
    codes, _, stored, blocked = _codes_in_blocks(x, _element_format(fmt), block, scale_rule, margin, rounding,
                                                 saturate, amax)
    if blocked:
        codes = _from_blocks(codes, *x.shape[-2:]).reshape(x.shape)
    return codes.contiguous(), stored.contiguous()


def fake_quantize_blocked(x: torch.Tensor, fmt: Format | str, *, block: Block | str,
                          scale_rule: ScaleRule | str, margin: int = 0,
                          rounding: Rounding | str = Rounding.NEAREST_EVEN, saturate: bool = True,
                          amax: torch.Tensor | None = None) -> torch.Tensor:
    """``s * decode(code)`` of every element as float32: ``dequantize_blocked(*quantize_blocked(
    x, ...))`` rounded to float32 (exact for power-of-two scales; for ``amax`` scales one
    rounding of the exact product, as the float32 multiply is). Arguments as
    :func:`quantize_blocked_fast`."""
    fmt = _element_format(fmt)
    codes, s, _, blocked = _codes_in_blocks(x, fmt, block, scale_rule, margin, rounding, saturate, amax)
    if ScaleRule.get(scale_rule) is ScaleRule.FIXED:  # a power of two fixed by the recipe: in the table
        values = _decode(codes, fmt, float(s))
    else:
        values = _decode(codes, fmt).mul_(s)
    if blocked:
        values = _from_blocks(values, *x.shape[-2:]).reshape(x.shape)
    return values

