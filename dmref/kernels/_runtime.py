"""Where the kernels may run: a Hopper GPU, or Triton's interpreter on the CPU.

Triton reads ``TRITON_INTERPRET`` when a kernel is defined, so the interpreter has to be switched on
before ``dmref.kernels``' kernel modules are first imported (the tests do it in a conftest).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch


def interpreting() -> bool:
    """True when Triton's interpreter runs the kernels (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def require_runnable(*tensors: torch.Tensor) -> None:
    """Raise a clear error when the kernels cannot run on these tensors here."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise RuntimeError(
            "dmref.kernels needs triton (pip install 'dmref[gpu]') and a CUDA GPU of compute "
            "capability >= 9.0"
        ) from exc
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    (device,) = devices
    if interpreting():
        if device.type != "cpu":
            raise RuntimeError(f"TRITON_INTERPRET=1 runs kernels on the CPU; tensors are on {device}")
        return
    if device.type != "cuda":
        raise RuntimeError(
            f"dmref.kernels runs on a CUDA GPU of compute capability >= 9.0 (Hopper); the tensors "
            f"are on {device}"
            + ("" if torch.cuda.is_available() else " and this machine has no CUDA GPU")
            + ". To check indexing on the CPU, set TRITON_INTERPRET=1 before importing triton."
        )
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        raise RuntimeError(
            f"dmref.kernels uses FP8 wgmma, which needs compute capability >= 9.0; "
            f"{torch.cuda.get_device_name(device)} has {major}.{minor}"
        )


def register_cap(maxnreg: int | None) -> dict:
    """Launch options for a tiling's register cap (Triton's ``maxnreg``); none under the
    interpreter, which does not compile."""
    return {} if maxnreg is None or interpreting() else {"maxnreg": maxnreg}


@dataclass(frozen=True)
class Launch:
    """How one kernel is launched: its constexprs, Triton's launch options and the block shapes
    of the arguments it takes as TMA tensor descriptors. Each kernel has one function that
    returns it (``fwd.launch``, ``bwd.launch``, ``quantize.launch``), read by its launcher and by
    ``compile_check`` alike."""

    constexprs: dict
    num_warps: int
    num_stages: int
    maxnreg: int | None = None  #: register cap per thread (None: the compiler's choice)
    descriptors: dict = field(default_factory=dict)  #: argument name -> TMA block shape

    def options(self) -> dict:
        """The launch options as keyword arguments (``num_warps``, ``num_stages``, ``maxnreg``)."""
        return dict(num_warps=self.num_warps, num_stages=self.num_stages, **register_cap(self.maxnreg))
