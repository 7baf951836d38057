"""Ground-truth files of real FP8 GEMM outputs (the format of tests/data/h200_fp8_gemm.npz).

Layout (the file's ``about`` entry says the same): for each case ``cNNN``, ``cNNN_a`` (M, K) and
``cNNN_bt`` (N, K) uint8 FP8 codes, ``cNNN_c`` and ``cNNN_out`` (M, N) uint32 float32 bit
patterns, ``cNNN_meta`` a JSON string with at least ``engine``, ``fa``, ``fb``, ``dist``, ``K``.
Optional per case: ``cNNN_scale_a`` (M, T) and ``cNNN_scale_b`` (N or ceil(N/128), T) float32
block scales (with ``meta["scale_block_k"]``).

Engines and how each is replayed (:func:`replay_kwargs`):

- ``triton_dot``: Triton K loop over ``BK`` tiles; ``chain`` true: ``acc = tl.dot(a, b, acc,
  max_num_imprecise_acc=N)``; false: ``acc += tl.dot(a, b)``.
- ``cublas_scaled_mm``: ``torch._scaled_mm`` with unit scales and ``use_fast_accum``.
- ``triton_scaled``: Triton K loop over 128-wide tiles with block scales, the tile's dot from
  zero, then ``acc = fma(dot * sx, sw, acc)`` (Transformer Engine's blockwise reference order).
"""

from __future__ import annotations

import json
import os
import zipfile
from dataclasses import dataclass, field

import numpy as np

from ..formats import get_format
from .engine import matmul
from .model import cublas_schedule, triton_dot_schedule

#: The arrays of one case, as key suffixes (``cNNN_a``, ...), and the keys every case needs.
PARTS = ("scale_a", "scale_b", "meta", "out", "bt", "a", "c")  # longest suffix first
REQUIRED = ("a", "bt", "c", "out", "meta")
#: Engines this module can replay (:func:`replay_kwargs`), with the metadata each needs.
ENGINES = {"triton_dot": ("BK",), "cublas_scaled_mm": ("use_fast_accum",), "triton_scaled": ()}
META_KEYS = ("engine", "fa", "fb", "dist", "K")


class GemmFileError(ValueError):
    """A ground-truth file that cannot be replayed: missing, not an .npz, or not in the layout of
    the module docstring. The message is one line naming the file, the case and the value."""


@dataclass
class Case:
    name: str
    meta: dict
    a: np.ndarray
    bt: np.ndarray
    c: np.ndarray  #: float32
    out: np.ndarray  #: uint32 bits
    scale_a: np.ndarray | None = None
    scale_b: np.ndarray | None = None

    @property
    def group(self) -> str:
        return group_key(self.meta)


def load_cases(path) -> tuple[dict, list[Case]]:
    """(about, cases) of a ground-truth file; never loads pickles. Raises
    :class:`GemmFileError` for a file that is missing, is not an .npz archive, holds no case, or
    has a case that is not in the layout of the module docstring."""
    with _open_npz(path) as z:
        keys = _split_keys(z.files, path)
        if not keys:
            raise GemmFileError(f"{path} holds no cases: no arrays named like c000_a, c000_bt, "
                                f"c000_c, c000_out, c000_meta (it has {_some_keys(z.files)})")
        about = _parse_json(_read_array(z, "about", path), f"{path}: about") if "about" in z.files else {}
        parts = {name: {part: _read_array(z, key, path) for part, key in case.items()}
                 for name, case in keys.items()}
    return about, [_case(name, parts[name], f"{path}: case {name}") for name in sorted(parts)]


def _open_npz(path):
    if not os.path.exists(path):
        raise GemmFileError(f"{path}: no such file")
    if os.path.isdir(path):
        raise GemmFileError(f"{path} is a directory, not an .npz file")
    try:
        z = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        # numpy's own message for a pickle suggests allow_pickle=True, which is never safe here
        raise GemmFileError(f"{path} is not an .npz archive of arrays (numpy.savez); "
                            f"numpy.load could not read it ({type(e).__name__})") from None
    if not isinstance(z, np.lib.npyio.NpzFile):
        raise GemmFileError(f"{path} is a single .npy array, not an .npz archive of cases")
    return z


def _read_array(z, key: str, path) -> np.ndarray:
    try:
        return z[key]
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise GemmFileError(f"{path}: array {key!r} cannot be read without pickle or is "
                            f"damaged ({type(e).__name__})") from None


def _some_keys(keys: list[str]) -> str:
    keys = sorted(keys)
    if not keys:
        return "no arrays"
    shown = ", ".join(repr(k) for k in keys[:5])
    return f"{len(keys)} other entries: {shown}{', ...' if len(keys) > 5 else ''}"


def _split_keys(keys: list[str], path) -> dict[str, dict[str, str]]:
    """{case name: {part: key}}; with cases present, a key that is no part of one (other than
    ``about``) is an error."""
    cases: dict[str, dict[str, str]] = {}
    stray = []
    for key in keys:
        part = next((p for p in PARTS if key.endswith(f"_{p}") and len(key) > len(p) + 1), None)
        if part is not None:
            cases.setdefault(key[:-len(part) - 1], {})[part] = key
        elif key != "about":
            stray.append(key)
    if stray and cases:
        raise GemmFileError(f"{path}: entries {', '.join(map(repr, sorted(stray)[:5]))} are not "
                            f"part of a case (NAME_a, _bt, _c, _out, _meta, _scale_a, _scale_b)")
    return cases


def _parse_json(arr: np.ndarray, what: str):
    if arr.ndim != 0 or arr.dtype.kind not in "US":
        raise GemmFileError(f"{what} must be a JSON string, got a {arr.dtype} array of shape "
                            f"{arr.shape}")
    try:
        return json.loads(str(arr) if arr.dtype.kind == "U" else bytes(arr).decode())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise GemmFileError(f"{what} is not valid JSON ({e.msg if hasattr(e, 'msg') else e})") from None


def _case(name: str, parts: dict[str, np.ndarray], where: str) -> Case:
    missing = [p for p in REQUIRED if p not in parts]
    if missing:
        raise GemmFileError(f"{where} has no {', '.join(f'{name}_{p}' for p in missing)} "
                            f"(every case needs {', '.join(f'_{p}' for p in REQUIRED)})")
    meta = _check_meta(_parse_json(parts["meta"], f"{where}: meta"), where)
    a, bt, c, out = (parts[p] for p in ("a", "bt", "c", "out"))
    _check_array(a, "a", np.uint8, where)
    _check_array(bt, "bt", np.uint8, where)
    _check_array(c, "c", np.uint32, where)
    _check_array(out, "out", np.uint32, where)
    (m, k), n = a.shape, bt.shape[0]
    want = {"bt": (n, k), "c": (m, n), "out": (m, n)}
    for key, arr in (("bt", bt), ("c", c), ("out", out)):
        if arr.shape != want[key]:
            raise GemmFileError(f"{where}: {key} has shape {arr.shape}; a is {a.shape} (M, K), so "
                                f"{key} must be {want[key]}")
    if out.size == 0:
        raise GemmFileError(f"{where} has no outputs to check (M={m}, N={n})")
    for key, size in (("K", k), ("M", m), ("N", n)):
        if key in meta and meta[key] != size:
            raise GemmFileError(f"{where}: meta {key}={meta[key]!r} but the arrays have {key}={size}")
    scale_a, scale_b = _check_scales(parts, meta, where)
    return Case(name=name, meta=meta, a=a, bt=bt, c=c.view(np.float32), out=out,
                scale_a=scale_a, scale_b=scale_b)


def _check_array(arr: np.ndarray, key: str, dtype, where: str) -> None:
    if arr.dtype != dtype or arr.ndim != 2:
        raise GemmFileError(f"{where}: {key} is a {arr.dtype} array of shape {arr.shape}; it must "
                            f"be a 2-D {np.dtype(dtype)} array")


def _check_meta(meta, where: str) -> dict:
    if not isinstance(meta, dict):
        raise GemmFileError(f"{where}: meta must be a JSON object, got {type(meta).__name__}")
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        raise GemmFileError(f"{where}: meta has no {', '.join(missing)} (needs {', '.join(META_KEYS)})")
    engine = meta["engine"]
    if not isinstance(engine, str) or engine not in ENGINES:
        raise GemmFileError(f"{where}: engine={engine!r}; accepted: {', '.join(ENGINES)}")
    for key in ENGINES[engine]:
        if meta.get(key) is None:
            raise GemmFileError(f"{where}: a {engine} case needs {key} in its meta")
    if not isinstance(meta["dist"], str):
        raise GemmFileError(f"{where}: meta dist={meta['dist']!r} must be a string")
    for key in ("chain", "use_fast_accum"):
        if key in meta and not isinstance(meta[key], bool):
            raise GemmFileError(f"{where}: meta {key}={meta[key]!r} must be true or false")
    for key in ("fa", "fb"):
        try:
            fmt = get_format(meta[key])
        except (ValueError, TypeError, KeyError):
            fmt = None
        if fmt is None or fmt.bits != 8:
            raise GemmFileError(f"{where}: {key}={meta[key]!r} is not an 8-bit format name "
                                "(e4m3, e5m2, float8_e4m3fn, ...)")
    for key in ("K", "M", "N", "BK", "scale_block_k", "max_num_imprecise_acc"):
        v = meta.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise GemmFileError(f"{where}: meta {key}={v!r} must be a non-negative integer")
        if key in ("BK", "scale_block_k") and v == 0:  # a K tile of no elements
            raise GemmFileError(f"{where}: meta {key}=0 must be positive (K elements per tile)")
    return meta


def _check_scales(parts: dict, meta: dict, where: str):
    scale_a, scale_b = parts.get("scale_a"), parts.get("scale_b")
    if (scale_a is None) != (scale_b is None):
        raise GemmFileError(f"{where} has only one of scale_a and scale_b; give both or neither")
    if (scale_a is not None) != (meta["engine"] == "triton_scaled"):
        raise GemmFileError(f"{where}: engine {meta['engine']!r} "
                            f"{'needs' if scale_a is None else 'takes no'} scale_a and scale_b")
    for key, arr in (("scale_a", scale_a), ("scale_b", scale_b)):
        if arr is not None:
            _check_array(arr, key, np.float32, where)
    return scale_a, scale_b


def settings(meta: dict) -> str:
    """The kernel settings of a case, in words (part of its group)."""
    engine = meta["engine"]
    if engine == "triton_dot":
        n = meta.get("max_num_imprecise_acc")
        loop = "acc = dot(a, b, acc)" if meta.get("chain", True) else "acc += dot(a, b)"
        return f"BK={meta['BK']} {loop} imprecise_acc={'default' if n is None else n}"
    if engine == "cublas_scaled_mm":
        return f"use_fast_accum={bool(meta['use_fast_accum'])}"
    if engine == "triton_scaled":
        return f"BK={meta.get('scale_block_k', 128)} y=fma(dot*sx, sw, y)"
    return json.dumps({k: v for k, v in sorted(meta.items())
                       if k not in ("engine", "fa", "fb", "dist", "K", "c", "M", "N")})


def group_key(meta: dict) -> str:
    return f"{meta['engine']} | {settings(meta)} | {meta['fa']}x{meta['fb']} | {meta['dist']}"


def replay_kwargs(meta: dict) -> dict:
    """The ``matmul`` keywords that model the case's kernel."""
    engine = meta["engine"]
    if engine == "triton_dot":
        return triton_dot_schedule(meta["BK"], meta.get("max_num_imprecise_acc"), meta.get("chain", True))
    if engine == "cublas_scaled_mm":
        return cublas_schedule(bool(meta["use_fast_accum"]))
    if engine == "triton_scaled":
        return {"scale_block_k": meta.get("scale_block_k", 128)}
    raise ValueError(f"no model for engine {engine!r}")


def replay(case: Case, device="cpu", **overrides) -> np.ndarray:
    """The hopper model's float32 bit patterns (uint32) for ``case``; ``overrides`` go to
    ``matmul`` (e.g. ``rules=...`` to flip a rule)."""
    import torch

    kwargs = replay_kwargs(case.meta) | overrides
    if case.scale_a is not None:
        kwargs.setdefault("scale_a", torch.from_numpy(case.scale_a).to(device))
        kwargs.setdefault("scale_b", torch.from_numpy(case.scale_b).to(device))
    out = matmul(torch.from_numpy(case.a).to(device), torch.from_numpy(case.bt).to(device),
                 torch.from_numpy(case.c).to(device), fa=case.meta["fa"], fb=case.meta["fb"],
                 model="hopper", **kwargs)
    return out.cpu().numpy().view(np.uint32)


def ulp_distance(x_bits: np.ndarray, y_bits: np.ndarray) -> np.ndarray:
    """|x - y| in float32 ulps, counted along the ordered bit patterns (-0 and +0 are 1 apart;
    NaN against anything else is 2**32)."""
    def ordered(b):
        b = b.astype(np.int64)
        return np.where(b & 0x80000000, 0x80000000 - (b & 0x7FFFFFFF) - 1, b + 0x80000000)
    d = np.abs(ordered(x_bits) - ordered(y_bits))
    nan_x = np.isnan(x_bits.view(np.float32))
    nan_y = np.isnan(y_bits.view(np.float32))
    return np.where(nan_x | nan_y, np.where(x_bits == y_bits, 0, 1 << 32), d)


@dataclass
class GroupResult:
    group: str
    cases: list[str] = field(default_factory=list)
    outputs: int = 0
    matched: int = 0
    max_ulps: int = 0

    @property
    def fraction(self) -> float:
        return self.matched / self.outputs if self.outputs else 0.0

    def as_dict(self) -> dict:
        return {"group": self.group, "cases": self.cases, "outputs": self.outputs,
                "matched": self.matched, "fraction": self.fraction, "max_ulps": self.max_ulps}


def verify(path, device="cpu", **overrides) -> list[GroupResult]:
    """Replay every case of ``path``; per group the fraction of bit patterns reproduced. Raises
    :class:`GemmFileError` for a file that cannot be replayed (see :func:`load_cases`; also a
    case whose settings the model rejects)."""
    _, cases = load_cases(path)
    groups: dict[str, GroupResult] = {}
    for case in cases:
        try:
            got = replay(case, device, **overrides)
        except (ValueError, TypeError) as e:  # the model's own checks of settings and scales
            raise GemmFileError(f"{path}: case {case.name}: {e}") from None
        g = groups.setdefault(case.group, GroupResult(case.group))
        g.cases.append(case.name)
        g.outputs += got.size
        g.matched += int((got == case.out).sum())
        g.max_ulps = max(g.max_ulps, int(ulp_distance(got, case.out).max(initial=0)))
    return list(groups.values())
