"""The five-GEMM backward (``dmref.kernels.bwd_fused``, ``attention_backward(..., fused=True)``)
against the emulated reference ``dmref.tiled`` on the recipe its spec states: dS as each matmul
sees it (dK: per key over the query tile; dQ: per query over the key block) equal to the
reference's on at least CODE_AGREEMENT of the elements, dQ, dK and dV within the bounds the other
kernels meet (tests/kernels/test_kernels_vs_reference.py), and the deterministic mode's order:
each key block adds its dQ partial after exactly the blocks before it, and two runs agree bit
for bit (GPU). In Triton's interpreter at small sizes (tail tiles, causal, GQA, head dims 64 and
128, logits beyond 2**24), and on a Hopper GPU at larger ones."""

from __future__ import annotations

import math

import pytest
import torch

from kernel_bounds import BF16_REL, CODE_AGREEMENT, code_flip_rel_bound, rel_err
from kernel_inputs import Case, backend_params, outlier_inputs, require_backend
from reference_intermediates import flat, tap

CASES = {
    "interpreter": [
        Case(1, 2, 1, 203, 64, True, "kernels_naive_fp8"),  # GQA 2:1, causal, N % 64 = 11
        Case(1, 2, 2, 150, 64, False, "kernels_naive_fp8"),
        Case(1, 1, 1, 130, 128, True, "kernels_naive_fp8"),  # head dim 128, N % 64 = 2
        Case(1, 2, 1, 150, 64, True, "kernels_naive_fp8", logit_log2=26),  # logits ~2**26
    ],
    "gpu": [
        Case(2, 4, 2, 1000, 128, False, "kernels_naive_fp8"),
        Case(2, 4, 2, 1000, 128, True, "kernels_naive_fp8"),
        Case(1, 4, 4, 777, 64, True, "kernels_naive_fp8"),
        Case(1, 4, 1, 777, 64, False, "kernels_naive_fp8"),
        Case(1, 4, 4, 513, 64, True, "kernels_naive_fp8", logit_log2=28),
        Case(1, 2, 2, 700, 128, True, "kernels_folded_naive_fp8"),
    ],
}

#: FP8 operands each side quantizes from float32 data it computed itself, per gradient (P for
#: dV; P then dS for dK and dQ), as in test_kernels_vs_reference
_FP8_FROM_FLOAT32 = {"dv": 1, "dk": 2, "dq": 2}

_RUNS: dict = {}


def _run(backend: str, case: Case, deterministic: bool = False) -> dict:
    key = (backend, case, deterministic)
    if key in _RUNS:
        return _RUNS[key]
    device = require_backend(backend)  # before importing the kernels: it skips without triton
    from dmref import tiled
    from dmref.kernels import api

    q, k, v, do = outlier_inputs(case, device)
    spec = case.spec()
    rr = spec.reference_recipe("hopper" if backend == "gpu" else "fp32")
    scale = 1.0 / math.sqrt(case.head_dim)
    o, _lse, saved, _ = api.attention_forward(q, k, v, causal=case.causal, scale=scale, recipe=spec)
    dq, dk, dv, dbg = api.attention_backward(saved, o, do, shape=api.Shape.of(q, k, v), causal=case.causal,
                                             scale=scale, recipe=spec, fused=True, deterministic=deterministic,
                                             debug=True)
    # the reference's backward from the kernel's O and LSE, its dS casts recorded
    qf, kf, vf, dof = (t.float() for t in (q, k, v, do))
    fwd = tiled.forward(qf, kf, vf, recipe=rr, causal=case.causal, scale=scale)
    state = tiled.ForwardResult(o.float(), tiled.SoftmaxStats(fwd.stats.ref, fwd.stats.l,
                                                              saved.lse2.view_as(fwd.stats.lse2)))
    with tap() as bt:
        bwd = tiled.backward(qf, kf, vf, state, dof, recipe=rr, causal=case.causal, scale=scale)
    n = case.n
    out = dict(kernel=dict(dq=dq, dk=dk, dv=dv, **dbg),
               ref=dict(dq=bwd.dq, dk=bwd.dk, dv=bwd.dv,
                        ds_dk=flat(bt.assemble("backward", "ds_dk", n)).to(device),
                        ds_dq=flat(bt.assemble("backward", "ds_dq", n)).to(device)))
    _RUNS[key] = out
    return out


def _valid(case: Case, device) -> torch.Tensor:
    i = torch.arange(case.n, device=device)
    return (i[:, None] >= i[None, :]) if case.causal else torch.ones(case.n, case.n, dtype=torch.bool, device=device)


@pytest.mark.parametrize("backend,case", backend_params(CASES))
@pytest.mark.parametrize("use", ["ds_dk", "ds_dq"])
def test_ds_as_each_matmul_sees_it_agrees_with_reference(backend, case, use):
    r = _run(backend, case)
    kern, ref = r["kernel"][use], r["ref"][use]
    valid = _valid(case, kern.device).expand_as(kern)
    agree = (kern == ref)[valid].double().mean().item()
    assert agree >= CODE_AGREEMENT, f"{use}: {agree:.6f} of the dS values agree with the reference"
    # and among the elements either side makes nonzero (most are zero at large logits: P one-hot)
    nonzero = valid & ((kern != 0) | (ref != 0))
    assert nonzero.any()
    agree = (kern == ref)[nonzero].double().mean().item()
    assert agree >= CODE_AGREEMENT, f"{use}: {agree:.6f} of the nonzero dS values agree with the reference"
    assert (kern[~valid] == 0).all(), f"{use}: nonzero dS outside the causal mask"


@pytest.mark.parametrize("backend,case", backend_params(CASES))
def test_gradients_equal_reference_up_to_code_flips(backend, case):
    r = _run(backend, case)
    for name, n_ops in _FP8_FROM_FLOAT32.items():
        diff = rel_err(r["kernel"][name].float(), r["ref"][name])
        tol = code_flip_rel_bound(n_ops) if backend == "gpu" else BF16_REL
        assert diff <= tol, f"{name}: fused kernel vs reference {diff:.3e} > {tol:.3e}"


_DET_CASES = {"interpreter": [CASES["interpreter"][0], Case(1, 2, 2, 150, 64, False, "kernels_naive_fp8")],
              "gpu": CASES["gpu"][:4]}


def _expected_counters(case: Case, spec) -> torch.Tensor:
    """What key block j reads from query tile i's counter: j where it sees the tile (the blocks
    0 .. j-1 have added before it), -1 where it does not (causal: the tile ends before the block)."""
    t = spec.bwd_tiles(case.head_dim)
    n_q, n_k = -(-case.n // t.block_m1), -(-case.n // t.block_n2)
    i = torch.arange(n_q)[:, None]
    j = torch.arange(n_k)[None, :]
    sees = (i + 1) * t.block_m1 > j * t.block_n2 if case.causal else torch.ones(n_q, n_k, dtype=torch.bool)
    return torch.where(sees, j, -1).to(torch.int32).expand(case.batch * case.heads, n_q, n_k)


@pytest.mark.parametrize("backend,case", backend_params(_DET_CASES))
def test_deterministic_mode_adds_dq_partials_in_key_order(backend, case):
    r = _run(backend, case, deterministic=True)
    seen = r["kernel"]["sem_seen"].cpu()
    assert torch.equal(seen, _expected_counters(case, case.spec()))
    for name, n_ops in _FP8_FROM_FLOAT32.items():
        diff = rel_err(r["kernel"][name].float(), r["ref"][name])
        tol = code_flip_rel_bound(n_ops) if backend == "gpu" else BF16_REL
        assert diff <= tol, f"{name}: deterministic fused kernel vs reference {diff:.3e} > {tol:.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", _DET_CASES["gpu"], ids=str)
def test_deterministic_mode_is_bit_identical_across_runs(case):
    device = require_backend("gpu")
    from dmref.kernels import api

    q, k, v, do = outlier_inputs(case, device)
    spec = case.spec()
    o, _lse, saved, _ = api.attention_forward(q, k, v, causal=case.causal, recipe=spec)
    scale = 1.0 / math.sqrt(case.head_dim)
    runs = [api.attention_backward(saved, o, do, shape=api.Shape.of(q, k, v), causal=case.causal, scale=scale,
                                   recipe=spec, fused=True, deterministic=True)[:3] for _ in range(3)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_fused_backward_refuses_the_matched_delta_and_a_lone_deterministic():
    pytest.importorskip("triton")
    from dmref.kernels import bwd_fused
    from dmref.kernels.config import SPECS

    why = bwd_fused.refusal(SPECS["kernels_delta_matching"], 128)
    assert why is not None and "stale delta" in why
    assert bwd_fused.refusal(SPECS["kernels_naive_fp8"], 128) is None
    with pytest.raises(ValueError, match="stale delta"):
        bwd_fused.launch(SPECS["kernels_delta_matching"], head_dim=64, causal=False)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_launch_reads_tiles_and_p_scale_from_the_spec(head_dim):
    """The fused kernel's query tile and key block are the spec's ``block_m1`` and ``block_n2``, so
    its dS blocks and promotion points are the recipe's (``fit_to_tiles`` changes nothing)."""
    pytest.importorskip("triton")
    from dmref.kernels import bwd_fused
    from dmref.kernels.config import SPECS, fit_to_tiles

    spec = SPECS["kernels_naive_fp8"]
    run = bwd_fused.launch(spec, head_dim=head_dim, causal=True)
    t = spec.bwd_tiles(head_dim)
    assert (run.constexprs["BLOCK_M"], run.constexprs["BLOCK_N"]) == (t.block_m1, t.block_n2)
    assert run.constexprs["P_SCALE"] == 2.0 ** spec.recipe.p_bwd.offset_log2
    assert fit_to_tiles(spec.recipe, t) == spec.recipe
    assert spec.recipe.ds_dq.granularity.value.endswith(str(t.block_n2))
    assert spec.recipe.ds_dk.granularity.value.endswith(str(t.block_m1))


_COMPILE_SCRIPT = """
import json
from dmref.kernels import bwd_fused
print(json.dumps([u.__dict__ for u in bwd_fused.compile_usage(causal=(True,)) + bwd_fused.compile_usage(
    head_dims=(64,), causal=(True,), deterministic=(False,), group=2)]))
"""


@pytest.mark.slow
def test_fused_kernel_compiles_for_sm90_within_hopper_limits():
    """Every variant (D = 64 and 128, deterministic or not, GQA) compiles for sm_90a with the
    shared memory and registers of one Hopper CTA (test_compile_sm90's limits) and launch options
    of the spec's default (``default_fused_tiles``)."""
    from test_compile_sm90 import MAX_SHARED_BYTES
    from warp_specialized_budget import compiled_usage

    usage = compiled_usage(_COMPILE_SCRIPT)
    assert len(usage) == 5
    for u in usage:
        assert u["shared_bytes"] <= MAX_SHARED_BYTES, u
        assert u["registers"] <= HOPPER_MAX_REGISTERS, u
        assert ("warps=4" if "d=64" in u["variant"] else "warps=8") in u["variant"], u


#: Hopper: 255 registers per thread at most
HOPPER_MAX_REGISTERS = 255


_MATCHED_CASES = {"interpreter": [Case(1, 2, 1, 203, 64, True, "kernels_naive_fp8"),
                                  Case(1, 1, 1, 130, 128, False, "kernels_naive_fp8")],
                  "gpu": [Case(2, 4, 2, 1000, 128, True, "kernels_naive_fp8"),
                          Case(1, 4, 1, 777, 64, False, "kernels_naive_fp8")]}


@pytest.mark.parametrize("backend,case", backend_params(_MATCHED_CASES))
def test_caller_matched_delta_gives_the_matched_recipe(backend, case):
    """With ``delta=`` the reference's matched D (``DeltaKind.MATCHED``, computed ahead by a
    pre-sweep), the fused kernel computes the spec's recipe with the matched delta: dS as each
    matmul sees it and the gradients agree with ``dmref.tiled`` on that recipe as above, and its
    dS rows sum far closer to zero than the stale delta's (what the matched delta is for)."""
    import dataclasses

    device = require_backend(backend)
    from dmref import tiled
    from dmref.kernels import api
    from dmref.recipes import MATCHED

    q, k, v, do = outlier_inputs(case, device)
    spec = case.spec()
    rr = dataclasses.replace(spec.reference_recipe("hopper" if backend == "gpu" else "fp32"), delta=MATCHED)
    scale = 1.0 / math.sqrt(case.head_dim)
    o, _lse, saved, _ = api.attention_forward(q, k, v, causal=case.causal, scale=scale, recipe=spec)
    qf, kf, vf, dof = (t.float() for t in (q, k, v, do))
    fwd = tiled.forward(qf, kf, vf, recipe=rr, causal=case.causal, scale=scale)
    state = tiled.ForwardResult(o.float(), tiled.SoftmaxStats(fwd.stats.ref, fwd.stats.l,
                                                              saved.lse2.view_as(fwd.stats.lse2)))
    with tap() as bt:
        bwd = tiled.backward(qf, kf, vf, state, dof, recipe=rr, causal=case.causal, scale=scale, diagnostics=True)
    delta = bwd.rowsum.delta.float().to(device)
    shape = api.Shape.of(q, k, v)
    dq, dk, dv, dbg = api.attention_backward(saved, o, do, shape=shape, causal=case.causal, scale=scale,
                                             recipe=spec, fused=True, delta=delta, debug=True)
    valid = _valid(case, device).expand_as(dbg["ds_dk"])
    for use in ("ds_dk", "ds_dq"):
        ref = flat(bt.assemble("backward", use, case.n)).to(device)
        agree = (dbg[use] == ref)[valid].double().mean().item()
        assert agree >= CODE_AGREEMENT, f"{use}: {agree:.6f} of the dS values agree with the reference"
    for name, got, want in (("dq", dq, bwd.dq), ("dk", dk, bwd.dk), ("dv", dv, bwd.dv)):
        diff = rel_err(got.float(), want)
        tol = code_flip_rel_bound(_FP8_FROM_FLOAT32[name]) if backend == "gpu" else BF16_REL
        assert diff <= tol, f"{name}: fused kernel (caller's matched D) vs reference {diff:.3e} > {tol:.3e}"
    # the row sums of dS as dQ sees it: with the matched D, far below the stale delta's
    stale = api.attention_backward(saved, o, do, shape=shape, causal=case.causal, scale=scale, recipe=spec,
                                   fused=True, debug=True)[3]
    matched_res = dbg["ds_dq"].double().sum(-1).abs().mean().item()
    stale_res = stale["ds_dq"].double().sum(-1).abs().mean().item()
    assert matched_res < stale_res, (matched_res, stale_res)


def test_caller_delta_is_checked():
    pytest.importorskip("triton")
    from dmref.kernels import bwd_fused

    good = torch.zeros(2, 3, 5)
    assert bwd_fused.caller_delta(good, 2, 3, 5, "cpu").shape == (6, 5)
    with pytest.raises(ValueError, match="float32"):
        bwd_fused.caller_delta(good.double(), 2, 3, 5, "cpu")
    with pytest.raises(ValueError, match="shape"):
        bwd_fused.caller_delta(torch.zeros(2, 3, 4), 2, 3, 5, "cpu")


@pytest.mark.parametrize("backend", ["interpreter", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_dsq_exponents_are_floor_log2_of_448_over_the_bound(backend):
    """``dsq_exponents(U)`` (what ``bwd_ws.fused(vec_tma=True)`` hands its kernel instead of U) is
    k = floor(log2(448 / U)) exactly, clamped to [-126, 126], 0 where U = 0: against exact
    rational arithmetic on every float32 exponent, the fraction fields at and around E4M3's
    1.75, subnormals, the largest float32 and 0, in a tail-length (B*H, N) tensor."""
    device = require_backend(backend)
    import math
    from fractions import Fraction

    import numpy as np

    from dmref.kernels.bwd_fused import dsq_exponents

    fields = [0, 1, 0x400000, 0x5FFFFF, 0x600000, 0x600001, 0x7FFFFF]  # 1.75 = fraction field 0x600000
    bits = [(e << 23) | f for e in range(0, 255) for f in fields] + [1, 2, 0x7FFFFF]  # normals, subnormals
    u = np.array(bits, dtype=np.uint32).view(np.float32)
    u = np.concatenate([u, np.float32([0.0, np.finfo(np.float32).max])])
    u = np.resize(u, (3, (len(u) + 2) // 3))  # a tail: N not a multiple of the kernel's block

    def exact(x: float) -> int:
        if x == 0:
            return 0
        q = Fraction(448) / Fraction(x)
        k = math.floor(math.log2(q))  # then exactly: 2**k <= q < 2**(k + 1)
        while Fraction(2) ** k > q:
            k -= 1
        while Fraction(2) ** (k + 1) <= q:
            k += 1
        return max(-126, min(126, k))

    got = dsq_exponents(torch.from_numpy(u).to(device)).cpu()
    assert got.dtype == torch.int32 and got.shape == u.shape
    want = torch.tensor([[exact(float(x)) for x in row] for row in u], dtype=torch.int32)
    bad = (got != want).nonzero()
    assert not len(bad), [(float(u[tuple(i)]), int(got[tuple(i)]), int(want[tuple(i)])) for i in bad[:5].tolist()]


@pytest.mark.parametrize("backend", ["interpreter", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_the_postprocess_of_a_transposed_buffer_gives_the_same_bits(backend):
    """``postprocess_dq(..., transposed=True)`` (dQ^T's buffer, ``(B*H, D, N)``: ``bwd_ws``'s
    ``dq_t``) rounds each element as the plain one does: BF16(dQ_acc * scale) bit for bit, on a
    tail length, both head dims, values over 60 binades, signed zeros and subnormal results."""
    device = require_backend(backend)
    from dmref.kernels.bwd_fused import postprocess_dq

    gen = torch.Generator().manual_seed(0)
    for b, h, n, d in ((2, 3, 203, 64), (1, 2, 130, 128)):
        x = torch.randn(b * h, n, d, generator=gen) * torch.exp2(torch.randint(-130, 30, (b * h, n, d), generator=gen).float())
        x[0, :3] = -0.0
        x = x.to(device)
        plain = postprocess_dq(x, b, h, n, d, 0.125)
        got = postprocess_dq(x.transpose(1, 2).contiguous(), b, h, n, d, 0.125, transposed=True)
        assert got.shape == (b, h, n, d)
        assert torch.equal(got.view(torch.int16), plain.view(torch.int16))
