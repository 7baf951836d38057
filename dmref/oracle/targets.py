"""The oracle's ready-made targets: torch's SDPA (:func:`sdpa_math`, :func:`sdpa`), FlexAttention
(:func:`flex`) and dmref's emulated recipes (:func:`emulated`, ``emulated_<preset>``):
``dmref check dmref.targets:sdpa_math`` (``dmref.oracle:sdpa_math`` and
``dmref.oracle:emulated_<preset>`` name the same functions). cuDNN's live FP8 attention is in
:mod:`dmref.cudnn.target`.

The targets take ``fn(q, k, v, *, causal=False, scale=None, mask=None, window=None,
documents=None)``: GQA, a boolean or additive mask, a sliding window and document ids (the last
two through the mask: :func:`features_into_mask`; with ``causal`` and a mask, SDPA gets one
combined mask: :func:`causal_into_mask`). The emulated targets declare
``causal_alignment = "bottom_right"`` (dmref.attention's), the SDPA targets are top-left.

A target that cannot run here raises :class:`TargetUnavailable`; one that declines a problem
raises :class:`CaseUnsupported`.
"""

from __future__ import annotations

import math

import torch

__all__ = ["TargetUnavailable", "CaseUnsupported", "causal_into_mask", "emulated", "features_into_mask", "flex",
           "gqa_kwargs", "sdpa", "sdpa_math"]


class TargetUnavailable(RuntimeError):
    """Raised by an implementation that cannot run on this machine at all (a package or the GPU
    is missing): :func:`dmref.oracle.check` stops and re-raises it instead of failing every case; the message
    is one line and says what is missing. A subclass that is also a ``NotImplementedError``
    declines one problem only (:class:`CaseUnsupported`) and is recorded per case."""


class CaseUnsupported(TargetUnavailable, NotImplementedError):
    """The target runs here but not on this problem (head dim, ...). A ``NotImplementedError``,
    so the oracle records the case as skipped."""


# ==============================================================================================
# torch's SDPA and dmref's emulated recipes
# ==============================================================================================


def gqa_kwargs(q, k) -> dict:
    """``{"enable_gqa": True}`` when k has fewer heads than q (SDPA, torch >= 2.5, needs it to
    read key/value head h // (H // Hkv) for query head h), else ``{}`` (older torch then works
    on everything but GQA)."""
    return {"enable_gqa": True} if q.shape[-3] != k.shape[-3] else {}


def causal_into_mask(q, k, mask, causal: bool):
    """SDPA takes ``is_causal`` or ``attn_mask``, not both: with both, the causal mask (top-left
    aligned, as SDPA's ``is_causal``: query i sees keys j <= i) folded into ``mask`` (boolean:
    and-ed; floating: -inf where causal removes a position). Returns ``(mask, causal)`` for SDPA."""
    if mask is None or not causal:
        return mask, causal
    nq, nk = q.shape[-2], k.shape[-2]
    keep = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril()
    if mask.dtype == torch.bool:
        return mask & keep, False
    return mask.masked_fill(~keep, -math.inf), False


def features_into_mask(q, k, mask, window=None, documents=None):
    """A sliding ``window`` ``(left, right)`` and ``documents`` ids ((batch, seqlen)) as a mask
    combined with ``mask`` (:func:`dmref.oracle.cases.feature_mask`): how a target without
    native support for them runs them through SDPA's ``attn_mask``."""
    if window is None and documents is None:
        return mask
    from .cases import feature_mask

    keep = feature_mask(q.shape[-2], k.shape[-2], window=window, documents=documents, device=q.device)
    if mask is None:
        return keep
    if mask.dtype == torch.bool:
        return mask & keep
    return mask.masked_fill(~keep, -math.inf)


def sdpa_math(q, k, v, *, causal=False, scale=None, mask=None, window=None, documents=None):
    """torch's scaled_dot_product_attention, math backend. ``mask``: boolean (True = attend) or
    floating (added to the scaled scores), with ``causal`` too (:func:`causal_into_mask`); a
    sliding ``window`` and ``documents`` through the mask (:func:`features_into_mask`); k, v
    may have fewer heads than q (GQA)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    mask = features_into_mask(q, k, mask, window, documents)
    mask, causal = causal_into_mask(q, k, mask, causal)
    with sdpa_kernel(SDPBackend.MATH):
        return scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                            **gqa_kwargs(q, k))


def sdpa(q, k, v, *, causal=False, scale=None, mask=None, window=None, documents=None):
    """torch's scaled_dot_product_attention, whatever backend torch picks (mask, window,
    documents and GQA as :func:`sdpa_math`)."""
    from torch.nn.functional import scaled_dot_product_attention

    mask = features_into_mask(q, k, mask, window, documents)
    mask, causal = causal_into_mask(q, k, mask, causal)
    return scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, **gqa_kwargs(q, k))


def flex(q, k, v, *, causal=False, scale=None):
    """torch's FlexAttention (``torch.nn.attention.flex_attention``, eager), causal through a
    block mask (top-left, ``kv_idx <= q_idx``, as SDPA's ``is_causal``), GQA through
    ``enable_gqa``. torch 2.13 has no FlexAttention backward on the CPU (NotImplementedError:
    every case fails ``runs`` there); on a GPU it runs."""
    import warnings

    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    block_mask = None
    if causal:
        def causal_mod(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx

        block_mask = create_block_mask(causal_mod, None, None, q.shape[-2], k.shape[-2], device=q.device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention warns that it is not compiled
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def emulated(recipe):
    """``dmref.attention`` with ``recipe`` as an oracle target (``fn(q, k, v, *, causal, scale,
    mask)``; GQA and boolean or additive masks as :func:`dmref.attention`); also reachable as
    ``dmref.oracle:emulated_<preset>`` from the command line."""
    from ..api import attention

    def fn(q, k, v, *, causal=False, scale=None, mask=None, window=None, documents=None):
        mask = features_into_mask(q, k, mask, window, documents)
        return attention(q, k, v, causal=causal, scale=scale, mask=mask, recipe=recipe)

    name = recipe if isinstance(recipe, str) else recipe.name
    fn.__name__ = fn.__qualname__ = f"emulated_{name}"
    fn.causal_alignment = "bottom_right"  # dmref.attention aligns as dmref.reference (FlashAttention >= 2.1)
    return fn


def __getattr__(name: str):
    if name.startswith("emulated_"):
        from ..recipes import get_recipe

        preset = name[len("emulated_"):]
        get_recipe(preset)  # raises ValueError for an unknown preset
        return emulated(preset)
    raise AttributeError(f"module 'dmref.oracle.targets' has no attribute {name!r}")
