"""Triton FP8 attention kernels for Hopper (sm_90) and their torch.autograd wrappers.

This is the only part of dmref that imports triton, and only lazily: importing
``dmref.kernels`` on a machine without triton or without a GPU works; calling a kernel there
raises a clear error.

- :func:`attention` — ``torch.autograd.Function`` over BF16 ``(B, H, N, D)`` tensors.
- :mod:`dmref.kernels.config` — tile configurations and the recipes the kernels implement
  (``RECIPES["delta_matching"]``, ``RECIPES["naive_fp8"]``), importable without triton.
"""

from __future__ import annotations

from .config import RECIPES, BwdTiles, FwdTiles, KernelRecipe, get_recipe

__all__ = ["attention", "RECIPES", "BwdTiles", "FwdTiles", "KernelRecipe", "get_recipe"]


def attention(q, k, v, *, causal=False, scale=None, recipe="delta_matching"):
    """FP8 attention with Delta-Matching; see :func:`dmref.kernels.api.attention`."""
    from .api import attention as _attention

    return _attention(q, k, v, causal=causal, scale=scale, recipe=recipe)
