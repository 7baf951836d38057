"""K and V quantized by the caller (``dmref.kernels.quantize_kv``, ``attention(..., kv_fp8=)``):
the forward reads the given codes instead of quantizing ``k`` and ``v``, and everything it
computes is what it computes when it quantizes them itself; inputs that do not fit are one-line
ValueErrors."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import Case, backend_params, outlier_inputs, require_backend

CASES = {
    "interpreter": [Case(1, 2, 1, 150, 64, True, "kernels_folded_delta_matching")],
    "gpu": [Case(2, 4, 2, 1000, 128, True, "kernels_folded_delta_matching"),
            Case(1, 4, 4, 777, 64, False, "kernels_folded_naive_fp8")],
}


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.detach().contiguous().view(torch.int16)


@pytest.mark.parametrize("backend,case", backend_params(CASES))
def test_given_kv_fp8_gives_the_bits_of_quantizing_inside(backend, case):
    """O and dQ, dK, dV through autograd, with K and V quantized inside and given as
    ``quantize_kv(k, v)``: the same bits (the same codes and scales reach the same kernels); the
    given codes are read, not made again (poisoned codes change O)."""
    device = require_backend(backend)
    from dmref.kernels import attention, quantize_kv

    q, k, v, do = outlier_inputs(case, device)
    runs = []
    for given in (False, True):
        qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
        kv = quantize_kv(k, v, recipe=case.recipe) if given else None
        o = attention(qg, kg, vg, causal=case.causal, recipe=case.recipe, kv_fp8=kv)
        o.backward(do)
        runs.append((o, qg.grad, kg.grad, vg.grad))
    for name, a, b in zip(("O", "dQ", "dK", "dV"), *runs):
        assert torch.equal(_bits(a), _bits(b)), f"{name}: given K/V codes differ from quantizing inside"
    poisoned = quantize_kv(k, v, recipe=case.recipe)
    poisoned.k8.view(torch.uint8).bitwise_xor_(0x01)
    o = attention(q, k, v, causal=case.causal, recipe=case.recipe, kv_fp8=poisoned)
    assert not torch.equal(_bits(o), _bits(runs[0][0])), "the given K codes were not read"


def test_kv_fp8_that_does_not_fit_is_a_one_line_error():
    device = require_backend("interpreter")
    from dmref.kernels import api, attention, quantize_kv

    case = Case(1, 2, 1, 150, 64, True, "kernels_folded_delta_matching")
    q, k, v, _ = outlier_inputs(case, device)
    kv = quantize_kv(k, v)
    fwd_only = quantize_kv(k, v, for_backward=False)
    other = quantize_kv(k[:, :, :100].contiguous(), v[:, :, :100].contiguous())
    for call, match in (
        (lambda: quantize_kv(k, v, recipe="kernels_delta_matching"), "folded recipes"),
        (lambda: quantize_kv(k.float(), v.float()), "bfloat16"),
        (lambda: attention(q, k, v, recipe="kernels_delta_matching", kv_fp8=kv), "folded recipes"),
        (lambda: attention(q, k, v, kv_fp8=(kv.k8, kv.vt8)), "quantize_kv returns"),
        (lambda: attention(q, k, v, kv_fp8=other), r"not the \(B\*HKV, N, D\)"),
        (lambda: attention(q, k, v, kv_fp8=fwd_only), "for_backward=True"),
    ):
        with pytest.raises((ValueError, TypeError), match=match) as exc:
            call()
        assert "\n" not in str(exc.value)
    # a forward alone takes the codes without the backward's copies
    o, _, saved, _ = api.attention_forward(q, k, v, causal=True, for_backward=False, kv_fp8=fwd_only)
    assert saved is None and torch.isfinite(o.float()).all()
