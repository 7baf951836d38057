"""Inputs and cases of the kernel tests: seeded BF16 problems with outlier channels, their sizes,
the kernel spec a case runs, and which backend (GPU or Triton's interpreter) a test runs on.

Nothing here describes a recipe: what the kernels compute is ``KernelSpec.recipe``, and the
tests compare against the emulated reference ``dmref.tiled`` on it (``reference_intermediates``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from dmref.kernels.config import SPECS, BwdTiles, KernelSpec


def outlier_inputs(case, device: str, seed: int = 0):
    """BF16 q, k, v, dO for a test case (batch, heads, kv_heads, n, head_dim): normal values with
    every 16th channel of q and k three times larger (outlier channels); with a case's
    ``logit_log2``, q and k scaled so that the logits reach about 2**logit_log2."""
    g = torch.Generator().manual_seed(seed)
    b, h, hkv, n, d = case.batch, case.heads, case.kv_heads, case.n, case.head_dim
    outlier = torch.ones(d)
    outlier[::16] = 3.0  # every 16th channel 3x larger, as outlier channels in real activations
    q = torch.randn(b, h, n, d, generator=g) * outlier
    k = torch.randn(b, hkv, n, d, generator=g) * outlier
    big = getattr(case, "logit_log2", None)
    if big:
        # logits of magnitude about 2**big: q and k each scaled by 2**(big / 2)
        q, k = q * 2.0 ** (big / 2), k * 2.0 ** (big / 2)
    v = torch.randn(b, hkv, n, d, generator=g)
    do = torch.randn(b, h, n, d, generator=g)
    return [t.to(torch.bfloat16).to(device) for t in (q, k, v, do)]


@dataclass(frozen=True)
class ProblemShape:
    """The sizes :func:`outlier_inputs` reads."""

    batch: int
    heads: int
    kv_heads: int
    n: int
    head_dim: int


@dataclass(frozen=True)
class Case(ProblemShape):
    """A differential-test case: sizes, causal or not, and the kernel recipe (by name) with its
    shipped tilings or the backward tiling ``bwd`` (which refits the recipe: ``with_tiles``)."""

    causal: bool = False
    recipe: str = "kernels_delta_matching"
    bwd: BwdTiles | None = None
    #: q and k scaled so that the logits reach about 2**logit_log2 (None: unscaled)
    logit_log2: int | None = None
    #: P scaled by 2**p_scale_log2 at its quantization points in both passes instead of the
    #: recipe's (:func:`with_p_scale`; None: the recipe's)
    p_scale_log2: int | None = None

    def spec(self) -> KernelSpec:
        r = SPECS[self.recipe]
        if self.p_scale_log2 is not None:
            r = with_p_scale(r, self.p_scale_log2)
        return r if self.bwd is None else r.with_tiles(bwd=self.bwd)

    @property
    def matched(self) -> bool:
        return self.spec().matched

    def __str__(self) -> str:
        t = "" if self.bwd is None else f"-bwd{self.bwd.block_m1}x{self.bwd.block_n2}"
        t += "" if self.logit_log2 is None else f"-logits2^{self.logit_log2}"
        t += "" if self.p_scale_log2 is None else f"-p2^{self.p_scale_log2}"
        return (f"{self.recipe}-{'causal' if self.causal else 'full'}-b{self.batch}h{self.heads}"
                f"kv{self.kv_heads}n{self.n}d{self.head_dim}{t}")


def with_p_scale(spec: KernelSpec, p_scale_log2: int) -> KernelSpec:
    """``spec`` with P entering its quantization points times ``2**p_scale_log2`` in the forward
    and the backward (``Recipe.p_fwd``, ``Recipe.p_bwd``), under a name of its own."""
    r = spec.recipe
    recipe = dataclasses.replace(r, name=f"{r.name}_p2^{p_scale_log2}",
                                 p_fwd=dataclasses.replace(r.p_fwd, offset_log2=p_scale_log2),
                                 p_bwd=dataclasses.replace(r.p_bwd, offset_log2=p_scale_log2))
    return dataclasses.replace(spec, recipe=recipe)


def backend_params(cases: dict, keep=None) -> list:
    """pytest parameters ``(backend, case)`` of ``{backend: [Case, ...]}`` (those ``keep(case)``
    accepts, where given), the GPU ones marked ``gpu``."""
    import pytest

    return [pytest.param(backend, c, id=f"{backend}-{c}", marks=[pytest.mark.gpu] if backend == "gpu" else [])
            for backend, group in cases.items() for c in group if keep is None or keep(c)]


def require_backend(backend: str) -> str:
    """Skip unless this process runs ``backend`` ("gpu": compiled kernels, "interpreter":
    Triton's interpreter); return the torch device of its tensors."""
    import os

    import pytest

    if backend == "interpreter":
        pytest.importorskip("triton")
        if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            pytest.skip("this process compiles for the GPU; the interpreter variant runs on the CPU")
        return "cpu"
    return "cuda"
