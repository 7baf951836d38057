"""The seven-GEMM backward of ``kernels_delta_prepass`` (``dmref.kernels.bwd_prepass``, then the
five-GEMM ``bwd_fused`` with its D): the pre-pass's D is the dq kernel's matched D bit for bit; the
whole backward against the emulated reference ``dmref.tiled`` on the spec's recipe (the matched
delta from a pre-sweep, no deferred dQ): dS as each matmul sees it on at least CODE_AGREEMENT of
the elements, dQ, dK and dV within test_bwd_fused's bounds, D within test_kernels_vs_reference's;
dS's row sums within the Delta-Matching bound, which the stale delta's exceed on the same inputs;
every other path refuses the recipe in one line. In Triton's interpreter at small sizes (tail
tiles, causal, GQA, head dims 64 and 128), and on a Hopper GPU at larger ones."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from dmref.kernels.config import SPECS, BwdTiles

from kernel_bounds import (BF16_REL, CODE_AGREEMENT, EXP2_APPROX_REL, U32, code_flip_rel_bound,
                           delta_matching_rowsum_bound, gamma, rel_err)
from kernel_inputs import Case, backend_params, outlier_inputs, require_backend
from reference_intermediates import flat, tap
from test_bwd_fused import _FP8_FROM_FLOAT32, _expected_counters, _valid

CASES = {
    "interpreter": [
        Case(1, 2, 1, 203, 64, True, "kernels_delta_prepass"),  # GQA 2:1, causal, N % 64 = 11
        Case(1, 2, 2, 150, 64, False, "kernels_delta_prepass"),  # N % 64 = 22
        Case(1, 1, 1, 130, 128, True, "kernels_delta_prepass"),  # head dim 128 (TMA loads), N % 64 = 2
    ],
    "gpu": [
        Case(2, 4, 2, 1000, 128, True, "kernels_delta_prepass"),
        Case(1, 4, 1, 777, 64, False, "kernels_delta_prepass"),
        Case(1, 4, 4, 513, 64, True, "kernels_delta_prepass"),
        Case(1, 2, 2, 700, 128, True, "kernels_folded_delta_prepass"),
    ],
}

#: the pre-pass against the dq kernel: the cases above, and tiles of 32 keys (a 64-query program)
_DELTA_CASES = {"interpreter": [*CASES["interpreter"],
                                Case(1, 2, 2, 113, 64, True, "kernels_delta_prepass", BwdTiles(32, 64, 64, 32, 4, 1, 4, 1))],
                "gpu": CASES["gpu"]}


def _matched_twin(case: Case):
    """The spec with the dq kernel's deferred matched dQ and ``case``'s tiles and forward."""
    spec = SPECS[case.recipe.replace("delta_prepass", "delta_matching")]
    return spec if case.bwd is None else spec.with_tiles(bwd=case.bwd)


@pytest.mark.parametrize("backend,case", backend_params(_DELTA_CASES))
def test_prepass_delta_equals_the_dq_kernels_matched_delta_bit_for_bit(backend, case):
    """The pre-pass runs the dq kernel's key loop (its helpers, tiles and order): on the same saved
    forward and dO, its D and the one the dq kernel of ``kernels_delta_matching`` accumulates are
    the same float32 numbers."""
    device = require_backend(backend)
    from dmref.kernels import api, bwd, bwd_prepass
    from dmref.kernels.quantize import quantize

    q, k, v, do = outlier_inputs(case, device)
    spec, twin = case.spec(), _matched_twin(case)
    assert spec.prepass and twin.matched and spec.bwd_tiles(case.head_dim) == twin.bwd_tiles(case.head_dim)
    scale = 1.0 / math.sqrt(case.head_dim)
    o, _lse, saved, _ = api.attention_forward(q, k, v, causal=case.causal, scale=scale, recipe=spec)
    shape = api.Shape.of(q, k, v)
    dims = dict(batch=shape.batch, heads=shape.heads, kv_heads=shape.kv_heads, n=shape.n, head_dim=shape.head_dim,
                causal=case.causal, scale=scale)
    do8, delta_stale = quantize(do, twin.recipe.do_dp.fmt.name, rows=True, cols=True, delta_with=o)
    pdp = bwd.backward(saved, do8, do8, delta_stale, recipe=twin, kernels=("dq",), **dims)[3]["delta"]
    d = bwd_prepass.delta(saved, do8, recipe=spec, **dims)
    assert d.dtype == torch.float32 and d.shape == (case.batch * case.heads, case.n)
    assert torch.equal(d, pdp), f"{(d != pdp).sum().item()} of {d.numel()} rows differ"
    if case.bwd is None:  # and the one attention_backward runs
        got = api.attention_backward(saved, o, do, shape=shape, causal=case.causal, scale=scale, recipe=spec)[3]
        assert torch.equal(got["delta"], pdp)


_RUNS: dict = {}


def _run(backend: str, case: Case, deterministic: bool = False) -> dict:
    """The kernels' backward of ``case`` (debug dumps on) and the reference's on the kernel's O and
    LSE, with the reference's P and dP for the row-sum bound, and the stale fused backward's dS on
    the same saved state; cached."""
    key = (backend, case, deterministic)
    if key in _RUNS:
        return _RUNS[key]
    device = require_backend(backend)
    from dmref import tiled
    from dmref.kernels import api

    q, k, v, do = outlier_inputs(case, device)
    spec = case.spec()
    rr = spec.reference_recipe("hopper" if backend == "gpu" else "fp32")
    scale = 1.0 / math.sqrt(case.head_dim)
    o, _lse, saved, _ = api.attention_forward(q, k, v, causal=case.causal, scale=scale, recipe=spec)
    shape = api.Shape.of(q, k, v)
    dq, dk, dv, dbg = api.attention_backward(saved, o, do, shape=shape, causal=case.causal, scale=scale, recipe=spec,
                                             deterministic=deterministic, debug=True)
    stale = case.recipe.replace("delta_prepass", "naive_fp8")
    stale_dbg = api.attention_backward(saved, o, do, shape=shape, causal=case.causal, scale=scale, recipe=stale,
                                       fused=True, debug=True)[3]
    qf, kf, vf, dof = (t.float() for t in (q, k, v, do))
    fwd = tiled.forward(qf, kf, vf, recipe=rr, causal=case.causal, scale=scale)
    lse2 = saved.lse2.view_as(fwd.stats.lse2)
    state = tiled.ForwardResult(o.float(), tiled.SoftmaxStats(fwd.stats.ref, fwd.stats.l, lse2))
    with tap() as bt:
        ref = tiled.backward(qf, kf, vf, state, dof, recipe=rr, causal=case.causal, scale=scale, diagnostics=True)
    n, h = case.n, case.heads
    ops = {name: bt.operand("_backward_operands", name).out.double() for name in ("q", "k", "do_dp", "v_dp")}
    q_hat, do_hat = ops["q"], ops["do_dp"]
    k_hat, v_hat = (ops[x].repeat_interleave(h // case.kv_heads, dim=1) for x in ("k", "v_dp"))
    c = scale * math.log2(math.e)
    out = dict(kernel=dict(dq=dq, dk=dk, dv=dv, **dbg), stale=stale_dbg,
               ref=dict(dq=ref.dq, dk=ref.dk, dv=ref.dv, delta=flat(ref.rowsum.delta), abs_pdp=flat(ref.rowsum.abs_pdp),
                        lse2=flat(fwd.stats.lse2),
                        ds_dk=flat(bt.assemble("backward", "ds_dk", n)),
                        ds_dq=flat(bt.assemble("backward", "ds_dq", n)),
                        p=flat(bt.assemble("backward", "p_dv", n, value="x")),
                        dp=flat((do_hat @ v_hat.transpose(-1, -2)).float()),
                        s2_abs=flat((q_hat.abs() @ k_hat.abs().transpose(-1, -2) * c).float()),
                        dp_abs=flat((do_hat.abs() @ v_hat.abs().transpose(-1, -2)).float())),
               lse2=saved.lse2)
    _RUNS[key] = out
    return out


@pytest.mark.parametrize("backend,case", backend_params(CASES))
def test_backward_equals_the_reference_on_its_recipe(backend, case):
    """dS as each matmul sees it, the gradients and D against ``dmref.tiled`` on the spec's recipe
    (the matched D of a pre-sweep, no deferred dQ)."""
    r = _run(backend, case)
    kern, ref = r["kernel"], r["ref"]
    valid = _valid(case, kern["ds_dk"].device).expand_as(kern["ds_dk"])
    for use in ("ds_dk", "ds_dq"):
        agree = (kern[use] == ref[use])[valid].double().mean().item()
        assert agree >= CODE_AGREEMENT, f"{use}: {agree:.6f} of the dS values agree with the reference"
        assert (kern[use][~valid] == 0).all(), f"{use}: nonzero dS outside the causal mask"
    for name, n_ops in _FP8_FROM_FLOAT32.items():
        diff = rel_err(kern[name].float(), ref[name])
        tol = code_flip_rel_bound(n_ops) if backend == "gpu" else BF16_REL
        assert diff <= tol, f"{name}: pre-pass + fused backward vs reference {diff:.3e} > {tol:.3e}"
    # D: sum_j P dP of the same dP codes and a P that differs by exp2's error and by the two LSEs
    # (test_kernels_vs_reference's bound on the dq kernel's matched D, which this D equals)
    lse2 = ref["lse2"].double()
    finite = torch.isfinite(lse2)
    dlse = (r["lse2"].double() - lse2).abs().where(finite, torch.zeros_like(lse2))
    d_tol = (2 * gamma(case.n) + EXP2_APPROX_REL + math.log(2) * dlse) * ref["abs_pdp"].double()
    excess = ((kern["delta"].double() - ref["delta"].double()).abs() - d_tol).max().item()
    assert excess <= 0, f"delta differs from the reference's beyond its bound by {excess:.3e}"


@pytest.mark.parametrize("backend,case", backend_params(CASES))
def test_ds_rowsums_within_the_delta_matching_bound_and_the_stale_deltas_not(backend, case):
    """r_i = sum_j dS_ij of the float32 dS the fused kernel forms (before its casts, the debug
    dump ``"ds"``) with the pre-pass's D: within the Delta-Matching bound of the kernels' matched
    recipe (``kernel_bounds.delta_matching_rowsum_bound``, as test_kernels_intermediates bounds the
    dq and dkdv kernels; in the interpreter widened by the float32 recomputation of P and dP in
    two orders, the pre-pass's Q K^T and the fused kernel's K Q^T) in every row; the same fused
    kernel with the stale delta on the same saved forward and dO exceeds it in most rows."""
    r = _run(backend, case)
    ref = r["ref"]
    unit = 0.0 if backend == "gpu" else U32

    def bound(delta):
        return delta_matching_rowsum_bound(ref["p"], ref["dp"], delta, s2_abs=ref["s2_abs"], dp_abs=ref["dp_abs"],
                                           head_dim=case.head_dim, recompute_unit=unit)

    matched = r["kernel"]["ds"].double().sum(-1)
    excess = (matched.abs() - bound(r["kernel"]["delta"])).max().item()
    assert excess <= 0, f"the pre-pass D's dS row sums exceed the Delta-Matching bound by {excess:.3e}"
    stale = r["stale"]["ds"].double().sum(-1)
    outside = (stale.abs() > bound(r["stale"]["delta"])).double().mean().item()
    assert outside > 0.5, f"only {outside:.3f} of the stale delta's rows exceed the bound"


_DET_CASES = {"interpreter": [CASES["interpreter"][0]], "gpu": CASES["gpu"][:2]}


@pytest.mark.parametrize("backend,case", backend_params(_DET_CASES))
def test_deterministic_mode_runs_the_prepass_recipe(backend, case):
    """``deterministic=True`` with a pre-pass spec: dQ's partials added in key order (the counters
    test_bwd_fused checks), the gradients within the same bounds."""
    r = _run(backend, case, deterministic=True)
    assert torch.equal(r["kernel"]["sem_seen"].cpu(), _expected_counters(case, case.spec()))
    for name, n_ops in _FP8_FROM_FLOAT32.items():
        diff = rel_err(r["kernel"][name].float(), r["ref"][name])
        tol = code_flip_rel_bound(n_ops) if backend == "gpu" else BF16_REL
        assert diff <= tol, f"{name}: deterministic pre-pass backward vs reference {diff:.3e} > {tol:.3e}"


_AUTOGRAD_CASES = {"interpreter": [CASES["interpreter"][0]], "gpu": CASES["gpu"][1:2] + CASES["gpu"][3:]}


@pytest.mark.parametrize("backend,case", backend_params(_AUTOGRAD_CASES))
def test_autograd_function_runs_the_prepass_recipe(backend, case):
    """``dmref.kernels.attention(..., recipe="kernels_delta_prepass")``: the forward of the spec's
    family and, in the backward, the pre-pass and the fused kernel: the gradients of
    ``attention_backward`` on the same inputs (dK, dV bit for bit; dQ too in the interpreter, which
    adds dQ's partials in one order; on the GPU the atomics' float32 sums may differ in their
    last bits, and their BF16 roundings by one BF16 step, 2 * BF16_REL relative)."""
    device = require_backend(backend)
    from dmref.kernels import api, attention

    q, k, v, do = outlier_inputs(case, device)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = attention(*leaves, causal=case.causal, recipe=case.recipe)
    out.backward(do)
    o, _lse, saved, _ = api.attention_forward(q, k, v, causal=case.causal, recipe=case.recipe)
    assert torch.equal(out.detach(), o)
    want = api.attention_backward(saved, o, do, shape=api.Shape.of(q, k, v), causal=case.causal,
                                  scale=1.0 / math.sqrt(case.head_dim), recipe=case.recipe)[:3]
    for name, leaf, w in zip(("dq", "dk", "dv"), leaves, want):
        if name == "dq" and backend == "gpu":
            assert rel_err(leaf.grad.float(), w.float()) <= 2 * BF16_REL, name
        else:
            assert torch.equal(leaf.grad, w), name


def _one_line(exc_or_str) -> str:
    text = str(exc_or_str)
    assert text and "\n" not in text, text
    return text


def test_the_prepass_recipes_are_kernel_recipes_and_every_other_path_refuses_them():
    """The two pre-pass recipes are kernel recipes (``with_prepass_delta`` of the matched ones, a
    spec each); the dq and dkdv kernels (Triton and Gluon) refuse them, and ``attention_backward``
    refuses ``fused=False`` and ``delta=`` for them, each in one line, while the Gluon pre-pass
    and five-GEMM kernels take them; the fused backward still refuses the deferred dQ."""
    pytest.importorskip("triton")
    import dataclasses

    import dmref
    from dmref.kernels import api, bwd, bwd_fused, bwd_ws
    from dmref.kernels.config import unsupported
    from dmref.recipes import KERNEL_RECIPES, MATCHED, DeltaKind, DeltaStrategy, with_prepass_delta

    for name, folded in (("kernels_delta_prepass", False), ("kernels_folded_delta_prepass", True)):
        spec = SPECS[name]
        matched = SPECS[name.replace("delta_prepass", "delta_matching")].recipe
        assert spec.recipe == KERNEL_RECIPES[name] == with_prepass_delta(matched, name) and spec.recipe.delta == MATCHED
        assert dmref.get_recipe(name) is spec.recipe and spec.folded == folded
        assert spec.prepass and not spec.matched and unsupported(spec.recipe, spec.bwd) is None
        assert bwd_fused.refusal(spec, 64) is None and bwd_fused.refusal(spec, 128) is None
        for kernel in ("dq", "dkdv"):
            with pytest.raises(ValueError, match="pre-pass") as info:
                bwd.launch(spec, head_dim=128, causal=False, kernel=kernel)
            _one_line(info.value)
            with pytest.raises(ValueError, match="pre-pass") as info:
                bwd_ws.launch(spec, head_dim=128, causal=False, kernel=kernel)
            _one_line(info.value)
        assert "pre-pass" in _one_line(api.gluon_backward_refusal(spec, 128))
        # the Gluon pre-pass and five-GEMM kernels run them (on a Hopper GPU)
        for kernel in ("prepass", "fused"):
            assert bwd_ws.launch(spec, head_dim=128, causal=False, kernel=kernel).constexprs["HEAD_DIM"] == 128
        assert "pre-pass" not in (api.gluon_backward_refusal(spec, 128, fused=True) or "")
        shape = api.Shape(1, 1, 1, 64, 64)
        for kw, match in ((dict(fused=False), "five-GEMM"), (dict(delta=torch.zeros(1, 1, 64)), "pre-pass")):
            with pytest.raises(ValueError, match=match) as info:
                api.attention_backward(None, None, None, shape=shape, causal=False, scale=0.125, recipe=spec, **kw)
            _one_line(info.value)
    assert "stale delta" in _one_line(bwd_fused.refusal(SPECS["kernels_delta_matching"], 128))
    # a matched delta of neither kind, and a preset: refused with one line each
    recipe = SPECS["kernels_delta_prepass"].recipe
    odd = dataclasses.replace(recipe, delta=DeltaStrategy(DeltaKind.MATCHED, do=recipe.q))
    assert _one_line(unsupported(odd)).startswith("delta: ")
    assert "q: " in _one_line(unsupported(dmref.get_recipe("delta_matching")))


_COMPILE_SCRIPT = """
import json
from dmref.kernels import bwd_prepass
print(json.dumps([u.__dict__ for u in bwd_prepass.compile_usage("kernels_delta_prepass")
                  + bwd_prepass.compile_usage("kernels_folded_delta_prepass", causal=(True,))]))
"""


@pytest.mark.slow
def test_prepass_kernel_compiles_for_sm90_without_spills():
    """The pre-pass compiles for sm_90a at head dims 64 and 128, causal or not, with the dq
    kernel's launch options, within one Hopper CTA's registers and shared memory, and spills
    nothing (``python -m dmref.kernels.bwd_prepass`` prints the numbers)."""
    from test_bwd_fused import HOPPER_MAX_REGISTERS
    from test_compile_sm90 import MAX_SHARED_BYTES
    from warp_specialized_budget import compiled_usage

    usage = compiled_usage(_COMPILE_SCRIPT)
    assert len(usage) == 6
    for u in usage:
        assert u["spill_bytes"] == 0 and u["registers"] <= HOPPER_MAX_REGISTERS, u
        assert u["shared_bytes"] <= MAX_SHARED_BYTES, u


_DSQ = "kernels_folded_delta_prepass_dsq_row"
#: The Triton form of ``kernels_folded_delta_prepass_dsq_row`` (``bwd_prepass.delta(bound=True)``,
#: then ``bwd_fused.backward(dsq_bound=U)``): the interpreter at small sizes, and the GPU (the
#: Triton kernels, compiled) at larger ones.
_DSQ_CASES = {
    "interpreter": [
        Case(1, 2, 1, 203, 64, True, _DSQ),  # GQA 2:1, causal, N % 64 = 11
        Case(1, 1, 1, 130, 128, False, _DSQ),  # head dim 128, N % 64 = 2
    ],
    "gpu": [
        Case(1, 4, 2, 700, 128, True, _DSQ),
        Case(1, 4, 4, 513, 64, False, _DSQ),
    ],
}


@pytest.mark.parametrize("backend,case", backend_params(_DSQ_CASES))
def test_the_dsq_row_recipe_in_triton_equals_its_reference(backend, case):
    """The pre-pass's bound U (``bound=True``) and the fused backward that scales dS for dQ per
    query from it, K for dQ per head (``dsq_bound=U``; the forward of the spec writes K^T with the
    head's scale), against ``dmref.tiled`` on ``kernels_folded_delta_prepass_dsq_row``: dS as each matmul sees it on at least CODE_AGREEMENT
    of the elements (dQ's only agree where the kernel's scale is the recipe's), dQ, dK and dV
    within the pre-pass test's bounds, D as the plain pre-pass gives it bit for bit."""
    device = require_backend(backend)
    from dmref import get_recipe, tiled
    from dmref.kernels import api, bwd_fused, bwd_prepass
    from dmref.kernels.quantize import quantize_with

    q, k, v, do = outlier_inputs(case, device)
    spec = case.spec()
    scale = 1.0 / math.sqrt(case.head_dim)
    o, _lse, saved, _ = api.attention_forward(q, k, v, causal=case.causal, scale=scale, recipe=spec)
    dims = dict(batch=case.batch, heads=case.heads, kv_heads=case.kv_heads, n=case.n, head_dim=case.head_dim)
    if saved.q is None:
        do8, _, q8 = quantize_with(do, "float8_e4m3fn", saved.q_pending, saved.q_fmt)
        saved = dataclasses.replace(saved, q=q8, q_pending=None)
    else:
        from dmref.kernels.quantize import quantize
        do8, _ = quantize(do, "float8_e4m3fn", rows=True, cols=True)
    d, u = bwd_prepass.delta(saved, do8, causal=case.causal, scale=scale, recipe=spec, bound=True, **dims)
    assert torch.equal(d, bwd_prepass.delta(saved, do8, causal=case.causal, scale=scale, recipe=spec, **dims))
    assert saved.kt_head
    dq, dk, dv, kern = bwd_fused.backward(saved, do8, d, causal=case.causal, scale=scale, recipe=spec, debug=True,
                                          dsq_bound=u, **dims)
    # the API runs the same kernels on the same inputs: the same D and gradients, bit for bit
    got = api.attention_backward(saved, o, do, shape=api.Shape.of(q, k, v), causal=case.causal, scale=scale,
                                 recipe=spec, deterministic=True, gluon=False)
    want = bwd_fused.backward(saved, do8, d, causal=case.causal, scale=scale, recipe=spec, deterministic=True,
                              dsq_bound=u, **dims)
    assert torch.equal(got[3]["delta"], d)
    for a, b in zip(got[:3], want[:3]):
        assert torch.equal(a, b)
    rr = get_recipe(_DSQ + ("" if backend == "gpu" else "@fp32"))
    qf, kf, vf, dof = (t.float() for t in (q, k, v, do))
    fwd = tiled.forward(qf, kf, vf, recipe=rr, causal=case.causal, scale=scale)
    state = tiled.ForwardResult(o.float(), tiled.SoftmaxStats(fwd.stats.ref, fwd.stats.l,
                                                              saved.lse2.view_as(fwd.stats.lse2)))
    told = torch.zeros(case.batch, case.heads, case.n, 1, dtype=torch.float32)
    real = tiled._quantize

    def spy(x, point, *args, **kw):  # the row amax the reference's dS-for-dQ casts are given: its U
        if point is rr.ds_dq:
            told[..., case.n - x.shape[-2]:, :] = kw["amax"].expand(*x.shape[:-1], 1).cpu()
        return real(x, point, *args, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tiled, "_quantize", spy)
        with tap() as bt:  # the tap records the casts, then calls the spy
            ref = tiled.backward(qf, kf, vf, state, dof, recipe=rr, causal=case.causal, scale=scale)
    # the kernel's U bounds its own dS (Lemma 2), and its scale exponents are the reference's
    assert bool((u.cpu() >= kern["ds"].abs().amax(dim=-1).cpu()).all())
    u_ref = told.reshape(u.shape)
    same = (torch.floor(torch.log2(u.cpu())) == torch.floor(torch.log2(u_ref))).double().mean().item()
    assert same >= CODE_AGREEMENT, f"only {same:.6f} of the rows have the reference's dS-for-dQ scale"
    valid = _valid(case, kern["ds_dk"].device).expand_as(kern["ds_dk"])
    # the fused kernel's dQ cast: one factor per query over all its keys, POW2_DOWN of U (U/448 <=
    # factor < 2U/448), not a factor per 64-key block
    inv = kern["ds_dq_inv"].cpu()
    u_q = u.cpu()[..., None].expand_as(inv)
    live = valid.cpu() & (u_q > 2.0**-100)
    assert bool(((inv >= u_q / 448) & (inv < 2 * u_q / 448))[live].all())
    for use in ("ds_dk", "ds_dq"):
        agree = (kern[use] == flat(bt.assemble("backward", use, case.n)))[valid].double().mean().item()
        assert agree >= CODE_AGREEMENT, f"{use}: {agree:.6f} of the dS values agree with the reference"
    got = dict(dq=dq, dk=dk, dv=dv)
    for name, n_ops in _FP8_FROM_FLOAT32.items():
        diff = rel_err(got[name].float(), getattr(ref, name))
        tol = code_flip_rel_bound(n_ops) if backend == "gpu" else BF16_REL
        assert diff <= tol, f"{name}: dsq-row backward vs reference {diff:.3e} > {tol:.3e}"


def test_dsq_bound_goes_with_a_dsq_row_spec_only():
    """``dsq_bound`` is given exactly for a spec that scales dS for dQ from it, on a saved state
    whose K^T copy that spec's forward wrote (the head's scale); each mismatch is refused in one
    line, before any kernel runs."""
    pytest.importorskip("triton")
    from types import SimpleNamespace

    from dmref.kernels import bwd_fused

    dims = dict(batch=1, heads=1, n=64, device="cpu")
    for spec, saved, bound, why in (
            (SPECS["kernels_folded_delta_prepass"], SimpleNamespace(kt_head=True), torch.zeros(1, 64),
             "dsq_bound is read by"),
            (SPECS[_DSQ], SimpleNamespace(kt_head=True), None, "pass dsq_bound"),
            (SPECS[_DSQ], SimpleNamespace(kt_head=False), torch.zeros(1, 64), "another recipe's forward")):
        with pytest.raises(ValueError, match=why) as err:
            bwd_fused.check_dsq(spec, saved, bound, **dims)
        assert "\n" not in str(err.value)
    assert bwd_fused.check_dsq(SPECS["kernels_folded_delta_prepass"], None, None, **dims) is None
    with pytest.raises(ValueError, match="dsq_bound must be a float32"):
        bwd_fused.check_dsq(SPECS[_DSQ], SimpleNamespace(kt_head=True), torch.zeros(1, 64, dtype=torch.float64),
                            **dims)
