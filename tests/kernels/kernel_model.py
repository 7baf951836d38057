"""A plain-torch model of exactly what dmref.kernels computes, quantization point by point.

Until the emulated reference (``dmref.tiled``) can be driven with a kernel's recipe, the kernel
tests compare against this model. It follows ``dmref.kernels.config.KernelRecipe``: the same
block scales (``ScaleRule.POW2_DOWN``, ``dmref.emulation.scales_from_amax``), the same casts (``dmref.emulation.encode`` with
RNE and saturation), the same running-max P in the forward, the same dS blocks and the same
deferred dQ correction. The two matmuls whose results are quantized again (QK^T, dO V^T) are
computed by ``dot``: ``exact_dot`` (float64 rounded once to float32) or ``hopper_dot`` (the
H200's FP8 wgmma accumulation, bit-exact on the shared H200 data); the others in float64. So the
model differs from the kernel only by accumulation in the outputs and ``exp2`` rounding.

Shapes: q ``(B, H, N, D)``, k and v ``(B, HKV, N, D)``; internal tensors are ``(B*H, ...)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dmref.emulation import ScaleRule, decode, encode, get_format, scales_from_amax
from dmref.kernels.config import QUANT_BLOCK, KernelRecipe

LOG2E = 1.4426950408889634


def exact_dot(a: torch.Tensor, b: torch.Tensor, **_formats) -> torch.Tensor:
    """a @ b of FP8 values (float32 tensors), exact in float64, rounded once to float32."""
    return (a.double() @ b.double()).float()


def pow2_scales(amax: torch.Tensor, fmt: str) -> torch.Tensor:
    """The kernels' dequantization factors 2**-k for block amaxes: the emulation's POW2_DOWN
    scales (``dmref.emulation.scales_from_amax``; 1 where amax == 0), float32."""
    return scales_from_amax(amax.float(), fmt, ScaleRule.POW2_DOWN).float()


def quantize_blocks(x: torch.Tensor, fmt: str, dim: int):
    """One scale per slice along ``dim`` (amax over ``dim``): codes and dequantization factors."""
    inv = pow2_scales(x.abs().amax(dim=dim, keepdim=True), fmt)
    codes = encode((x / inv).float(), fmt, saturate=True)
    return codes, inv


def rows(x: torch.Tensor, fmt: str):
    """Row copy of ``(BH, N, D)``: codes (BH, N, D) uint8, dequantization factors (BH, N)."""
    codes, inv = quantize_blocks(x, fmt, dim=-1)
    return codes, inv.squeeze(-1)


def cols(x: torch.Tensor, fmt: str):
    """Transposed copy: codes (BH, D, NPAD) uint8, dequantization factors (BH, NPAD/128, D)."""
    bh, n, d = x.shape
    npad = -(-n // QUANT_BLOCK) * QUANT_BLOCK
    xp = torch.nn.functional.pad(x, (0, 0, 0, npad - n)).view(bh, npad // QUANT_BLOCK, QUANT_BLOCK, d)
    codes, inv = quantize_blocks(xp, fmt, dim=2)
    return codes.view(bh, npad, d).transpose(1, 2).contiguous(), inv.squeeze(2)


def cols_dequantized(codes: torch.Tensor, inv: torch.Tensor, fmt: str, n: int) -> torch.Tensor:
    """(BH, N, D) float32 values of a transposed copy."""
    vals = decode(codes, fmt).transpose(1, 2)  # (BH, NPAD, D)
    return (vals * inv.repeat_interleave(QUANT_BLOCK, dim=1))[:, :n]


def _flat(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, HKV, N, D) -> (B*H, N, D), query head h reading key/value head h // (H // HKV)."""
    b, hkv, n, d = x.shape
    return x.repeat_interleave(heads // hkv, dim=1).reshape(b * heads, n, d).float()


def _mask(n: int, causal: bool, device) -> torch.Tensor:
    i = torch.arange(n, device=device)
    return (i[:, None] >= i[None, :]) if causal else torch.ones(n, n, dtype=torch.bool, device=device)


def _scores(q8, qs, k8, ks, scale: float, fmt: str, dot) -> torch.Tensor:
    """S2 = dot(Q8, K8^T) * (q_scale * tau * log2(e) * k_scale), as the kernels order it."""
    qk_scale = torch.tensor(scale * LOG2E, dtype=torch.float32)
    q_scale = qs * qk_scale
    s = dot(decode(q8, fmt), decode(k8, fmt).transpose(1, 2), fmt_a=fmt, fmt_b=fmt)
    return s * (q_scale[:, :, None] * ks[:, None, :])


def forward(q, k, v, *, causal: bool, scale: float, recipe: KernelRecipe, dot=exact_dot,
            p_codes_in: torch.Tensor | None = None):
    """O (B, H, N, D) float32, LSE2 (B*H, N) and the P codes (B*H, N, N) of the forward kernel.

    ``p_codes_in``: P codes to multiply into V instead of the model's own (e.g. a kernel's debug
    dump), everything else unchanged: O recomputed from them."""
    b, h, n, d = q.shape
    fmt = recipe.qkv_format
    q8, qs = rows(q.reshape(b * h, n, d).float(), fmt)
    k8, ks = rows(_flat(k, h), fmt)
    vt8, vts = cols(_flat(v, h), fmt)
    s2 = _scores(q8, qs, k8, ks, scale, fmt, dot)
    s2 = s2.masked_fill(~_mask(n, causal, q.device), float("-inf"))
    p_scale = float(2 ** recipe.p_scale_log2)
    m = torch.full((b * h, n), float("-inf"), device=q.device)
    l_ = torch.zeros((b * h, n), device=q.device)
    acc = torch.zeros((b * h, n, d), device=q.device)
    p_codes = torch.zeros((b * h, n, n), dtype=torch.uint8, device=q.device)
    bn = recipe.fwd.block_n
    for start in range(0, n, bn):
        sl = slice(start, min(start + bn, n))
        s = s2[:, :, sl]
        m_new = torch.maximum(m, s.amax(-1))
        m_sub = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
        p = torch.exp2(s - m_sub[..., None])
        alpha = torch.exp2(m - m_sub)
        l_ = l_ * alpha + p.sum(-1)
        # Q-point P: float32 -> E4M3, scale 2**8 against the running max, RNE, satfinite
        p8 = encode(p * p_scale, recipe.recipe.p.fmt.name, saturate=True)
        if p_codes_in is not None:
            p8 = p_codes_in[:, :, sl].to(p8.device)
        p_codes[:, :, sl] = p8
        vt = decode(vt8[:, :, sl], fmt).transpose(1, 2)  # (BH, tile, D)
        v_scale = vts[:, start // QUANT_BLOCK, :]
        acc = acc * alpha[..., None] + exact_dot(decode(p8, recipe.recipe.p.fmt.name), vt) * v_scale[:, None, :]
        m = m_new
    o = acc / (l_ * p_scale)[..., None]
    return o.view(b, h, n, d), m + torch.log2(l_), p_codes


def _quantize_ds(ds: torch.Tensor, fmt: str, along: int, block: int, other_block: int,
                 granularity: str):
    """Quantize dS (BH, N, N) in blocks of ``block`` elements along ``along`` (2: keys, 1:
    queries), with one scale per row of the other axis ("rowwise") or per whole tile ("tile", tile
    extent ``other_block`` along the other axis). Returns (codes, dequantization factors), both
    (BH, N, N)."""
    bh, n, _ = ds.shape
    npad = -(-n // QUANT_BLOCK) * QUANT_BLOCK
    x = torch.nn.functional.pad(ds, (0, npad - n, 0, npad - n))
    if along == 1:
        x = x.transpose(1, 2)  # blocks along the last axis
    xb = x.reshape(bh, npad, npad // block, block)
    amax = xb.abs().amax(-1, keepdim=True)  # per row of the other axis
    if granularity == "tile":
        ob = other_block
        amax = amax.view(bh, npad // ob, ob, npad // block, 1).amax(2, keepdim=True)
        amax = amax.expand(bh, npad // ob, ob, npad // block, 1).reshape(bh, npad, npad // block, 1)
    inv = pow2_scales(amax, fmt)
    codes = encode((xb / inv).float(), fmt, saturate=True)
    inv = inv.expand_as(xb)
    codes, inv = codes.reshape(bh, npad, npad), inv.reshape(bh, npad, npad)
    if along == 1:
        codes, inv = codes.transpose(1, 2), inv.transpose(1, 2)
    return codes[:, :n, :n].contiguous(), inv[:, :n, :n].contiguous()


def backward(q, k, v, o, lse2, do, *, causal: bool, scale: float, recipe: KernelRecipe,
             dot=exact_dot):
    """Gradients and the debug quantities of the backward kernels (see ``bwd.backward``)."""
    b, h, n, d = q.shape
    hkv = k.shape[1]
    fmt, dfmt, pf, sf = recipe.qkv_format, recipe.do_format, recipe.recipe.p.fmt.name, recipe.recipe.ds_dq.fmt.name
    dev = q.device
    qf = q.reshape(b * h, n, d).float()
    dof = do.reshape(b * h, n, d).float()
    q8, qs = rows(qf, fmt)
    k8, ks = rows(_flat(k, h), fmt)
    v8, vs = rows(_flat(v, h), fmt)
    do8, dos = rows(dof, dfmt)
    q_t = cols_dequantized(*cols(qf, fmt), fmt, n)
    k_t = cols_dequantized(*cols(_flat(k, h), fmt), fmt, n)
    do_t = cols_dequantized(*cols(dof, dfmt), dfmt, n)
    mask = _mask(n, causal, dev)
    # recompute: in the forward this was S2 against the running max; now P against LSE
    s2 = _scores(q8, qs, k8, ks, scale, fmt, dot)
    p = torch.where(mask, torch.exp2(s2 - lse2[..., None]), torch.zeros((), device=dev))
    dp = dot(decode(do8, dfmt), decode(v8, fmt).transpose(1, 2), fmt_a=dfmt, fmt_b=fmt)
    dp = dp * (dos[:, :, None] * vs[:, None, :])
    # delta step
    d_stale = (o.reshape(b * h, n, d).float() * dof).sum(-1)
    d_matched = (p.double() * dp.double()).sum(-1).float()
    delta = d_matched if recipe.delta == "matched" else d_stale
    p_scale = float(2 ** recipe.p_scale_log2)
    p8 = encode(p * p_scale, pf, saturate=True)
    p_deq = decode(p8, pf) / p_scale
    # dkdv side: dS = P (dP - D), quantized along queries (the dK contraction)
    ds = p * (dp - delta[..., None])
    t = recipe.bwd_tiles(d)
    ds_codes, ds_inv = _quantize_ds(ds, sf, along=1, block=t.block_m1, other_block=t.block_n1,
                                    granularity=recipe.ds_granularity)
    ds_deq = decode(ds_codes, sf) * ds_inv
    dv = exact_dot(p_deq.transpose(1, 2), do_t)
    dk = exact_dot(ds_deq.transpose(1, 2), q_t) * scale
    # dq side: dS with the stale delta as predictor, quantized along keys (the dQ contraction)
    ds_q = p * (dp - d_stale[..., None])
    dsq_codes, dsq_inv = _quantize_ds(ds_q, sf, along=2, block=t.block_n2, other_block=t.block_m2,
                                      granularity=recipe.ds_granularity)
    dq = exact_dot(decode(dsq_codes, sf) * dsq_inv, k_t)
    # scales of the two accumulations that kernel and model order differently: the float32 sum
    # of dS K (abs terms) and, matched, the float16 roundings of kbar (abs terms times |D - D_stale|)
    dq_abs = exact_dot((decode(dsq_codes, sf) * dsq_inv).abs(), k_t.abs()) * scale
    dq_corr_abs = torch.zeros_like(dq_abs)
    if recipe.delta == "matched":
        dq_corr_abs = (d_matched - d_stale).abs()[..., None] * kbar(p, k, h, recipe, t.block_n2, absolute=True) * scale
        # deferred correction: dQ -= (D - D_stale) * kbar (second order, float16)
        dq = dq - (d_matched - d_stale)[..., None] * kbar(p, k, h, recipe, t.block_n2)
    dq = dq * scale
    group = h // hkv
    # absolute values of the two recomputed dots, for the recompute terms of the row-sum bound
    qk_scale = torch.tensor(scale * LOG2E, dtype=torch.float32)
    s2_abs = (decode(q8, fmt).abs().double() @ decode(k8, fmt).abs().double().transpose(1, 2)).float() * (
        (qs * qk_scale)[:, :, None] * ks[:, None, :])
    dp_abs = (decode(do8, dfmt).abs().double() @ decode(v8, fmt).abs().double().transpose(1, 2)).float() * (
        dos[:, :, None] * vs[:, None, :])
    return {
        "s2_abs": s2_abs,
        "dp_abs": dp_abs,
        "dq": dq.view(b, h, n, d),
        "dq_abs": dq_abs.view(b, h, n, d),
        "dq_corr_abs": dq_corr_abs.view(b, h, n, d),
        "kbar_roundings": 2 * -(-n // t.block_n2),
        "dk": dk.view(b, hkv, group, n, d).sum(2),
        "dv": dv.view(b, hkv, group, n, d).sum(2),
        "delta": delta,
        "d_stale": d_stale,
        "p": p,
        "dp": dp,
        "ds_rowsum": ds.double().sum(-1).float(),
        "p_codes": p8,
        "ds_codes": ds_codes,
        "ds_scale": ds_inv,
    }


def kbar(p: torch.Tensor, k: torch.Tensor, heads: int, recipe: KernelRecipe, block_n: int,
         absolute: bool = False):
    """kbar_i = sum_j deq(Q8(2**4 P_ij)) K_j / 2**4 as the dq kernel forms it: per key tile a
    float16 chain over the K codes (modelled as the exact sum rounded to float16), scaled to
    units u of the head's largest K scale in float32, added to a float16 accumulator, times u
    at the end. (BH, N, D) float32. With ``absolute``: sum_j deq(Q8(2**4 P_ij)) |K_j| / 2**4,
    unrounded (the scale of kbar's float16 roundings)."""
    from dmref.kernels.config import KBAR_P_SCALE_LOG2

    fmt, pf = recipe.qkv_format, recipe.recipe.p.fmt.name
    kbar_scale = float(2**KBAR_P_SCALE_LOG2)
    p8 = decode(encode(p * kbar_scale, pf, saturate=True), pf).double()
    kt_codes, kt_inv = cols(_flat(k, heads), fmt)  # (BH, D, NPAD), (BH, NPAD / 128, D)
    kt = decode(kt_codes, fmt).double().transpose(1, 2)  # (BH, NPAD, D) codes' values
    n = p.shape[-1]
    if absolute:
        k_abs = kt[:, :n].abs() * kt_inv.repeat_interleave(QUANT_BLOCK, dim=1)[:, :n].double()
        return (p8 @ k_abs).float() / kbar_scale
    unit = kt_inv.amax(dim=(1, 2))[:, None, None]  # (BH, 1, 1): the head's largest block scale
    acc = torch.zeros(p.shape[0], p.shape[1], kt.shape[-1], dtype=torch.float16, device=p.device)
    for j0 in range(0, n, block_n):
        j1 = min(j0 + block_n, n)
        part = (p8[:, :, j0:j1] @ kt[:, j0:j1]).to(torch.float16).float()
        scale = kt_inv[:, j0 // QUANT_BLOCK, :][:, None, :] / unit * (1.0 / kbar_scale)
        acc = (acc.float() + part * scale).to(torch.float16)
    return acc.float() * unit


def exact_attention(q, k, v, do, *, causal: bool, scale: float):
    """float64 attention of the BF16 inputs and its gradients via autograd (GQA summed)."""
    h = q.shape[1]
    hkv = k.shape[1]
    q64 = q.double().requires_grad_()
    k64 = k.double().requires_grad_()
    v64 = v.double().requires_grad_()
    kk = k64.repeat_interleave(h // hkv, dim=1)
    vv = v64.repeat_interleave(h // hkv, dim=1)
    s = (q64 @ kk.transpose(-1, -2)) * scale
    n = q.shape[2]
    s = s.masked_fill(~_mask(n, causal, q.device), float("-inf"))
    o = torch.softmax(s, dim=-1) @ vv
    o.backward(do.double())
    return {"o": o.detach(), "dq": q64.grad, "dk": k64.grad, "dv": v64.grad}


def _floor_log2(x: torch.Tensor) -> torch.Tensor:
    """floor(log2 |x|) exactly (from frexp), for x != 0."""
    return torch.frexp(x)[1] - 1


def _exponent(x: torch.Tensor, emin: int) -> torch.Tensor:
    """The exponent a value is held with: floor(log2 |x|), but at least ``emin`` (subnormals
    keep the minimum exponent with a significand below 1); a large negative number for 0."""
    e = torch.maximum(_floor_log2(torch.where(x != 0, x, torch.ones_like(x))), torch.tensor(emin))
    return torch.where(x != 0, e, torch.full_like(e, -100000))


def hopper_dot(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None = None, *,
               fmt_a: str = "float8_e4m3fn", fmt_b: str = "float8_e4m3fn",
               rows_per_chunk: int = 64) -> torch.Tensor:
    """a @ b (+ c) as one Hopper FP8 wgmma chain with no promotion, the model of docs/gemm.md
    (``dmref.emulation.gemm``): per k-step of 32, the alignment exponent E is the largest of the products'
    unnormalised exponents (e_a + e_b) and the accumulator's; every term is truncated toward zero
    to 13 fractional bits relative to 2**E, the terms are added exactly and the sum is truncated
    toward zero to 14 significant bits. a: (..., M, K), b: (..., K, N), FP8 values as float32."""
    ea_min, eb_min = get_format(fmt_a).emin, get_format(fmt_b).emin
    a64, b64 = a.double(), b.double()
    ea, eb = _exponent(a64, ea_min), _exponent(b64, eb_min)
    kdim = a.shape[-1]
    out_shape = a.shape[:-1] + b.shape[-1:]
    acc = torch.zeros(out_shape, dtype=torch.float64, device=a.device) if c is None else c.double().clone()
    for r0 in range(0, a.shape[-2], rows_per_chunk):
        rs = slice(r0, r0 + rows_per_chunk)
        cacc = acc[..., rs, :]
        for k0 in range(0, kdim, 32):
            ks = slice(k0, k0 + 32)
            prod = a64[..., rs, ks, None] * b64[..., None, ks, :]  # (..., m, 32, N), exact
            e_prod = ea[..., rs, ks, None] + eb[..., None, ks, :]
            e_c = _exponent(cacc, -126)
            e_big = torch.maximum(e_prod.amax(dim=-2), e_c)  # (..., m, N)
            ulp = torch.exp2((e_big - 13).double())
            terms = torch.cat([prod, cacc[..., None, :]], dim=-2)
            s = (torch.trunc(terms / ulp[..., None, :]) * ulp[..., None, :]).sum(dim=-2)
            ulp_s = torch.exp2((_floor_log2(torch.where(s != 0, s, torch.ones_like(s))) - 13).double())
            cacc = torch.trunc(s / ulp_s) * ulp_s
        acc[..., rs, :] = cacc
    return acc.float()


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
    """A differential-test case: sizes, causal or not, and the recipe (by name) with its shipped
    tilings or ``tiles`` = (FwdTiles, BwdTiles, ds_granularity) replacing them."""

    causal: bool = False
    recipe: str = "delta_matching"
    tiles: tuple | None = None
    #: q and k scaled so that the logits reach about 2**logit_log2 (None: unscaled)
    logit_log2: int | None = None

    def recipe_obj(self) -> KernelRecipe:
        from dmref.kernels.config import RECIPES

        r = RECIPES[self.recipe]
        if self.tiles is not None:
            import dataclasses

            fwd, bwd, gran = self.tiles
            r = dataclasses.replace(r.with_tiles(fwd, bwd), ds_tile_scales=gran == "tile")
        return r

    def __str__(self) -> str:
        t = "" if self.tiles is None else "-smalltiles"
        t += "" if self.logit_log2 is None else f"-logits2^{self.logit_log2}"
        return (f"{self.recipe}-{'causal' if self.causal else 'full'}-b{self.batch}h{self.heads}"
                f"kv{self.kv_heads}n{self.n}d{self.head_dim}{t}")


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
