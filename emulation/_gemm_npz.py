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
from dataclasses import dataclass, field

import numpy as np

from .gemm import cublas_schedule, matmul, triton_dot_schedule


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
    """(about, cases) of a ground-truth file; never needs pickle."""
    with np.load(path, allow_pickle=False) as z:
        about = json.loads(str(z["about"])) if "about" in z.files else {}
        names = sorted({f.rsplit("_", 1)[0] for f in z.files if f.endswith("_meta")})
        cases = []
        for name in names:
            get = lambda key: z[f"{name}_{key}"] if f"{name}_{key}" in z.files else None
            cases.append(Case(
                name=name, meta=json.loads(str(z[f"{name}_meta"])), a=z[f"{name}_a"],
                bt=z[f"{name}_bt"], c=z[f"{name}_c"].view(np.float32), out=z[f"{name}_out"],
                scale_a=get("scale_a"), scale_b=get("scale_b"),
            ))
    return about, cases


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
        return self.matched / self.outputs if self.outputs else 1.0

    def as_dict(self) -> dict:
        return {"group": self.group, "cases": self.cases, "outputs": self.outputs,
                "matched": self.matched, "fraction": self.fraction, "max_ulps": self.max_ulps}


def verify(path, device="cpu", **overrides) -> list[GroupResult]:
    """Replay every case of ``path``; per group the fraction of bit patterns reproduced."""
    _, cases = load_cases(path)
    groups: dict[str, GroupResult] = {}
    for case in cases:
        got = replay(case, device, **overrides)
        g = groups.setdefault(case.group, GroupResult(case.group))
        g.cases.append(case.name)
        g.outputs += got.size
        g.matched += int((got == case.out).sum())
        g.max_ulps = max(g.max_ulps, int(ulp_distance(got, case.out).max(initial=0)))
    return list(groups.values())
