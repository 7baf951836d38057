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
        patch_interpreter_scalar_index()
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


#: Triton's name of each element type the kernels' arguments hold, by the format's name (the one
#: table: signatures write ``"*" + name``, Gluon layouts take ``triton.language.dtype(name)``).
TRITON_TYPES = {"float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5", "bfloat16": "bf16", "float32": "fp32"}


def triton_type(fmt: str) -> str:
    """Triton's name of the element type ``fmt`` (a format's name, ``dmref.emulation``'s or torch's
    dtype name, e.g. ``"float8_e4m3fn"`` -> ``"fp8e4nv"``)."""
    try:
        return TRITON_TYPES[fmt]
    except KeyError:
        raise ValueError(f"no Triton type for {fmt!r}: one of {sorted(TRITON_TYPES)}") from None


@dataclass(frozen=True)
class Launch:
    """How one kernel is launched: the jitted kernel (Triton or Gluon), its constexprs, the launch
    options, the tokens a program takes along the grid's first axis, and the block shapes of the
    arguments it takes as Triton TMA tensor descriptors. Each kernel has one function that returns
    it from a ``config.KernelSpec`` and the problem (``fwd.launch``, ``bwd.launch``,
    ``fwd_ws.launch``, ``bwd_ws.launch``, ``quantize.launch``), read by its launcher and by
    ``compile_check.compile_launch`` alike."""

    constexprs: dict
    num_warps: int
    #: Triton's software-pipelining depth (None: not an option of the kernel, as for Gluon's)
    num_stages: int | None
    maxnreg: int | None = None  #: register cap per thread (None: the compiler's choice)
    descriptors: dict = field(default_factory=dict)  #: argument name -> TMA block shape
    kernel: object = None  #: the jitted kernel
    block_m: int | None = None  #: tokens per program along the grid's first axis
    #: a compilation without a launch (Gluon kernels): ``signature(launch, n_multiple_of_16)`` gives
    #: the argument types and divisibility attributes; None: ``compile_check`` derives them from the
    #: argument names
    signature: object = None

    def options(self) -> dict:
        """The launch options as keyword arguments (``num_warps``, ``num_stages``, ``maxnreg``)."""
        stages = {} if self.num_stages is None else {"num_stages": self.num_stages}
        return dict(num_warps=self.num_warps, **stages, **register_cap(self.maxnreg))

    def start(self, grid, *args) -> None:
        """Launch this kernel on ``grid`` with the positional ``args`` and its constexprs and
        options."""
        self.kernel[grid](*args, **self.constexprs, **self.options())

    def grid(self, n: int, programs: int) -> tuple[int, int]:
        """The grid over ``n`` tokens and ``programs`` heads (or key/value heads)."""
        return (-(-n // self.block_m), programs)
