"""The operands of the emulated GEMM: FP8 codes from codes, FP8 dtypes or exactly representable
floats; float32 accumulators; block scales per row or per 128-row block. Each refuses what it
cannot take with an error that names the value."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

from ..cast import decode, encode
from ..formats import FORMATS, Format, get_format

_TORCH_FP8 = {f.torch_dtype: f.name for f in FORMATS.values() if f.is_fp8 and f.torch_dtype is not None}
_NUMPY_FP8 = {np.dtype(getattr(ml_dtypes, n)): n for n in ("float8_e4m3fn", "float8_e5m2",
                                                            "float8_e4m3fnuz", "float8_e5m2fnuz")}


def as_codes(x, fmt, name: str) -> tuple[torch.Tensor, Format]:
    """(uint8 codes tensor, format) from codes, FP8 dtypes or exactly representable floats."""
    if isinstance(x, np.ndarray):
        if x.dtype in _NUMPY_FP8:
            fmt = _agree(fmt, _NUMPY_FP8[x.dtype], name)
            x = x.view(np.uint8)
        x = torch.from_numpy(np.ascontiguousarray(x))
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a numpy array or torch tensor, got {type(x).__name__}")
    if x.dtype in _TORCH_FP8:
        fmt = _agree(fmt, _TORCH_FP8[x.dtype], name)
        x = x.view(torch.uint8)
    if fmt is None:
        raise ValueError(f"{name} holds {x.dtype} values: give its FP8 format (f{name[0]}=...)")
    fmt = get_format(fmt)
    if not fmt.signed or not fmt.has_zero:
        raise ValueError(f"f{name[0]}={fmt.name}: {fmt.name} cannot hold GEMM operands (it has no sign or "
                         "no zero); it is a scale format: give its values as scale_a/scale_b")
    if x.dtype == torch.uint8:
        return x, fmt
    if x.is_floating_point():
        codes = encode(x.to(torch.float32), fmt)
        back = decode(codes, fmt)
        same = (back == x) | (torch.isnan(back) & torch.isnan(x))
        if not bool(same.all()):
            raise ValueError(f"{name} has values that are not exactly {fmt.name} values; pass "
                             "FP8 codes and give block scales with scale_a/scale_b")
        return codes, fmt
    raise TypeError(f"{name} must hold uint8 FP8 codes or an FP8/float dtype, got {x.dtype}")


def _agree(fmt, name: str, what: str):
    if fmt is not None and get_format(fmt) is not get_format(name):
        raise ValueError(f"{what} has dtype {name} but its format was given as {fmt!r}")
    return name


def as_float32(x, device, name: str) -> torch.Tensor:
    t = torch.as_tensor(x) if not isinstance(x, torch.Tensor) else x
    if t.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {t.dtype}")
    return t.to(device)


def expand_scale(s, rows: int, tiles: int, device, name: str) -> torch.Tensor:
    """(rows, tiles) float32 from per-row or per-128-row-block scales."""
    s = as_float32(s, device, name)
    if s.ndim == 0:
        return s.expand(rows, tiles)
    if s.ndim != 2 or s.shape[1] != tiles:
        raise ValueError(f"{name} has shape {tuple(s.shape)}; expected (rows, {tiles}) "
                         f"or (ceil(rows/128), {tiles}) for K tiles of the scale block")
    if s.shape[0] == rows:
        return s
    if s.shape[0] == -(-rows // 128):
        return s.repeat_interleave(128, dim=0)[:rows]
    raise ValueError(f"{name} has {s.shape[0]} rows; expected {rows} or {-(-rows // 128)}")


__all__ = ["as_codes", "as_float32", "expand_scale"]
