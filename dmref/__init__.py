"""dmref: the reference, emulation and verification library for FP8 attention with
Delta-Matching.

``import dmref`` stays light (no torch import); the names below load their module on first use:

- ``dmref.attention(q, k, v, *, causal=False, scale=None, mask=None, recipe="exact")``: the
  differentiable emulated attention (:mod:`dmref.api`);
- ``dmref.Recipe``, ``dmref.PRESETS``, ``dmref.get_recipe``: recipes as data (:mod:`dmref.recipes`);
  ``get_recipe`` also returns the Recipes dmref.kernels runs, by their names
  (``"kernels_delta_matching"``, ...);
- ``dmref.attention_ref``: the exact float64 reference (:mod:`dmref.reference`);
- ``dmref.evaluate``: diagnostics of a recipe against the reference (:mod:`dmref.diagnostics`).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "attention": ("dmref.api", "attention"),
    "Recipe": ("dmref.recipes", "Recipe"),
    "PRESETS": ("dmref.recipes", "PRESETS"),
    "get_recipe": ("dmref.recipes", "get_recipe"),
    "attention_ref": ("dmref.reference", "attention_ref"),
    "evaluate": ("dmref.diagnostics", "evaluate"),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dmref' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
