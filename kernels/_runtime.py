"""Where the kernels may run: a Hopper GPU, or Triton's interpreter on the CPU.

Triton reads ``TRITON_INTERPRET`` when a kernel is defined, so the interpreter has to be switched on
before ``dmref.kernels``' kernel modules are first imported (the tests do it in a conftest).
"""

from __future__ import annotations

import os

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
