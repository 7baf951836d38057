"""``dmref.kernels.attention``: FP8 attention forward and backward as a torch.autograd.Function.

Tensors are ``(batch, heads, seqlen, head_dim)`` like ``torch.nn.functional.
scaled_dot_product_attention``; k and v may have fewer heads than q (GQA, ``heads % kv_heads ==
0``). Inputs are BF16; quantization to FP8 happens inside (fused quantization kernel), and the
outputs and gradients are BF16.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from dmref.recipes import Recipe

from ._runtime import require_runnable
from .config import DEFAULT_RECIPE, QUANT_BLOCK, KernelSpec, get_spec


@dataclass
class SavedForward:
    """What the backward reads: FP8 copies of Q, K, V made once in the forward, and LSE2."""

    q: object  #: quantize.Quantized with rows (QK^T) and cols (dS^T Q); None until the backward makes it
    k: object  #: rows (QK^T) and cols (dS K)
    v: object  #: cols (PV, forward) and rows (dO V^T, backward)
    lse2: torch.Tensor  #: (B*H, N) float32, base 2: LSE = LSE2 * ln 2
    #: Q (BF16) whose copies the backward's preprocess makes, in dO's quantization launch, where
    #: the forward did not make them (``q`` None): the warp-specialized forward quantizes Q's rows
    #: inside its kernel and the transposed copy's 128-token blocks are not a consumer's
    q_pending: torch.Tensor | None = None
    q_fmt: str = "float8_e4m3fn"  #: the format of Q's copies (the recipe's ``q``), where pending
    #: whether K's transposed copy (``k.cols``) holds its row codes with the head's factor, as a
    #: spec with K for dQ per head reads it (``KernelSpec.dsq_row``), rather than a factor per
    #: channel and 128-token block
    kt_head: bool = False

    def with_q_copies(self) -> SavedForward:
        """This state with Q's copies made, where they are pending (one launch, ``quantize``):
        what the kernels' own entry points (``bwd``, ``bwd_fused``, ``bwd_prepass``, ``bwd_ws``)
        read; :func:`attention_backward` makes them in dO's launch instead."""
        if self.q is not None:
            return self
        from .quantize import quantize

        return dataclasses.replace(self, q=quantize(self.q_pending, self.q_fmt)[0], q_pending=None)


@dataclass
class Shape:
    batch: int
    heads: int
    kv_heads: int
    n: int
    head_dim: int

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> "Shape":
        if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
            raise ValueError(f"q, k, v must be (B, H, N, D): got {tuple(q.shape)}, "
                             f"{tuple(k.shape)}, {tuple(v.shape)}")
        b, h, n, d = q.shape
        bk, hkv, nk, dk = k.shape
        if k.shape != v.shape:
            raise ValueError(f"k shape {tuple(k.shape)} != v shape {tuple(v.shape)}")
        if (bk, nk, dk) != (b, n, d):
            raise ValueError(f"k shape {tuple(k.shape)} does not fit q shape {tuple(q.shape)}: "
                             "batch, seqlen and head dim must agree")
        if h % hkv:
            raise ValueError(f"query heads {h=} must be a multiple of key/value heads {hkv=}")
        if d not in (64, 128):
            raise ValueError(f"head dim {d=} must be 64 or 128")
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dtype != torch.bfloat16:
                raise TypeError(f"{name} must be bfloat16, got {t.dtype}")
        return cls(b, h, hkv, n, d)


def _dims(s: Shape) -> dict:
    return dict(batch=s.batch, heads=s.heads, kv_heads=s.kv_heads, n=s.n, head_dim=s.head_dim)


def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
    scale: float | None = None, recipe: str | KernelSpec | Recipe = DEFAULT_RECIPE,
    for_backward: bool = True, debug: bool = False, kv_fp8=None,
):
    """Quantize (fused) and run the forward kernel.

    ``kv_fp8``: K and V already quantized by :func:`quantize_kv` (a folded recipe's
    ``FoldedKV``, for the backward too where ``for_backward``), which the forward then reads
    instead of quantizing ``k`` and ``v`` itself: a caller that has them, a training step
    that made them once, pays for no second quantization. ``k`` and ``v`` still give the shape.

    Returns ``(O, LSE, saved, debug dict)``: O ``(B, H, N, D)`` BF16, LSE ``(B, H, N)`` float32
    (natural log), ``saved`` for :func:`attention_backward` (None unless ``for_backward``), and
    with ``debug`` the forward's P codes under ``"p_codes"`` (``(B*H, N, N)`` uint8; the kernel
    stores the float32 values its cast received and the host casts them: ``fwd.fp8_codes``).
    """
    from . import fwd
    from .quantize import quantize

    r = get_spec(recipe)
    require_runnable(q, k, v)
    s = Shape.of(q, k, v)
    scale = 1.0 / math.sqrt(s.head_dim) if scale is None else float(scale)
    if kv_fp8 is not None:
        _check_kv_fp8(kv_fp8, s, r, for_backward)
    if r.folded:
        return _folded_forward(q, k, v, s, r, causal=causal, scale=scale, for_backward=for_backward, debug=debug,
                               kv=kv_fp8)
    # one quantization kernel per operand writes the copies of all its Q-points (formats equal:
    # config.unsupported)
    q8, _ = quantize(q, r.recipe.q.fmt.name, rows=True, cols=for_backward)
    k8, _ = quantize(k, r.recipe.k.fmt.name, rows=True, cols=for_backward)
    v8, _ = quantize(v, r.recipe.v.fmt.name, rows=for_backward, cols=True)
    o, lse2, p_codes = fwd.forward(q8, k8, v8, causal=causal, scale=scale, recipe=r, debug=debug,
                                   **_dims(s))
    lse = (lse2 * fwd.LN2).view(s.batch, s.heads, s.n)
    saved = SavedForward(q8, k8, v8, lse2) if for_backward else None
    return o, lse, saved, ({"p_codes": p_codes} if debug else {})


def quantize_kv(k: torch.Tensor, v: torch.Tensor, *, recipe: str | KernelSpec | Recipe = DEFAULT_RECIPE,
                for_backward: bool = True):
    """K and V quantized as the folded ``recipe``'s forward quantizes them (E4M3, POW2_DOWN: K one
    scale per head, V one per head and channel; ``for_backward``: also K's transposed copy and
    V's rows, which its backward reads), for :func:`attention_forward` and :func:`attention`'s
    ``kv_fp8``: the same codes and scales those make from ``k`` and ``v``, made once. Returns a
    ``dmref.kernels.quantize.FoldedKV``. A recipe whose forward is not the folded one (it
    quantizes K and V per token and per token block, with Q) is a ValueError."""
    from .quantize import quantize_kv_folded

    r = get_spec(recipe)
    if not r.folded:
        raise ValueError(f"quantize_kv: recipe {r.recipe.name!r} quantizes K and V per token inside its forward; "
                         "pre-quantized K and V are the folded recipes' (kernels_folded_*)")
    require_runnable(k, v)
    if k.ndim != 4 or k.shape != v.shape:
        raise ValueError(f"quantize_kv: k {tuple(k.shape)} and v {tuple(v.shape)} must be (B, HKV, N, D) of one shape")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != torch.bfloat16:
            raise TypeError(f"quantize_kv: {name} must be bfloat16, got {t.dtype}")
    return quantize_kv_folded(k.contiguous(), v.contiguous(), for_backward=for_backward, kt_head=r.dsq_row)


def _check_kv_fp8(kv, s: Shape, r: KernelSpec, for_backward: bool) -> None:
    """``kv_fp8`` fits the problem and the recipe, or a one-line ValueError says why not."""
    from .quantize import FoldedKV

    if not isinstance(kv, FoldedKV):
        raise ValueError(f"kv_fp8 must be what dmref.kernels.quantize_kv returns, got {type(kv).__name__}")
    if not r.folded:
        raise ValueError(f"kv_fp8: recipe {r.recipe.name!r} quantizes K and V per token inside its forward; "
                         "pre-quantized K and V are the folded recipes' (kernels_folded_*)")
    want = (s.batch * s.kv_heads, s.n, s.head_dim)
    if tuple(kv.k8.shape) != want or tuple(kv.k_scale.shape) != want[:1] or \
            tuple(kv.v_scale.shape) != (want[0], s.head_dim) or kv.vt8.shape[:2] != (want[0], s.head_dim) or \
            kv.vt8.shape[2] < s.n:
        raise ValueError(f"kv_fp8 holds K codes {tuple(kv.k8.shape)}, not the (B*HKV, N, D) = {want} of k and v")
    if for_backward and (kv.k_cols is None or kv.v_rows is None):
        raise ValueError("kv_fp8 has no copies for the backward: make it with quantize_kv(k, v, for_backward=True)")
    if for_backward and kv.kt_head != r.dsq_row:
        raise ValueError(f"kv_fp8's K^T copy is scaled {'per head' if kv.kt_head else 'per channel and block'}, "
                         f"recipe {r.recipe.name!r} reads it {'per head' if r.dsq_row else 'per channel and block'}: "
                         "make it with quantize_kv(k, v, recipe=<this recipe>)")


def _folded_forward(q, k, v, s: Shape, r: KernelSpec, *, causal: bool, scale: float, for_backward: bool, debug: bool,
                    kv=None):
    """The folded recipes' forward: K and V quantized with folded scales (one per head; one per
    head and channel), then on a Hopper GPU the warp-specialized Gluon kernel (``fwd_ws``, which
    quantizes Q itself), elsewhere (Triton's interpreter) and with ``debug`` the Triton forward on
    the same codes with the folded scales given per token and per token block (``fwd.launch``); for
    the backward, the copies its kernels read: K's rows with its head's scale for every token
    (the same codes and scale), K's transposed copy and V's rows, written by the folded
    quantization's second launch, and Q's row and transposed copies: with the Triton forward
    written by the quantization of Q whose rows it reads, with the Gluon one (which quantizes
    Q's rows itself) left to the backward's preprocess (``SavedForward.q_pending``: dO's
    quantization launch writes them; the same bytes either way, and the forward's time is the
    forward's own). ``kv``: that quantization's result, made by the caller
    (:func:`quantize_kv`), instead of made here."""
    from . import fwd, fwd_ws
    from ._runtime import interpreting
    from .fwd import LN2
    from .quantize import Quantized, quantize, quantize_kv_folded

    if kv is None:
        kv = quantize_kv_folded(k, v, for_backward=for_backward, kt_head=r.dsq_row)
    # K's rows as the Triton forward and the backward read them: the head's factor for every token
    k_rows = kv.k_rows or Quantized(n=s.n, rows=kv.k8, row_scale=kv.k_scale[:, None].expand(-1, s.n).contiguous())
    # the debug dumps are the Triton forward's: it runs them, on the same codes and scales
    gluon = not interpreting() and not debug and _not_hopper(q.device) is None
    extra = {}
    q8 = None  # Q's copies: the Gluon forward quantizes Q's rows itself and leaves them to the backward
    if gluon:
        o, lse2 = fwd_ws.forward(q.contiguous(), kv.k8, kv.k_scale, kv.vt8, kv.v_scale, kv_heads=s.kv_heads,
                                 causal=causal, scale=scale, recipe=r)
    else:
        q8, _ = quantize(q, r.recipe.q.fmt.name, rows=True, cols=for_backward)
        blocks = kv.vt8.shape[-1] // QUANT_BLOCK
        vt = Quantized(n=s.n, cols=kv.vt8, col_scale=kv.v_scale[:, None, :].expand(-1, blocks, -1).contiguous())
        o, lse2, p_codes = fwd.forward(q8, k_rows, vt, causal=causal, scale=scale, recipe=r, debug=debug, **_dims(s))
        if debug:
            extra["p_codes"] = p_codes
    saved = None
    if for_backward:
        # K's transposed copy and V's rows (E4M3, the recipe's k_dq and v_dp: config.unsupported)
        # from the folded quantization's own pass over K and V; Q's copies from the Triton
        # forward's quantization, or made by the backward's preprocess (q_pending)
        k8 = dataclasses.replace(k_rows, cols=kv.k_cols.cols, col_scale=kv.k_cols.col_scale)
        saved = SavedForward(q8, k8, kv.v_rows, lse2, q_pending=q if q8 is None else None, q_fmt=r.recipe.q.fmt.name,
                             kt_head=kv.kt_head)
    return o, (lse2 * LN2).view(s.batch, s.heads, s.n), saved, extra


def attention_backward(
    saved: SavedForward, o: torch.Tensor, do: torch.Tensor, *, shape: Shape, causal: bool,
    scale: float, recipe: str | KernelSpec | Recipe = DEFAULT_RECIPE, debug: bool = False,
    gluon: bool | None = None, fused: bool | None = None, deterministic: bool = False,
    delta: torch.Tensor | None = None,
):
    """Preprocess (dO quantization + stale delta, one kernel), then the dq and dkdv kernels; for a
    spec with D from a pre-pass (``kernels_delta_prepass``, ``KernelSpec.prepass``), dO's
    quantization, the pre-pass and the five-GEMM backward.

    The dq and dkdv kernels are the warp-specialized Gluon ones (``bwd_ws``) where they run the
    recipe (:func:`gluon_backward_refusal`), the Triton ones (``bwd``) otherwise; both give the same
    gradients bit for bit (tests/kernels/test_bwd_ws.py, on the H200). ``gluon`` forces the choice
    (``False``: the Triton kernels; ``True``: the Gluon ones, or a ValueError saying why not).

    Returns ``(dq, dk, dv, debug dict)``. The debug dict always holds ``"delta"`` (the D the dkdv
    kernel used) and with ``debug`` also ``"ds_rowsum"`` (float32 row sums of the dS tiles that
    dK uses, before quantization), ``"dq_ds_rowsum"`` (row sums of the effective dS behind dQ),
    ``"p_codes"`` / ``"ds_codes"`` (``(B*H, N, N)`` uint8 codes of the dkdv kernel's P and dS) and
    ``"ds_scale"`` (the dequantization factor of each dS element, ``(B*H, cdiv(N, block_m1), N)``: per query tile and key).

    ``fused=True`` runs the five-GEMM backward (one kernel per key block, dQ's partials added into
    a float32 buffer, then a postprocess: the Gluon ``bwd_ws.fused`` where it runs, as above, else
    the Triton ``bwd_fused``; ``gluon`` forces the choice as above) instead of dq and dkdv, for recipes
    with the stale delta (else a ValueError saying why); ``deterministic`` adds dQ's partials in key
    order, bit-identical across runs; ``delta`` (float32 ``(B, H, N)``, fused only): the D that dS =
    P (dP - D) uses instead of the stale delta, e.g. a matched delta computed ahead, so that the
    kernel computes the spec's recipe with that delta. Its debug dict holds ``"delta"`` and with ``debug``
    ``"ds_dk"``, ``"ds_dq"`` (dS as each matmul sees it) and, deterministic, ``"sem_seen"``
    (``bwd_fused.backward``).

    ``fused`` None (the default) is False for the other specs. A pre-pass spec always runs the
    five-GEMM backward (``fused`` None or True; ``fused=False`` is a ValueError, and so is
    ``delta=``, its D being the pre-pass's): the pre-pass makes the matched D from dO's row copy
    and the five-GEMM kernel runs with it, both Gluon (``bwd_ws.prepass``, ``bwd_ws.fused``) where
    they run, else Triton (``bwd_prepass.delta``, ``bwd_fused.backward``); ``gluon`` and
    ``deterministic`` as above; the debug dict's ``"delta"`` is the pre-pass's D.
    """
    from . import bwd
    from .quantize import quantize, quantize_with

    r = get_spec(recipe)
    if r.prepass:
        if fused is False:
            raise ValueError(f"recipe {r.name!r} takes D from a pre-pass, which runs with the five-GEMM backward "
                             "only (fused=True or None); the dq and dkdv kernels compute the matched D with their "
                             "deferred dQ (recipe 'kernels_delta_matching')")
        if delta is not None:
            raise ValueError(f"delta= replaces the stale delta; recipe {r.name!r} computes its D in the pre-pass")
        fused = True
    if deterministic and not fused:
        raise ValueError("deterministic=True is an option of the fused backward (fused=True); the dq and dkdv "
                         "kernels are deterministic already")
    if delta is not None and not fused:
        raise ValueError("delta= is read by the fused backward only (fused=True)")
    if saved.q is None and saved.q_pending is None:
        raise ValueError("saved holds neither Q's copies nor Q: it is not what attention_forward(for_backward=True) "
                         "returns")
    if do.dtype != torch.bfloat16:
        do = do.to(torch.bfloat16)

    def quantize_do(delta_with=None):
        """dO's copies (and with ``delta_with`` the stale delta), and Q's copies where the forward
        left them to the backward (``saved.q_pending``), in one launch."""
        nonlocal saved
        if saved.q is not None:
            return quantize(do, r.recipe.do_dp.fmt.name, rows=True, cols=True, delta_with=delta_with)
        do8_, d_, q8_ = quantize_with(do, r.recipe.do_dp.fmt.name, saved.q_pending, saved.q_fmt,
                                      delta_with=delta_with)
        saved = dataclasses.replace(saved, q=q8_, q_pending=None)
        return do8_, d_

    if fused:
        from . import bwd_fused

        given = None if delta is None else bwd_fused.caller_delta(delta, shape.batch, shape.heads, shape.n, do.device)
        why = bwd_fused.refusal(r, shape.head_dim)
        if why:
            raise ValueError(f"the fused backward does not run this call: {why}")
        why_not = gluon_backward_refusal(r, shape.head_dim, debug, do.device, fused=True)
        if gluon and why_not:
            raise ValueError(f"the Gluon fused backward does not run this call: {why_not}")
        use_gluon = not why_not and gluon is not False
        if use_gluon:
            from . import bwd_ws
        u = None
        if r.prepass:  # D from the pre-pass, on dO's row copy (and the bound U of dS for dQ, dsq_row)
            from . import bwd_prepass

            bwd_fused.check_kt_head(r, saved)  # before the pre-pass runs
            do8, _ = quantize_do()
            d = (bwd_ws.prepass if use_gluon else bwd_prepass.delta)(saved, do8, causal=causal, scale=scale,
                                                                       recipe=r, bound=r.dsq_row, **_dims(shape))
            if r.dsq_row:
                d, u = d
        else:  # the stale delta fused into dO's quantization, or the caller's D
            do8, d = quantize_do(delta_with=o if given is None else None)
            if given is not None:
                d = given
        if use_gluon:
            return bwd_ws.fused(saved, do8, d, causal=causal, scale=scale, recipe=r, deterministic=deterministic,
                                dsq_bound=u, **_dims(shape))
        return bwd_fused.backward(saved, do8, d, causal=causal, scale=scale, recipe=r, deterministic=deterministic,
                                  debug=debug, dsq_bound=u, **_dims(shape))
    # delta step (stale) fused into the quantization of dO: one read of dO and O
    do8, delta_stale = quantize_do(delta_with=o)
    why_not = gluon_backward_refusal(r, shape.head_dim, debug, do.device)
    if gluon and why_not:
        raise ValueError(f"the Gluon backward does not run this call: {why_not}")
    if why_not or gluon is False:
        return bwd.backward(saved, do8, do8, delta_stale, causal=causal, scale=scale, recipe=r,
                            debug=debug, **_dims(shape))
    from . import bwd_ws

    return bwd_ws.backward_ws(saved, do8, do8, delta_stale, causal=causal, scale=scale, recipe=r,
                              kernels=("dq", "dkdv"), **_dims(shape))


def gluon_backward_refusal(recipe: KernelSpec, head_dim: int, debug: bool = False,
                           device: torch.device | None = None, fused: bool = False) -> str | None:
    """Why the warp-specialized Gluon backward (``bwd_ws``: dq and dkdv, or with ``fused`` its
    five-GEMM kernel) does not run ``recipe`` at ``head_dim`` on ``device`` (a CUDA device, or
    None: not asked), or None where it does: its kernels are written for Hopper's wgmma, Triton's
    interpreter runs no Gluon kernel, and the kernels' own checks (``bwd_ws._check``,
    ``bwd_ws._check_dq``, ``bwd_ws._check_fused``: the debug dumps, the 64-query and 64-key
    tiles, the delta) say the rest."""
    from ._runtime import interpreting
    from .bwd import prepass_refusal

    why = None if fused else prepass_refusal(recipe)
    if why:
        return why
    if device is not None and device.type == "cuda":
        why = _not_hopper(device)
        if why:
            return why
    if interpreting():
        return "Triton's interpreter runs no Gluon kernel"
    from . import bwd_ws

    try:
        if fused:
            bwd_ws._check_fused(recipe, head_dim, debug)
        else:
            bwd_ws._check_dq(recipe, head_dim, debug)
            bwd_ws._check(recipe, head_dim, debug)
    except ValueError as exc:
        return str(exc)
    return None


def _not_hopper(device: torch.device) -> str | None:
    """Why the Gluon kernels (``fwd_ws``, ``bwd_ws``: Hopper's wgmma and setmaxnreg) do not run
    on the CUDA ``device``, or None on a Hopper GPU (compute capability 9.x)."""
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return (f"the Gluon kernels use Hopper's wgmma (compute capability 9.x); "
                f"{torch.cuda.get_device_name(device)} has {major}.{minor}")
    return None


class _FP8Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, recipe, kv_fp8):
        o, _lse, saved, _ = attention_forward(q, k, v, causal=causal, scale=scale, recipe=recipe,
                                              for_backward=True, kv_fp8=kv_fp8)
        ctx.shape = Shape.of(q, k, v)
        ctx.causal = causal
        ctx.scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        ctx.recipe = recipe
        # Q itself where the backward makes its copies: saved through autograd, which checks that
        # it was not changed in place before the backward
        ctx.save_for_backward(o, *(() if saved.q_pending is None else (q,)))
        ctx.saved = dataclasses.replace(saved, q_pending=None) if saved.q_pending is not None else saved
        return o

    @staticmethod
    def backward(ctx, do):
        o, *q = ctx.saved_tensors
        saved = dataclasses.replace(ctx.saved, q_pending=q[0]) if q else ctx.saved
        dq, dk, dv, _ = attention_backward(saved, o, do.contiguous(), shape=ctx.shape,
                                           causal=ctx.causal, scale=ctx.scale, recipe=ctx.recipe)
        return dq, dk, dv, None, None, None, None


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
    scale: float | None = None, recipe: str | KernelSpec | Recipe = DEFAULT_RECIPE, kv_fp8=None,
) -> torch.Tensor:
    """FP8 attention with Delta-Matching (or stale delta), forward and backward.

    q: (B, H, N, D), k and v: (B, HKV, N, D), all BF16 on a Hopper GPU; D in {64, 128};
    ``scale`` defaults to 1/sqrt(D); ``recipe`` is a name of ``config.SPECS``
    (``"kernels_delta_matching"``, ``"kernels_naive_fp8"`` with the stale delta,
    ``"kernels_delta_prepass"`` with the matched D from a pre-pass and the five-GEMM backward, and
    their ``kernels_folded_`` forms, whose forward on a Hopper GPU is the warp-specialized Gluon
    kernel; by default ``config.DEFAULT_RECIPE``, ``"kernels_folded_delta_matching"``), a
    ``config.KernelSpec``, or a ``dmref.recipes.Recipe`` the kernels run; ``dmref.get_recipe(name)``
    is the Recipe a name runs. Another recipe (a dmref preset such as ``"delta_matching"``) is a
    ValueError naming the kernel recipe to use. Returns O (B, H, N, D) BF16; where no gradient
    can flow (``torch.no_grad()``, or no input requiring one) the forward runs alone, without the
    copies only a backward reads (the same O). Fails with a clear
    message where no Hopper GPU is available (unless Triton's interpreter is switched on).
    ``kv_fp8``: K and V already quantized (:func:`quantize_kv`, a folded recipe's), which the
    forward reads instead of quantizing ``k`` and ``v``; the gradients still go to ``k`` and ``v``.
    """
    spec = get_spec(recipe)
    require_runnable(q, k, v)
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if kv_fp8 is not None:
        _check_kv_fp8(kv_fp8, Shape.of(q, k, v), spec, grad)
    if not grad:  # no backward can run: the forward alone, without the copies only the backward reads
        return attention_forward(q, k, v, causal=causal, scale=scale, recipe=spec, for_backward=False,
                                 kv_fp8=kv_fp8)[0]
    return _FP8Attention.apply(q, k, v, causal, scale, spec, kv_fp8)
