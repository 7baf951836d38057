"""cuDNN's live FP8 attention as an oracle target (``dmref check dmref.cudnn.target:cudnn_fp8``,
or ``dmref.targets:cudnn_fp8``).

cuDNN's FP8 attention:

:func:`cudnn_fp8` is ``fn(q, k, v, *, causal, scale)`` (the oracle's convention,
:mod:`dmref.oracle`): cuDNN's fused FP8 attention forward (``pygraph.sdpa_fp8``, with softmax
stats) and backward (``pygraph.sdpa_fp8_backward``) through ``nvidia-cudnn-frontend``, wrapped
in a ``torch.autograd.Function`` and quantized the way Transformer Engine's per-tensor FP8
recipe feeds cuDNN:

- Q, K, V, dO: one scale per tensor, ``scale = fmax / amax`` of this call's tensor
  (``fmax`` = 448 for E4M3, 57344 for E5M2; ``scale = 1`` when ``amax = 0``), the product
  ``x * scale`` rounded to float32, clamped to ``±fmax`` and rounded to FP8 (RNE);
  ``descale = 1 / scale`` in float32 (TE's ``scale_inv``).
- P (``scale_s``): 448 = fmax / 1: the forward quantizes exp(s - running max), whose largest
  element is exactly 1 in every row, and the backward P = exp(s - LSE) <= 1.
- O, dQ, dK, dV and dS (``scale_dP``): the outputs of cuDNN's kernels. Current scaling of an
  output needs its amax before it is rounded, so each graph runs first to measure it: cuDNN's
  ``amax_*`` outputs are the amax of the float32 tensor before scaling, so the scales of a
  calibrating run do not change them. The forward runs twice (``amax_o``, then O with
  ``scale_o = 448 / amax_o``); the backward three times (``amax_dP``; then ``amax_dQ/dK/dV``
  with dS quantized by ``scale_dP = 448 / amax_dP``; then the gradients with their scales).

Current scaling, not TE's default delayed scaling: an oracle call has no history of earlier
steps to take an amax from, and current scaling is what delayed scaling converges to on a
repeated input. The cost (two forward and three backward runs) does not matter to an oracle.

Formats: Q, K, V, O and P in E4M3; dO and dQ, dK, dV in ``grad_format`` (default ``"e4m3"``:
the combination cuDNN-frontend's own FP8 SDPA test runs, ``test/python/sdpa/fp8.py``, which
gives dO the input type; ``"e5m2"`` is TE's HYBRID recipe, E5M2 gradients). dS is quantized in
E4M3 with ``scale_dP`` (cuDNN-frontend's reference rounds dS to the input type).

Hopper limits (``include/cudnn_frontend/node/sdpa_fp8_bwd.h``): head dim 128 for both Q/K and
V, causal top-left only (SDPA's ``is_causal``), no mask or bias, GQA with ``heads % kv_heads
== 0``. A problem outside them raises :class:`CaseUnsupported` (a ``NotImplementedError``:
the oracle records the case as skipped); a machine without the frontend or a Hopper GPU raises
:class:`TargetUnavailable` with a one-line message.

``import dmref.cudnn.target`` needs neither the frontend nor a GPU (both load on the first call).
:func:`cudnn_fp8_forward` and :func:`cudnn_fp8_backward` return every FP8 tensor, scale and
amax cuDNN consumed and produced (``captures/capture_cudnn_fp8.py`` saves them).
"""

from __future__ import annotations

import math

import torch

from ..emulation import get_format
from ..oracle.targets import CaseUnsupported, TargetUnavailable


__all__ = ["TargetUnavailable", "CaseUnsupported", "GRAD_FORMATS", "cudnn_fp8", "cudnn_fp8_backward",
           "cudnn_fp8_forward", "dequantize", "require_cudnn_fp8"]

_INSTALL_HINT = "pip install 'dmref[cudnn]'"

#: FP8 formats by name: the torch dtype and cuDNN's data type name.
#: cuDNN's FP8 data types by the formats' short names (their torch dtypes: ``Format.torch_dtype``)
_FORMATS = {"e4m3": "FP8_E4M3", "e5m2": "FP8_E5M2"}
#: the formats ``cudnn_fp8(..., grad_format=)`` takes for dO and dQ, dK, dV.
GRAD_FORMATS = tuple(_FORMATS)
_FWD_FORMAT = "e4m3"  # Q, K, V, O, P and dS
_HEAD_DIM = 128  # cuDNN's Hopper FP8 backward: d_qk == d_v == 128 only
_GRAPH_CACHE_SIZE = 32


def _fmax(fmt: str) -> float:
    return float(get_format(fmt).max)


# ==============================================================================================
# Availability
# ==============================================================================================


def _import_cudnn():
    try:
        import cudnn
    except ImportError:
        raise TargetUnavailable(f"dmref.targets.cudnn_fp8 needs nvidia-cudnn-frontend ({_INSTALL_HINT})") from None
    except OSError as e:  # the frontend is there but its cuDNN library does not load
        raise TargetUnavailable(f"dmref.targets.cudnn_fp8: nvidia-cudnn-frontend does not load: {e}") from None
    return cudnn


def _gpu_problem(device) -> str | None:
    """What is missing on the GPU side for ``device`` (None: the current CUDA device), or None."""
    if not torch.cuda.is_available():
        return "a CUDA GPU of compute capability 9.0 (Hopper; torch sees no CUDA device)"
    device = torch.device("cuda") if device is None else torch.device(device)
    if device.type != "cuda":
        return f"CUDA tensors on a GPU of compute capability 9.0 (got device {device}; run the oracle with --device cuda)"
    cc = torch.cuda.get_device_capability(device)
    if cc[0] != 9:
        return (f"a CUDA GPU of compute capability 9.0 (Hopper), got {cc[0]}.{cc[1]} "
                f"({torch.cuda.get_device_name(device)})")
    return None


def require_cudnn_fp8(device=None):
    """Raise :class:`TargetUnavailable` unless the frontend imports and ``device`` (default: the
    current CUDA device) is a CUDA GPU of compute capability 9.x; the message names everything
    missing (the frontend and the GPU). Returns the ``cudnn`` module."""
    missing, cudnn = [], None
    try:
        cudnn = _import_cudnn()
    except TargetUnavailable as e:
        missing.append(str(e).removeprefix("dmref.targets.cudnn_fp8 needs ").removeprefix("dmref.targets.cudnn_fp8: "))
    gpu = _gpu_problem(device)
    if gpu:
        missing.append(gpu)
    if missing:
        raise TargetUnavailable("dmref.targets.cudnn_fp8 needs " + "; and ".join(missing))
    return cudnn


def _check_problem(q, k, v, grad_format):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be (batch, heads, seqlen, head_dim); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    b, h, _, d = q.shape
    if k.shape[0] != b or v.shape[0] != b or k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must share batch, heads and seqlen with "
                         f"each other and batch with q {tuple(q.shape)}")
    if k.shape[-1] != d:
        raise ValueError(f"q and k head dims differ: {d} and {k.shape[-1]}")
    if h % k.shape[1] != 0:
        raise ValueError(f"heads={h} must be a multiple of kv_heads={k.shape[1]}")
    if grad_format not in _FORMATS:
        raise ValueError(f"grad_format={grad_format!r}; accepted: {', '.join(GRAD_FORMATS)}")


def _check_supported(q, v):
    d = q.shape[-1]
    if d != _HEAD_DIM or v.shape[-1] != _HEAD_DIM:
        raise CaseUnsupported(f"cuDNN's FP8 attention backward takes head dim {_HEAD_DIM} only on Hopper "
                              f"(got {d} for q/k, {v.shape[-1]} for v)")


# ==============================================================================================
# Graphs (one forward and one backward per problem geometry, cached)
# ==============================================================================================

_HANDLES: dict = {}
_GRAPHS: dict = {}


def _bshd_empty(shape, dtype, device) -> torch.Tensor:
    """A (B, H, S, D) view of BSHD storage: the layout cuDNN's FP8 SDPA tests and samples use."""
    b, h, s, d = shape
    return torch.empty(b, s, h, d, dtype=dtype, device=device).transpose(1, 2)


def _bshd_output(shape, dtype, device) -> torch.Tensor:
    """Like :func:`_bshd_empty`, filled with NaN: an element cuDNN does not write reads NaN (the
    oracle and the capture see it) instead of whatever the allocator left there."""
    return _bshd_empty(shape, dtype, device).fill_(float("nan"))


def _bshd_stride(shape) -> list[int]:
    b, h, s, d = shape
    return [s * h * d, d, h * d, 1]


def _stats_stride(shape) -> list[int]:
    b, h, s, _ = shape
    return [h * s, s, 1, 1]


_SCALAR = [1, 1, 1, 1]


def _scalar_tensor(g, cudnn, name):
    return g.tensor(name=name, dim=_SCALAR, stride=_SCALAR, data_type=cudnn.data_type.FLOAT)


def _finalize(g, cudnn):
    try:
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
    except cudnn.cudnnGraphNotSupportedError as e:
        raise CaseUnsupported("cuDNN declines the FP8 attention graph: " + " ".join(str(e).split())) from None


#: The scalars of the forward graph (its descales and scales), by their names in the graph.
FWD_SCALARS = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
_BWD_SCALARS = ("descale_q", "descale_k", "descale_v", "descale_o", "descale_dO", "descale_s", "descale_dP",
                "scale_s", "scale_dQ", "scale_dK", "scale_dV", "scale_dP")
_BWD_OUTPUTS = ("dQ", "dK", "dV", "amax_dQ", "amax_dK", "amax_dV", "amax_dP")


def _build_fwd(cudnn, handle, geo):
    qs, ks, os_ = geo["q"], geo["k"], geo["o"]
    e4m3, f32 = getattr(cudnn.data_type, _FORMATS[_FWD_FORMAT]), cudnn.data_type.FLOAT
    g = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
    t = {n: g.tensor(name=n.upper(), dim=list(s), stride=_bshd_stride(s), data_type=e4m3)
         for n, s in (("q", qs), ("k", ks), ("v", geo["v"]))}
    t.update({n: _scalar_tensor(g, cudnn, n) for n in FWD_SCALARS})
    o, stats, amax_s, amax_o = g.sdpa_fp8(
        q=t["q"], k=t["k"], v=t["v"],
        descale_q=t["descale_q"], descale_k=t["descale_k"], descale_v=t["descale_v"],
        descale_s=t["descale_s"], scale_s=t["scale_s"], scale_o=t["scale_o"],
        generate_stats=True, attn_scale=geo["scale"], use_causal_mask=geo["causal"], name="sdpa_fp8_fwd")
    o.set_output(True).set_dim(list(os_)).set_stride(_bshd_stride(os_)).set_data_type(e4m3)
    stats_shape = [*os_[:3], 1]
    stats.set_output(True).set_dim(stats_shape).set_stride(_stats_stride(stats_shape)).set_data_type(f32)
    for a in (amax_s, amax_o):
        a.set_output(True).set_dim(_SCALAR).set_stride(_SCALAR).set_data_type(f32)
    t.update(o=o, stats=stats, amax_s=amax_s, amax_o=amax_o)
    _finalize(g, cudnn)
    return g, t


def _build_bwd(cudnn, handle, geo):
    e4m3, f32 = getattr(cudnn.data_type, _FORMATS[_FWD_FORMAT]), cudnn.data_type.FLOAT
    grad = getattr(cudnn.data_type, _FORMATS[geo["grad_format"]])
    g = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
    t = {n: g.tensor(name=n, dim=list(geo[key]), stride=_bshd_stride(geo[key]), data_type=dt)
         for n, key, dt in (("q", "q", e4m3), ("k", "k", e4m3), ("v", "v", e4m3), ("o", "o", e4m3),
                            ("dO", "o", grad))}
    stats_shape = [*geo["o"][:3], 1]
    t["stats"] = g.tensor(name="stats", dim=stats_shape, stride=_stats_stride(stats_shape), data_type=f32)
    t.update({n: _scalar_tensor(g, cudnn, n) for n in _BWD_SCALARS})
    outs = g.sdpa_fp8_backward(
        q=t["q"], k=t["k"], v=t["v"], o=t["o"], dO=t["dO"], stats=t["stats"],
        **{n: t[n] for n in _BWD_SCALARS},
        attn_scale=geo["scale"], use_causal_mask=geo["causal"], name="sdpa_fp8_bwd")
    for name, x, key in zip(("dQ", "dK", "dV"), outs[:3], ("q", "k", "v")):
        x.set_output(True).set_dim(list(geo[key])).set_stride(_bshd_stride(geo[key])).set_data_type(grad)
        t[name] = x
    for name, a in zip(_BWD_OUTPUTS[3:], outs[3:7]):
        a.set_output(True).set_dim(_SCALAR).set_stride(_SCALAR).set_data_type(f32)
        t[name] = a
    _finalize(g, cudnn)
    return g, t


class _Graphs:
    """The built forward and backward graphs of one problem geometry, their tensor handles and
    one workspace large enough for both."""

    def __init__(self, cudnn, device, geo):
        self.device, self.geo = device, geo
        if device.index not in _HANDLES:
            with torch.cuda.device(device):
                _HANDLES[device.index] = cudnn.create_handle()
        self.handle = _HANDLES[device.index]
        with torch.cuda.device(device):
            self.fwd, self.t_fwd = _build_fwd(cudnn, self.handle, geo)
            self.bwd, self.t_bwd = _build_bwd(cudnn, self.handle, geo)
        size = max(self.fwd.get_workspace_size(), self.bwd.get_workspace_size(), 1)
        self.workspace = torch.empty(size, dtype=torch.uint8, device=device)

    def run(self, which: str, tensors: dict) -> None:
        graph, handles = (self.fwd, self.t_fwd) if which == "fwd" else (self.bwd, self.t_bwd)
        cudnn = _import_cudnn()
        with torch.cuda.device(self.device):
            cudnn.set_stream(self.handle, torch.cuda.current_stream(self.device).cuda_stream)
            graph.execute({handles[n]: x for n, x in tensors.items()}, self.workspace, handle=self.handle)


def _graphs(q, k, v, causal, scale, grad_format) -> _Graphs:
    _check_problem(q, k, v, grad_format)
    cudnn = require_cudnn_fp8(q.device)
    _check_supported(q, v)
    b, h, nq, _ = q.shape
    geo = {"q": tuple(q.shape), "k": tuple(k.shape), "v": tuple(v.shape), "o": (b, h, nq, v.shape[-1]),
           "causal": bool(causal), "scale": float(scale), "grad_format": grad_format}
    key = (q.device.index, *geo["q"], *geo["k"], geo["causal"], geo["scale"], grad_format)
    if key not in _GRAPHS:
        if len(_GRAPHS) >= _GRAPH_CACHE_SIZE:
            _GRAPHS.pop(next(iter(_GRAPHS)))
        _GRAPHS[key] = _Graphs(cudnn, q.device, geo)
    return _GRAPHS[key]


# ==============================================================================================
# Quantization (per tensor, current scaling) and the runs
# ==============================================================================================


def _scalar(x, device) -> torch.Tensor:
    """A float32 [1, 1, 1, 1] tensor on ``device`` (cuDNN's shape for scales and amaxes)."""
    return torch.as_tensor(x, dtype=torch.float32, device=device).reshape(_SCALAR).clone()


def _measured(amax: torch.Tensor, name: str) -> torch.Tensor:
    """cuDNN's amax output ``name``, checked to be written and finite (the buffers start NaN)."""
    value = amax.item()
    if not math.isfinite(value):
        raise RuntimeError(f"cuDNN returned {name}={value}: the FP8 graph did not write a finite amax")
    return amax


def _reciprocal(x: torch.Tensor) -> torch.Tensor:
    """``1 / x`` in float32 as a tensor division (correctly rounded, as TE's scale_inv)."""
    return torch.ones_like(x) / x


def _scale_from_amax(amax: torch.Tensor, fmt: str) -> torch.Tensor:
    """``fmax / amax`` in float32, 1 where amax is 0 (TE's current-scaling rule, no margin)."""
    amax = amax.float().reshape(_SCALAR)
    # a tensor divided by a tensor: torch evaluates float / tensor as float * (1 / tensor),
    # which is not the correctly rounded quotient
    fmax = torch.full_like(amax, _fmax(fmt))
    return torch.where(amax > 0, fmax / amax, torch.ones_like(amax))


def _quantize(x: torch.Tensor, fmt: str):
    """(codes as a BHSD view of BSHD storage, scale, descale, amax) of ``x`` in ``fmt``."""
    xf = x.detach().float()
    amax = _scalar(xf.abs().amax(), x.device)
    scale = _scale_from_amax(amax, fmt)
    codes = _bshd_empty(x.shape, get_format(fmt).torch_dtype, x.device)
    # Q-point: x * scale rounded to float32, clamped to +-fmax (torch's FP8 cast does not
    # saturate), RNE to fmt
    codes.copy_((xf * scale.reshape(())).clamp_(-_fmax(fmt), _fmax(fmt)))
    return codes, scale, _reciprocal(scale), amax


def dequantize(codes: torch.Tensor, descale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``codes * descale`` in float32, rounded to ``dtype``, contiguous."""
    return (codes.float() * descale.reshape(())).to(dtype).contiguous()


def cudnn_fp8_forward(q, k, v, *, causal: bool = False, scale: float | None = None,
                      grad_format: str = "e4m3") -> dict:
    """Quantize q, k, v and run cuDNN's FP8 forward; every tensor it consumed and produced.

    Returns a dict of CUDA tensors: ``q_fp8, k_fp8, v_fp8, o_fp8`` (FP8, BHSD views of BSHD
    storage), ``stats`` (float32 (B, H, Nq, 1), natural-log LSE of the scaled scores),
    the [1, 1, 1, 1] float32 scalars ``scale_q/k/v``, ``descale_q/k/v``, ``amax_q/k/v``,
    ``scale_s, descale_s, scale_o, descale_o``, ``amax_s, amax_o`` (cuDNN's, final run) and
    ``amax_o_calibration`` (the first run's), plus ``graphs`` and ``attn_scale``.
    """
    attn_scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    g = _graphs(q, k, v, causal, attn_scale, grad_format)
    dev = q.device
    r = {"graphs": g, "attn_scale": attn_scale}
    for n, x in (("q", q), ("k", k), ("v", v)):
        r[f"{n}_fp8"], r[f"scale_{n}"], r[f"descale_{n}"], r[f"amax_{n}"] = _quantize(x, _FWD_FORMAT)
    r["scale_s"] = _scale_from_amax(_scalar(1.0, dev), _FWD_FORMAT)  # max of exp(s - running max) is 1
    r["descale_s"] = _reciprocal(r["scale_s"])
    o_shape = g.geo["o"]
    for calibrating in (True, False):
        if calibrating:
            r["scale_o"] = _scalar(1.0, dev)  # any finite scale: amax_o is taken before scaling
        else:
            r["scale_o"] = _scale_from_amax(r["amax_o_calibration"], _FWD_FORMAT)
        r["descale_o"] = _reciprocal(r["scale_o"])
        out = {"o": _bshd_output(o_shape, get_format(_FWD_FORMAT).torch_dtype, dev),
               "stats": torch.empty(*o_shape[:3], 1, dtype=torch.float32, device=dev),
               "amax_s": _scalar(float("nan"), dev), "amax_o": _scalar(float("nan"), dev)}
        g.run("fwd", {"q": r["q_fp8"], "k": r["k_fp8"], "v": r["v_fp8"], **{n: r[n] for n in FWD_SCALARS},
                      **out})
        if calibrating:
            r["amax_o_calibration"] = _measured(out["amax_o"], "amax_o")
    r.update(o_fp8=out["o"], stats=out["stats"], amax_s=out["amax_s"], amax_o=out["amax_o"])
    return r


def cudnn_fp8_backward(fwd: dict, do: torch.Tensor) -> dict:
    """Quantize dO and run cuDNN's FP8 backward on the forward ``fwd`` returned.

    Returns a dict of CUDA tensors: ``do_fp8, dq_fp8, dk_fp8, dv_fp8`` (FP8 in the graphs'
    ``grad_format``, BHSD views of BSHD storage), the [1, 1, 1, 1] float32 scalars
    ``scale_dO, descale_dO, amax_dO_input`` (this call's dO), ``scale_dP, descale_dP,
    scale_dQ, scale_dK, scale_dV`` (what the final run was given), ``amax_dQ/dK/dV/dP`` (its
    outputs) and ``amax_dP_calibration, amax_dQ/dK/dV_calibration`` (the calibrating runs').
    """
    g: _Graphs = fwd["graphs"]
    gf, dev = g.geo["grad_format"], do.device
    r = {}
    r["do_fp8"], r["scale_dO"], r["descale_dO"], r["amax_dO_input"] = _quantize(do, gf)
    given = {n: fwd[n] for n in ("descale_q", "descale_k", "descale_v", "descale_o", "descale_s", "scale_s")}
    inputs = {"q": fwd["q_fp8"], "k": fwd["k_fp8"], "v": fwd["v_fp8"], "o": fwd["o_fp8"], "dO": r["do_fp8"],
              "stats": fwd["stats"]}
    one = _scalar(1.0, dev)  # calibrating scales: amax_* are taken before scaling
    sc = {"scale_dP": one, "scale_dQ": one, "scale_dK": one, "scale_dV": one}
    for run in ("dP", "grads", "final"):
        if run == "grads":
            sc["scale_dP"] = _scale_from_amax(r["amax_dP_calibration"], _FWD_FORMAT)
        if run == "final":
            for n in ("dQ", "dK", "dV"):
                sc[f"scale_{n}"] = _scale_from_amax(r[f"amax_{n}_calibration"], gf)
        out = {n: _bshd_output(g.geo[n[1].lower()], get_format(gf).torch_dtype, dev) for n in ("dQ", "dK", "dV")}
        out.update({n: _scalar(float("nan"), dev) for n in _BWD_OUTPUTS[3:]})
        g.run("bwd", {**inputs, **given, "descale_dO": r["descale_dO"], "descale_dP": _reciprocal(sc["scale_dP"]),
                      **sc, **out})
        if run == "dP":
            r["amax_dP_calibration"] = _measured(out["amax_dP"], "amax_dP")
        if run == "grads":
            r.update({f"amax_{n}_calibration": _measured(out[f"amax_{n}"], f"amax_{n}") for n in ("dQ", "dK", "dV")})
    r.update(sc, descale_dP=_reciprocal(sc["scale_dP"]))
    r.update(dq_fp8=out["dQ"], dk_fp8=out["dK"], dv_fp8=out["dV"],
             **{n: out[n] for n in _BWD_OUTPUTS[3:]})
    return r


# ==============================================================================================
# The oracle target
# ==============================================================================================


class _CudnnFP8Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, grad_format):
        fwd = cudnn_fp8_forward(q, k, v, causal=causal, scale=scale, grad_format=grad_format)
        ctx.fwd = fwd
        ctx.dtypes = (q.dtype, k.dtype, v.dtype)
        return dequantize(fwd["o_fp8"], fwd["descale_o"], q.dtype)

    @staticmethod
    def backward(ctx, do):
        bwd = cudnn_fp8_backward(ctx.fwd, do)
        grads = tuple(dequantize(bwd[f"d{n}_fp8"], _reciprocal(bwd[f"scale_d{n.upper()}"]), dt)
                      for n, dt in zip("qkv", ctx.dtypes))
        del ctx.fwd
        return (*grads, None, None, None)


def cudnn_fp8(q, k, v, *, causal: bool = False, scale: float | None = None, grad_format: str = "e4m3"):
    """cuDNN's FP8 attention (module docstring) as an oracle target: ``(B, H, Nq, 128)`` q and
    ``(B, Hkv, Nk, 128)`` k, v on a Hopper GPU (bf16, fp16 or float32); returns the output in
    q's dtype, differentiable in q, k, v. Raises :class:`TargetUnavailable` without the
    frontend or a compute capability 9.x GPU, :class:`CaseUnsupported` for a head dim other
    than 128, ValueError for inconsistent shapes or an unknown ``grad_format``."""
    return _CudnnFP8Function.apply(q, k, v, causal, scale, grad_format)
