"""Power-of-two rescaling commutes with every quantization point of the kernels.

With K -> 2^e K and Q -> 2^-e Q the logits, P and dS are unchanged (every scale is a power of two
chosen from its block's amax, so the codes stay and the scales move by 2^+-e), hence
O, dV are unchanged, dQ = tau dS K scales by exactly 2^e and dK = tau dS^T Q by 2^-e, bit for
bit. e = 17 puts |K| far beyond float16's 65504: the matched dQ's kbar (a float16 accumulator,
``dmref/kernels/bwd.py``) must be kept relative to K's own scales to survive it.
"""

from __future__ import annotations

import pytest
import torch

from kernel_inputs import ProblemShape, outlier_inputs, require_backend

E = 17  # |K| * 2^17 > 65504 for |K| > 0.5: beyond float16's range

_CASES = [
    pytest.param("interpreter", ProblemShape(1, 2, 1, 130, 64), True, id="interpreter-gqa-n130-d64-causal"),
    pytest.param("gpu", ProblemShape(1, 4, 2, 1000, 128), False, id="gpu-gqa-n1000-d128", marks=pytest.mark.gpu),
    pytest.param("gpu", ProblemShape(1, 4, 4, 777, 64), True, id="gpu-n777-d64-causal", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("recipe", ["kernels_delta_matching", "kernels_naive_fp8"])
@pytest.mark.parametrize("backend,case,causal", _CASES)
def test_pow2_rescaling_of_q_and_k_is_exact(backend, case, causal, recipe):
    device = require_backend(backend)
    from dmref.kernels import api

    q, k, v, do = outlier_inputs(case, device, seed=3)
    q2, k2 = q * 2.0**-E, k * 2.0**E  # exact in BF16 (no under/overflow at these magnitudes)
    assert torch.equal(q2 * 2.0**E, q) and torch.equal(k2 * 2.0**-E, k)
    shape = api.Shape.of(q, k, v)
    runs = []
    for qq, kk in ((q, k), (q2, k2)):
        o, _lse, saved, _ = api.attention_forward(qq, kk, v, causal=causal, recipe=recipe)
        dq, dk, dv, _ = api.attention_backward(saved, o, do, shape=shape, causal=causal,
                                               scale=case.head_dim**-0.5, recipe=recipe)
        runs.append((o, dq, dk, dv))
    (o, dq, dk, dv), (o2, dq2, dk2, dv2) = runs
    assert torch.isfinite(dq2.float()).all(), "dQ overflowed with |K| beyond float16's range"
    assert torch.equal(o2, o) and torch.equal(dv2, dv)
    assert torch.equal(dq2, dq * 2.0**E)
    assert torch.equal(dk2, dk * 2.0**-E)
