"""The attention problems the oracle runs (:func:`make_cases`).

Every case is generated in float64, rounded once to the input dtype (round to nearest even, the
cast torch's ``.to`` does), and then made probe-ready by :func:`dmref.probe.prepare` (two null
channels in Q and K, K's largest element set to 7 * 2^e). The exact reference is computed from
the rounded inputs, so rounding the inputs is never counted as the implementation's error.

Causal cases have ``seqlen_q == seqlen_k``: there the top-left alignment of
``torch.nn.functional.scaled_dot_product_attention`` and the bottom-right alignment of
FlashAttention >= 2.1 (and :mod:`dmref.reference`) agree. Rows with no key left (only through an
explicit mask) are run only when the implementation takes a ``mask`` argument.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from . import probe as _probe

__all__ = ["CASE_SETS", "Case", "make_cases"]


@dataclass
class Case:
    """One attention problem. Tensors are ``(batch, heads, seqlen, head_dim)`` in the input
    dtype; ``mask`` is boolean (True = attend) or None."""

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

    @property
    def shape(self) -> str:
        b, h, nq, d = self.q.shape
        nk = self.k.shape[-2]
        n = f"{nq}" if nq == nk else f"{nq}x{nk}"
        return f"{b}x{h}x{n}x{d}"

    def to(self, device) -> "Case":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return Case(self.name, self.description, move(self.q), move(self.k), move(self.v), move(self.dout),
                    self.causal, self.scale, move(self.mask), self.probe, self.tags)


def _randn(g, *shape):
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _token_scaled_dout(g, b, h, n, dv, grad_scale):
    """dO with log-normal per-token scales around ``grad_scale`` (as in training)."""
    return _randn(g, b, h, n, dv) * torch.exp(0.5 * _randn(g, b, h, n, 1)) * grad_scale


def _realistic(g, b, h, n, d, *, seed):
    """dmref.demo's problem: outlier channels (x3 in Q, K; x8 in V), a sink key, a shared query
    direction and peaked rows; dO per-token scaled."""
    from .demo import make_problem

    q, k, v, dout = make_problem(b, h, n, d, seed=seed)
    return tuple(t.to(torch.float64) for t in (q, k, v, dout))


def _outliers(g, b, h, n, d):
    """Massive activations: two channels of K and V 2^14 times larger than the rest (LLMs show
    outliers of ~10^4; Q's matching channels 2^-14 smaller, so the logits stay moderate).
    E4M3 blocks along the head dim then push the other channels of a token into the subnormal
    range (spacing 2^-9 of a scale set by the outlier: ~0.1 absolute); blocks along the
    sequence keep them normal. This case tells quantization axes apart."""
    q, k, v = _randn(g, b, h, n, d), _randn(g, b, h, n, d), _randn(g, b, h, n, d)
    big = [d // 4 - 1, 3 * d // 4 - 1]
    k[..., big] *= 2.0**14
    v[..., big] *= 2.0**14
    q[..., big] *= 2.0**-14
    return q, k, v, _token_scaled_dout(g, b, h, n, d, 1.0)


def _gaussian(g, b, h, nq, nk, d):
    return _randn(g, b, h, nq, d), _randn(g, b, h, nk, d), _randn(g, b, h, nk, d), _token_scaled_dout(g, b, h, nq, d, 1.0)


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
    scale_factor: float = 1.0  # scale = scale_factor / sqrt(head_dim)
    magnitude: tuple[float, float, float, float] = (1.0, 1.0, 1.0, 1.0)  # q, k, v, dout multipliers
    masked_rows: bool = False
    tags: tuple[str, ...] = ()


def _specs(size: str) -> list[_Spec]:
    n = {"quick": 128, "standard": 256, "thorough": 512}[size]
    long_n = {"quick": 512, "standard": 1024, "thorough": 4096}[size]
    h = {"quick": 1, "standard": 2, "thorough": 4}[size]
    d = 64
    return [
        _Spec("realistic", "outlier channels x3/x8, sink key, peaked rows (dmref.demo)", 1, h, n, n, d, False, "realistic",
              tags=("realistic",)),
        _Spec("realistic_causal", "as realistic, causal", 1, h, n, n, d, True, "realistic", tags=("realistic", "causal")),
        _Spec("outlier_channels", "two channels of K and V x2^14 (Q's x2^-14), causal", 1, h, n, n, d, True, "outliers",
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
        _Spec("large_values", "q, k x2^6 (scale / 2^12 keeps logits moderate), v, dO x2^10", 1, h, n, n, d, False,
              "gaussian", scale_factor=2.0**-12, magnitude=(2.0**6, 2.0**6, 2.0**10, 2.0**10), tags=("adversarial",)),
        _Spec("small_values", "v, dO x2^-12", 1, h, n, n, d, True, "gaussian", magnitude=(1.0, 1.0, 2.0**-12, 2.0**-12),
              tags=("adversarial", "causal")),
        _Spec("fully_masked_rows", "boolean mask with every 7th query row fully masked (needs fn(..., mask=))", 1, h, n, n,
              d, False, "gaussian", masked_rows=True, tags=("adversarial", "mask")),
    ]


#: The case sets by name; ``quick`` is what the test suites run, ``standard`` what ``dmref
#: check`` runs by default, ``thorough`` adds size.
CASE_SETS = ("quick", "standard", "thorough")


def make_cases(size: str = "standard", *, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
               names: list[str] | None = None, head_dim: int | None = None, probe: bool = True) -> list[Case]:
    """The oracle's cases (module docstring), inputs in ``dtype``.

    ``names`` keeps only those cases (in this order); ``head_dim`` replaces the default 64."""
    if size not in CASE_SETS:
        raise ValueError(f"unknown case set {size!r}; known: {', '.join(CASE_SETS)}")
    specs = _specs(size)
    if names is not None:
        by_name = {s.name: s for s in specs}
        unknown = [n for n in names if n not in by_name]
        if unknown:
            raise ValueError(f"unknown case names {unknown}; known: {', '.join(by_name)}")
        specs = [by_name[n] for n in names]
    cases = []
    for i, s in enumerate(specs):
        d = head_dim or s.head_dim
        g = torch.Generator().manual_seed(seed * 1000 + i)
        if s.make == "realistic":
            q, k, v, dout = _realistic(g, s.batch, s.heads, s.seqlen_q, d, seed=seed * 1000 + i)
        elif s.make == "outliers":
            q, k, v, dout = _outliers(g, s.batch, s.heads, s.seqlen_q, d)
        else:
            q, k, v, dout = _gaussian(g, s.batch, s.heads, s.seqlen_q, s.seqlen_k, d)
        q, k, v, dout = (t * m for t, m in zip((q, k, v, dout), s.magnitude))
        q, k, v, dout = (t.to(dtype) for t in (q, k, v, dout))
        mask = None
        if s.masked_rows:
            keep = torch.rand(s.seqlen_q, s.seqlen_k, generator=g) < 0.7
            keep[::7] = False
            mask = keep[None, None]
        setup = None
        if probe and d >= _probe.GROUP:
            q, k, setup = _probe.prepare(q, k)
        scale = s.scale_factor / math.sqrt(d)
        cases.append(Case(s.name, s.description, q, k, v, dout, s.causal, scale, mask, setup, s.tags))
    return cases
