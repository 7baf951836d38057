"""K and V quantized by the caller (``dmref.kernels.quantize_kv``, ``attention(..., kv_fp8=)``):
the forward reads the given codes instead of quantizing ``k`` and ``v``, and everything it
computes is what it computes when it quantizes them itself; inputs that do not fit are one-line
ValueErrors."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import Case, backend_params, outlier_inputs, require_backend

CASES = {
    "interpreter": [Case(1, 2, 1, 150, 64, True, "kernels_folded_delta_matching"),
                    Case(1, 2, 1, 150, 64, False, "kernels_folded_delta_prepass_dsq_row")],
    "gpu": [Case(2, 4, 2, 1000, 128, True, "kernels_folded_delta_matching"),
            Case(1, 4, 4, 777, 64, False, "kernels_folded_naive_fp8"),
            Case(2, 4, 2, 1024, 128, True, "kernels_folded_delta_prepass_dsq_row")],
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
        (lambda: attention(q.requires_grad_(), k, v, kv_fp8=fwd_only), "for_backward=True"),
        # K^T scaled per channel and block where the recipe reads it with the head's scale
        (lambda: attention(q.requires_grad_(), k, v, recipe="kernels_folded_delta_prepass_dsq_row", kv_fp8=kv),
         "K\\^T copy is scaled per channel and block"),
    ):
        with pytest.raises((ValueError, TypeError), match=match) as exc:
            call()
        assert "\n" not in str(exc.value)
    # a forward alone takes the codes without the backward's copies, and so does attention where
    # no gradient can flow
    o, _, saved, _ = api.attention_forward(q, k, v, causal=True, for_backward=False, kv_fp8=fwd_only)
    assert saved is None and torch.isfinite(o.float()).all()
    with torch.no_grad():
        assert torch.equal(attention(q, k, v, causal=True, kv_fp8=fwd_only), o)


QKV_CASES = {
    "interpreter": [Case(1, 4, 2, 150, 64)],
    "gpu": [Case(2, 8, 2, 1000, 128), Case(1, 4, 4, 777, 64)],
}


@pytest.mark.parametrize("backend,case", backend_params(QKV_CASES))
def test_k_rows_factor_is_the_heads_factor_for_every_token(backend, case):
    """``quantize_kv_folded(k, v, for_backward=True)``'s codes launch writes K's row copy as the
    backward reads it: the codes ``k8`` and, for every token (a tail tile included), its head's
    factor; a head of all zeros (zero amax) too."""
    device = require_backend(backend)
    from dmref.kernels.quantize import quantize_kv_folded

    _, k, v, _ = outlier_inputs(case, device)
    k[0, 0] = 0
    kv = quantize_kv_folded(k, v, for_backward=True)
    assert kv.k_rows.rows is kv.k8
    assert torch.equal(kv.k_rows.row_scale, kv.k_scale[:, None].expand(-1, case.n))


BWD_CASES = {
    "interpreter": [Case(1, 4, 2, 150, 64, True, "kernels_folded_delta_matching"),
                    Case(1, 2, 1, 150, 64, False, "kernels_folded_delta_prepass")],
    "gpu": [Case(2, 8, 2, 1000, 128, True, "kernels_folded_delta_matching"),
            Case(1, 4, 4, 777, 64, False, "kernels_folded_delta_prepass")],
}


@pytest.mark.parametrize("backend,case", backend_params(QKV_CASES))
def test_kt_head_is_the_row_codes_transposed_with_the_heads_factor(backend, case):
    """``quantize_kv_folded(..., for_backward=True, kt_head=True)`` (a spec with K for dQ per head,
    ``KernelSpec.dsq_row``) writes K's transposed copy as the row codes transposed, code 0 past N,
    and the head's factor for every channel of every 128-token block; a head of all zeros too. The
    other copies are those of ``kt_head=False``."""
    device = require_backend(backend)
    from dmref.kernels.quantize import quantize_kv_folded

    _, k, v, _ = outlier_inputs(case, device)
    k[0, 0] = 0
    kv = quantize_kv_folded(k, v, for_backward=True, kt_head=True)
    plain = quantize_kv_folded(k, v, for_backward=True)
    assert kv.kt_head and not plain.kt_head
    n = case.n
    cols = kv.k_cols.cols.view(torch.uint8)
    assert torch.equal(cols[..., :n], kv.k8.view(torch.uint8).transpose(1, 2))
    assert not cols[..., n:].any()
    assert torch.equal(kv.k_cols.col_scale, kv.k_scale[:, None, None].expand_as(kv.k_cols.col_scale))
    for a, b in ((kv.k8, plain.k8), (kv.vt8, plain.vt8), (kv.v_rows.rows, plain.v_rows.rows),
                 (kv.k_rows.row_scale, plain.k_rows.row_scale), (kv.v_rows.row_scale, plain.v_rows.row_scale)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("backend,case", backend_params(BWD_CASES))
def test_q_copies_made_by_the_backward_give_the_forwards_bits(backend, case):
    """The warp-specialized forward leaves Q's copies to the backward's preprocess
    (``SavedForward.q_pending``: dO's quantization launch makes them, ``quantize_with``): the
    backward from a saved state whose Q is pending gives the bits of the one whose Q's copies the
    forward made; ``quantize_with`` gives ``quantize``'s codes, factors and stale delta for both
    tensors (dO in E5M2 beside Q in E4M3 too); and ``attention`` where no gradient can flow gives
    the O of the forward for training."""
    import dataclasses

    device = require_backend(backend)
    from dmref.kernels import api, attention
    from dmref.kernels.quantize import quantize, quantize_with

    q, k, v, do = outlier_inputs(case, device)
    shape = api.Shape.of(q, k, v)
    scale = case.head_dim ** -0.5
    o, _, saved, _ = api.attention_forward(q, k, v, causal=case.causal, scale=scale, recipe=case.recipe)
    if saved.q is None:  # the Gluon forward: make the forward-made state to compare with
        saved_made = dataclasses.replace(saved, q=quantize(q, "float8_e4m3fn")[0], q_pending=None)
        saved_pending = saved
    else:
        saved_made, saved_pending = saved, dataclasses.replace(saved, q=None, q_pending=q)
    # the five-GEMM backward (the pre-pass recipe's) adds dQ's partials in key order only when deterministic
    det = dict(deterministic=True) if api.get_spec(case.recipe).prepass else {}
    runs = [api.attention_backward(s, o, do, shape=shape, causal=case.causal, scale=scale, recipe=case.recipe,
                                   **det)[:3] for s in (saved_made, saved_pending)]
    # the kernels' own entry points make pending copies themselves
    assert saved_pending.with_q_copies().q is not None and saved_made.with_q_copies() is saved_made
    for name, a, b in zip(("dQ", "dK", "dV"), *runs):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"{name} differs with Q's copies made late"
    with pytest.raises(ValueError, match="neither"):
        api.attention_backward(dataclasses.replace(saved, q=None, q_pending=None), o, do, shape=shape,
                               causal=case.causal, scale=scale, recipe=case.recipe)
    for do_fmt in ("float8_e4m3fn", "float8_e5m2"):
        x8, delta, y8 = quantize_with(do, do_fmt, q.transpose(1, 2).contiguous().transpose(1, 2), "float8_e4m3fn",
                                      delta_with=o)
        want_x, want_delta = quantize(do, do_fmt, delta_with=o)
        want_y, _ = quantize(q, "float8_e4m3fn")
        for got, want in ((x8, want_x), (y8, want_y)):
            for field in ("rows", "row_scale", "cols", "col_scale"):
                a, b = getattr(got, field), getattr(want, field)
                assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                                   b.view(torch.uint8) if b.element_size() == 1 else b), field
        assert torch.equal(delta, want_delta)
    with torch.no_grad():
        assert torch.equal(attention(q, k, v, causal=case.causal, scale=scale, recipe=case.recipe).view(torch.int16),
                           o.view(torch.int16))
