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


if not hopper_available():
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton  # noqa: F401
    except ImportError:  # the tests that need triton skip or fail on their own
        pass
    else:
        from dmref.kernels._runtime import patch_interpreter_scalar_index

        patch_interpreter_scalar_index()

# the helper modules beside this file (kernel_inputs, kernel_bounds, reference_intermediates) import by name
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
