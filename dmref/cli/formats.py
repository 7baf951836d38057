"""``dmref formats`` (the table of formats and their derived properties) and ``dmref cast``
(cast values given on the command line and show codes and bits).

``dmref cast`` reads each value exactly as written (decimal text, ``nan``, ``inf``) and rounds it
*once* into the format, in every rounding mode: the decimal is first rounded to float64 by
round-to-odd, which keeps every bit a rounding to a format of at most 51 significand bits (every
format of :mod:`dmref.emulation`) depends on, then :func:`dmref.emulation.encode` rounds that
float64 once (Boldo and Melquiond, "When double rounding is odd", 2005). The ``error`` column is
the decoded value minus the exact input, rounded to float64 (null when either is not finite).
"""

from __future__ import annotations

import argparse
import math
import re
import struct
import sys
from fractions import Fraction

import numpy as np
from rich.console import Console

from dmref.cli import UsageError, _tables, dumps_json, input_errors
from dmref.emulation import FORMATS, Rounding, decode, encode, get_format

#: What ``dmref cast`` accepts as a value, for messages.
VALUE_SYNTAX = "a decimal number (1.5, -3e-3, 0.0029296874999999996), nan, inf or -inf"

#: Arguments that are values, not options, although they start with "-" ("-3e-3", "-inf"):
#: argparse's own rule only knows "-1" and "-1.5".
_NEGATIVE_VALUE = re.compile(r"^-(\d|\.\d|inf|infinity|nan)", re.IGNORECASE)


def register(subparsers) -> None:
    p = subparsers.add_parser("formats", help="table of number formats and derived properties")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_formats)

    p = subparsers.add_parser(
        "cast", help="cast values into a format; show codes and bits",
        description="Round each value, read exactly as written, once into the format (see "
                    "dmref.cli.formats); the error column is the decoded value minus the input.")
    p.add_argument("values", nargs="+", help=f"values: each {VALUE_SYNTAX}")
    p.add_argument("--format", "-f", default="float8_e4m3fn",
                   help=f"target format (default float8_e4m3fn): {', '.join(FORMATS)} or an alias")
    p.add_argument("--rounding", "-r", default="nearest_even", choices=[r.value for r in Rounding])
    p.add_argument("--saturate", action="store_true", help="overflow to +-max")
    p.add_argument("--rbits", type=_rbits, default=None,
                   help="random bits (0..65535), required by and only for --rounding stochastic")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cast)
    # "-3e-3" and "-inf" are values (argparse has no public hook for this; the attribute exists
    # in every Python this project supports, 3.10 to 3.13).
    p._negative_number_matcher = _NEGATIVE_VALUE


def _rbits(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer in 0..65535") from None
    if not 0 <= value < 1 << 16:
        raise argparse.ArgumentTypeError(f"{value} is not in 0..65535 (16 random bits)")
    return value


def _format_row(f) -> dict:
    return {
        "name": f.name,
        "bits": f.bits,
        "exponent_bits": f.exponent_bits,
        "mantissa_bits": f.mantissa_bits,
        "bias": f.bias,
        "max": f.max,
        "min_normal": f.min_normal,
        "min_subnormal": f.min_subnormal,
        "eps": f.eps,
        "inf": f.has_inf,
        "negative_zero": f.has_negative_zero,
        "nan_codes": len(f.nan_codes),
        "nan_code": f"0x{f.nan_code:0{f.bits // 4}X}",
        "max_code": f"0x{f.max_code:0{f.bits // 4}X}",
    }


#: The two tables of ``dmref formats``: the encoding, then the range (keys of :func:`_format_row`
#: with their headers); each fits 80 columns.
_ENCODING_COLUMNS = {"bits": "bits", "exponent_bits": "e", "mantissa_bits": "m", "bias": "bias", "inf": "inf",
                     "negative_zero": "-0", "nan_codes": "NaNs", "nan_code": "NaN code", "max_code": "max code"}
_RANGE_COLUMNS = {"max": "max", "min_normal": "min normal", "min_subnormal": "min subnormal", "eps": "eps"}
#: Significant digits of the range table (--json gives every digit)
_DIGITS = 6


def _formats(args) -> int:
    rows = [_format_row(f) for f in FORMATS.values()]
    if args.json:
        print(dumps_json(rows, indent=2))
        return 0
    console = Console()
    for title, columns in (("Number formats: encoding", _ENCODING_COLUMNS),
                           (f"Number formats: range ({_DIGITS} significant digits; --json: every digit)",
                            _RANGE_COLUMNS)):
        table = _tables.table(title)
        _tables.text_column(table, "name", no_wrap=True)
        for header in columns.values():
            _tables.number_column(table, header)
        for row in rows:
            table.add_row(row["name"], *(f"{row[k]:.{_DIGITS}g}" if isinstance(row[k], float) else
                                         ("yes" if row[k] else "no") if isinstance(row[k], bool) else str(row[k])
                                         for k in columns))
        console.print(table)
        console.print()
    console.print("Every property is derived from the bit fields (e exponent bits, m mantissa bits); "
                  "NaNs: how many codes are NaN.")
    return 0


_FLOAT64_MAX = Fraction(sys.float_info.max)


def _is_odd(x: float) -> bool:
    """Whether the last significand bit of the float64 ``x`` is 1."""
    return bool(struct.unpack("<q", struct.pack("<d", x))[0] & 1)


def round_to_odd(d: Fraction) -> float:
    """``d`` rounded to float64 by round-to-odd: ``d`` itself when it is a float64, else the one
    of its two float64 neighbours whose last significand bit is 1; above float64's max (whose
    last bit is 1), that max."""
    if abs(d) > _FLOAT64_MAX:
        return math.copysign(sys.float_info.max, d)
    f = float(d)  # correctly rounded: one of the two neighbours
    if Fraction(f) == d:
        return f
    other = math.nextafter(f, math.inf if Fraction(f) < d else -math.inf)
    return f if _is_odd(f) else other


def parse_value(text: str) -> tuple[float, Fraction | None]:
    """(float64 to encode, the exact value or None for nan / inf) of one ``dmref cast`` value.
    Raises UsageError for text that is not a number or is beyond float64's range."""
    try:
        nearest = float(text)
    except ValueError:
        raise UsageError(f"value {text!r} is not a number; expected {VALUE_SYNTAX}") from None
    if math.isnan(nearest) or text.strip().lstrip("+-").lower() in ("inf", "infinity"):
        return nearest, None
    if math.isinf(nearest) or (nearest == 0 and re.search(r"[1-9]", text.lower().partition("e")[0])):
        raise UsageError(f"value {text!r} is beyond float64's range: its magnitude must be at most "
                         f"{sys.float_info.max!r} and, unless 0, at least 2^-1075 (write inf or 0)")
    exact = Fraction(text.strip())
    return (nearest if exact == 0 else round_to_odd(exact)), exact  # 0: float() kept the sign


def _cast(args) -> int:
    with input_errors():
        fmt = get_format(args.format)
    parsed = [parse_value(v) for v in args.values]
    stochastic = args.rounding == Rounding.STOCHASTIC.value
    if stochastic != (args.rbits is not None):
        raise UsageError("--rbits (0..65535) is required by --rounding stochastic and only by it; "
                         f"got --rounding {args.rounding} and --rbits {args.rbits}")
    x = np.array([f for f, _ in parsed], dtype=np.float64)
    rbits = np.full(x.shape, args.rbits, dtype=np.uint16) if stochastic else None
    codes = encode(x, fmt, rounding=args.rounding, saturate=args.saturate, rbits=rbits)
    values = decode(codes, fmt)
    rows = []
    for text, (_, exact), code, value in zip(args.values, parsed, codes.tolist(), values.tolist()):
        bits = format(code, f"0{fmt.bits}b")
        s = int(fmt.signed)
        fields = " ".join(p for p in (bits[:s], bits[s:s + fmt.exponent_bits], bits[s + fmt.exponent_bits:]) if p)
        err = float(Fraction(value) - exact) if exact is not None and math.isfinite(value) else None
        rows.append({"input": text, "code": code, "hex": f"0x{code:0{fmt.bits // 4}X}", "bits": fields,
                     "value": value, "error": err})
    if args.json:
        print(dumps_json({"format": fmt.name, "rounding": args.rounding, "saturate": args.saturate,
                          "results": rows}, indent=2))
        return 0
    table = _tables.table(f"{fmt.name}, {args.rounding}, saturate={args.saturate}")
    for key in rows[0]:
        _tables.number_column(table, key)  # folds a long value onto a second line, never cuts it
    for row in rows:
        table.add_row(*(repr(v) if isinstance(v, float) else str(v) for v in row.values()))
    Console().print(table)
    return 0
