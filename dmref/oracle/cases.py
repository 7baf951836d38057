"""The attention problems the oracle runs (:func:`make_cases`).

Every case is generated in float64, rounded once to the input dtype (round to nearest even, the
cast torch's ``.to`` does), and then made probe-ready by :func:`dmref.oracle.probe.prepare` (two null
channels in Q and K, K's largest element set to 7 * 2^e). The exact reference is computed from
the rounded inputs, so rounding the inputs is never counted as the implementation's error.

Causal cases have ``seqlen_q == seqlen_k`` (where the top-left alignment of
``torch.nn.functional.scaled_dot_product_attention`` and the bottom-right alignment of
FlashAttention >= 2.1 and :mod:`dmref.reference` agree), except ``causal_cross`` and
``causal_more_queries``, whose reference follows the declared alignment
(:meth:`Case.for_reference`).

The cases together vary every axis an attention bug can live on (docs/oracle.md lists the axes
and a planted bug for each): batch, heads, key/value heads and the GQA ratio (1 to 16, one
key/value head), seqlen_q and seqlen_k separately (1, tails, block multiples, more queries than
keys, 32,785 keys in ``thorough``), head dims (64 to 256, Q's and V's apart), the values' range
up to the dtype's limits (every case representable in it: :func:`representable`), the logits'
range and where an extreme sits, causal or not and its alignment, boolean and additive masks with
fully masked rows, sliding windows and documents, the softmax scale, and the memory layout
(non-contiguous views, a storage offset, a non-contiguous dO), and long sums of terms of one sign
in O and in dV, dK, dQ (an accumulation without promotion, a running sum in a narrow type). The
model shapes come from :data:`MODEL_SHAPES`. ``Case.feature`` names the optional feature a case exercises (``"gqa"``,
``"mask"``, ``"window"``, ``"documents"``), None for the core cases.

GQA: k and v (and so dK, dV) have ``kv_heads`` heads, q and dO ``groups * kv_heads``; query
head h reads key/value head ``h // groups`` (``repeat_interleave``, SDPA's ``enable_gqa``); at
least two key/value heads except in ``single_kv_head``, so that a wrong grouping (``repeat``
instead of ``repeat_interleave``) is a different problem. Masks: boolean (True = attend) or
floating, added to the scaled scores (SDPA's float ``attn_mask``), rounded to the input dtype
like the inputs, one per batch element, so the reference sees exactly the mask fn gets.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field

import torch

from . import probe as _probe

__all__ = ["CAUSAL_ALIGNMENTS", "CASE_SETS", "DEFAULT_CASES", "DEFAULT_HEAD_DIM", "MAX_SEED", "LAYOUTS", "OTHER_HEAD_DIM", "Case", "as_layout",
           "MODEL_SHAPES", "extreme_magnitude", "feature_mask", "make_cases", "representable"]

#: the head dim of every case but ``other_head_dim`` when the caller gives none
DEFAULT_HEAD_DIM = 64
#: the head dim of the ``other_head_dim`` case when the caller gives none (not a power of two,
#: more than one 64-channel tile)
OTHER_HEAD_DIM = 96


@dataclass
class Case:
    """One attention problem. Tensors are ``(batch, heads, seqlen, head_dim)`` in the input
    dtype, k and v with ``kv_heads`` heads (a divisor of q's heads: GQA). ``mask`` is None,
    boolean (True = attend) or floating in the input dtype (additive: added to the scaled
    scores, -inf removes a position), broadcastable to (batch, heads, seqlen_q, seqlen_k)."""

    name: str
    description: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    causal: bool
    scale: float
    mask: torch.Tensor | None = None
    probe: _probe.ProbeSetup | None = None
    tags: tuple[str, ...] = field(default_factory=tuple)
    layout: str = "contiguous"  #: how fn receives q, k, v and dO: see :func:`as_layout`
    #: a sliding window ``(left, right)`` (FlashAttention's ``window_size``): query i sees keys
    #: i - left <= j <= i + right (seqlen_q == seqlen_k); fn gets it as ``window=``
    window: tuple[int, int] | None = None
    #: (batch, seqlen) int64 document ids of packed sequences: query i sees key j only within
    #: its document (seqlen_q == seqlen_k); fn gets it as ``documents=``
    documents: torch.Tensor | None = None

    def fn_kwargs(self) -> dict:
        """The keyword arguments of an optional feature fn gets beyond causal, scale and mask."""
        extra = {}
        if self.window is not None:
            extra["window"] = self.window
        if self.documents is not None:
            extra["documents"] = self.documents
        return extra

    @property
    def kv_heads(self) -> int:
        return self.k.shape[1]

    @property
    def feature(self) -> str | None:
        """The optional feature the case exercises: ``"window"`` (a sliding window),
        ``"documents"`` (a document mask of packed sequences), ``"mask"`` (an explicit boolean
        or additive mask), ``"gqa"`` (fewer key/value heads than query heads), or None."""
        if self.window is not None:
            return "window"
        if self.documents is not None:
            return "documents"
        if self.mask is not None:
            return "mask"
        if self.kv_heads != self.q.shape[1]:
            return "gqa"
        return None

    def leaf(self, t: torch.Tensor, device=None) -> torch.Tensor:
        """A fresh leaf tensor with t's values in this case's memory layout (on ``device``)."""
        return as_layout(t.detach().to(device) if device is not None else t.detach(), self.layout)

    @property
    def shape(self) -> str:
        """``batch x heads x seqlen x head_dim``; ``heads/kv_heads`` under GQA, ``seqlen_q x
        seqlen_k`` when they differ (e.g. ``1x8/2x128x64``)."""
        b, h, nq, d = self.q.shape
        nk = self.k.shape[-2]
        n = f"{nq}" if nq == nk else f"{nq}x{nk}"
        heads = f"{h}" if h == self.kv_heads else f"{h}/{self.kv_heads}"
        return f"{b}x{heads}x{n}x{d}"

    def for_reference(self, alignment: str) -> "Case":
        """The case as the reference computes it under a causal ``alignment``: ``"top_left"``
        (SDPA's ``is_causal``: query i sees keys j <= i) or ``"bottom_right"`` (FlashAttention
        >= 2.1 and :mod:`dmref.reference`: j <= i + seqlen_k - seqlen_q). The two differ only
        when the case is causal with seqlen_q != seqlen_k; top-left then becomes a boolean or
        additive mask with ``causal=False``."""
        if alignment not in CAUSAL_ALIGNMENTS:
            raise ValueError(f"causal_alignment={alignment!r}; accepted: {', '.join(CAUSAL_ALIGNMENTS)}")
        nq, nk = self.q.shape[-2], self.k.shape[-2]
        if self.window is not None or self.documents is not None:  # as a boolean mask (nq == nk)
            keep = feature_mask(nq, nk, window=self.window, documents=self.documents)
            return Case(self.name, self.description, self.q, self.k, self.v, self.dout, self.causal, self.scale,
                        keep, self.probe, self.tags, self.layout)
        if not self.causal or nq == nk or alignment == "bottom_right":
            return self
        keep = torch.ones(nq, nk, dtype=torch.bool).tril()
        if self.mask is None:
            mask = keep[None, None]
        elif self.mask.dtype == torch.bool:
            mask = self.mask & keep
        else:
            mask = self.mask.masked_fill(~keep, -math.inf)
        return Case(self.name, self.description, self.q, self.k, self.v, self.dout, False, self.scale, mask,
                    self.probe, self.tags, self.layout)

    def to(self, device) -> "Case":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return Case(self.name, self.description, move(self.q), move(self.k), move(self.v), move(self.dout),
                    self.causal, self.scale, move(self.mask), self.probe, self.tags, self.layout, self.window,
                    move(self.documents))


def feature_mask(seqlen_q: int, seqlen_k: int, *, window=None, documents=None, device=None) -> torch.Tensor:
    """The boolean "attend" mask of a sliding ``window`` ``(left, right)`` (-1: no limit on that
    side; query i sees keys i - left <= j <= i + right) and of ``documents`` ((batch, seqlen)
    ids: query i sees key j when both are in one document), broadcastable to (batch, 1,
    seqlen_q, seqlen_k); seqlen_q == seqlen_k."""
    if seqlen_q != seqlen_k:
        raise ValueError(f"windows and documents take seqlen_q == seqlen_k, got {seqlen_q} and {seqlen_k}")
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    keep = torch.ones(1, 1, seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if window is not None:
        left, right = window
        if left >= 0:
            keep = keep & (j >= i - left)
        if right >= 0:
            keep = keep & (j <= i + right)
    if documents is not None:
        docs = documents.to(device)
        keep = keep & (docs[:, None, :, None] == docs[:, None, None, :])
    return keep


def _documents(batch: int, lengths: tuple[tuple[int, ...], ...]) -> torch.Tensor:
    """(batch, sum(lengths)) int64 ids: the documents of element e have lengths[e]."""
    rows = [torch.repeat_interleave(torch.arange(len(ls)), torch.tensor(ls)) for ls in lengths[:batch]]
    return torch.stack(rows).to(torch.int64)


#: the memory layouts a case can give fn its tensors in
LAYOUTS = ("contiguous", "strided")
#: how a causal mask is aligned when seqlen_q != seqlen_k (:meth:`Case.for_reference`)
CAUSAL_ALIGNMENTS = ("top_left", "bottom_right")


def as_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A new leaf tensor equal to ``t`` (``(batch, heads, seqlen, head_dim)``) in ``layout``:

    - ``contiguous``: a contiguous copy;
    - ``strided``: a ``(batch, seqlen, heads, head_dim)`` buffer seen through ``transpose(1, 2)``
      (the layout of a projection's output split into heads: not contiguous), starting one
      element into its storage (storage offset 1: the data pointer is not 16-byte aligned).
    """
    if layout == "contiguous":
        return t.clone(memory_format=torch.contiguous_format)
    if layout == "strided":
        b, h, n, d = t.shape
        storage = torch.zeros(1 + t.numel(), dtype=t.dtype, device=t.device)
        view = storage[1:].view(b, n, h, d).transpose(1, 2)
        view.copy_(t)
        return view.detach()
    raise ValueError(f"{layout=} is not one of {LAYOUTS}")


def _randn(g, *shape):
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _token_scaled_dout(g, b, h, n, dv, grad_scale):
    """dO with log-normal per-token scales around ``grad_scale`` (as in training)."""
    return _randn(g, b, h, n, dv) * torch.exp(0.5 * _randn(g, b, h, n, 1)) * grad_scale


def _realistic(g, b, h, n, d, *, seed):
    """dmref.demo's problem: outlier channels (x3 in Q, K; x8 in V), a sink key, a shared query
    direction and peaked rows; dO per-token scaled."""
    from ..problems import make_problem

    q, k, v, dout = make_problem(b, h, n, d, seed=seed)
    return tuple(t.to(torch.float64) for t in (q, k, v, dout))


def _outliers(g, b, h, n, d, factor):
    """Massive activations: two channels of K and V ``factor`` times larger than the rest (2^14
    where the dtype allows: LLMs show outliers of ~10^4; Q's matching channels 1/factor smaller,
    so the logits stay moderate).
    E4M3 blocks along the head dim then push the other channels of a token into the subnormal
    range (spacing 2^-9 of a scale set by the outlier: ~0.1 absolute); blocks along the
    sequence keep them normal. This case tells quantization axes apart."""
    q, k, v = _randn(g, b, h, n, d), _randn(g, b, h, n, d), _randn(g, b, h, n, d)
    big = [d // 4 - 1, 3 * d // 4 - 1]
    k[..., big] *= factor
    v[..., big] *= factor
    q[..., big] /= factor
    return q, k, v, _token_scaled_dout(g, b, h, n, d, 1.0)


def _gaussian(g, b, h, nq, nk, d, dv=None):
    dv = dv or d
    return (_randn(g, b, h, nq, d), _randn(g, b, h, nk, d), _randn(g, b, h, nk, dv),
            _token_scaled_dout(g, b, h, nq, dv, 1.0))


def _one_signed(g, b, h, nq, nk, d, dv=None):
    """Gaussian q, k; v and dO = 1 + randn / 4: positive but for a few values, so that
    O = P V / l (rows close to uniform, by the case's scale) and dV = Pᵀ dO are long sums of
    terms of one sign, whose accumulator outgrows each term: what a tensor-core chain without
    promotion truncates (docs/kernels_speed.md, "Long chains on the tensor cores")."""
    dv = dv or d
    return (_randn(g, b, h, nq, d), _randn(g, b, h, nk, d), 1 + _randn(g, b, h, nk, dv) / 4,
            1 + _randn(g, b, h, nq, dv) / 4)


def _one_signed_gradients(g, b, h, nq, nk, d, dv=None):
    """Inputs whose gradients are long sums of terms of one sign. Each key j carries a sign a_j
    (half the keys +1, half -1, in random order), each query a weight b_i = 1 + randn/4; with 1
    the all-ones vector and c a vector of +1 on half the channels and -1 on the others
    (c . 1 = 0)::

        V_j = a_j 1 + randn/4    K_j = a_j 1 + randn/4    dO_i = b_i 1 + randn/4    Q_i = b_i c + randn/4

    so that the logits are the noise's (Q_i . K_j = b_i a_j c . 1 + noise: rows neither flat
    nor peaked), dP_ij = dO_i . V_j ~ a_j b_i dv, D_i = sum_j P_ij dP_ij ~ 0, dS_ij ~ P_ij a_j b_i dv,
    and, channel by channel, every term of each gradient's sum has the same sign:

        dV_j = sum_i P_ij dO_i              ~ (sum_i P_ij b_i) 1               (over the queries)
        dK_j = tau sum_i dS_ij Q_i          ~ tau a_j dv (sum_i P_ij b_i^2) c  (over the queries)
        dQ_i = tau sum_j dS_ij K_j          ~ tau b_i dv (sum_j P_ij a_j^2) 1  (over the keys)

    A running sum kept in a narrow type (a BF16 dV, dK or dQ added into block by block) then
    rounds a total that outgrows each block's term, where zero-mean inputs keep it small."""
    dv = dv or d
    a = torch.ones(nk, dtype=torch.float64)
    a[: nk // 2] = -1
    a = a[torch.randperm(nk, generator=g)]
    weight = 1 + _randn(g, b, h, nq, 1) / 4
    c = torch.ones(d, dtype=torch.float64)
    c[torch.randperm(d, generator=g)[: d // 2]] = -1
    ones_v = torch.ones(dv, dtype=torch.float64)
    v = a[:, None] * ones_v + _randn(g, b, h, nk, dv) / 4
    k = a[:, None] * torch.ones(d, dtype=torch.float64) + _randn(g, b, h, nk, d) / 4
    dout = weight * ones_v + _randn(g, b, h, nq, dv) / 4
    q = weight * c + _randn(g, b, h, nq, d) / 4
    return q, k, v, dout


def _gqa(g, b, h, hkv, nq, nk, d, dv=None):
    """Gaussian q (h heads), k, v (hkv heads) with four outlier channels (x3 in Q and K, x8 in V,
    as dmref.demo), the query heads of a group sharing a mean direction (|mu| about half a
    token's norm); dO per-token scaled."""
    groups = h // hkv
    dv = dv or d
    chan = torch.ones(d, dtype=torch.float64)
    outliers = torch.randperm(d, generator=g)[:4]
    qk_scale, v_scale = chan.clone(), torch.ones(dv, dtype=torch.float64)
    qk_scale[outliers], v_scale[outliers % dv] = 3.0, 8.0
    mu = _randn(g, b, hkv, 1, d)
    mu = 0.5 * math.sqrt(d) * mu / mu.norm(dim=-1, keepdim=True)
    q = _randn(g, b, h, nq, d) * qk_scale + mu.repeat_interleave(groups, dim=1)
    k = _randn(g, b, hkv, nk, d) * qk_scale
    v = _randn(g, b, hkv, nk, dv) * v_scale
    return q, k, v, _token_scaled_dout(g, b, h, nq, dv, 1.0)


def _additive_mask(g, b, h, nq, nk) -> torch.Tensor:
    """(b, h, nq, nk) float64: ALiBi-like -slope_h |i - j| with slope_h = 2^-(4 + h) (one
    power-of-two slope per head), a random 10% of the positions -inf (drawn for each batch
    element and head), and every 9th query row all -inf (row 0 included) in batch element 0,
    shifted by one row in each further element."""
    i = torch.arange(nq, dtype=torch.float64)[:, None]
    j = torch.arange(nk, dtype=torch.float64)[None, :]
    slopes = 2.0 ** -(4.0 + torch.arange(h, dtype=torch.float64))
    bias = (-slopes[:, None, None] * (i - j).abs()).expand(b, h, nq, nk).clone()
    drop = torch.rand(b, h, nq, nk, generator=g, dtype=torch.float64) < 0.1
    bias = bias.masked_fill(drop, -math.inf)
    for e in range(b):
        bias[e, :, e::9, :] = -math.inf
    return bias


def _boolean_mask(g, b, nq, nk) -> torch.Tensor:
    """(b, 1, nq, nk) boolean: a random 70% of the positions kept, drawn for each batch element
    (one mask for all heads: it broadcasts), and every 7th query row fully masked, starting at
    row e in batch element e."""
    keep = torch.rand(b, 1, nq, nk, generator=g) < 0.7
    for e in range(b):
        keep[e, :, e::7] = False
    return keep


def _spikes(g, b, h, nq, nk, d, positions):
    """Gaussian q, k, v, dO in which batch element e has one key, ``positions[e]``, whose logit
    is 2^7 above the others' (|logits| of order 1 elsewhere: beyond exp's float32 range, 88.7,
    unless the row maximum includes that key). Queries share a mean direction mu (|mu| =
    sqrt(d)) with their noise orthogonal to it, and the spike key is 2^7 mu / |mu|, so that
    its scaled logit tau q_i . k = 2^7 in every row."""
    mu = _randn(g, b, h, 1, d)
    mu = mu / mu.norm(dim=-1, keepdim=True)
    noise = _randn(g, b, h, nq, d)
    noise = noise - (noise * mu).sum(-1, keepdim=True) * mu
    q = math.sqrt(d) * mu + noise
    k = _randn(g, b, h, nk, d)
    for e, j in enumerate(positions):
        k[e, :, j] = 2.0**7 * mu[e, :, 0]
    return q, k, _randn(g, b, h, nk, d), _token_scaled_dout(g, b, h, nq, d, 1.0)


#: where the spike key sits in each batch element of the ``extreme_positions`` case (203
#: keys): in the first block of 64 keys, in the last full block of 64 (keys 128-191; in the
#: tail of tiles of 128) and in the tail of every tile size (keys 192-202)
SPIKE_POSITIONS = (5, 150, 200)


@dataclass(frozen=True)
class _Spec:
    name: str
    description: str
    batch: int
    heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    causal: bool
    make: str  # generator name
    scale_factor: float | None = 1.0  # scale = scale_factor / sqrt(head_dim); None: 1 / (q's x k's magnitude)
    magnitude: tuple[float, float, float, float] = (1.0, 1.0, 1.0, 1.0)  # q, k, v, dout multipliers
    masked_rows: bool = False  # boolean mask, every 7th row fully masked
    window: tuple[int, int] | None = None  # a sliding window (left, right)
    documents: tuple[tuple[int, ...], ...] | None = None  # document lengths per batch element
    additive_mask: bool = False  # floating mask (see _additive_mask)
    kv_heads: int | None = None  # None: as many as query heads
    tags: tuple[str, ...] = ()
    layout: str = "contiguous"
    extreme: int = 0  # +1: q, k, v, dO at the dtype's huge magnitude m, -1 at 1/m (scale m^-2 / m^2)
    head_dim_v: int | None = None  # V's (and dO's) head dim when it differs from Q's and K's


def _specs(size: str) -> list[_Spec]:
    n = {"quick": 128, "standard": 256, "thorough": 512}[size]
    long_n = {"quick": 512, "standard": 1024, "thorough": 4096}[size]
    h = {"quick": 2, "standard": 2, "thorough": 4}[size]
    d = DEFAULT_HEAD_DIM
    kv = max(2, h)  # GQA: at least two key/value heads, so that the grouping matters
    # one query block against a long context (MODEL_SHAPES: 32,768 to 163,840 tokens); a
    # tail past every power of two
    context = {"quick": 2048 + 65, "standard": 8192 + 59, "thorough": 32768 + 17}[size]
    return [
        _Spec("realistic", "outlier channels x3/x8, sink key, peaked rows (dmref.demo)", 1, h, n, n, d, False, "realistic",
              tags=("realistic",)),
        _Spec("realistic_causal", "as realistic, causal", 1, h, n, n, d, True, "realistic", tags=("realistic", "causal")),
        _Spec("outlier_channels", "two channels of K and V x2^14 (Q's x2^-14; float16: 2^4, its extreme magnitude), causal", 1, h, n, n, d, True, "outliers",
              tags=("adversarial", "causal")),
        _Spec("peaked_rows", "scale 8/sqrt(d): logits of standard deviation 8, rows close to one-hot", 1, h, n, n, d, False, "gaussian",
              scale_factor=8.0, tags=("adversarial",)),
        _Spec("flat_rows", "scale 2^-10/sqrt(d): rows close to uniform", 1, h, n, n, d, True, "gaussian",
              scale_factor=2.0**-10, tags=("adversarial", "causal")),
        _Spec("long_sequence", f"{long_n} tokens, causal", 1, 1, long_n, long_n, d, True, "gaussian",
              tags=("adversarial", "causal", "long")),
        _Spec("tail_lengths", "203 tokens (not a multiple of any tile), causal", 1, h, 203, 203, d, True, "gaussian",
              tags=("adversarial", "causal")),
        _Spec("cross_tail", "113 queries x 203 keys, not causal", 1, h, 113, 203, d, False, "gaussian",
              tags=("adversarial", "cross")),
        _Spec("large_values", "q, k x2^6 (scale / 2^12 keeps logits moderate), v, dO x2^10 (each capped at the "
              "dtype's extreme magnitude: float16 2^4)", 1, h, n, n, d, False,
              "gaussian", scale_factor=None, magnitude=(2.0**6, 2.0**6, 2.0**10, 2.0**10), tags=("adversarial",)),
        _Spec("small_values", "v, dO x2^-12", 1, h, n, n, d, True, "gaussian", magnitude=(1.0, 1.0, 2.0**-12, 2.0**-12),
              tags=("adversarial", "causal")),
        _Spec("fully_masked_rows", "boolean mask, one per batch element, every 7th query row fully masked, "
              "batch 2, 203 tokens, causal (needs fn(..., mask=))", 2, h, 203, 203,
              d, True, "gaussian", masked_rows=True, tags=("adversarial", "mask", "causal")),
        _Spec("gqa", f"GQA: {4 * kv} query heads on {kv} key/value heads, outlier channels, causal", 1, 4 * kv, n, n,
              d, True, "gqa", kv_heads=kv, tags=("realistic", "causal", "gqa")),
        _Spec("additive_mask", "float mask: ALiBi-like bias per head, 10% -inf, every 9th row all -inf, one mask "
              "per batch element and head, batch 2, 113 queries x 203 keys (needs fn(..., mask=))", 2, h, 113, 203, d,
              False, "gaussian", additive_mask=True, tags=("adversarial", "mask", "additive", "cross")),
        # appended (each case is seeded by its position: the cases above keep their inputs)
        _Spec("batch_heads", f"batch 3, {h + 1} heads, causal", 3, h + 1, n, n, d, True, "gaussian",
              tags=("axes", "causal")),
        _Spec("strided_inputs", "q, k, v, dO non-contiguous (transposed (batch, seqlen, heads, head_dim) views) "
              "at storage offset 1", 2, h, n, n, d, False, "gaussian", layout="strided", tags=("axes", "layout")),
        _Spec("more_queries", "203 queries x 77 keys, not causal", 1, h, 203, 77, d, False, "gaussian",
              tags=("axes", "cross")),
        _Spec("single_query", "1 query x 203 keys (decoding), batch 2", 2, h, 1, 203, d, False, "gaussian",
              tags=("axes", "cross")),
        _Spec("gqa_ratio_2", "GQA: 6 query heads on 3 key/value heads, 113 queries x 203 keys, batch 2", 2, 6,
              113, 203, d, False, "gqa", kv_heads=3, tags=("axes", "gqa", "cross")),
        _Spec("other_head_dim", f"head dim {OTHER_HEAD_DIM} (the caller's head dim when one is given), causal", 1,
              h, n, n, OTHER_HEAD_DIM, True, "gaussian", tags=("axes", "causal")),
        _Spec("huge_values", "q, k, v, dO at m = 2^(e/4), e = min(max exponent of the dtype, 128) (bf16: 2^32), "
              "scale / m^2", 1, h, n, n, d, False, "gaussian", extreme=1, tags=("axes", "range")),
        _Spec("tiny_values", "q, k, v, dO at 1/m (bf16: 2^-32), scale x m^2, causal", 1, h, n, n, d, True,
              "gaussian", extreme=-1, tags=("axes", "range", "causal")),
        _Spec("huge_logits", "scale 32/sqrt(d): logits of standard deviation 32, beyond exp's float32 range "
              "without the row maximum subtracted", 1, h, n, n, d, False, "gaussian", scale_factor=32.0,
              tags=("axes", "range")),
        _Spec("extreme_positions", "one key per row with a logit 2^7 above the rest, at key 5 (first block), 150 "
              "(last full block of 64) and 200 (tail) in batch elements 0, 1, 2; 77 queries x 203 keys", 3, h, 77, 203,
              d, False, "spikes", tags=("axes", "range", "position", "cross")),
        _Spec("causal_cross", "113 queries x 203 keys, causal: top-left (SDPA) or bottom-right (FlashAttention) "
              "as declared", 2, h, 113, 203, d, True, "gaussian", tags=("contract", "causal", "cross", "alignment")),
        _Spec("causal_more_queries", "203 queries x 77 keys, causal (bottom-right: the first 126 rows see no key)",
              1, h, 203, 77, d, True, "gaussian", tags=("contract", "causal", "cross", "alignment")),
        # shapes of published models (MODEL_SHAPES)
        _Spec("long_context", f"one block of 64 queries against {context:,} keys (a long context), 1 head, not "
              "causal", 1, 1, 64, context, d, False, "gaussian", tags=("models", "long", "cross")),
        _Spec("single_kv_head", "8 query heads on 1 key/value head at head dim 256 (Gemma 2B), 113 tokens, causal",
              2, 8, 113, 113, 256, True, "gqa", kv_heads=1, tags=("models", "gqa", "causal")),
        _Spec("gqa_ratio_16", "32 query heads on 2 key/value heads (Llama 3.1 405B's ratio, 128 on 8), 77 tokens, "
              "causal", 1, 32, 77, 77, d, True, "gqa", kv_heads=2, tags=("models", "gqa", "causal")),
        _Spec("gqa_ratio_7", "14 query heads on 2 key/value heads (Qwen2.5 7B's ratio, 28 on 4), 113 queries x 203 "
              "keys, batch 2", 2, 14, 113, 203, d, False, "gqa", kv_heads=2, tags=("models", "gqa", "cross")),
        _Spec("mla_head_dims", "head dim 192 for Q, K and 128 for V (DeepSeek-V3's multi-head latent attention), "
              "4 heads, causal", 1, 4, n, n, 192, True, "gaussian", head_dim_v=128, tags=("models", "causal")),
        # masks people train with (optional features "window" and "documents")
        _Spec("sliding_window", "causal sliding window of 48 keys (window=(48, 0); Mistral 7B and Gemma 2: 4,096), "
              "batch 2, 203 tokens (needs fn(..., window=))", 2, h, 203, 203, d, True, "gaussian", window=(48, 0),
              tags=("features", "window", "causal")),
        _Spec("local_window", "two-sided window of 32 keys back and 16 ahead (window=(32, 16)), 203 tokens, not "
              "causal (needs fn(..., window=))", 1, h, 203, 203, d, False, "gaussian", window=(32, 16),
              tags=("features", "window")),
        _Spec("documents", "packed sequences: documents of 77, 9, 117 tokens (batch element 0) and 1, 128, 74 "
              "(element 1), causal (needs fn(..., documents=))", 2, h, 203, 203, d, True, "gaussian",
              documents=((77, 9, 117), (1, 128, 74)), tags=("features", "documents", "causal")),
        _Spec("documents_bidirectional", "packed sequences of 40, 1, 72 tokens, not causal (an encoder's; needs "
              "fn(..., documents=))", 1, h, 113, 113, d, False, "gaussian", documents=((40, 1, 72),),
              tags=("features", "documents")),
        # the accumulation's own axis (appended: the cases above keep their inputs)
        _Spec("long_average", f"one block of 64 queries averaging {context:,} keys (scale 2^-10/sqrt(d): rows "
              "close to uniform) whose V, like dO, is 1 + randn/4: long sums of terms of (nearly) one sign",
              1, 1, 64, context, d, False, "one_signed", scale_factor=2.0**-10, tags=("adversarial", "long",
                                                                                  "accumulation", "cross")),
        # the gradients' long one-signed sums, over the queries (dV, dK) and over the keys (dQ), in
        # blocks of 64 that a running sum in a narrow type rounds after each block
        _Spec("long_sums_over_queries", f"{context:,} queries x 64 keys: dV and dK are long sums of terms of one sign "
              "over the queries (dO along the all-ones vector; dS's sign set by the key, Q's by the channel)",
              1, 1, context, 64, d, False, "one_signed_gradients", tags=("adversarial", "long", "accumulation",
                                                                       "cross")),
        _Spec("long_sums_over_keys", f"64 queries x {context:,} keys: dQ is a long sum of terms of one sign over the "
              "keys (dS's sign and K's set by the key)", 1, 1, 64, context, d, False, "one_signed_gradients",
              tags=("adversarial", "long", "accumulation", "cross")),
    ]


#: The published model configurations the ``models`` cases take their shapes from (attention
#: heads, key/value heads, head dim of Q and K, head dim of V, context length; from each model's
#: config.json or paper), and which case takes what: docs/oracle.md lists the same.
MODEL_SHAPES = {
    "Llama 3.1 8B": (32, 8, 128, 128, 131072),
    "Llama 3.1 405B": (128, 8, 128, 128, 131072),
    "Qwen2.5 7B": (28, 4, 128, 128, 131072),
    "Mistral 7B v0.1": (32, 8, 128, 128, 32768),
    "Gemma 2B": (8, 1, 256, 256, 8192),
    "Falcon 7B": (71, 1, 64, 64, 2048),
    "DeepSeek-V3": (128, 128, 192, 128, 163840),
}


def extreme_magnitude(dtype: torch.dtype) -> float:
    """m = 2^(e/4) with e = min(the dtype's largest binary exponent, 128): q, k, v, dO of
    magnitude m (scale m^-2 keeps the logits of order 1) give dP = dO Vᵀ ~ m^2 sqrt(d) and dQ,
    dK of order m, finite in float32 accumulation for every dtype with e >= 16 (float16: m = 2^4,
    bfloat16, float32, float64: m = 2^32)."""
    e = math.frexp(torch.finfo(dtype).max)[1]  # the largest binary exponent + 1: 128 for float32, 16 for float16
    return 2.0 ** (min(e, 128) // 4)


def representable(case: Case) -> str:
    """Why ``case`` is not representable in its dtype, or "" when it is: every input, the exact
    output and gradients, and the exact dS = P (dP - D) (which an implementation in the dtype
    rounds to it, as FlashAttention rounds dS; dP = dO Vᵀ itself stays in float32
    accumulation) are at most half the dtype's largest finite value (one binade of headroom: a
    rounding error cannot overflow)."""
    from .. import reference

    limit = torch.finfo(case.q.dtype).max / 2
    q, k, v, do = (t.to(torch.float64) for t in (case.q, case.k, case.v, case.dout))
    out, lse, dq, dk, dv = reference.attention_ref(q, k, v, do, causal=case.causal, scale=case.scale, mask=case.mask)
    groups = q.shape[1] // k.shape[1]
    p = torch.exp(reference.scores(q, k, reference.check_attention_inputs(q, k, v, scale=case.scale, mask=case.mask),
                                   case.causal, case.mask) - torch.where(torch.isinf(lse), math.inf, lse)[..., None])
    dp = do @ reference.expand_kv(v, groups).transpose(-1, -2)
    ds = p * (dp - (do * out).sum(-1, keepdim=True))
    values = {"q": q, "k": k, "v": v, "dO": do, "out": out, "dq": dq, "dk": dk, "dv": dv, "dS": ds}
    over = {n: t.abs().max().item() for n, t in values.items() if not t.abs().max().item() <= limit}
    return ", ".join(f"max |{n}| = {x:.3g}" for n, x in over.items()) + (
        f" beyond half of {case.q.dtype}'s largest value ({limit:.3g})" if over else "")


#: The case sets by name: ``quick`` for a fast look, ``standard`` the default everywhere
#: (:data:`DEFAULT_CASES`), ``thorough`` adds size.
CASE_SETS = ("quick", "standard", "thorough")
#: The one default case set of :func:`dmref.oracle.check`, ``dmref check`` and the pytest
#: fixture ``dmref_oracle``.
DEFAULT_CASES = "standard"

#: case i of a set draws from a generator seeded ``seed * _SEED_STRIDE + i``
_SEED_STRIDE = 1000
#: the largest ``seed``: torch's generators take seeds below 2^64, and case i uses
#: ``seed * 1000 + i``
MAX_SEED = (2**64 - 1 - (_SEED_STRIDE - 1)) // _SEED_STRIDE


def check_seed(seed) -> int:
    """``seed`` as an int in [0, :data:`MAX_SEED`]; TypeError or ValueError naming it."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed={seed!r} must be an int (the cases' generators take integers), not "
                        f"{type(seed).__name__}")
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed={seed} must be in [0, {MAX_SEED}] (torch's generators take seeds below 2^64; "
                         f"case i is seeded seed * {_SEED_STRIDE} + i)")
    return seed


def check_head_dim(head_dim) -> int | None:
    """``head_dim`` as an even int >= 16, or None; TypeError or ValueError naming it."""
    if head_dim is None:
        return None
    if isinstance(head_dim, bool) or not isinstance(head_dim, int):
        raise TypeError(f"head_dim={head_dim!r} must be an int, not {type(head_dim).__name__}")
    if head_dim < _probe.GROUP or head_dim % 2:
        raise ValueError(f"{head_dim=} must be even and at least {_probe.GROUP} (the probe's two null channels "
                         f"live in an aligned group of {_probe.GROUP})")
    return head_dim


def check_bool(name: str, value) -> bool:
    """``value`` if it is a bool; TypeError naming it otherwise (a string such as "no" is not
    taken for a truth value)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be True or False, not {type(value).__name__}")
    return value


def make_cases(size: str = "standard", *, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
               names: list[str] | None = None, head_dim: int | None = None, probe: bool = True) -> list[Case]:
    """The oracle's cases (module docstring), inputs in ``dtype``.

    ``names`` keeps only those cases (in this order). ``head_dim``: every case at that head dim
    (at least 16, even); None: :data:`DEFAULT_HEAD_DIM`, and ``other_head_dim`` at
    :data:`OTHER_HEAD_DIM`."""
    if size not in CASE_SETS:
        raise ValueError(f"unknown case set {size!r}; known: {', '.join(CASE_SETS)}")
    head_dim = check_head_dim(head_dim)
    seed = check_seed(seed)
    check_bool("probe", probe)
    specs = _specs(size)
    # each case is seeded by its place in the full list, so a case picked by name sees the same inputs
    position = {s.name: i for i, s in enumerate(specs)}
    if names is not None:
        by_name = {s.name: s for s in specs}
        unknown = [n for n in names if n not in by_name]
        if unknown:
            close = {n: difflib.get_close_matches(n, by_name, n=1) for n in unknown}
            hint = " ".join(f"did you mean {c[0]!r}" + (f" for {n!r}?" if len(unknown) > 1 else "?")
                             for n, c in close.items() if c)
            raise ValueError(f"unknown case names {unknown}; {hint + ' ' if hint else ''}known: {', '.join(by_name)}")
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"case {', '.join(map(repr, twice))} named more than once: each case runs once "
                             "(a case's inputs are fixed by the seed, so a second run would check the same problem)")
        specs = [by_name[n] for n in names]
    cases = []
    for s in specs:
        i = position[s.name]
        d = head_dim or s.head_dim
        dv = head_dim or s.head_dim_v or d
        g = torch.Generator().manual_seed(seed * _SEED_STRIDE + i)
        if s.make == "realistic":
            q, k, v, dout = _realistic(g, s.batch, s.heads, s.seqlen_q, d, seed=seed * _SEED_STRIDE + i)
        elif s.make == "outliers":
            q, k, v, dout = _outliers(g, s.batch, s.heads, s.seqlen_q, d, min(2.0**14, extreme_magnitude(dtype)))
        elif s.make == "spikes":
            q, k, v, dout = _spikes(g, s.batch, s.heads, s.seqlen_q, s.seqlen_k, d, SPIKE_POSITIONS)
        elif s.make == "gqa":
            q, k, v, dout = _gqa(g, s.batch, s.heads, s.kv_heads, s.seqlen_q, s.seqlen_k, d, dv)
        elif s.make == "one_signed_gradients":
            q, k, v, dout = _one_signed_gradients(g, s.batch, s.heads, s.seqlen_q, s.seqlen_k, d, dv)
        elif s.make == "one_signed":
            q, k, v, dout = _one_signed(g, s.batch, s.heads, s.seqlen_q, s.seqlen_k, d, dv)
        else:
            q, k, v, dout = _gaussian(g, s.batch, s.heads, s.seqlen_q, s.seqlen_k, d, dv)
        m = extreme_magnitude(dtype) ** s.extreme
        # a magnitude multiplier above the dtype's extreme magnitude is capped there (float16:
        # 2^4), so that every quantity of the case stays representable (:func:`representable`)
        factors = [min(f, extreme_magnitude(dtype)) for f in s.magnitude]
        q, k, v, dout = (t * f * m for t, f in zip((q, k, v, dout), factors))
        q, k, v, dout = (t.to(dtype) for t in (q, k, v, dout))
        mask = None
        if s.masked_rows:
            mask = _boolean_mask(g, s.batch, s.seqlen_q, s.seqlen_k)
        if s.additive_mask:  # on the dtype's grid, as q, k, v
            mask = _additive_mask(g, s.batch, s.heads, s.seqlen_q, s.seqlen_k).to(dtype)
        setup = None
        if probe and d >= _probe.GROUP:
            q, k, setup = _probe.prepare(q, k)
        scale_factor = s.scale_factor if s.scale_factor is not None else 1 / (factors[0] * factors[1])
        scale = scale_factor * m**-2 / math.sqrt(d)
        documents = _documents(s.batch, s.documents) if s.documents is not None else None
        cases.append(Case(s.name, s.description, q, k, v, dout, s.causal, scale, mask, setup, s.tags, s.layout,
                          s.window, documents))
    return cases
