"""Triton FP8 attention kernels for Hopper (sm_90) and their torch.autograd wrappers.

This is the only part of dmref that imports triton, and only lazily: importing
``dmref.kernels`` on a machine without triton or without a GPU works; calling a kernel there
raises a clear error.

- :func:`attention` — ``torch.autograd.Function`` over BF16 ``(B, H, N, D)`` tensors;
  :func:`quantize_kv` — K and V quantized once for it (``kv_fp8``, the folded recipes').
- :mod:`dmref.kernels.config` — what the kernels run, importable without triton: a
  :class:`KernelSpec` (a ``dmref.recipes.Recipe`` and the tilings) per recipe name of
  :data:`SPECS` (``kernels_delta_matching``, ``kernels_naive_fp8``, ``kernels_delta_prepass`` and
  their ``kernels_folded_`` forms; :data:`DEFAULT_RECIPE` when none is named); ``dmref.get_recipe(name)`` is the spec's Recipe (:func:`get_spec` finds a spec; ``RECIPES`` and ``get_recipe`` are deprecated aliases).
"""

from __future__ import annotations

from .config import DEFAULT_RECIPE, RECIPES, SPECS, BwdTiles, FwdTiles, KernelSpec, get_recipe, get_spec

__all__ = ["attention", "quantize_kv", "DEFAULT_RECIPE", "SPECS", "BwdTiles", "FwdTiles", "KernelSpec", "get_spec", "RECIPES", "get_recipe"]


def attention(q, k, v, *, causal=False, scale=None, recipe=DEFAULT_RECIPE, kv_fp8=None):
    """FP8 attention with Delta-Matching; see :func:`dmref.kernels.api.attention`."""
    from .api import attention as _attention

    return _attention(q, k, v, causal=causal, scale=scale, recipe=recipe, kv_fp8=kv_fp8)


def quantize_kv(k, v, *, recipe=DEFAULT_RECIPE, for_backward=True):
    """K and V quantized once for :func:`attention`'s ``kv_fp8``; see
    :func:`dmref.kernels.api.quantize_kv`."""
    from .api import quantize_kv as _quantize_kv

    return _quantize_kv(k, v, recipe=recipe, for_backward=for_backward)
