"""Bit-exact FP8 emulation: formats as data, encode/decode/quantize, block scaling and the
emulated FP8 GEMM. Needs only numpy, ml_dtypes and torch."""

from .blocked import Block, BlockQuantized, ScaleRule, block_amax, dequantize_blocked, quantize_blocked, scales_from_amax
from .cast import decode, encode, quantize
from .gemm import HOPPER, Accumulation, WgmmaRules, error_bound, matmul
from .formats import ALIASES, FORMATS, Format, Rounding, Specials, get_format, get_rounding
from .spec import decode_scalar, encode_scalar

__all__ = [
    "Accumulation",
    "HOPPER",
    "WgmmaRules",
    "error_bound",
    "matmul",
    "ALIASES",
    "Block",
    "BlockQuantized",
    "FORMATS",
    "Format",
    "Rounding",
    "ScaleRule",
    "Specials",
    "block_amax",
    "decode",
    "decode_scalar",
    "dequantize_blocked",
    "encode",
    "encode_scalar",
    "get_format",
    "get_rounding",
    "quantize",
    "quantize_blocked",
    "scales_from_amax",
]
