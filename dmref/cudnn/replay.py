"""Replay of cuDNN's FP8 attention (per-tensor scaling, Hopper) from a capture, code for code.

A capture (the format of ``tests/data/h200_cudnn_fp8_sdpa.npz``, written by
``captures/capture_cudnn_fp8.py``; its ``about`` entry states the layout) holds, per case, the
FP8 codes cuDNN consumed (Q, K, V, dO) and produced (O, dQ, dK, dV), every scale it was given and
the softmax stats it returned. :func:`replay_case` recomputes O, the stats, dQ, dK and dV from the
very same input codes and scales with the emulated Hopper FP8 GEMM of :mod:`dmref.emulation`
(every matmul on the FP8 codes, the per-tensor descales applied to the float32 result, as cuDNN's
graph does), following the ``cudnn_fp8`` preset of :mod:`dmref.recipes` for what it can state and
the points below for what it cannot. docs/cudnn_fp8.md gives the evidence for each point.

Forward (``descale_qk = fl(fl(fl(attn_scale descale_q) descale_k) log2 e)``, all float32)::

    x    = hopper(Q, K) * descale_qk                  (masked: -inf)     base-2 logits
    per key tile of recipe.tiles.block_k keys (256):  m = running row max, p = 2^(x - m),
         P8 = E4M3(p * scale_s)  (scale_s = 448),  l = alpha l + rowsum(p),
         acc = hopper(P8, V, c = alpha acc)          (the accumulator chained through the tile)
    O8   = E4M3(acc / l * fl(descale_s descale_v scale_o));   stats = (m + log2 l) ln 2

Backward (``GF``: the case's gradient format, dO's format; ``S = hopper(Q, K)``, the logits'
accumulator)::

    P    = 2^(fl(fma(S, fl(attn_scale fl(descale_q descale_k)), -stats) log2 e))   (masked: 0)
    P8   = E4M3(P * scale_s)
    dV   = GF( sum_group( hopper(P8ᵀ, dO) * fl(descale_s descale_dO) ) * scale_dV )
    D    = fl32(rowsum(dO8 ∘ O8)) * descale_dO * descale_o           (stale: FP8 dO, FP8 O)
    dP-D = fma(hopper(dO, V), fl(descale_dO descale_v), -D)   (one rounding: dP is never rounded)
    y    = fl(P attn_scale) fl((dP - D) scale_dP)      (scale_dP = 448 / amax(attn_scale dS))
    dK   = GF( sum_group( hopper(GF(y)ᵀ, Q) * fl(descale_dP descale_q) ) * scale_dK )
    dQ   = GF( (sum over 128-key blocks, float32 adds, of hopper(GF(fp16(y)), K))
               * fl(descale_dP descale_k) * scale_dQ )

``GF(fp16(y))``: dQ's dS operand is rounded to float16 first, then to FP8 (double rounding);
dK's is rounded once. Every FP8 cast is round-to-nearest-even with saturation (satfinite). The
backward's P is the natural-log exponent ``S fl(attn_scale fl(descale_q descale_k)) - stats`` as
one fused multiply-add, then times log2 e (not the forward's base-2 logits ``x``), and dS's two
scalars multiply P and ``dP - D`` apart before their product.
"""

from __future__ import annotations

import json
import os
import zipfile
from dataclasses import dataclass

import numpy as np
import torch

from .. import emulation
from ..emulation import constants, gemm
from ..recipes import Recipe, get_recipe

__all__ = ["CaptureError", "CODES", "DS_SCALES", "GOALS", "P_EXPONENTS", "ReplayOptions", "SCALARS", "TENSORS",
           "TensorMatch", "backward_p", "code_steps", "fma32", "load_capture", "replay_case", "summary", "to_json",
           "verify_capture"]

#: FP8 code arrays every case must hold: inputs cuDNN consumed and outputs it produced.
CODES = ("q_fp8", "k_fp8", "v_fp8", "do_fp8", "o_fp8", "dq_fp8", "dk_fp8", "dv_fp8")
#: float scalars every case must hold (the scales cuDNN was given).
SCALARS = ("attn_scale", "descale_q", "descale_k", "descale_v", "scale_s", "descale_s", "scale_o",
           "descale_o", "descale_dO", "scale_dP", "descale_dP", "scale_dQ", "scale_dK", "scale_dV")
#: compared outputs, in report order
TENSORS = ("o", "dq", "dk", "dv")
#: the goal per tensor: the least fraction of identical codes; every other code within MAX_STEPS
#: (over the codes cuDNN computed: its zeros in dQ's last partial query tile are counted apart)
GOALS = {"o": 0.99, "dq": 0.95, "dk": 0.95, "dv": 0.95}
MAX_STEPS = 1
#: query rows per tile of cuDNN's FP8 backward. With a query count that is not a multiple of it,
#: cuDNN writes +0 into part of dQ's last, partial tile (docs/cudnn_fp8.md, "cuDNN writes zeros
#: into part of dQ's last query tile"): those codes are not cuDNN's dQ, so they are counted
#: (``cudnn_dq_tail_zeros``) and left out of the goal rather than compared.
CUDNN_BWD_QUERY_TILE = 64
#: the distance counted for a NaN code against any other code (larger than any ordinal distance)
NAN_STEPS = 256

_GRAD_FORMATS = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}
_E4M3 = emulation.get_format("float8_e4m3fn")
_F32 = np.float32
_LOG2E = _F32(constants.LOG2E)
_LN2 = _F32(constants.LN2)
_DQ_KEY_BLOCK = 128  # dQ: one wgmma chain per 128-key block, the partials added in float32
#: accepted values of ReplayOptions.p_exponent and ReplayOptions.ds_scales (cuDNN's first)
P_EXPONENTS = ("natural", "natural_attn_first", "base2")
DS_SCALES = ("split", "sequential")


@dataclass(frozen=True)
class ReplayOptions:
    """Departures from cuDNN's behaviour, for measuring what each point of the replay is worth
    (docs/cudnn_fp8.md); the defaults are cuDNN's."""

    p_scale: float | None = None  #: P's multiplier before E4M3 (None: the case's scale_s, 448)
    ds_dq_fp16: bool = True  #: dQ's dS operand rounded to float16 before FP8
    dq_key_block: int | None = _DQ_KEY_BLOCK  #: keys per dQ wgmma chain (None: one chain)
    delta_do: str = "fp8"  #: dO in the delta: "fp8" (the codes cuDNN consumed) or "input" (the BF16 input)
    dp_fma: bool = True  #: dP - D as one fused multiply-add of the dO V accumulator (False: dP rounded first)
    #: the backward's exponent of P: "natural", ``fl(fma(S, fl(attn_scale fl(descale_q descale_k)),
    #: -stats) log2 e)``; "natural_attn_first", the same with the forward's product order
    #: ``fl(fl(attn_scale descale_q) descale_k)``; "base2", ``fl(x - fl(stats log2 e))`` with the
    #: forward's base-2 logits x
    p_exponent: str = "natural"
    #: dS's scalars: "split", ``fl(fl(P attn_scale) fl((dP - D) scale_dP))``; "sequential",
    #: ``fl(fl(fl(P (dP - D)) attn_scale) scale_dP)``
    ds_scales: str = "split"

    def __post_init__(self):
        object.__setattr__(self, "ds_dq_fp16", emulation.formats.check_bool(self.ds_dq_fp16, "ds_dq_fp16"))
        for name, accepted in (("delta_do", ("fp8", "input")), ("p_exponent", P_EXPONENTS),
                               ("ds_scales", DS_SCALES)):
            if getattr(self, name) not in accepted:
                raise ValueError(f"{name}={getattr(self, name)!r}; accepted: {', '.join(map(repr, accepted))}")


class CaptureError(ValueError):
    """A capture file that cannot be replayed; the message is one line and names the problem."""


# ==============================================================================================
# Loading
# ==============================================================================================


def load_capture(path: str) -> list[dict]:
    """The cases of a capture, each a dict of numpy arrays and scalars (keys without the ``c<i>.``
    prefix, plus ``index``). Never loads pickles. Raises :class:`CaptureError` for a missing or
    unreadable file, a file with no case, or a case lacking an array or with inconsistent shapes."""
    if not os.path.isfile(path):
        raise CaptureError(f"capture {path!r} does not exist or is not a file")
    try:
        z = np.load(path, allow_pickle=False)
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        # numpy's own message for a pickle suggests allow_pickle=True, which is never safe here
        raise CaptureError(f"capture {path!r} is not a readable .npz without pickles: numpy.load "
                           f"could not read it as an archive of arrays (numpy.savez) ({type(e).__name__})") from None
    if not isinstance(z, np.lib.npyio.NpzFile):
        raise CaptureError(f"capture {path!r} is a single .npy array, not a readable .npz archive of cases")
    with z:
        arrays = {}
        for name in z.files:
            try:
                arrays[name] = z[name]
            except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
                raise CaptureError(f"capture {path!r}: array {name!r} is not a readable .npz member without "
                                   f"pickles (pickled or damaged: {type(e).__name__})") from None
    indices = sorted({int(n[1:].split(".", 1)[0]) for n in arrays
                      if n.startswith("c") and "." in n and n[1:].split(".", 1)[0].isdigit()})
    if not indices:
        raise CaptureError(f"capture {path!r} holds no case (no c<i>.* arrays)")
    cases = [_check_case(path, i, {n.split(".", 1)[1]: a for n, a in arrays.items() if n.startswith(f"c{i}.")})
             for i in indices]
    for case in cases:  # the BF16 dO the capture quantized (optional; only ReplayOptions.delta_do uses it)
        bits = arrays.get(f"p{case['problem']}.do")
        if bits is not None and bits.dtype == np.uint16 and bits.shape == case["do_fp8"].shape:
            case["do_input"] = (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return cases


def _check_case(path: str, i: int, case: dict) -> dict:
    missing = [n for n in (*CODES, *SCALARS, "stats", "causal", "grad_format") if n not in case]
    if missing:
        raise CaptureError(f"capture {path!r} case {i} lacks {', '.join(missing)}")
    grad = str(case["grad_format"])
    if grad not in _GRAD_FORMATS:
        raise CaptureError(f"capture {path!r} case {i}: grad_format={grad!r}; accepted: {', '.join(_GRAD_FORMATS)}")
    for n in CODES:
        if case[n].dtype != np.uint8 or case[n].ndim != 4:
            raise CaptureError(f"capture {path!r} case {i}: {n} must be 4-d uint8 codes, got "
                               f"{case[n].dtype} {case[n].shape}")
    b, h, nq, d = case["q_fp8"].shape
    kv = case["k_fp8"].shape
    shapes = {"v_fp8": kv, "do_fp8": (b, h, nq, d), "o_fp8": (b, h, nq, d), "dq_fp8": (b, h, nq, d),
              "dk_fp8": kv, "dv_fp8": kv, "stats": (b, h, nq)}
    bad = [n for n, s in shapes.items() if tuple(case[n].shape) != tuple(s)]
    if bad or kv[0] != b or kv[3] != d or kv[1] == 0 or h % kv[1]:
        raise CaptureError(f"capture {path!r} case {i}: inconsistent shapes ({', '.join(bad) or 'k_fp8'}): "
                           f"q {case['q_fp8'].shape}, k {kv}")
    causal = np.asarray(case["causal"])
    if causal.shape != () or causal.dtype != np.bool_:
        # bool() of the string "no" would be True: only a boolean says causal or not
        raise CaptureError(f"capture {path!r} case {i}: causal must be a 0-d bool array, got "
                           f"{causal.dtype} {causal.shape} {causal!r:.40}")
    for n in SCALARS:
        value = np.asarray(case[n])
        if value.shape != () or not np.isfinite(value):
            raise CaptureError(f"capture {path!r} case {i}: {n} must be a finite scalar, got {value!r}")
    out = {n: case[n] for n in (*CODES, "stats")}
    out.update({n: _F32(case[n]) for n in SCALARS if n != "attn_scale"})
    out["do_input"] = None
    out.update(index=i, attn_scale=float(case["attn_scale"]), causal=bool(case["causal"]), grad_format=grad,
               problem=int(case.get("problem", -1)))
    return out


# ==============================================================================================
# Replay
# ==============================================================================================


def _decode(codes: np.ndarray, fmt) -> np.ndarray:
    return emulation.decode(torch.from_numpy(np.ascontiguousarray(codes)), fmt).numpy().astype(np.float64)


def _encode(x: np.ndarray, fmt) -> np.ndarray:
    """float32 x -> FP8 codes, nearest-even, satfinite."""
    return emulation.encode(torch.from_numpy(np.ascontiguousarray(x, dtype=_F32)), fmt, saturate=True).numpy()


def _t(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.swapaxes(x, -1, -2))


def _mm(a, bt, fa, fb, model: str, c=None) -> np.ndarray:
    """a (..., M, K) @ bt (..., N, K)ᵀ on FP8 codes under ``model``: float32 (..., M, N)."""
    return gemm.matmul(np.ascontiguousarray(a), np.ascontiguousarray(bt), c=c, fa=fa, fb=fb, model=model)


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """``fl32(a b + c)`` for float32 ``a, b, c``, rounded once (nearest-even), as a GPU's fused
    multiply-add. ``a b`` is exact in float64 (48 bits); TwoSum gives ``a b + c = s + e`` exactly;
    ``fl32(s)`` is the correctly rounded result except where ``s`` is a float32 midpoint and the
    remainder ``e`` breaks the tie, which is then resolved toward ``e``."""
    a, b, c = (np.asarray(x, dtype=_F32) for x in (a, b, c))
    prod = a.astype(np.float64) * b.astype(np.float64)
    c64 = np.broadcast_to(c.astype(np.float64), prod.shape)
    with np.errstate(invalid="ignore", over="ignore"):  # an infinite operand: s is the result, e is NaN
        s = prod + c64
        bv = s - prod
        e = (prod - (s - bv)) + (c64 - bv)  # TwoSum: prod + c64 == s + e exactly
        r = s.astype(_F32)
        other = np.nextafter(r, np.where(s > r, _F32(np.inf), _F32(-np.inf)).astype(_F32))
        tie = (s != r) & (s == (r.astype(np.float64) + other.astype(np.float64)) / 2) & (e != 0)
        wrong_side = np.sign(s - r) == np.sign(e)  # the exact value lies beyond s, on other's side
    return np.where(tie & wrong_side, other, r).astype(_F32)


def _expand(x: np.ndarray, heads: int) -> np.ndarray:
    """GQA: kv head h // (heads // kv_heads) serves query head h."""
    return np.repeat(x, heads // x.shape[1], axis=1)


def _group_sum(x: np.ndarray, kv_heads: int) -> np.ndarray:
    b, h, n, d = x.shape
    return x.reshape(b, kv_heads, h // kv_heads, n, d).sum(axis=2, dtype=_F32)


def _scores(case: dict, model: str) -> np.ndarray:
    """S = hopper(Q, K), the logits' float32 accumulator before any scale."""
    q, k = case["q_fp8"], _expand(case["k_fp8"], case["q_fp8"].shape[1])
    return _mm(q, k, _E4M3, _E4M3, model)


def _masked(case: dict, shape: tuple) -> np.ndarray | None:
    """The causal mask (top-left: row i sees keys j <= i) of logits of ``shape``; None if not causal."""
    if not case["causal"]:
        return None
    nq, nk = shape[-2:]
    return np.triu(np.ones((nq, nk), bool), 1)


def _logits(case: dict, s: np.ndarray) -> np.ndarray:
    """x = S * fl(fl(fl(attn_scale descale_q) descale_k) log2 e), masked -inf (base 2)."""
    c = ((_F32(case["attn_scale"]) * case["descale_q"]) * case["descale_k"]) * _LOG2E
    x = (s * c).astype(_F32)
    mask = _masked(case, x.shape)
    if mask is not None:
        x[..., mask] = -np.inf
    return x


def _p_scales(case: dict, opts: ReplayOptions) -> tuple[np.float32, np.float32]:
    """(scale, descale) of P."""
    if opts.p_scale is None:
        return case["scale_s"], case["descale_s"]
    return _F32(opts.p_scale), _F32(1.0) / _F32(opts.p_scale)


def _forward(case: dict, x: np.ndarray, recipe: Recipe, model: str,
             opts: ReplayOptions) -> tuple[np.ndarray, np.ndarray]:
    """(O codes, stats): the online softmax over key tiles of ``recipe.tiles.block_k``."""
    scale_s, descale_s = _p_scales(case, opts)
    v = _expand(case["v_fp8"], case["q_fp8"].shape[1])
    vt = _t(v)
    lead = x.shape[:-1]
    m = np.full(lead, -np.inf, _F32)
    l = np.zeros(lead, _F32)
    acc = np.zeros((*lead, v.shape[-1]), _F32)
    bk = recipe.tiles.block_k
    for j0 in range(0, x.shape[-1], bk):
        xt = x[..., j0:j0 + bk]
        m_new = np.maximum(m, xt.max(axis=-1))
        ref = np.where(m_new == -np.inf, _F32(0), m_new).astype(_F32)
        alpha = np.exp2(m - ref).astype(_F32)  # 0 where nothing was seen yet
        p = np.exp2(xt - ref[..., None]).astype(_F32)
        # Q-point P (PV): p * scale_s -> E4M3 (cuDNN: scale_s = 448, against the running max)
        p8 = _encode(p * scale_s, _E4M3)
        l = (l * alpha + p.sum(axis=-1, dtype=_F32)).astype(_F32)
        acc = _mm(p8, vt[..., j0:j0 + bk], _E4M3, _E4M3, model, c=(acc * alpha[..., None]).astype(_F32))
        m = m_new
    dead = l == 0
    l_div = np.where(dead, _F32(1), l)
    o = (acc / l_div[..., None]).astype(_F32) * ((descale_s * case["descale_v"]) * case["scale_o"])
    # Q-point O (returned and saved): -> E4M3 with scale_o
    o8 = _encode(np.where(dead[..., None], _F32(0), o), _E4M3)
    stats = np.where(dead, -np.inf, (np.where(m == -np.inf, _F32(0), m) + np.log2(l_div)) * _LN2).astype(_F32)
    return o8, stats


def backward_p(case: dict, model: str = "hopper", options: ReplayOptions | None = None) -> np.ndarray:
    """P of the backward of one case (float32, (batch, heads, queries, keys)), as :func:`replay_case`
    computes it under ``model`` and ``options.p_exponent`` (cuDNN's: "natural")."""
    s = _scores(case, model)
    return _backward_p(case, s, _logits(case, s), options or ReplayOptions())


def _backward_p(case: dict, s: np.ndarray, x: np.ndarray, opts: ReplayOptions) -> np.ndarray:
    """P from the logits' accumulator ``s``, the forward's base-2 logits ``x`` and cuDNN's stats."""
    stats = np.broadcast_to(case["stats"][..., None], s.shape)
    if opts.p_exponent == "base2":
        return np.exp2(x - (stats * _LOG2E).astype(_F32)).astype(_F32)
    attn = _F32(case["attn_scale"])
    if opts.p_exponent == "natural":
        c = attn * (case["descale_q"] * case["descale_k"])
    else:  # "natural_attn_first"
        c = (attn * case["descale_q"]) * case["descale_k"]
    # S c - stats as one fused multiply-add (natural log), then to base 2
    t = fma32(s, np.full(s.shape, c, _F32), -stats)
    mask = _masked(case, s.shape)
    if mask is not None:
        t[..., mask] = -np.inf
    return np.exp2((t * _LOG2E).astype(_F32)).astype(_F32)


def _backward(case: dict, s: np.ndarray, x: np.ndarray, model: str, opts: ReplayOptions) -> dict:
    """dQ, dK, dV codes (module docstring)."""
    scale_s, descale_s = _p_scales(case, opts)
    gf = emulation.get_format(_GRAD_FORMATS[case["grad_format"]])
    q, do, o = case["q_fp8"], case["do_fp8"], case["o_fp8"]
    heads, kv_heads = q.shape[1], case["k_fp8"].shape[1]
    k, v = _expand(case["k_fp8"], heads), _expand(case["v_fp8"], heads)
    p = _backward_p(case, s, x, opts)
    # Q-point P (dV = Pᵀ dO): P * scale_s -> E4M3
    p8 = _encode(p * scale_s, _E4M3)
    dv = _group_sum(_mm(_t(p8), _t(do), _E4M3, gf, model) * (descale_s * case["descale_dO"]), kv_heads)
    dp_acc = _mm(do, v, gf, _E4M3, model)
    dp_scale = case["descale_dO"] * case["descale_v"]
    # stale delta from the FP8 codes of dO and O (exact products, one float32 rounding of the sum)
    if opts.delta_do == "fp8":
        rowsum = (_decode(do, gf) * _decode(o, _E4M3)).sum(axis=-1).astype(_F32)
        delta = ((rowsum * case["descale_dO"]).astype(_F32) * case["descale_o"]).astype(_F32)
    else:  # the BF16 dO the capture quantized (a departure, for measurement only)
        if case["do_input"] is None:
            raise CaptureError(f"case {case['index']}: the capture holds no BF16 dO input (p<j>.do)")
        rowsum = (case["do_input"] * _decode(o, _E4M3)).sum(axis=-1).astype(_F32)
        delta = (rowsum * case["descale_o"]).astype(_F32)
    # dP - D: one fused multiply-add of the accumulator (dP itself is never rounded to float32; in
    # rows where P is one-hot, dP_ij and D_i agree to a few hundred float32 ulps and that rounding
    # decides dS's code)
    if opts.dp_fma:
        dp_minus_d = fma32(dp_acc, dp_scale, -delta[..., None])
    else:
        dp_minus_d = ((dp_acc * dp_scale).astype(_F32) - delta[..., None]).astype(_F32)
    attn = _F32(case["attn_scale"])
    if opts.ds_scales == "split":  # P attn_scale and (dP - D) scale_dP, then their product
        y = ((p * attn).astype(_F32) * (dp_minus_d * case["scale_dP"]).astype(_F32)).astype(_F32)
    else:  # "sequential"
        y = ((p * dp_minus_d).astype(_F32) * attn).astype(_F32) * case["scale_dP"]
    # Q-point dS (dK = dSᵀ Q): y -> GF once
    ds_dk = _encode(y, gf)
    # Q-point dS (dQ = dS K): y -> float16 -> GF (double rounding)
    y16 = torch.from_numpy(y).to(torch.float16).to(torch.float32).numpy() if opts.ds_dq_fp16 else y
    ds_dq = _encode(y16, gf)
    dk = _group_sum(_mm(_t(ds_dk), _t(q), gf, _E4M3, model) * (case["descale_dP"] * case["descale_q"]), kv_heads)
    kt = _t(k)
    dq, step = None, opts.dq_key_block or k.shape[-2]
    for j0 in range(0, k.shape[-2], step):
        part = _mm(ds_dq[..., j0:j0 + step], kt[..., j0:j0 + step], gf, _E4M3, model)
        dq = part if dq is None else (dq + part).astype(_F32)
    dq = (dq * (case["descale_dP"] * case["descale_k"])).astype(_F32)
    return {"dq": _encode(dq * case["scale_dQ"], gf), "dk": _encode(dk * case["scale_dK"], gf),
            "dv": _encode(dv * case["scale_dV"], gf)}


def replay_case(case: dict, recipe: Recipe | str = "cudnn_fp8", model: str = "hopper",
                options: ReplayOptions | None = None) -> dict:
    """The emulated codes of one case: ``{"o", "dq", "dk", "dv"}`` (uint8, cuDNN's layout) and
    ``"stats"`` (float32, natural-log LSE). ``model``: the accumulation model of every matmul
    (``"hopper"``: cuDNN's; ``"exact"`` for comparison); ``options``: departures for measurement."""
    recipe, opts = get_recipe(recipe), options or ReplayOptions()
    s = _scores(case, model)
    x = _logits(case, s)
    o8, stats = _forward(case, x, recipe, model, opts)
    return {"o": o8, "stats": stats, **_backward(case, s, x, model, opts)}


# ==============================================================================================
# Comparison
# ==============================================================================================


def code_steps(a: np.ndarray, b: np.ndarray, fmt) -> np.ndarray:
    """Ordinal distance between FP8 codes of ``fmt`` (sign-magnitude: +0 and -0 are 0 apart;
    adjacent values are 1 apart); a NaN code against any other code counts :data:`NAN_STEPS`."""
    fmt = emulation.get_format(fmt) if isinstance(fmt, str) else fmt
    a, b = a.astype(np.int32), b.astype(np.int32)
    sign = 1 << (fmt.bits - 1)

    def ordinal(c):
        mag = c & (sign - 1)
        return np.where(c & sign, -mag, mag)

    steps = np.abs(ordinal(a) - ordinal(b))
    nan_a = torch.isnan(emulation.decode(torch.from_numpy(a.astype(np.uint8)), fmt)).numpy()
    nan_b = torch.isnan(emulation.decode(torch.from_numpy(b.astype(np.uint8)), fmt)).numpy()
    return np.where((nan_a | nan_b) & (a != b), NAN_STEPS, steps)


@dataclass
class TensorMatch:
    """One output tensor of one case, emulated against cuDNN."""

    tensor: str
    codes: int  #: number of codes compared
    identical: int  #: codes identical to cuDNN's
    max_steps: int  #: largest ordinal distance
    beyond_one: int  #: codes more than MAX_STEPS apart
    zero_beyond_one: int  #: of those, codes where cuDNN returned +0 (an unwritten output reads as 0)
    max_steps_nonzero: int  #: largest distance over the codes where cuDNN's code is not +0
    #: dQ only: codes in the last partial query tile (:data:`CUDNN_BWD_QUERY_TILE`) where cuDNN
    #: returned +0 and the replay is more than MAX_STEPS away; left out of the goal
    tail_zeros: int = 0
    max_steps_checked: int = 0  #: largest distance over the codes the goal covers (all but tail_zeros)

    @property
    def fraction(self) -> float:
        return self.identical / self.codes if self.codes else 1.0

    @property
    def fraction_checked(self) -> float:
        """Identical codes among those the goal covers (a tail zero is never identical)."""
        checked = self.codes - self.tail_zeros
        return self.identical / checked if checked else 1.0

    @property
    def meets_goal(self) -> bool:
        return self.fraction_checked >= GOALS[self.tensor] and self.max_steps_checked <= MAX_STEPS

    def as_dict(self) -> dict:
        return {"tensor": self.tensor, "codes": self.codes, "identical": self.identical,
                "fraction": self.fraction, "max_steps": self.max_steps, "beyond_one_step": self.beyond_one,
                "cudnn_zero_beyond_one_step": self.zero_beyond_one,
                "max_steps_where_cudnn_nonzero": self.max_steps_nonzero,
                "cudnn_dq_tail_zeros": self.tail_zeros, "fraction_checked": self.fraction_checked,
                "max_steps_checked": self.max_steps_checked,
                "goal_fraction": GOALS[self.tensor], "meets_goal": self.meets_goal}


def dq_tail_rows(n_queries: int) -> slice:
    """The query rows of cuDNN's last partial backward tile (empty for a multiple of the tile)."""
    return slice(n_queries - n_queries % CUDNN_BWD_QUERY_TILE, n_queries)


def _match(tensor: str, ours: np.ndarray, theirs: np.ndarray, fmt) -> TensorMatch:
    steps = code_steps(ours, theirs, fmt)
    zero = theirs == 0
    tail = np.zeros(steps.shape, bool)
    if tensor == "dq":  # (batch, heads, queries, head_dim)
        tail[..., dq_tail_rows(steps.shape[-2]), :] = True
        tail &= zero & (steps > MAX_STEPS)
    return TensorMatch(tensor, int(steps.size), int((ours == theirs).sum()), int(steps.max(initial=0)),
                       int((steps > MAX_STEPS).sum()), int(((steps > MAX_STEPS) & zero).sum()),
                       int(steps[~zero].max(initial=0)), int(tail.sum()), int(steps[~tail].max(initial=0)))


def verify_capture(path: str, recipe: Recipe | str = "cudnn_fp8", model: str = "hopper",
                   options: ReplayOptions | None = None, on_case=None) -> list[dict]:
    """Replay every case of a capture; per case a JSON-ready dict with the case's description,
    ``stats_max_abs`` (largest |emulated - cuDNN| of the stats, finite rows) and per tensor the
    :class:`TensorMatch` as a dict. ``on_case(done, total)``, if given, is called before the first
    case and after each. Raises :class:`CaptureError` for a bad file."""
    results = []
    cases = load_capture(path)
    if on_case is not None:
        on_case(0, len(cases))
    for case in cases:
        got = replay_case(case, recipe, model, options)
        gf = _GRAD_FORMATS[case["grad_format"]]
        fmts = {"o": _E4M3, "dq": gf, "dk": gf, "dv": gf}
        matches = [_match(t, got[t], case[f"{t}_fp8"], fmts[t]) for t in TENSORS]
        finite = np.isfinite(case["stats"]) & np.isfinite(got["stats"])
        diff = np.abs(got["stats"][finite].astype(np.float64) - case["stats"][finite])
        b, h, nq, d = case["q_fp8"].shape
        results.append({
            "case": case["index"], "problem": case["problem"],
            "shape": [b, h, case["k_fp8"].shape[1], nq, case["k_fp8"].shape[2], d],
            "causal": case["causal"], "grad_format": case["grad_format"],
            "stats_max_abs": float(diff.max(initial=0.0)),
            "tensors": {m.tensor: m.as_dict() for m in matches},
        })
        if on_case is not None:
            on_case(len(results), len(cases))
    return results


def summary(results: list[dict]) -> dict:
    """Per tensor over all cases: the least identical fraction and the largest step distance."""
    out = {}
    for t in TENSORS:
        rows = [r["tensors"][t] for r in results]
        out[t] = {"min_fraction": min(x["fraction"] for x in rows), "max_steps": max(x["max_steps"] for x in rows),
                  "min_fraction_checked": min(x["fraction_checked"] for x in rows),
                  "max_steps_checked": max(x["max_steps_checked"] for x in rows),
                  "cudnn_dq_tail_zeros": sum(x["cudnn_dq_tail_zeros"] for x in rows),
                  "beyond_one_step": sum(x["beyond_one_step"] for x in rows),
                  "cudnn_zero_beyond_one_step": sum(x["cudnn_zero_beyond_one_step"] for x in rows),
                  "max_steps_where_cudnn_nonzero": max(x["max_steps_where_cudnn_nonzero"] for x in rows),
                  "goal_fraction": GOALS[t],
                  "meets_goal": all(x["meets_goal"] for x in rows)}
    return out


def to_json(path: str, results: list[dict]) -> str:
    """Strict JSON (no NaN or infinity) of a verification."""
    summ = summary(results)
    left_out = (f"dQ codes of cuDNN's last partial {CUDNN_BWD_QUERY_TILE}-row query tile where cuDNN returned +0 "
                f"and the replay is more than {MAX_STEPS} step away (cudnn_dq_tail_zeros): cuDNN writes zeros there")
    return json.dumps({"file": path, "goal": {"fractions": GOALS, "max_steps": MAX_STEPS, "left_out": left_out},
                       "goal_met": all(s["meets_goal"] for s in summ.values()), "summary": summ,
                       "cases": results}, indent=2, allow_nan=False)
