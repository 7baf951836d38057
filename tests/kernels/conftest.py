"""Kernel tests run twice over the same bodies: on a Hopper GPU, and in Triton's interpreter on
the CPU (indexing and masking, at small sizes, in CI).

Triton decides between compiling and interpreting when a kernel is defined, so the interpreter is
switched on here, before any test imports the kernel modules, whenever this process has no Hopper
GPU. A process with one runs the GPU variants only.
"""

from __future__ import annotations

import os
import sys

import torch


def hopper_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def patch_interpreter_scalar_index() -> None:
    """Work around Triton's interpreter under NumPy >= 2.4: let it use program-id-derived values
    as ``range`` bounds.

    The interpreter holds a scalar as a 1-element array and converts it with ``int(array)``
    (``triton/runtime/interpreter.py``, ``_patch_lang_tensor``: ``__index__``), which NumPy 2.4
    turned from a deprecation warning into ``TypeError: only 0-dimensional arrays can be
    converted to Python scalars``; every kernel loop whose bounds come from ``program_id`` (all
    of the backward's) then fails in the interpreter only. Still needed with Triton 3.6.0 and
    NumPy 2.4 (without it the interpreter tests fail with that TypeError). This wraps the
    interpreter's per-call patching of ``tl.tensor`` so that ``__index__`` reads the single
    element. Idempotent.
    """
    from triton.runtime import interpreter

    if getattr(interpreter, "_dmref_index_patched", False):
        return
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    interpreter._dmref_index_patched = True


if not hopper_available():
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton  # noqa: F401
    except ImportError:  # the tests that need triton skip or fail on their own
        pass
    else:
        patch_interpreter_scalar_index()

# the helper modules beside this file (kernel_inputs, kernel_bounds, reference_intermediates) import by name
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
