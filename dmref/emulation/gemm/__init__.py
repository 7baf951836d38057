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
bound of each model), :func:`plan_k_tiles`.

Modules
-------
``model``     the model as data, no torch: Accumulation, WgmmaRules, HOPPER, MatmulModel, the
              schedules of real kernels, plan_k_tiles
``engine``    :func:`matmul` on torch tensors (CPU or CUDA)
``operands``  FP8 codes, float32 accumulators and block scales from what the caller gives
``hopper``    the ``hopper`` k-step, vectorised; ``exact``: the ``exact`` and ``fp32`` models
``tables``    per-code tables of a format, shared by the engines
``bounds``    :func:`error_bound`, the a-priori bound of each model
``spec``      the plain-Python specification (exact rationals) that ``matmul`` must equal
``captures``  files of real GPU GEMM outputs (tests/data/h200_fp8_gemm.npz): read, replay, verify
"""

from .bounds import error_bound
from .engine import CPU_BLOCK, matmul
from .model import (HOPPER, Accumulation, KTile, MatmulModel, WgmmaRules, cublas_schedule, plan_k_tiles,
                    triton_dot_schedule)

__all__ = ["Accumulation", "HOPPER", "MatmulModel", "WgmmaRules", "cublas_schedule", "error_bound", "matmul",
           "triton_dot_schedule"]
