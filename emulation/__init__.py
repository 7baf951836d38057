"""Bit-exact FP8 emulation: formats as data, encode/decode/quantize, block scaling and the
emulated FP8 GEMM. Needs only numpy, ml_dtypes and torch."""

from .cast import decode, encode, quantize
from .formats import ALIASES, FORMATS, Format, Rounding, Specials, get_format, get_rounding
from .spec import decode_scalar, encode_scalar

__all__ = [
    "ALIASES",
    "FORMATS",
    "Format",
    "Rounding",
    "Specials",
    "decode",
    "decode_scalar",
    "encode",
    "encode_scalar",
    "get_format",
    "get_rounding",
    "quantize",
]
