"""Running the implementation under test: the options a check takes (validated, naming the
value), the call of fn on a case (forward and backward in the case's layout, what the call did
to its inputs and output), the per-case timeout, exits and device faults."""

from __future__ import annotations

import inspect
import threading

import torch

from .cases import Case
from .targets import TargetUnavailable  # defined with the targets, which raise it

__all__ = ["DTYPE_NAMES", "MAX_TIMEOUT", "TargetUnavailable", "check_timeout", "device_problem", "resolve_dtype",
           "run_case", "validate_signature"]

#: dtype names :func:`check` (and ``dmref check --dtype``, the marker's ``dtype=``) accept
DTYPE_NAMES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
               "fp32": torch.float32, "float32": torch.float32, "fp64": torch.float64, "float64": torch.float64}

#: The longest per-case timeout: the runner waits on a worker thread with
#: ``threading.Thread.join(timeout)``, which takes at most ``threading.TIMEOUT_MAX`` seconds
#: (longer waits overflow the C timer: a ValueError or, through the CLI, an abort).
MAX_TIMEOUT = threading.TIMEOUT_MAX


def resolve_dtype(dtype) -> torch.dtype:
    """A torch floating dtype from a dtype or one of :data:`DTYPE_NAMES` (``"torch.float16"``
    too); TypeError naming the value otherwise."""
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPE_NAMES.values():
            return dtype
    elif isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        if name in DTYPE_NAMES:
            return DTYPE_NAMES[name]
    raise TypeError(f"dtype={dtype!r}: the oracle has a baseline for {', '.join(DTYPE_NAMES)} "
                    "(or the torch dtypes of those names)")


def check_timeout(timeout) -> float | None:
    """``timeout`` as a float in (0, :data:`MAX_TIMEOUT`], or None; TypeError or ValueError
    naming it."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout={timeout!r} must be a number of seconds, not {type(timeout).__name__}")
    if not 0 < timeout <= MAX_TIMEOUT:
        raise ValueError(f"timeout={timeout!r} must be a finite number of seconds in (0, {MAX_TIMEOUT:.0f}] "
                         "(threading.TIMEOUT_MAX: the longest wait the runner's worker thread can make)")
    return float(timeout)


def check_accumulation_u(u) -> float | None:
    if u is None:
        return None
    if isinstance(u, bool) or not isinstance(u, (int, float)):
        raise TypeError(f"accumulation_u={u!r} must be a number, not {type(u).__name__}")
    if not 0 < u < 1:
        raise ValueError(f"accumulation_u={u!r} must be a unit roundoff in (0, 1) (float32: 2^-24, the Hopper FP8 "
                         "accumulation: 2^-13)")
    return float(u)


def device_problem(device) -> str | None:
    """Why fn cannot run on ``device`` here, or None when it can: the device must exist and
    hold data that can be read back to the CPU (``meta`` holds none)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError) as e:
        return f"device {device!r} is not a torch device ({e})"
    if dev.type == "cuda" and not torch.cuda.is_available():
        return (f"device {device!r}: no CUDA device on this machine (torch.cuda.is_available() is False, torch "
                f"{torch.__version__}); accepted here: cpu")
    try:
        back = torch.ones(2, device=dev).sum().cpu().item()
    except Exception as e:  # noqa: BLE001 - whatever torch says about the device
        return (f"device {device!r} cannot run an implementation here (the oracle computes on it and reads the "
                f"results back): {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    if back != 2.0:
        return f"device {device!r} computed 1 + 1 = {back}"
    return None


def validate_signature(fn) -> bool:
    """Check that ``fn(q, k, v, causal=..., scale=...)`` is a valid call. Returns whether fn
    also takes ``mask``. Raises TypeError naming what is wrong."""
    if not callable(fn):
        raise TypeError(f"the attention implementation must be callable, got {type(fn).__name__}")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: trust the call
        return False
    try:
        sig.bind(None, None, None, causal=False, scale=1.0)
    except TypeError as e:
        raise TypeError(
            f"{target_name(fn)}{sig} cannot be called as fn(q, k, v, *, causal, scale): {e}. The oracle "
            "calls fn(q, k, v, causal=bool, scale=float) with (batch, heads, seqlen, head_dim) tensors "
            "and expects the attention output."
        ) from None
    return "mask" in sig.parameters


def optional_arguments(fn) -> frozenset:
    """The optional arguments among mask, window and documents fn's signature takes (all of
    them when it has no signature or takes ``**kwargs``: the call decides)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return frozenset(("mask", "window", "documents"))
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return frozenset(("mask", "window", "documents"))
    return frozenset(n for n in ("mask", "window", "documents") if n in params)


def target_name(fn) -> str:
    module = getattr(fn, "__module__", None) or ""
    qual = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    return f"{module}:{qual}" if module else qual


def call_once(fn, case: Case, device, **overrides):
    """One forward and backward of fn on the case, inputs and dO in the case's memory layout
    (``overrides``: the keyword arguments fn gets instead of the case's; a key mapped to None is
    left out). Returns ``((out, dq, dk, dv) detached on fn's device, contract)`` with
    ``contract`` the caller-visible surprises: ``{"output": ..., "inputs": ...}``, "" where none."""
    q_, k_, v_ = (case.leaf(t, device).requires_grad_(True) for t in (case.q, case.k, case.v))
    kwargs = dict(causal=case.causal, scale=case.scale)
    mask = None
    if case.mask is not None:
        mask = case.mask.to(device).clone()  # a copy: fn writing into it cannot change the case
        kwargs["mask"] = mask
    kwargs.update({n: x.to(device).clone() if isinstance(x, torch.Tensor) else x for n, x in case.fn_kwargs().items()})
    kwargs.update(overrides)
    kwargs = {k: x for k, x in kwargs.items() if x is not None or k not in overrides}
    out = fn(q_, k_, v_, **kwargs)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"fn returned {type(out).__name__}, not a tensor")
    expected = (*case.q.shape[:-1], case.v.shape[-1])
    if tuple(out.shape) != expected:
        raise ValueError(f"fn returned shape {tuple(out.shape)}, expected {expected}")
    output = _output_problem(out, case.q.dtype, (q_, k_, v_))
    dout = case.leaf(case.dout.to(dtype=out.dtype), device)
    out.backward(dout)
    grads = (q_.grad, k_.grad, v_.grad)
    if any(g is None for g in grads):
        missing = [n for n, g in zip("qkv", grads) if g is None]
        raise ValueError(f"no gradient reached {', '.join(missing)}: fn is not differentiable in them")
    changed = [n for n, t, orig in (("q", q_, case.q), ("k", k_, case.k), ("v", v_, case.v),
                                    ("dO", dout, case.dout.to(dtype=out.dtype)), ("mask", mask, case.mask))
               if t is not None and not same_bits(t, orig)]
    inputs = (f"fn changed {', '.join(changed)} in place (a caller's tensors must come back as they were given)"
              if changed else "")
    return tuple(t.detach() for t in (out, *grads)), {"output": output, "inputs": inputs}


def same_bits(t: torch.Tensor, orig: torch.Tensor) -> bool:
    """t holds orig's values bit for bit (NaN and -0 included)."""
    a, b = t.detach().cpu(), orig.detach().cpu()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))


def _overlaps(t: torch.Tensor) -> bool:
    """Whether two elements of t share an address (a zero stride, an expand, or strides that
    interleave): sorted by stride, each dimension's stride must reach past the span of the
    dimensions below it."""
    dims = sorted((st, n) for st, n in zip(t.stride(), t.shape) if n > 1)
    span = 1
    for st, n in dims:
        if st < span:
            return True
        span = st * (n - 1) + span
    return False


def _output_problem(out: torch.Tensor, dtype: torch.dtype, inputs) -> str:
    """What in the output surprises a caller: another dtype than q's, elements that share
    memory, or memory shared with an input."""
    if out.dtype != dtype:
        return f"fn returned {str(out.dtype).replace('torch.', '')} for {str(dtype).replace('torch.', '')} inputs"
    if _overlaps(out):
        return f"fn returned an output whose elements share memory (strides {tuple(out.stride())})"
    storage = out.untyped_storage().data_ptr()
    shared = [n for n, t in zip("qkv", inputs) if t.untyped_storage().data_ptr() == storage]
    if shared:
        return f"fn returned an output in the memory of {', '.join(shared)}"
    return ""


#: How a failed ``runs`` check that was a device-side fault begins (see :func:`is_device_fault`).
DEVICE_FAULT = "device-side fault: "


def is_device_fault(e: BaseException) -> bool:
    """A CUDA error raised by the implementation (an illegal or misaligned access, a device-side
    assert): it leaves the process's CUDA context unusable, so every later call fails too."""
    accelerator_error = getattr(torch, "AcceleratorError", ())
    return (isinstance(e, accelerator_error) if accelerator_error else False) or "CUDA error" in str(e)


def run_case(work, name: str, timeout: float | None):
    """``work()`` (the checks of case ``name``), in a worker thread when there is a timeout.
    Returns its result, or None when it outlived ``timeout`` (the thread cannot be stopped and
    is left running as a daemon). An exception of ``work`` is raised here."""
    if timeout is None:
        return work()
    result: dict = {}

    def target():
        try:
            result["value"] = work()
        except BaseException as e:  # noqa: BLE001 - handed to the calling thread
            result["error"] = e

    worker = threading.Thread(target=target, name=f"dmref-oracle-{name}", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        return None
    if "error" in result:
        raise result["error"]
    return result["value"]


def exit_detail(e: BaseException) -> str:
    return (f"fn raised {type(e).__name__}({', '.join(map(repr, e.args))}): an attention call that tries to end "
            "the process fails its case (the oracle goes on)")
