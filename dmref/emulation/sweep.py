"""Exhaustive comparison of casts over all 2**32 float32 bit patterns, and the float64
double-rounding census.

Used by the slow tests (tests/emulation/test_exhaustive.py) and by the script
benchmarks/exhaustive_casts.py, which prints the counts and the time taken.

The comparisons and what each is expected to show (docs/casts.md):

==========================  ==============================  ====================================
ours                        library                         documented disagreement
==========================  ==============================  ====================================
e4m3fn, saturate=False      ml_dtypes astype                none
e4m3fn, saturate=True       torch .to()                     none
e5m2,   saturate=False      torch .to()                     none
e5m2,   saturate=False      ml_dtypes astype                NaN code: ml 0x7E|s, ours 0x7F|s
e4m3fnuz, saturate=False    ml_dtypes astype / torch .to()  none
e5m2fnuz, saturate=False    ml_dtypes astype / torch .to()  none
bfloat16, saturate=False    ml_dtypes astype                NaN code (ml 0x7FC0|s, ours 0x7FFF|s)
float16,  saturate=False    numpy astype                    NaN code (payload bits differ)
==========================  ==============================  ====================================

"ours" for the 8-bit formats is the table route of :mod:`dmref.emulation.cast` (built from the
integer arithmetic), never torch's own cast, so that the comparison with torch also proves that
``encode`` may dispatch to torch's cast where it does. For bfloat16 and float16 it is the
torch-cast route with dmref's NaN code, compared with ml_dtypes and numpy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np
import torch

from . import cast
from .formats import Rounding, get_format

#: (format name, saturate, library) -> which inputs may differ, by name (see module docstring)
COMPARISONS: tuple[tuple[str, bool, str, str], ...] = (
    ("float8_e4m3fn", False, "ml_dtypes", "none"),
    ("float8_e4m3fn", True, "torch", "none"),
    ("float8_e5m2", False, "torch", "none"),
    ("float8_e5m2", False, "ml_dtypes", "nan_code"),
    ("float8_e4m3fnuz", False, "ml_dtypes", "none"),
    ("float8_e4m3fnuz", False, "torch", "none"),
    ("float8_e5m2fnuz", False, "ml_dtypes", "none"),
    ("float8_e5m2fnuz", False, "torch", "none"),
    ("bfloat16", False, "ml_dtypes", "nan_code"),
    ("float16", False, "numpy", "nan_code"),
)


@dataclass
class SweepResult:
    fmt: str
    saturate: bool
    library: str
    allowed: str
    inputs: int = 0
    mismatches: int = 0
    undocumented: int = 0  # mismatches outside the documented disagreement
    examples: list = field(default_factory=list)  # (float32 bits, ours, library) of undocumented
    seconds: float = 0.0


def _library_cast(x: np.ndarray, fmt_name: str, library: str) -> np.ndarray:
    code_type = np.uint8 if get_format(fmt_name).bits == 8 else np.uint16
    if library in ("ml_dtypes", "numpy"):
        dtype = np.float16 if library == "numpy" else getattr(ml_dtypes, fmt_name)
        with np.errstate(invalid="ignore", over="ignore"):
            return x.astype(dtype).view(code_type)
    return torch.from_numpy(x).to(get_format(fmt_name).torch_dtype).view(torch.uint8).numpy()


def _documented(allowed: str, x: np.ndarray, ours: np.ndarray, theirs: np.ndarray,
                fmt_name: str = "float8_e5m2") -> np.ndarray:
    """Which of the mismatching inputs fall under the documented disagreement: for "nan_code",
    a NaN input for which both codes are NaN codes of the input's sign."""
    if allowed == "nan_code":
        fmt = get_format(fmt_name)
        sign = np.signbit(x)
        ours_v, theirs_v = cast.decode(ours, fmt), cast.decode(theirs, fmt)
        return (np.isnan(x) & np.isnan(ours_v) & np.isnan(theirs_v)
                & (((ours & fmt.sign_bit) != 0) == sign) & (((theirs & fmt.sign_bit) != 0) == sign))
    return np.zeros(x.shape, bool)


def _ours(x: np.ndarray, fmt_name: str, saturate: bool) -> np.ndarray:
    fmt = get_format(fmt_name)
    if fmt.bits == 8:
        return cast._encode_lut(x, fmt, Rounding.NEAREST_EVEN, saturate, None, 16)
    return cast._encode_16bit_native(torch.from_numpy(x), fmt, saturate).numpy().view(np.uint16)


def sweep_float32(comparisons=COMPARISONS, *, chunk_bits: int = 24, start: int = 0,
                  stop: int = 1 << 32, progress=None) -> list[SweepResult]:
    """Compare ``comparisons`` on every float32 bit pattern in [start, stop)."""
    results = [SweepResult(f, s, lib, allowed) for f, s, lib, allowed in comparisons]
    step = 1 << chunk_bits
    ours_cache: dict = {}
    for lo in range(start, stop, step):
        bits = np.arange(lo, min(lo + step, stop), dtype=np.uint64).astype(np.uint32)
        x = bits.view(np.float32)
        ours_cache.clear()
        for r in results:
            t0 = time.perf_counter()
            key = (r.fmt, r.saturate)
            if key not in ours_cache:
                ours_cache[key] = _ours(x, r.fmt, r.saturate)
            ours = ours_cache[key]
            theirs = _library_cast(x, r.fmt, r.library)
            diff = ours != theirs
            n_diff = int(diff.sum())
            if n_diff:
                idx = np.nonzero(diff)[0]
                bad = idx[~_documented(r.allowed, x[idx], ours[idx], theirs[idx], r.fmt)]
                r.undocumented += len(bad)
                r.examples.extend((int(bits[i]), int(ours[i]), int(theirs[i])) for i in bad[:3])
            r.inputs += x.size
            r.mismatches += n_diff
            r.seconds += time.perf_counter() - t0
        if progress is not None:
            progress(x.size)
    return results


# ----------------------------------------------------------------------------------------------
# float64: rounding once vs rounding twice
# ----------------------------------------------------------------------------------------------


@dataclass
class DoubleRoundingCensus:
    fmt: str
    inputs: int
    ours_wrong: int
    ml_dtypes_wrong: int
    torch_wrong: int
    example: tuple | None  # (x, correct code, ml_dtypes code, torch code)


def midpoint_neighbours(fmt_name: str) -> tuple[np.ndarray, np.ndarray]:
    """Every float64 just above and just below each midpoint between neighbouring finite values
    of the format (both signs, subnormals, and the overflow threshold max + half a quantum), with
    the correctly rounded nearest-even code of each (rounded once, in exact arithmetic)."""
    fmt = get_format(fmt_name)
    values = sorted({abs(fmt.value(c)) for c in range(fmt.n_codes)
                     if np.isfinite(fmt.value(c))})
    mids = [(a + b) / 2 for a, b in zip(values, values[1:])]
    top_quantum = values[-1] - values[-2]
    mids.append(values[-1] + top_quantum / 2)  # the overflow threshold
    mids = np.array(mids, dtype=np.float64)  # exact: at most 1 bit more than the format
    x = np.concatenate([np.nextafter(mids, -np.inf), np.nextafter(mids, np.inf)])
    if fmt.signed:
        x = np.concatenate([x, -x])
    from .spec import encode_scalar
    correct = np.array([encode_scalar(float(v), fmt) for v in x], dtype=np.uint8)
    return x, correct


def double_rounding_census(fmt_name: str) -> DoubleRoundingCensus:
    x, correct = midpoint_neighbours(fmt_name)
    ours = cast.encode(x, fmt_name)
    ml = _library_cast(x, fmt_name, "ml_dtypes") if hasattr(ml_dtypes, fmt_name) else correct
    th = torch.from_numpy(x).to(get_format(fmt_name).torch_dtype).view(torch.uint8).numpy()
    # compare values the library means to produce: only where the library's own overflow and
    # NaN conventions agree with ours (finite, in range), so the census counts rounding alone
    in_range = np.abs(x) < get_format(fmt_name).max
    wrong_ml = in_range & (ml != correct)
    wrong_th = in_range & (th != correct)
    i = np.nonzero(wrong_ml & wrong_th)[0]
    example = (float(x[i[0]]), int(correct[i[0]]), int(ml[i[0]]), int(th[i[0]])) if len(i) else None
    return DoubleRoundingCensus(fmt_name, x.size, int((ours != correct).sum()), int(wrong_ml.sum()),
                                int(wrong_th.sum()), example)
