"""Bit-exact FP8 emulation: formats as data, encode/decode/quantize, block scaling and the
emulated FP8 GEMM. Needs only numpy, ml_dtypes and torch."""

from .blocked import Block, BlockQuantized, ScaleRule, block_amax, dequantize_blocked, quantize_blocked, scales_from_amax
from .cast import decode, encode, quantize
from . import constants
from .gemm import HOPPER, Accumulation, MatmulModel, WgmmaRules, error_bound, matmul
from .formats import (ALIASES, BFLOAT16, FLOAT8_E4M3FN, FLOAT8_E4M3FNUZ, FLOAT8_E5M2, FLOAT8_E5M2FNUZ, FLOAT8_E8M0FNU,
                      FLOAT16, FORMATS, Format, Rounding, Specials, get_format, get_rounding)
from .spec import decode_scalar, encode_scalar

__all__ = [
    "Accumulation",
    "HOPPER",
    "MatmulModel",
    "constants",
    "WgmmaRules",
    "error_bound",
    "matmul",
    "ALIASES",
    "BFLOAT16",
    "FLOAT16",
    "FLOAT8_E4M3FN",
    "FLOAT8_E4M3FNUZ",
    "FLOAT8_E5M2",
    "FLOAT8_E5M2FNUZ",
    "FLOAT8_E8M0FNU",
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
