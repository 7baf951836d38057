"""Differential tests of the kernels' intermediates: the P and dS codes their debug dumps hold,
their LSE, delta and dS row sums, against the emulated reference ``dmref.tiled`` on the recipe
the kernels run (``KernelSpec.reference_recipe``), whose own P, dS and operands are read where it
casts them (``reference_intermediates``).

The reference's backward starts from the kernel's saved O and LSE (``tiled.backward`` on a
``ForwardResult`` of them), so that both sides see the same saved state and the P of the
backward agree code for code. Every test body runs on the GPU (marked ``gpu``; the reference
with the Hopper wgmma model) and in Triton's interpreter on the CPU at small sizes (float32
matmuls on both sides; see conftest). The interpreter's FP8 casts are made exact by the kernels'
own rounding helper, so codes are compared there too.
"""

from __future__ import annotations

import math

import pytest
import torch

from dmref import reference, tiled
from dmref.emulation import decode, encode
from dmref.kernels.config import BwdTiles

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
from kernel_inputs import Case, backend_params, outlier_inputs, require_backend
from reference_intermediates import flat, tap

#: dS in 1x32 blocks (MX-32 extents) and kbar tiles of 32 keys: the smallest backward tiles
_SMALL_BWD = BwdTiles(32, 64, 64, 32, 4, 1, 4, 1)
#: dS in 1x128 blocks, as the reference presets quantize it
_REFERENCE_BWD = BwdTiles(128, 64, 64, 128, 8, 1, 8, 1)

#: Awkward sequence lengths (tails in every tile size), GQA, both head dims, both recipes.
CASES = {
    "interpreter": [
        Case(1, 2, 1, 203, 64, False, "kernels_naive_fp8"),
        Case(1, 2, 1, 203, 64, True, "kernels_naive_fp8"),
        Case(1, 2, 1, 203, 64, False, "kernels_delta_matching"),
        Case(1, 2, 1, 203, 64, True, "kernels_delta_matching"),
        Case(1, 1, 1, 130, 128, True, "kernels_delta_matching"),
        Case(1, 2, 2, 113, 64, True, "kernels_delta_matching", _SMALL_BWD),
        # P scaled by 2**6 instead of the recipe's 2**8 in both passes: the kernels read it from the spec
        Case(1, 2, 1, 203, 64, True, "kernels_delta_matching", p_scale_log2=6),
    ],
    "gpu": [
        Case(2, 4, 2, 1000, 128, False, "kernels_naive_fp8"),
        Case(2, 4, 2, 1000, 128, True, "kernels_naive_fp8"),
        Case(2, 4, 2, 1000, 128, False, "kernels_delta_matching"),
        Case(2, 4, 2, 1000, 128, True, "kernels_delta_matching"),
        Case(1, 4, 4, 777, 64, True, "kernels_delta_matching"),
        Case(1, 4, 1, 777, 64, False, "kernels_naive_fp8"),
        Case(1, 4, 2, 333, 64, True, "kernels_delta_matching", _SMALL_BWD),
        Case(1, 2, 2, 700, 128, True, "kernels_delta_matching", _REFERENCE_BWD),
        Case(2, 4, 2, 1000, 128, True, "kernels_naive_fp8", p_scale_log2=6),
    ],
}


_RUNS: dict = {}


def _expand(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, HKV, N, D) -> (B, H, N, D): query head h reads key/value head h // (H // HKV)."""
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def _reference(q, k, v, do, case: Case, rr, *, o, lse2, p_fwd=None):
    """The reference's forward (P replaced by the dumped ``p_fwd`` codes where given) and its
    backward from the saved ``o`` and ``lse2`` (the kernel's), with their intermediates."""
    scale = 1.0 / math.sqrt(case.head_dim)
    qf, kf, vf, dof = (t.float() for t in (q, k, v, do))
    sub = None
    if p_fwd is not None:
        p_scale = 2.0 ** rr.p_fwd.offset_log2
        codes = p_fwd.view(case.batch, case.heads, case.n, case.n)
        sub = {("forward", "p"): lambda c: decode(codes[..., c.i0:, c.j0:c.j1], rr.p.fmt).to(c.x.device) / p_scale}
    with tap(sub) as ft:
        fwd = tiled.forward(qf, kf, vf, recipe=rr, causal=case.causal, scale=scale)
    if p_fwd is not None:
        return dict(o=fwd.out)
    state = tiled.ForwardResult(o.float(), tiled.SoftmaxStats(fwd.stats.ref, fwd.stats.l, lse2.view_as(fwd.stats.lse2)))
    with tap() as bt:
        bwd = tiled.backward(qf, kf, vf, state, dof, recipe=rr, causal=case.causal, scale=scale, diagnostics=True)
    n, h = case.n, case.heads
    ops = {name: bt.operand("_backward_operands", name).out.double() for name in ("q", "k", "do_dp", "v_dp", "k_dq")}
    q_hat, k_hat, do_hat, v_hat = ops["q"], _expand(ops["k"], h), ops["do_dp"], _expand(ops["v_dp"], h)
    k_dq = _expand(ops["k_dq"], h).abs()
    c = scale * math.log2(math.e)
    p_dv = bt.assemble("backward", "p_dv", n)
    ds_dq = bt.assemble("backward", "ds_dq", n).double()
    out = dict(
        o=fwd.out, lse2=flat(fwd.stats.lse2),
        p_fwd=encode(flat(ft.assemble("forward", "p", n)) * 2.0 ** rr.p_fwd.offset_log2, rr.p.fmt, saturate=True),
        p_codes=encode(flat(p_dv) * 2.0 ** rr.p_bwd.offset_log2, rr.p_dv.fmt, saturate=True),
        ds_dk=flat(bt.assemble("backward", "ds_dk", n)),
        p=flat(bt.assemble("backward", "p_dv", n, value="x")),
        dp=flat((do_hat @ v_hat.transpose(-1, -2)).float()),
        s2_abs=flat((q_hat.abs() @ k_hat.abs().transpose(-1, -2) * c).float()),
        dp_abs=flat((do_hat.abs() @ v_hat.abs().transpose(-1, -2)).float()),
        dq=bwd.dq, dk=bwd.dk, dv=bwd.dv,
        dq_abs=(ds_dq.abs() @ k_dq * scale).float(),
    )
    if rr.delta.deferred_dq is not None:
        # the scale of kbar's float16 roundings: sum_j Q_kbar(P_ij) |K_j| (the kbar P as the reference casts it)
        out["kbar_abs"] = (bt.assemble("accumulate", "p", n).double() @ k_dq).float()
    return out


def run_case(backend: str, case: Case) -> dict:
    """Kernel (with debug outputs), reference and float64 attention on the same inputs; cached."""
    key = (backend, case)
    if key in _RUNS:
        return _RUNS[key]
    device = require_backend(backend)  # before importing the kernels: it skips without triton
    from dmref.kernels import api

    q, k, v, do = outlier_inputs(case, device)
    spec = case.spec()
    rr = spec.reference_recipe("hopper" if backend == "gpu" else "fp32")
    scale = 1.0 / math.sqrt(case.head_dim)
    o, lse, saved, fdbg = api.attention_forward(q, k, v, causal=case.causal, scale=scale,
                                                recipe=spec, debug=True)
    dq, dk, dv, bdbg = api.attention_backward(saved, o, do, shape=api.Shape.of(q, k, v),
                                              causal=case.causal, scale=scale, recipe=spec,
                                              debug=True)
    ref = _reference(q, k, v, do, case, rr, o=o, lse2=saved.lse2)
    n_tiles = -(-case.n // spec.bwd_tiles(case.head_dim).block_n2)
    if "kbar_abs" in ref:
        d_stale = (o.float() * do.float()).sum(-1).flatten(0, 1)
        corr = (bdbg["delta"] - d_stale).abs().view(case.batch, case.heads, case.n, 1)
        ref["dq_corr_abs"] = corr * ref["kbar_abs"] * scale
    else:
        ref["dq_corr_abs"] = torch.zeros_like(ref["dq_abs"])
    ref["kbar_roundings"] = 2 * n_tiles
    ex = reference.attention_ref(*(t.double() for t in (q, k, v, do)), causal=case.causal, scale=scale)
    exact = dict(o=ex[0], dq=ex[2], dk=ex[3], dv=ex[4])
    out = dict(kernel=dict(o=o, lse2=saved.lse2, p_fwd=fdbg["p_codes"], dq=dq, dk=dk, dv=dv, **bdbg),
               ref=ref, exact=exact, inputs=(q, k, v, do), recipe=rr)
    _RUNS[key] = out
    return out


def _cases(matched: bool | None = None):
    """(backend, case) parameters of :data:`CASES` (of one delta where ``matched`` is given)."""
    return backend_params(CASES, None if matched is None else (lambda c: c.matched == matched))


def _code_report(kc: torch.Tensor, mc: torch.Tensor, valid: torch.Tensor) -> str:
    """Where and how far kernel and reference codes differ (for a failure message)."""
    kv, mv = decode(kc, "e4m3").double(), decode(mc, "e4m3").double()
    diff = (kc != mc) & valid
    rel = ((kv - mv).abs() / mv.abs().clamp_min(2.0**-9))[diff]
    cols = diff.double().mean(dim=(0, 1))
    rows = diff.double().mean(dim=(0, 2))
    by_col = [round(cols[i::128].mean().item(), 3) for i in range(0, 128, 16)]
    by_row = [round(rows[i::64].mean().item(), 3) for i in range(0, 64, 8)]
    return (f"kernel>reference {((kv > mv) & diff).double().sum().item():.0f}, "
            f"kernel<reference {((kv < mv) & diff).double().sum().item():.0f}, rel diff median "
            f"{rel.median().item() if rel.numel() else 0:.3g} max {rel.max().item() if rel.numel() else 0:.3g}; "
            f"mismatch rate by column mod 128 (every 16th) {by_col}, by row mod 64 {by_row}; "
            f"zero codes kernel {(kc[valid] & 0x7F == 0).double().mean().item():.3f} "
            f"reference {(mc[valid] & 0x7F == 0).double().mean().item():.3f}")


def _valid(case: Case, device) -> torch.Tensor:
    i = torch.arange(case.n, device=device)
    return (i[:, None] >= i[None, :]) if case.causal else torch.ones(case.n, case.n, dtype=torch.bool, device=device)


def _kernel_ds_dk(case: Case, kern: dict) -> torch.Tensor:
    """The dkdv kernel's dS as its dK matmul sees it: codes times their dequantization factor
    (one per key and ``block_m1`` queries), (B*H, N, N)."""
    block_m1 = case.spec().bwd_tiles(case.head_dim).block_m1
    scale = kern["ds_scale"].repeat_interleave(block_m1, dim=1)[:, :case.n, :]
    return decode(kern["ds_codes"].view(torch.uint8), "e4m3") * scale


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["interpreter", pytest.param("gpu", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("n,head_dim", [(203, 64), (130, 128)])
def test_quantize_kernel_codes_and_scales_equal_the_emulation(backend, fmt, n, head_dim):
    """The fused quantization kernel's copies are ``dmref.emulation.quantize_blocked``'s: the row
    copy one POW2_DOWN scale per token (a row), the transposed copy one per channel and 128 tokens."""
    device = require_backend(backend)  # before importing the kernels: it skips without triton
    from dmref.emulation import Block, ScaleRule, quantize_blocked
    from dmref.kernels.config import QUANT_BLOCK
    from dmref.kernels.quantize import quantize

    case = Case(1, 2, 2, n, head_dim)
    x, _, _, o = outlier_inputs(case, device)
    got, delta = quantize(x, fmt, rows=True, cols=True, delta_with=o)
    xf = x.reshape(2, n, head_dim).float()
    rows, row_inv = quantize_blocked(xf, fmt, block=Block.rows(), scale_rule=ScaleRule.POW2_DOWN)
    npad = -(-n // QUANT_BLOCK) * QUANT_BLOCK
    xp = torch.nn.functional.pad(xf, (0, 0, 0, npad - n))
    cols, col_inv = quantize_blocked(xp, fmt, block=Block.tile(QUANT_BLOCK, 1), scale_rule=ScaleRule.POW2_DOWN)
    assert torch.equal(got.rows.view(torch.uint8), rows)
    assert torch.equal(got.row_scale, row_inv.reshape(2, n))
    assert torch.equal(got.cols.view(torch.uint8), cols.transpose(1, 2))
    assert torch.equal(got.col_scale, col_inv.float())
    # the preprocess's stale delta: a float32 dot over the head dim
    of = o.reshape(2, n, head_dim).float()
    exact = (of.double() * xf.double()).sum(-1)
    bound = gamma(head_dim) * (of.double() * xf.double()).abs().sum(-1)
    assert ((delta.double() - exact).abs() <= bound).all()


def _check_codes(backend, case, names):
    require_backend(backend)
    r = run_case(backend, case)
    kern, ref = r["kernel"], r["ref"]
    valid = _valid(case, kern["o"].device).expand_as(ref["p_fwd"])
    agree = {name: (kern[name].view(torch.uint8) == ref[name])[valid].double().mean().item()
             for name in names if name != "ds_dk"}
    if "ds_dk" in names:
        # dS as each dK matmul sees it: codes and scales agree where these values do
        agree["ds_dk"] = (_kernel_ds_dk(case, kern) == ref["ds_dk"])[valid].double().mean().item()
    for name, a in agree.items():
        report = "" if name == "ds_dk" else _code_report(kern[name].view(torch.uint8), ref[name], valid)
        assert a >= CODE_AGREEMENT, f"{name}: {agree} of codes agree; " + report
    # outside the mask every code is +-0 (0 * negative is -0, code 0x80)
    for name in names:
        codes = kern["ds_codes" if name == "ds_dk" else name]
        assert (codes[~valid] & 0x7F == 0).all()


@pytest.mark.parametrize("backend,case", _cases())
def test_ds_as_dk_sees_it_agrees_with_reference(backend, case):
    _check_codes(backend, case, ("ds_dk",))


@pytest.mark.parametrize("backend,case", _cases())
def test_p_codes_agree_with_reference(backend, case):
    _check_codes(backend, case, ("p_fwd", "p_codes"))


#: Logits far beyond 2**24, where a float32 ulp of S2 exceeds 1: P = exp2(S2 - m) follows the
#: recipe only if S2 = fl(S * scale) is rounded before m or LSE is subtracted. A fused
#: multiply-add there leaves exp2(rounding error of S2) in place of P = 1 at a row's maximum.
LARGE_LOGIT_CASES = [
    pytest.param("interpreter", Case(1, 2, 1, 150, 64, True, "kernels_delta_matching", logit_log2=26),
                 id="interpreter-logits2^26"),
    pytest.param("gpu", Case(1, 4, 2, 700, 128, False, "kernels_delta_matching", logit_log2=26),
                 id="gpu-d128-logits2^26", marks=pytest.mark.gpu),
    pytest.param("gpu", Case(1, 4, 4, 513, 64, True, "kernels_naive_fp8", logit_log2=28),
                 id="gpu-d64-causal-logits2^28", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("backend,case", LARGE_LOGIT_CASES)
def test_codes_and_output_agree_with_reference_at_large_logits(backend, case):
    _check_codes(backend, case, ("p_fwd", "p_codes", "ds_dk"))
    r = run_case(backend, case)
    kern, ref = r["kernel"], r["ref"]
    # at such logits a row has a handful of nonzero P codes, P = 1 at its maximum among them:
    # the agreement that matters is on those
    valid = _valid(case, kern["o"].device).expand_as(ref["p_fwd"])
    for name in ("p_fwd", "p_codes"):
        kc, mc = kern[name].view(torch.uint8), ref[name]
        active = valid & (mc & 0x7F != 0)
        agree = (kc == mc)[active].double().mean().item()
        assert agree >= CODE_AGREEMENT, f"{name}: {agree:.4f} of the nonzero codes agree"
    recipe_error = rel_err(ref["o"], r["exact"]["o"])
    diff = rel_err(kern["o"].float(), ref["o"])
    assert diff <= RECIPE_NOISE_FRACTION * recipe_error, (
        f"o: kernel vs reference {diff:.3e}, reference vs float64 {recipe_error:.3e}")


#: FP8 wgmma truncates each k-step's terms to 13 fraction bits relative to the step's largest
#: (docs/gemm.md): a chain's result is within 2 * 2**-13 of its sum of |terms|.
WGMMA_TRUNCATION_REL = 2 * 2.0**-13


@pytest.mark.parametrize("backend,case", _cases())
def test_output_recomputed_from_dumped_p_codes_equals_kernel_output(backend, case):
    """The P codes the forward dumps are the ones its P V matmul consumed: the reference's
    forward with its P replaced by the dump equals the kernel's O up to the BF16 rounding of O
    and the wgmma truncation of P V: this test tells a wrong dump from a wrong P."""
    require_backend(backend)
    r = run_case(backend, case)
    kern = r["kernel"]
    q, k, v, do = r["inputs"]
    o_dump = _reference(q, k, v, do, case, r["recipe"], o=None, lse2=None, p_fwd=kern["p_fwd"])["o"]
    tol = 2.0**-8 + (WGMMA_TRUNCATION_REL if backend == "gpu" else 0.0)
    assert rel_err(kern["o"].float(), o_dump) <= tol


@pytest.mark.parametrize("backend,case", _cases())
def test_outputs_and_gradients_match_reference_within_recipe_noise(backend, case):
    require_backend(backend)
    r = run_case(backend, case)
    kern, ref, exact = r["kernel"], r["ref"], r["exact"]
    for name in ("o", "dq", "dk", "dv"):
        recipe_error = rel_err(ref[name], exact[name])
        diff = rel_err(kern[name].float(), ref[name])
        assert diff <= RECIPE_NOISE_FRACTION * recipe_error, (
            f"{name}: kernel vs reference {diff:.3e}, reference vs float64 {recipe_error:.3e}")
        if backend == "interpreter":
            # float32 accumulation on both sides, and every code agrees: the kernel's BF16
            # outputs are the reference's values rounded to BF16 (O: the reference's own BF16
            # point), up to one BF16 ulp where the float32 values straddle a rounding boundary,
            # plus, for dQ, what another order of the float32 sum of dS K (2 gamma_N of its
            # |terms|) and of kbar's float16 roundings can move
            allowed = bf16_ulp(ref[name])
            if name == "dq":
                allowed = allowed + 2 * gamma(case.n) * ref["dq_abs"] + \
                    2 * gamma(ref["kbar_roundings"], U_FP16) * ref["dq_corr_abs"]
            excess = ((kern[name].float() - ref[name]).abs() - allowed).max().item()
            assert excess <= 0, f"{name}: kernel and reference differ by more than one BF16 ulp ({excess:.3e} beyond)"
    # LSE: the same float32 online softmax, up to exp2/log2 rounding and accumulation order
    lse_tol = gamma(case.n + 4) * ref["lse2"].abs().max().item() + 2 * gamma(case.head_dim) * \
        ref["s2_abs"].abs().max().item()
    assert (kern["lse2"] - ref["lse2"]).abs().max().item() <= lse_tol


def _rowsum_bound(backend: str, case: Case):
    """(the run, the Delta-Matching bound on |sum_j dS_ij| for the kernel's delta and the
    reference's P and dP)."""
    require_backend(backend)
    r = run_case(backend, case)
    ref = r["ref"]
    bound = delta_matching_rowsum_bound(
        ref["p"], ref["dp"], r["kernel"]["delta"], s2_abs=ref["s2_abs"], dp_abs=ref["dp_abs"],
        head_dim=case.head_dim, recompute_unit=0.0 if backend == "gpu" else U32)
    return r, bound


@pytest.mark.parametrize("backend,case", _cases(matched=True))
def test_matched_delta_ds_rowsums_within_delta_matching_bound(backend, case):
    r, bound = _rowsum_bound(backend, case)
    kern = r["kernel"]
    for name in ("ds_rowsum", "dq_ds_rowsum"):
        excess = (kern[name].double().abs() - bound).max().item()
        assert excess <= 0, f"{name} exceeds the Delta-Matching bound by {excess:.3e}"


@pytest.mark.parametrize("backend,case", _cases(matched=False))
def test_stale_delta_ds_rowsums_visibly_outside_delta_matching_bound(backend, case):
    r, bound = _rowsum_bound(backend, case)
    kern, ref = r["kernel"], r["ref"]
    outside = (kern["ds_rowsum"].double().abs() > bound).double().mean().item()
    # "visibly": most rows, not a rounding accident
    assert outside > 0.5, f"only {outside:.3f} of stale rows exceed the bound"
    # and they are what dmref/proofs/stale_delta.md says: sum_j P (dP - D_stale) = (D_matched - D_stale) sum_j P
    matched = (ref["p"].double() * ref["dp"].double()).sum(-1) / ref["p"].double().sum(-1)
    predicted = (matched - kern["delta"].double()) * ref["p"].double().sum(-1)
    assert rel_err(kern["ds_rowsum"], predicted) <= RECIPE_NOISE_FRACTION


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["interpreter", pytest.param("gpu", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("recipe", ["kernels_delta_matching", "kernels_naive_fp8"])
def test_autograd_function_gives_the_backward_kernels_gradients(backend, recipe):
    require_backend(backend)
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
def test_wgmma_emulation_equals_triton_fp8_dot_at_kernel_tile_shapes(m, num_warps):
    """The emulation's wgmma arithmetic (``dmref.emulation.gemm``, the reference's Hopper model) is
    what tl.dot does at the kernels' tile shapes."""
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
    from dmref.emulation import gemm

    ref = gemm.matmul(a.float().cpu(), b.float().cpu(), fa="e4m3", fb="e4m3", model="hopper").to(c.device)  # a b^T
    assert torch.equal(c.view(torch.int32), ref.view(torch.int32))


@pytest.mark.parametrize("backend", ["interpreter", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_kernel_fp8_cast_equals_emulation_cast_at_every_rounding_boundary(backend):
    """``_common.to_fp8`` (``cvt.rn.satfinite`` on the GPU) is the emulation's RNE satfinite cast
    (``dmref.emulation.encode``) on every E4M3 value, every midpoint between neighbours (ties to
    even), the float32 numbers either side of each midpoint, and past the largest finite value:
    the debug dumps hold the float32 values the cast received and are cast on the host.

    The emulation's cast is ``encode``'s, which checks torch's own e4m3fn cast before using it:
    torch 2.11's maps overflow past 464 to NaN where the hardware saturates
    (tests/emulation/test_cast.py)."""
    require_backend(backend)
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
                           f"{x[bad].tolist()}, kernel {y.cpu()[bad].tolist()}, emulation {want[bad].tolist()}")
