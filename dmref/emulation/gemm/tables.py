"""Per-code tables of an FP8 format and the operand preparation shared by the GEMM models.

Everything is derived from :class:`~dmref.emulation.formats.Format` by decoding codes; nothing
about a format is typed in here.
"""

from __future__ import annotations

import functools
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from ..formats import Format

#: Exponent given to terms that never take part in the alignment maximum.
NO_EXPONENT = -(1 << 20)

#: The canonical float32 NaN of NVIDIA GPUs (PTX: arithmetic NaN results are 0x7FFFFFFF).
CANONICAL_NAN_BITS = 0x7FFFFFFF


@dataclass(frozen=True)
class CodeTable:
    """What the accumulation models need to know about each of the 256 codes of one format.

    ``exponent`` is the exponent a product uses in the alignment maximum: ``floor(log2 |x|)``
    for normal values; for subnormals ``emin`` (significand below 1, as the hardware keeps them)
    or, with ``subnormals_at_emin=False``, their normalised exponent. Zero, NaN and inf codes get
    ``emin``; whether zero products count is a rule of the model, not of the table.
    """

    value: np.ndarray  #: float32, exact (NaN and inf as decoded)
    exponent: np.ndarray  #: int32
    finite: np.ndarray  #: bool
    nonzero: np.ndarray  #: bool, finite and not zero


@functools.lru_cache(maxsize=None)
def code_table(fmt: Format, subnormals_at_emin: bool = True) -> CodeTable:
    if fmt.bits != 8:
        raise ValueError(f"the emulated GEMM takes 8-bit formats, got {fmt.name} ({fmt.bits} bits)")
    values = np.array([fmt.value(code) for code in range(256)], dtype=np.float64)
    finite = np.isfinite(values)
    nonzero = finite & (values != 0)
    exponent = np.full(256, fmt.emin, dtype=np.int32)
    for code in np.flatnonzero(nonzero):
        e = math.frexp(abs(values[code]))[1] - 1
        exponent[code] = max(e, fmt.emin) if subnormals_at_emin else e
    return CodeTable(values.astype(np.float32), exponent, finite, nonzero)


def exponent_range(fmt: Format, subnormals_at_emin: bool = True) -> tuple[int, int]:
    """(smallest, largest) exponent of a nonzero finite code."""
    t = code_table(fmt, subnormals_at_emin)
    e = t.exponent[t.nonzero]
    return int(e.min()), int(e.max())


def lut(table: np.ndarray, codes: torch.Tensor) -> torch.Tensor:
    """``table[codes]`` on the codes' device."""
    return torch.from_numpy(np.ascontiguousarray(table)).to(codes.device)[codes.to(torch.int64)]


def pow2_f32(e: torch.Tensor) -> torch.Tensor:
    """2**e as float32 for integer e in [-149, 127] (subnormal powers included), built from bits
    so that no library exp2 is trusted."""
    e = e.to(torch.int32)
    normal = ((e + 127).clamp(1, 254) << 23).view(torch.float32)
    sub = (torch.ones_like(e) << (e + 149).clamp(0, 22)).view(torch.float32)
    return torch.where(e >= -126, normal, sub)


def pow2_f64(e: torch.Tensor) -> torch.Tensor:
    """2**e as float64 for integer e in [-1022, 1023]."""
    return ((e.to(torch.int64) + 1023).clamp(1, 2046) << 52).view(torch.float64)


def canonical_nan_like(x: torch.Tensor) -> torch.Tensor:
    return torch.tensor(CANONICAL_NAN_BITS, dtype=torch.int32, device=x.device).view(torch.float32)


def canonicalize_nan(x: torch.Tensor) -> torch.Tensor:
    """Every NaN becomes 0x7FFFFFFF, the NaN an NVIDIA GPU writes."""
    return torch.where(torch.isnan(x), canonical_nan_like(x), x)


_POOL: ThreadPoolExecutor | None = None


def run_blocks(fn, blocks, device: torch.device) -> None:
    """``fn(*block)`` for every block. On the CPU the blocks go to worker threads (as many as
    torch's intra-op threads) whose torch ops run single-threaded: then no op ever waits at an
    OpenMP barrier for a thread that another process has descheduled. On this project's shared
    2-core machine two-thread ops were 10-50x slower than one thread under load."""
    global _POOL
    if device.type != "cpu":
        for blk in blocks:
            fn(*blk)
        return
    workers = torch.get_num_threads()
    if _POOL is None or _POOL._max_workers != workers:
        _POOL = ThreadPoolExecutor(workers, thread_name_prefix="dmref-gemm",
                                   initializer=torch.set_num_threads, initargs=(1,))
    for _ in _POOL.map(lambda blk: fn(*blk), blocks):
        pass
