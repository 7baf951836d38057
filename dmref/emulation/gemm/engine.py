"""Emulated FP8 GEMM: ``out = a @ bt.T + c`` from FP8 codes, under a chosen accumulation model,
bit for bit what an H100/H200 tensor core returns for the ``hopper`` model.

API
---
``matmul(a, bt, c=None, *, fa=None, fb=None, model="hopper", promote_every=None, tile_k=None,
chain=True, scale_a=None, scale_b=None, scale_block_k=128, rules=HOPPER) -> float32``

- ``a (..., M, K)`` and ``bt (..., N, K)``: FP8 codes as uint8 (numpy or torch, CPU or CUDA),
  with their formats ``fa``/``fb`` (``"e4m3"``, ``"e5m2"``, any 8-bit :class:`Format`); or torch
  float8 tensors / ml_dtypes float8 arrays, whose format is read from the dtype; or float
  tensors whose values are all exactly representable in ``fa``/``fb``. Both operands K-major,
  as FP8 wgmma needs them. Leading dimensions are batch dimensions (the same in both).
- ``c``: float32, broadcastable to (..., M, N), the initial accumulator; None means +0.
- Result: float32 (..., M, N), numpy if ``a`` is numpy, else a tensor on ``a``'s device.
  Every NaN result is 0x7FFFFFFF, the NaN NVIDIA GPUs write.
- ``model`` (:class:`Accumulation` or its value):

  ``"exact"``   exact products and exact sum (with ``c``), rounded once to float32 (nearest even).
  ``"fp32"``    ``acc = c``, then ``acc = fl32(acc + a_k b_k)`` for k = 0, 1, ..., K-1 in order.
  ``"hopper"``  the wgmma model (``rules``, default :data:`HOPPER`; see :class:`WgmmaRules`
                and docs/gemm.md): k-steps of 32 products, each aligned to the largest exponent
                of the step (accumulator included), truncated to 13 fraction bits, summed
                exactly and truncated to 14 significant bits.

- The K loop of a ``hopper`` kernel (ignored by ``exact`` and ``fp32``, which are defined on the
  whole sum):

  ``promote_every=N``  every N products (N a multiple of 32) the k-steps restart from a zeroed
                       partial accumulator, which is added to the float32 accumulator with a
                       round-to-nearest float32 add (and at the end of every ``tile_k`` tile).
                       If N > ``tile_k`` no partial accumulator is used at all (Triton's rule).
  ``tile_k=BK``        the kernel's K tile; ``chain=True`` feeds the accumulator into each tile's
                       first wgmma (``acc = tl.dot(a, b, acc)``), ``chain=False`` computes each
                       tile from zero and adds it (``acc += tl.dot(a, b)``).

  The settings of real kernels (:func:`triton_dot_schedule`, :func:`cublas_schedule`):

  ======================================================  =====================================
  Triton ``acc = tl.dot(a, b, acc)``, default               ``tile_k=BK`` (no promotion)
  Triton ``max_num_imprecise_acc=N``                        ``tile_k=BK, promote_every=N``
  Triton ``acc += tl.dot(a, b)``                            ``tile_k=BK, chain=False``
  cuBLAS ``torch._scaled_mm(use_fast_accum=True)``          (nothing: one chain)
  cuBLAS ``torch._scaled_mm(use_fast_accum=False)``         ``promote_every=128``
  DeepSeek-V3 (FP32 promotion every 128 of K)               ``promote_every=128``
  ======================================================  =====================================

- Block scales (all models): ``scale_a`` float32 (M, T) or (ceil(M/128), T) and ``scale_b``
  (N, T) or (ceil(N/128), T), T = ceil(K / scale_block_k): per K tile t the tile's partial
  result P_t (computed from zero under ``model``) is applied as in Transformer Engine's
  blockwise GEMM reference, ``y = fma(P_t * sx, sw, y)`` with ``y`` starting at ``c``; the
  product ``P_t * sx`` is rounded to float32 and the FMA rounds once.

Other public names: :class:`Accumulation`, :class:`WgmmaRules`, :data:`HOPPER`,
:func:`triton_dot_schedule`, :func:`cublas_schedule`, :func:`error_bound` (the a-priori error
bound of each model, in :mod:`dmref.emulation._gemm_bounds`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import torch

from . import _gemm_exact, _gemm_hopper
from ._gemm_tables import canonicalize_nan, run_blocks
from .formats import FORMATS, Format, Rounding, check_bool, get_format


class Accumulation(enum.Enum):
    """How the products are summed."""

    EXACT = "exact"  #: exact products and sum, rounded once to float32
    FP32 = "fp32"  #: float32 adds, one product at a time, k increasing, starting from c
    HOPPER = "hopper"  #: Hopper FP8 wgmma k-steps (WgmmaRules), with the kernel's promotion


@dataclass(frozen=True)
class WgmmaRules:
    """The rules of one FP8 wgmma k-step. :data:`HOPPER` is the measured H100/H200 behaviour;
    each field can be flipped to show which captured case then fails (docs/gemm.md)."""

    k_step: int = 32  #: products per wgmma k-step
    term_frac_bits: int = 13  #: fraction bits kept of every term, relative to 2**E
    result_bits: int = 14  #: significant bits of a step's result
    term_rounding: Rounding = Rounding.TOWARD_ZERO  #: how terms lose their low bits
    result_rounding: Rounding = Rounding.TOWARD_ZERO  #: how the result loses its low bits
    accumulator_in_max: bool = True  #: the accumulator's exponent takes part in E
    truncate_accumulator: bool = True  #: the accumulator is truncated like a product
    subnormals_at_emin: bool = True  #: a subnormal operand has exponent emin (significand < 1)
    subnormal_accumulator_at_emin: bool = True  #: a float32 subnormal C has exponent -126
    zeros_in_max: bool = False  #: zero products (exponent emin) take part in E
    normalised_products: bool = False  #: a product's exponent is floor(log2|ab|), not ea + eb

    def __post_init__(self):
        for name in ("term_rounding", "result_rounding"):
            r = Rounding(getattr(self, name))
            if r not in (Rounding.TOWARD_ZERO, Rounding.NEAREST_EVEN):
                raise ValueError(f"{name}={r.value!r}: only toward_zero and nearest_even exist here")
            object.__setattr__(self, name, r)
        if self.k_step <= 0 or self.k_step & (self.k_step - 1):
            raise ValueError(f"k_step={self.k_step} must be a power of two")
        if not 1 <= self.result_bits <= 24:
            raise ValueError(f"result_bits={self.result_bits} must be in 1..24")


#: The Hopper (sm_90) FP8 wgmma, as measured on an H200 (docs/gemm.md).
HOPPER = WgmmaRules()


@dataclass(frozen=True)
class MatmulModel:
    """How one matmul of an attention recipe sums its products: an :class:`Accumulation` and,
    for ``HOPPER``, the kernel's promotion interval and wgmma rules.

    - ``EXACT``: exact products and sum, rounded once to float32; with ``float64_result`` the
      sum is kept in float64 (the ``exact`` preset's reference arithmetic).
    - ``FP32``: float32 additions of exact products (the error bound is gamma_K whatever the
      order; :func:`matmul` adds in k order, ``dmref.tiled`` in torch's order).
    - ``HOPPER``: the wgmma k-steps of ``rules``, promoted to float32 every ``promote_every``
      products (None: one chain per scale block).

    ``MatmulModel.get`` reads the names of the user's edge: ``"fp32"``, ``"exact"``,
    ``"float64"``, ``"hopper"``, ``"hopper-p64"`` (promotion every 64 products); ``name`` writes
    them back.
    """

    accumulation: Accumulation = Accumulation.FP32
    promote_every: int | None = None
    float64_result: bool = False
    rules: WgmmaRules = HOPPER

    def __post_init__(self):
        object.__setattr__(self, "accumulation", Accumulation(self.accumulation))
        object.__setattr__(self, "float64_result", check_bool(self.float64_result, "float64_result"))
        if self.promote_every is not None:
            if self.accumulation is not Accumulation.HOPPER:
                raise ValueError(f"promote_every={self.promote_every} describes a wgmma kernel; "
                                 f"the {self.accumulation.value!r} model is defined on the whole sum")
            if self.promote_every <= 0 or self.promote_every % self.rules.k_step:
                raise ValueError(f"promote_every={self.promote_every} must be a positive multiple of "
                                 f"the k-step {self.rules.k_step}")
        if self.float64_result and self.accumulation is not Accumulation.EXACT:
            raise ValueError(f"float64_result needs the exact model, got {self.accumulation.value!r}")

    @property
    def name(self) -> str:
        if self.float64_result:
            return "float64"
        if self.promote_every is not None:
            return f"{self.accumulation.value}-p{self.promote_every}"
        return self.accumulation.value

    def __str__(self) -> str:
        return self.name

    @classmethod
    def get(cls, model: "MatmulModel | Accumulation | str") -> "MatmulModel":
        """The model for itself, an :class:`Accumulation`, or a name (class docstring)."""
        if isinstance(model, MatmulModel):
            return model
        if isinstance(model, Accumulation):
            return cls(model)
        if not isinstance(model, str):
            raise TypeError(f"an accumulation model is a MatmulModel or a name, got {type(model).__name__}")
        if model == "float64":
            return cls(Accumulation.EXACT, float64_result=True)
        base, sep, promote = model.partition("-p")
        try:
            acc = Accumulation(base)
            every = int(promote) if sep else None
        except ValueError:
            known = "'exact', 'float64', 'fp32', 'hopper', 'hopper-p<N>'"
            raise ValueError(f"unknown accumulation model {model!r}; known: {known}") from None
        return cls(acc, every)


def triton_dot_schedule(block_k: int, max_num_imprecise_acc: int | None = None,
                        chain: bool = True) -> dict:
    """``matmul`` keywords for a Triton K loop over ``block_k`` tiles:
    ``acc = tl.dot(a, b, acc, max_num_imprecise_acc=N)`` (chain) or ``acc += tl.dot(a, b)``.
    ``None`` is Triton's FP8 default on sm_90 (2**30: never promote). Triton refuses
    ``max_num_imprecise_acc > block_k`` at compile time (seen on the H200 with Triton 3.6)."""
    if max_num_imprecise_acc is not None and max_num_imprecise_acc > block_k:
        raise ValueError(f"{max_num_imprecise_acc=} > {block_k=}: Triton rejects this schedule "
                         "('max_num_imprecise_acc must be <= K')")
    return {"tile_k": block_k, "promote_every": max_num_imprecise_acc, "chain": check_bool(chain, "chain")}


def cublas_schedule(use_fast_accum: bool) -> dict:
    """``matmul`` keywords for ``torch._scaled_mm`` on Hopper: fast accumulation is one
    unpromoted chain; without it cuBLAS promotes every 128 products (measured on an H200)."""
    return {"promote_every": None if check_bool(use_fast_accum, "use_fast_accum") else 128}


# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------

_TORCH_FP8 = {f.torch_dtype: f.name for f in FORMATS.values() if f.is_fp8 and f.torch_dtype is not None}
_NUMPY_FP8 = {np.dtype(getattr(ml_dtypes, n)): n for n in ("float8_e4m3fn", "float8_e5m2",
                                                            "float8_e4m3fnuz", "float8_e5m2fnuz")}


def _as_codes(x, fmt, name: str) -> tuple[torch.Tensor, Format]:
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
        from .cast import decode, encode

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


def _as_float32(x, device, name: str) -> torch.Tensor:
    t = torch.as_tensor(x) if not isinstance(x, torch.Tensor) else x
    if t.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {t.dtype}")
    return t.to(device)


def _expand_scale(s, rows: int, tiles: int, device, name: str) -> torch.Tensor:
    """(rows, tiles) float32 from per-row or per-128-row-block scales."""
    s = _as_float32(s, device, name)
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


# ----------------------------------------------------------------------------------------------
# The K schedule of the hopper model
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Tile:
    k0: int
    k1: int
    segments: tuple[tuple[int, int], ...] | None  #: partial-accumulator spans; None: none


def plan_k_tiles(k_padded: int, k_step: int, promote_every: int | None, tile_k: int | None) -> list[_Tile]:
    """The K loop of a hopper kernel: its ``tile_k`` tiles over ``k_padded`` products, each with
    the spans of its partial accumulators (``promote_every``; None: the tile is one chain)."""
    for name, v in (("promote_every", promote_every), ("tile_k", tile_k)):
        if v is not None and (v <= 0 or v % k_step):
            raise ValueError(f"{name}={v} must be a positive multiple of the k-step {k_step}")
    tile = tile_k or k_padded
    tiles = []
    for k0 in range(0, k_padded, tile):
        k1 = min(k_padded, k0 + tile)
        segments = None
        if promote_every is not None and promote_every <= tile:
            segments = tuple((s, min(k1, s + promote_every)) for s in range(k0, k1, promote_every))
        tiles.append(_Tile(k0, k1, segments))
    return tiles


#: Output block of one pass on the CPU: the (32, TI, TJ) float32 products (1 MiB) stay in L2.
CPU_BLOCK = (64, 128)


def _block_shape(m: int, n: int, device: torch.device) -> tuple[int, int]:
    """On the CPU, :data:`CPU_BLOCK`; on CUDA as large as about 1 GiB of products allows."""
    if device.type == "cpu":
        return min(m, CPU_BLOCK[0]), min(n, CPU_BLOCK[1])
    per_row = 32 * 4 * n
    return max(1, min(m, (1 << 30) // per_row)), n


def _hopper(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, fa: Format, fb: Format,
            rules: WgmmaRules, promote_every, tile_k, chain, scales) -> torch.Tensor:
    m, k = a.shape
    n = b.shape[0]
    ks = rules.k_step
    k_padded = -(-k // ks) * ks
    align = _gemm_hopper.alignment(fa, fb, rules)
    op_a = _gemm_hopper.prepare(a, fa, rules, align.offset_a, align.dtype, k_padded)
    op_b = _gemm_hopper.prepare(b, fb, rules, align.offset_b, align.dtype, k_padded)
    if scales is not None:
        tile_k, chain = scales[2], False
    plan = plan_k_tiles(k_padded, ks, promote_every, tile_k)
    specials = not bool(torch.isfinite(c).all())
    out = torch.empty((m, n), dtype=torch.float32, device=a.device)
    steps = k_padded // ks

    def block(rows: slice, cols: slice) -> None:
        kern = _gemm_hopper.TileKernel(op_a, op_b, rows, cols, align, rules, step_block=8,
                                       specials=specials)
        zero = torch.zeros(kern.shape, dtype=torch.float32, device=a.device)

        def run(acc, k0, k1):
            for s in range(k0 // ks, k1 // ks):
                acc = kern.step(acc, s, steps)
            return acc

        acc = c[rows, cols]
        for t, tile in enumerate(plan):
            if chain and tile.segments is None:  # acc = dot(a, b, acc)
                acc = run(acc, tile.k0, tile.k1)
            elif chain:  # promotion: partial accumulators added to acc
                for s0, s1 in tile.segments:
                    acc = acc + run(zero, s0, s1)
            else:  # acc += dot(a, b): the tile from zero (its partials summed first)
                d = None
                for s0, s1 in tile.segments or ((tile.k0, tile.k1),):
                    p = run(zero, s0, s1)
                    d = p if d is None else d + p
                if scales is None:
                    acc = acc + d
                else:  # y = fma(partial * sx, sw, y)
                    acc = _gemm_exact.fma_f32(d * scales[0][rows, t, None], scales[1][None, cols, t], acc)
        out[rows, cols] = acc

    ti, tj = _block_shape(m, n, a.device)
    blocks = [(slice(r0, min(m, r0 + ti)), slice(c0, min(n, c0 + tj)))
              for r0 in range(0, m, ti) for c0 in range(0, n, tj)]
    run_blocks(block, blocks, a.device)
    return out


def _scaled_tiles(a, b, c, fa, fb, model, scales):
    """exact / fp32 with block scales: per K tile the model's partial, then the TE epilogue."""
    sa, sb, block = scales
    y = c
    zero = torch.zeros_like(c)
    for t, k0 in enumerate(range(0, a.shape[1], block)):
        at, bt = a[:, k0:k0 + block], b[:, k0:k0 + block]
        if model is Accumulation.EXACT:
            p = _gemm_exact.exact_matmul(at, bt, zero, fa, fb)
        else:
            p = _gemm_exact.fp32_matmul(at, bt, zero, fa, fb)
        y = _gemm_exact.fma_f32(p * sa[:, t, None], sb[None, :, t], y)
    return y


# ----------------------------------------------------------------------------------------------
# The public function
# ----------------------------------------------------------------------------------------------


def matmul(a, bt, c=None, *, fa=None, fb=None, model: Accumulation | str = Accumulation.HOPPER,
           promote_every: int | None = None, tile_k: int | None = None, chain: bool = True,
           scale_a=None, scale_b=None, scale_block_k: int = 128,
           rules: WgmmaRules = HOPPER):
    """``a @ bt.T + c`` from FP8 operands under an accumulation model (module docstring).

    With M = 0, N = 0 or an empty batch the result is empty; with K = 0 it is ``c`` itself (no
    products, no k-step: +0 where c is None) in every model, NaN written as 0x7FFFFFFF.

    ``fa``/``fb``: 8-bit element formats (e8m0, a scale format, is refused); ``c``: float32 of
    shape (..., M, N) or one that broadcasts to it; ``scale_block_k``: a positive int (the K
    extent of one block scale); ``chain``: a bool. ValueError or TypeError otherwise, naming the
    value."""
    model = Accumulation(model)
    chain = check_bool(chain, "chain")
    if isinstance(scale_block_k, bool) or not isinstance(scale_block_k, (int, np.integer)):
        raise TypeError(f"scale_block_k must be an int (K elements per block scale), got {scale_block_k!r}")
    if scale_block_k <= 0:
        raise ValueError(f"scale_block_k={scale_block_k} must be positive (K elements per block scale)")
    scale_block_k = int(scale_block_k)
    was_numpy = isinstance(a, np.ndarray)
    a, fa = _as_codes(a, fa, "a")
    bt, fb = _as_codes(bt, fb, "bt")
    bt = bt.to(a.device)
    if a.ndim < 2 or a.shape[:-2] != bt.shape[:-2] or a.shape[-1] != bt.shape[-1]:
        raise ValueError(f"a {tuple(a.shape)} and bt {tuple(bt.shape)} must be (..., M, K) and "
                         "(..., N, K) with the same batch dimensions and K")
    if model is not Accumulation.HOPPER and (promote_every is not None or tile_k is not None
                                             or not chain):
        raise ValueError(f"promote_every, tile_k and chain describe wgmma kernels; the "
                         f"{model.value!r} model is defined on the whole sum")
    batch, (m, k), n = a.shape[:-2], a.shape[-2:], bt.shape[-2]
    c = torch.zeros((), dtype=torch.float32) if c is None else c
    c = _as_float32(c, a.device, "c")
    try:
        fits = torch.broadcast_shapes(c.shape, (*batch, m, n)) == (*batch, m, n)
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(f"c has shape {tuple(c.shape)}; expected the result's shape {(*batch, m, n)} "
                         "(..., M, N) or one that broadcasts to it")
    c = c.expand(*batch, m, n)
    if (scale_a is None) != (scale_b is None):
        raise ValueError("give both scale_a and scale_b, or neither")
    tiles = -(-k // scale_block_k)
    if scale_a is not None and tile_k is not None and tile_k != scale_block_k:
        raise ValueError(f"block scales fix the K tile: {tile_k=} != {scale_block_k=}")
    if scale_a is not None and model is Accumulation.HOPPER and scale_block_k % rules.k_step:
        raise ValueError(f"scale_block_k={scale_block_k} must be a multiple of the k-step {rules.k_step}: "
                         "under the hopper model each block scale applies to whole wgmma k-steps")

    # explicit sizes: a dimension of size 0 leaves -1 undetermined
    nb = int(np.prod(batch, dtype=np.int64))
    a2, b2 = a.reshape(nb, m, k), bt.reshape(nb, n, k)
    c2 = c.reshape(nb, m, n)

    def item(s, i):  # the batch entry i of a block scale; a 0-d or 1-d scale serves them all
        return s.reshape(nb, *s.shape[-2:])[i] if batch and s.ndim >= 2 else s

    outs = []
    for i in range(nb):
        scales = None
        if scale_a is not None:
            sa = _expand_scale(item(scale_a, i), m, tiles, a.device, "scale_a")
            sb = _expand_scale(item(scale_b, i), n, tiles, a.device, "scale_b")
            scales = (sa, sb, scale_block_k)
        ai, bi, ci = a2[i], b2[i], c2[i].contiguous()
        if ai.numel() == 0 or bi.numel() == 0:
            # no products (K = 0: the sum is exactly zero, out = c in every model) or no
            # outputs (M = 0 or N = 0)
            out = ci.clone()
        elif model is Accumulation.HOPPER:
            out = _hopper(ai, bi, ci, fa, fb, rules, promote_every, tile_k, chain, scales)
        elif scales is not None:
            out = _scaled_tiles(ai, bi, ci, fa, fb, model, scales)
        elif model is Accumulation.EXACT:
            out = _gemm_exact.exact_matmul(ai, bi, ci, fa, fb)
        else:
            out = _gemm_exact.fp32_matmul(ai, bi, ci, fa, fb)
        outs.append(canonicalize_nan(out))
    if outs:
        out = torch.stack(outs).reshape(*batch, m, n)
    else:  # an empty batch
        out = torch.empty((*batch, m, n), dtype=torch.float32, device=a.device)
    return out.cpu().numpy() if was_numpy else out


def error_bound(*args, **kwargs):
    """The a-priori bound on ``|matmul(...) - exact value|``; see :mod:`._gemm_bounds`."""
    from ._gemm_bounds import error_bound as _bound

    return _bound(*args, **kwargs)


__all__ = ["Accumulation", "HOPPER", "MatmulModel", "WgmmaRules", "cublas_schedule", "error_bound", "matmul",
           "triton_dot_schedule"]
