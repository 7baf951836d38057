"""``dmref formats`` (the table of formats and their derived properties) and ``dmref cast``
(cast values given on the command line and show codes and bits)."""

from __future__ import annotations

import json
from fractions import Fraction

import numpy as np
from rich.console import Console
from rich.table import Table

from dmref.emulation import FORMATS, Rounding, decode, encode, get_format


def register(subparsers) -> None:
    p = subparsers.add_parser("formats", help="table of number formats and derived properties")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_formats)

    p = subparsers.add_parser("cast", help="cast values into a format; show codes and bits")
    p.add_argument("values", nargs="+", help="values, e.g. 1.0 -3e-3 nan inf 0.0029296874999999996")
    p.add_argument("--format", "-f", default="float8_e4m3fn", help="target format (default e4m3fn)")
    p.add_argument("--rounding", "-r", default="nearest_even", choices=[r.value for r in Rounding])
    p.add_argument("--saturate", action="store_true", help="overflow to +-max")
    p.add_argument("--rbits", type=int, default=None,
                   help="random bits (0..65535) for --rounding stochastic")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cast)


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


def _formats(args) -> int:
    rows = [_format_row(f) for f in FORMATS.values()]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = Table(title="dmref formats (every property derived from the bit fields)")
    short = {"exponent_bits": "e", "mantissa_bits": "m", "negative_zero": "-0", "nan_codes": "#NaN"}
    for key in rows[0]:
        table.add_column(short.get(key, key), justify="left" if key == "name" else "right", no_wrap=True)
    for row in rows:
        table.add_row(*(f"{v:.6g}" if isinstance(v, float) else str(v) for v in row.values()))
    console = Console()
    Console(width=max(console.width, 150)).print(table)
    return 0


def _parse(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise SystemExit(f"dmref cast: {text!r} is not a number") from None


def _cast(args) -> int:
    fmt = get_format(args.format)
    x = np.array([_parse(v) for v in args.values], dtype=np.float64)  # rounded once from float64
    rbits = None
    if args.rounding == Rounding.STOCHASTIC.value:
        if args.rbits is None or not 0 <= args.rbits < 1 << 16:
            raise SystemExit("dmref cast: --rounding stochastic needs --rbits in 0..65535")
        rbits = np.full(x.shape, args.rbits, dtype=np.uint16)
    codes = encode(x, fmt, rounding=args.rounding, saturate=args.saturate, rbits=rbits)
    values = decode(codes, fmt)
    rows = []
    for text, xi, code, value in zip(args.values, x, codes.tolist(), values.tolist()):
        bits = format(code, f"0{fmt.bits}b")
        s = int(fmt.signed)
        fields = " ".join(p for p in (bits[:s], bits[s:s + fmt.exponent_bits], bits[s + fmt.exponent_bits:]) if p)
        err = None
        if np.isfinite(value) and np.isfinite(xi):
            err = float(Fraction(value) - Fraction(float(xi)))
        rows.append({"input": text, "code": code, "hex": f"0x{code:0{fmt.bits // 4}X}", "bits": fields,
                     "value": value, "error": err})
    if args.json:
        print(json.dumps({"format": fmt.name, "rounding": args.rounding, "saturate": args.saturate,
                          "results": rows}, indent=2))
        return 0
    table = Table(title=f"{fmt.name}, {args.rounding}, saturate={args.saturate}")
    for key in rows[0]:
        table.add_column(key, justify="right")
    for row in rows:
        table.add_row(*(repr(v) if isinstance(v, float) else str(v) for v in row.values()))
    Console().print(table)
    return 0
