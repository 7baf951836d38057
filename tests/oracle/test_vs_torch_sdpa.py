"""The oracle against torch's scaled_dot_product_attention (math backend, CPU): a known answer
at the bounds of its input dtype, on every quick case (the boolean and additive masks and GQA
included)."""

from __future__ import annotations

import math

import pytest
import torch

from dmref import oracle


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sdpa_math_passes_at_its_input_dtypes_bounds(dtype):
    report = oracle.check(oracle.sdpa_math, cases=oracle.make_cases("quick", dtype=dtype), dtype=dtype)
    report.raise_for_failures()
    assert not report.skipped
    assert {"gqa", "additive_mask"} <= {c.name for c in report.cases}


# ----------------------------------------------------------------------------------------------
# torch's default CPU backend in BF16 (its flash-attention kernel): why it fails dV on peaked rows
# ----------------------------------------------------------------------------------------------


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(torch.float32)


def torch_cpu_flash_model(q, k, v, do, *, causal, scale, bf16_accumulation=True):
    """dK, dV as torch's CPU flash-attention backward computes them for BF16 inputs
    (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp): float32 matmuls on BF16 P and dS, and
    dK, dV accumulated directly in the BF16 gradient tensors: for every query head reading the
    key/value head (one, or the GQA group with ``enable_gqa``), for every block of queries (32 for
    fewer than 192 queries, 64 below 768, else 256), the running sum is rounded to BF16.
    ``bf16_accumulation=False``: the same sums in float32, rounded once (FlashAttention-2's
    numerics)."""
    q32, do32 = q.float(), do.float()
    groups = q.shape[1] // k.shape[1]
    k32, v32 = k.float().repeat_interleave(groups, 1), v.float().repeat_interleave(groups, 1)
    nq, nk = q.shape[-2], k.shape[-2]
    s = scale * q32 @ k32.transpose(-1, -2)
    if causal:
        s = s.masked_fill(~torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq), -math.inf)
    p = torch.softmax(s, dim=-1)
    out = _bf16(p @ v32)
    ds = p * (do32 @ v32.transpose(-1, -2) - (do32 * out).sum(-1, keepdim=True))
    p_b, ds_b = _bf16(p), _bf16(ds)
    block = 256 if nq >= 768 else 64 if nq >= 192 else 32
    dk, dv = torch.zeros_like(k.float()), torch.zeros_like(v.float())
    for h in range(q.shape[1]):
        j = h // groups
        for m in range(0, nq, block):
            rows = slice(m, m + block)
            dv[:, j] += p_b[:, h, rows].transpose(-1, -2) @ do32[:, h, rows]
            dk[:, j] += scale * ds_b[:, h, rows].transpose(-1, -2) @ q32[:, h, rows]
            if bf16_accumulation:
                dk[:, j], dv[:, j] = _bf16(dk[:, j]), _bf16(dv[:, j])
    return _bf16(dk), _bf16(dv)


@pytest.mark.slow
def test_torch_cpu_bf16_sdpa_rounds_dk_and_dv_to_bf16_after_every_block_of_queries():
    """The evidence behind docs/oracle.md's explanation: the model that rounds dV's running sum to
    BF16 after every block of queries of every query head reproduces torch's dV in almost every
    element, and its largest error exactly, with and without GQA; the same model accumulating in
    float32 (one rounding) does not, and has a smaller largest error."""
    from torch.nn.functional import scaled_dot_product_attention

    for case in oracle.make_cases("quick", names=["realistic", "peaked_rows", "more_queries", "gqa", "gqa_ratio_2"]):
        q, k, v = (t.clone().requires_grad_(True) for t in (case.q, case.k, case.v))
        scaled_dot_product_attention(q, k, v, is_causal=case.causal, scale=case.scale,
                                     **oracle.gqa_kwargs(q, k)).backward(case.dout)
        ex = oracle.exact_reference(case)
        dv_torch = v.grad.float()
        err_torch = oracle.max_value(oracle.elementwise_ratio((dv_torch.double() - ex.dv).abs(), ex.mags["dv"]))
        for bf16_acc in (True, False):
            _, dv = torch_cpu_flash_model(case.q, case.k, case.v, case.dout, causal=case.causal, scale=case.scale,
                                          bf16_accumulation=bf16_acc)
            same = (dv == dv_torch).double().mean().item()
            err = oracle.max_value(oracle.elementwise_ratio((dv.double() - ex.dv).abs(), ex.mags["dv"]))
            if bf16_acc:
                assert same > 0.97 and err == err_torch, (case.name, same, err, err_torch)
            else:
                assert same < 0.8 and err < err_torch, (case.name, same, err, err_torch)
