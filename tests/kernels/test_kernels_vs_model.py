"""Differential tests: dmref.kernels against a model of the same recipe (``kernel_model``).

Every test body runs on the GPU (marked ``gpu``) and in Triton's interpreter on the CPU at small
sizes (see conftest). The interpreter checks indexing, masking and the recipe's arithmetic; its
FP8 casts are made exact by the kernels' own rounding helper, so codes are compared there too.
"""

from __future__ import annotations

import math

import pytest
import torch

from dmref.kernels.config import BwdTiles, FwdTiles

import kernel_model as model
from kernel_model import Case, outlier_inputs
from kernel_bounds import (
    CODE_AGREEMENT,
    RECIPE_NOISE_FRACTION,
    U32,
    U_FP16,
    bf16_ulp,
    delta_matching_rowsum_bound,
    gamma,
    rel_err,
)


_SMALL_TILES = (FwdTiles(64, 32, 4, 1), BwdTiles(32, 64, 64, 32, 4, 1, 4, 1), "tile")
#: dS in 1x128 blocks, as the reference presets quantize it
_REFERENCE_TILES = (FwdTiles(), BwdTiles(128, 64, 64, 128, 8, 1, 8, 1), "rowwise")

#: Awkward sequence lengths (tails in every tile size), GQA, both head dims, both recipes.
CASES = {
    "interpreter": [
        Case(1, 2, 1, 203, 64, False, "naive_fp8"),
        Case(1, 2, 1, 203, 64, True, "naive_fp8"),
        Case(1, 2, 1, 203, 64, False, "delta_matching"),
        Case(1, 2, 1, 203, 64, True, "delta_matching"),
        Case(1, 1, 1, 130, 128, True, "delta_matching"),
        Case(1, 2, 2, 113, 64, True, "delta_matching", _SMALL_TILES),
    ],
    "gpu": [
        Case(2, 4, 2, 1000, 128, False, "naive_fp8"),
        Case(2, 4, 2, 1000, 128, True, "naive_fp8"),
        Case(2, 4, 2, 1000, 128, False, "delta_matching"),
        Case(2, 4, 2, 1000, 128, True, "delta_matching"),
        Case(1, 4, 4, 777, 64, True, "delta_matching"),
        Case(1, 4, 1, 777, 64, False, "naive_fp8"),
        Case(1, 4, 2, 333, 64, True, "delta_matching", _SMALL_TILES),
        Case(1, 2, 2, 700, 128, True, "delta_matching", _REFERENCE_TILES),
    ],
}


_RUNS: dict = {}


def run_case(backend: str, case: Case) -> dict:
    """Kernel (with debug outputs), model and float64 attention on the same inputs; cached."""
    key = (backend, case)
    if key in _RUNS:
        return _RUNS[key]
    from dmref.kernels import api

    device = "cuda" if backend == "gpu" else "cpu"
    q, k, v, do = outlier_inputs(case, device)
    recipe = case.recipe_obj()
    scale = 1.0 / math.sqrt(case.head_dim)
    o, lse, saved, fdbg = api.attention_forward(q, k, v, causal=case.causal, scale=scale,
                                                recipe=recipe, debug=True)
    dq, dk, dv, bdbg = api.attention_backward(saved, o, do, shape=api.Shape.of(q, k, v),
                                              causal=case.causal, scale=scale, recipe=recipe,
                                              debug=True)
    dot = model.hopper_dot if backend == "gpu" else model.exact_dot
    mo, mlse2, mp = model.forward(q, k, v, causal=case.causal, scale=scale, recipe=recipe, dot=dot)
    # the model's backward reads the kernel's O and LSE, so that it sees the same saved state
    mb = model.backward(q, k, v, o, saved.lse2, do, causal=case.causal, scale=scale,
                        recipe=recipe, dot=dot)
    exact = model.exact_attention(q, k, v, do, causal=case.causal, scale=scale)
    out = dict(kernel=dict(o=o, lse2=saved.lse2, p_fwd=fdbg["p_codes"], dq=dq, dk=dk, dv=dv, **bdbg),
               model=dict(o=mo, lse2=mlse2, p_fwd=mp, **mb), exact=exact)
    _RUNS[key] = out
    return out


def _cases(which: str | None = None):
    """(backend, case) parameters: interpreter cases and GPU cases, GPU ones marked."""
    params = []
    for backend, cases in CASES.items():
        for c in cases:
            if which is not None and c.recipe != which:
                continue
            marks = [pytest.mark.gpu] if backend == "gpu" else []
            params.append(pytest.param(backend, c, id=f"{backend}-{c}", marks=marks))
    return params


def _code_report(kc: torch.Tensor, mc: torch.Tensor, valid: torch.Tensor) -> str:
    """Where and how far kernel and model codes differ (for a failure message)."""
    from dmref.emulation import decode

    kv, mv = decode(kc, "e4m3").double(), decode(mc, "e4m3").double()
    diff = (kc != mc) & valid
    rel = ((kv - mv).abs() / mv.abs().clamp_min(2.0**-9))[diff]
    cols = diff.double().mean(dim=(0, 1))
    rows = diff.double().mean(dim=(0, 2))
    by_col = [round(cols[i::128].mean().item(), 3) for i in range(0, 128, 16)]
    by_row = [round(rows[i::64].mean().item(), 3) for i in range(0, 64, 8)]
    return (f"kernel>model {((kv > mv) & diff).double().sum().item():.0f}, "
            f"kernel<model {((kv < mv) & diff).double().sum().item():.0f}, rel diff median "
            f"{rel.median().item() if rel.numel() else 0:.3g} max {rel.max().item() if rel.numel() else 0:.3g}; "
            f"mismatch rate by column mod 128 (every 16th) {by_col}, by row mod 64 {by_row}; "
            f"zero codes kernel {(kc[valid] & 0x7F == 0).double().mean().item():.3f} "
            f"model {(mc[valid] & 0x7F == 0).double().mean().item():.3f}")


def _valid(case: Case, device) -> torch.Tensor:
    i = torch.arange(case.n, device=device)
    return (i[:, None] >= i[None, :]) if case.causal else torch.ones(case.n, case.n, dtype=torch.bool, device=device)


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["interpreter", pytest.param("gpu", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("n,head_dim", [(203, 64), (130, 128)])
def test_quantize_kernel_codes_and_scales_equal_model(backend, fmt, n, head_dim):
    model.require_backend(backend)
    from dmref.kernels.quantize import quantize

    device = "cuda" if backend == "gpu" else "cpu"
    case = Case(1, 2, 2, n, head_dim, False, "naive_fp8")
    x, _, _, o = outlier_inputs(case, device)
    got, delta = quantize(x, fmt, rows=True, cols=True, delta_with=o)
    xf = x.reshape(2, n, head_dim).float()
    rows, row_inv = model.rows(xf, fmt)
    cols, col_inv = model.cols(xf, fmt)
    assert torch.equal(got.rows.view(torch.uint8), rows)
    assert torch.equal(got.row_scale, row_inv)
    assert torch.equal(got.cols.view(torch.uint8), cols)
    assert torch.equal(got.col_scale, col_inv)
    # the preprocess's stale delta: a float32 dot over the head dim
    of = o.reshape(2, n, head_dim).float()
    exact = (of.double() * xf.double()).sum(-1)
    bound = gamma(head_dim) * (of.double() * xf.double()).abs().sum(-1)
    assert ((delta.double() - exact).abs() <= bound).all()


def _check_codes(backend, case, names):
    model.require_backend(backend)
    r = run_case(backend, case)
    kern, mod = r["kernel"], r["model"]
    valid = _valid(case, kern["o"].device).expand_as(mod["p_fwd"])
    agree = {name: (kern[name].view(torch.uint8) == mod[name])[valid].double().mean().item()
             for name in names}
    for name, a in agree.items():
        assert a >= CODE_AGREEMENT, f"{name}: {agree} of codes agree; " + _code_report(
            kern[name].view(torch.uint8), mod[name], valid)
    # outside the mask every code is +-0 (0 * negative is -0, code 0x80)
    for name in names:
        assert (kern[name][~valid] & 0x7F == 0).all()


@pytest.mark.parametrize("backend,case", _cases())
def test_ds_codes_agree_with_model(backend, case):
    _check_codes(backend, case, ("ds_codes",))


@pytest.mark.parametrize("backend,case", _cases())
def test_p_codes_agree_with_model(backend, case):
    _check_codes(backend, case, ("p_fwd", "p_codes"))


#: Logits far beyond 2**24, where a float32 ulp of S2 exceeds 1: P = exp2(S2 - m) follows the
#: recipe only if S2 = fl(S * scale) is rounded before m or LSE is subtracted. A fused
#: multiply-add there leaves exp2(rounding error of S2) in place of P = 1 at a row's maximum.
LARGE_LOGIT_CASES = [
    pytest.param("interpreter", Case(1, 2, 1, 150, 64, True, "delta_matching", logit_log2=26),
                 id="interpreter-logits2^26"),
    pytest.param("gpu", Case(1, 4, 2, 700, 128, False, "delta_matching", logit_log2=26),
                 id="gpu-d128-logits2^26", marks=pytest.mark.gpu),
    pytest.param("gpu", Case(1, 4, 4, 513, 64, True, "naive_fp8", logit_log2=28),
                 id="gpu-d64-causal-logits2^28", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("backend,case", LARGE_LOGIT_CASES)
def test_codes_and_output_agree_with_model_at_large_logits(backend, case):
    _check_codes(backend, case, ("p_fwd", "p_codes", "ds_codes"))
    r = run_case(backend, case)
    kern, mod = r["kernel"], r["model"]
    # at such logits a row has a handful of nonzero P codes, P = 1 at its maximum among them:
    # the agreement that matters is on those
    valid = _valid(case, kern["o"].device).expand_as(mod["p_fwd"])
    for name in ("p_fwd", "p_codes"):
        kc, mc = kern[name].view(torch.uint8), mod[name]
        active = valid & (mc & 0x7F != 0)
        agree = (kc == mc)[active].double().mean().item()
        assert agree >= CODE_AGREEMENT, f"{name}: {agree:.4f} of the nonzero codes agree"
    recipe_error = rel_err(mod["o"], r["exact"]["o"])
    diff = rel_err(kern["o"].float(), mod["o"])
    assert diff <= RECIPE_NOISE_FRACTION * recipe_error, (
        f"o: kernel vs model {diff:.3e}, model vs float64 {recipe_error:.3e}")


#: FP8 wgmma truncates each k-step's terms to 13 fraction bits relative to the step's largest
#: (docs/gemm.md): a chain's result is within 2 * 2**-13 of its sum of |terms|.
WGMMA_TRUNCATION_REL = 2 * 2.0**-13


@pytest.mark.parametrize("backend,case", _cases())
def test_output_recomputed_from_dumped_p_codes_equals_kernel_output(backend, case):
    """The P codes the forward dumps are the ones its P V matmul consumed: O recomputed from
    the dump (model arithmetic, exact P V products) equals the kernel's O up to the BF16
    rounding of O and the wgmma truncation of P V: this test tells a wrong dump from a wrong
    P."""
    model.require_backend(backend)
    r = run_case(backend, case)
    kern = r["kernel"]
    q, k, v, _ = outlier_inputs(case, kern["o"].device)
    dot = model.hopper_dot if backend == "gpu" else model.exact_dot
    o_dump, _, _ = model.forward(q, k, v, causal=case.causal, scale=1.0 / math.sqrt(case.head_dim),
                                 recipe=case.recipe_obj(), dot=dot, p_codes_in=kern["p_fwd"])
    tol = 2.0**-8 + (WGMMA_TRUNCATION_REL if backend == "gpu" else 0.0)
    assert rel_err(kern["o"].float(), o_dump) <= tol


@pytest.mark.parametrize("backend,case", _cases())
def test_outputs_and_gradients_match_model_within_recipe_noise(backend, case):
    model.require_backend(backend)
    r = run_case(backend, case)
    kern, mod, exact = r["kernel"], r["model"], r["exact"]
    for name in ("o", "dq", "dk", "dv"):
        recipe_error = rel_err(mod[name], exact[name])
        diff = rel_err(kern[name].float(), mod[name])
        assert diff <= RECIPE_NOISE_FRACTION * recipe_error, (
            f"{name}: kernel vs model {diff:.3e}, model vs float64 {recipe_error:.3e}")
        if backend == "interpreter":
            # float32 accumulation there, and every code agrees: the kernel's BF16 outputs are
            # the model's values rounded to BF16, up to one BF16 ulp where the float32 values
            # straddle a rounding boundary, plus, for dQ, what another order of the float32 sum
            # of dS K (2 gamma_N of its |terms|) and of kbar's float16 roundings can move
            allowed = bf16_ulp(mod[name])
            if name == "dq":
                allowed = allowed + 2 * gamma(case.n) * mod["dq_abs"] + \
                    2 * gamma(mod["kbar_roundings"], U_FP16) * mod["dq_corr_abs"]
            excess = ((kern[name].float() - mod[name]).abs() - allowed).max().item()
            assert excess <= 0, f"{name}: kernel and model differ by more than one BF16 ulp ({excess:.3e} beyond)"
    # LSE: the same float32 online softmax, up to exp2/log2 rounding and accumulation order
    lse_tol = gamma(case.n + 4) * mod["lse2"].abs().max().item() + 2 * gamma(case.head_dim) * \
        mod["s2_abs"].abs().max().item()
    assert (kern["lse2"] - mod["lse2"]).abs().max().item() <= lse_tol


@pytest.mark.parametrize("backend,case", _cases("delta_matching"))
def test_matched_delta_ds_rowsums_within_delta_matching_bound(backend, case):
    model.require_backend(backend)
    r = run_case(backend, case)
    kern, mod = r["kernel"], r["model"]
    bound = delta_matching_rowsum_bound(
        mod["p"], mod["dp"], kern["delta"], s2_abs=mod["s2_abs"], dp_abs=mod["dp_abs"],
        head_dim=case.head_dim, recompute_unit=0.0 if backend == "gpu" else U32)
    for name in ("ds_rowsum", "dq_ds_rowsum"):
        excess = (kern[name].double().abs() - bound).max().item()
        assert excess <= 0, f"{name} exceeds the Delta-Matching bound by {excess:.3e}"


@pytest.mark.parametrize("backend,case", _cases("naive_fp8"))
def test_stale_delta_ds_rowsums_visibly_outside_delta_matching_bound(backend, case):
    model.require_backend(backend)
    r = run_case(backend, case)
    kern, mod = r["kernel"], r["model"]
    bound = delta_matching_rowsum_bound(
        mod["p"], mod["dp"], kern["delta"], s2_abs=mod["s2_abs"], dp_abs=mod["dp_abs"],
        head_dim=case.head_dim, recompute_unit=0.0 if backend == "gpu" else U32)
    outside = (kern["ds_rowsum"].double().abs() > bound).double().mean().item()
    # "visibly": most rows, not a rounding accident
    assert outside > 0.5, f"only {outside:.3f} of stale rows exceed the bound"
    # and they are what proofs/stale_delta.md says: sum_j P (dP - D_stale) = (D_matched - D_stale) sum_j P
    matched = (mod["p"].double() * mod["dp"].double()).sum(-1) / mod["p"].double().sum(-1)
    predicted = (matched - kern["delta"].double()) * mod["p"].double().sum(-1)
    assert rel_err(kern["ds_rowsum"], predicted) <= RECIPE_NOISE_FRACTION


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["interpreter", pytest.param("gpu", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("recipe", ["delta_matching", "naive_fp8"])
def test_autograd_function_gives_the_backward_kernels_gradients(backend, recipe):
    model.require_backend(backend)
    from dmref.kernels import api, attention

    device = "cuda" if backend == "gpu" else "cpu"
    case = Case(1, 4, 2, 150, 64, True, recipe)
    q, k, v, do = outlier_inputs(case, device, seed=1)
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    o = attention(q, k, v, causal=True, recipe=recipe)
    o.backward(do)
    o2, _lse, saved, _ = api.attention_forward(q.detach(), k.detach(), v.detach(), causal=True,
                                               recipe=recipe)
    dq, dk, dv, _ = api.attention_backward(saved, o2, do, shape=api.Shape.of(q, k, v), causal=True,
                                           scale=1 / math.sqrt(64), recipe=recipe)
    assert o.dtype == torch.bfloat16 and o.shape == q.shape
    assert torch.equal(o, o2)
    assert torch.equal(q.grad, dq) and torch.equal(k.grad, dk) and torch.equal(v.grad, dv)
    assert k.grad.shape == k.shape  # GQA: summed over each key/value head's query heads


@pytest.mark.gpu
@pytest.mark.parametrize("num_warps", [4, 8])
@pytest.mark.parametrize("m", [64, 128])
def test_hopper_dot_model_equals_triton_fp8_dot_at_kernel_tile_shapes(m, num_warps):
    """The model's wgmma arithmetic (hopper_dot) is what tl.dot does at the kernels' tile shapes."""
    import triton
    import triton.language as tl

    if m == 64 and num_warps == 8:
        pytest.skip("a 64-row wgmma tile is replicated across 8 warps; the kernels avoid it")

    @triton.jit
    def _dot(A, B, C, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
        rm, rn, rk = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
        a = tl.load(A + rm[:, None] * K + rk[None, :])
        b = tl.load(B + rn[None, :] * K + rk[:, None])  # K-major, as the kernels load K
        tl.store(C + rm[:, None] * N + rn[None, :], tl.dot(a, b))

    g = torch.Generator().manual_seed(m + num_warps)
    a = (torch.randn(m, 128, generator=g) * 4).to(torch.float8_e4m3fn).cuda()
    b = (torch.randn(128, 128, generator=g) * 4).to(torch.float8_e4m3fn).cuda()
    c = torch.empty(m, 128, device="cuda")
    _dot[(1,)](a, b, c, M=m, N=128, K=128, num_warps=num_warps)
    ref = model.hopper_dot(a.float(), b.float().T)
    assert torch.equal(c.view(torch.int32), ref.view(torch.int32))


@pytest.mark.parametrize("backend", ["interpreter", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_kernel_fp8_cast_equals_model_cast_at_every_rounding_boundary(backend):
    """``_common.to_fp8`` (``cvt.rn.satfinite`` on the GPU) is the model's RNE satfinite cast
    (``dmref.emulation.encode``) on every E4M3 value, every midpoint between neighbours (ties to
    even), the float32 numbers either side of each midpoint, and past the largest finite value:
    the debug dumps hold the float32 values the cast received and are cast on the host.

    The model's cast is ``encode``'s, which checks torch's own e4m3fn cast before using it:
    torch 2.11's maps overflow past 464 to NaN where the hardware saturates
    (tests/emulation/test_cast.py)."""
    model.require_backend(backend)
    import triton
    from kernel_probes import cast_to_e4m3

    from dmref.emulation import decode, encode
    from dmref.kernels._runtime import interpreting

    values = decode(torch.arange(0, 0x7F, dtype=torch.uint8), "e4m3").double()  # +0 ... 448
    mids = (values[:-1] + values[1:]) / 2
    x = torch.cat([values, mids, torch.tensor([464.0, 480.0, 1e4])]).float()
    x = torch.cat([x, torch.nextafter(x, torch.tensor(0.0)), torch.nextafter(x, torch.tensor(1e30))])
    x = torch.cat([x, -x])
    device = "cuda" if backend == "gpu" else "cpu"
    xd = x.to(device)
    y = torch.empty(x.shape, dtype=torch.uint8, device=device)
    cast_to_e4m3[(triton.cdiv(x.numel(), 256),)](xd, y, x.numel(), BLOCK=256, INTERPRET=interpreting())
    want = encode(x, "e4m3", saturate=True)
    bad = y.cpu() != want
    assert not bad.any(), (f"{bad.sum().item()} of {x.numel()} codes differ: inputs "
                           f"{x[bad].tolist()}, kernel {y.cpu()[bad].tolist()}, model {want[bad].tolist()}")
