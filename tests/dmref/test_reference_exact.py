"""The exact float64 reference: against torch.autograd, masking, bad input."""

from __future__ import annotations

import math

import pytest
import torch
from dmref_problems import attention_shapes, make_inputs, masks
from hypothesis import given, settings
from hypothesis import strategies as st

from dmref import reference
from dmref.diagnostics import U_FP64, attention_error_bound


def autograd_attention(q, k, v, dout, *, causal, scale, mask):
    """Plain softmax attention in float64, differentiated by torch.autograd. Fully masked rows
    are given zero probabilities (softmax of an all -inf row is NaN)."""
    q, k, v = (t.detach().to(torch.float64).requires_grad_() for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    kx, vx = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    s = scale * (q @ kx.transpose(-1, -2))
    if mask is not None and mask.dtype != torch.bool:
        s = s + mask
    keep = reference.keep_mask(q.shape[2], k.shape[2], causal=causal,
                               mask=mask if mask is not None and mask.dtype == torch.bool else None)
    if keep is not None:
        s = s.masked_fill(~keep, -math.inf)
    dead = (s == -math.inf).all(dim=-1, keepdim=True)
    p = torch.softmax(torch.where(dead, torch.zeros_like(s), s), dim=-1)
    p = torch.where(dead, torch.zeros_like(p), p)
    out = p @ vx
    out.backward(dout.to(torch.float64))
    lse = torch.logsumexp(s, dim=-1)
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def assert_within(name, x, y, bound):
    assert not torch.isnan(x).any() and not torch.isnan(y).any(), f"{name}: NaN"
    excess = (x - y).abs() - bound
    assert bool((excess <= 0).all()), (
        f"{name}: |difference| exceeds the derived bound by {excess.max().item():.3g} "
        f"(largest difference {(x - y).abs().max().item():.3g})"
    )


@settings(max_examples=40)
@given(shape=attention_shapes(), causal=st.booleans(), data=st.data(),
       scale=st.one_of(st.none(), st.floats(0.05, 2.0)), seed=st.integers(0, 2**31 - 1))
def test_reference_gradients_equal_autograd_within_float64_bound(shape, causal, data, scale, seed):
    q, k, v, dout = make_inputs(shape, seed)
    mask = data.draw(masks(shape))
    kw = dict(causal=causal, scale=scale, mask=mask)
    out, lse, dq, dk, dv = reference.attention_ref(q, k, v, dout, **kw)
    a_out, a_lse, a_dq, a_dk, a_dv = autograd_attention(
        q, k, v, dout, scale=reference.check_attention_inputs(q, k, v, scale=scale).scale,
        causal=causal, mask=mask)
    # both compute the same function in float64; each is within the bound of exact arithmetic
    bound = attention_error_bound(q, k, v, dout, u=U_FP64, **kw)
    assert_within("out", out, a_out, 2 * bound["out"])
    assert_within("dq", dq, a_dq, 2 * bound["dq"])
    assert_within("dk", dk, a_dk, 2 * bound["dk"])
    assert_within("dv", dv, a_dv, 2 * bound["dv"])
    finite = torch.isfinite(a_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert_within("lse", lse[finite], a_lse[finite], 2 * bound["lse"][finite])


def test_fully_masked_rows_give_zero_output_and_zero_gradients():
    shape = dict(batch=1, heads=2, kv_heads=1, seqlen_q=9, seqlen_k=5, head_dim=4, head_dim_v=3)
    q, k, v, dout = make_inputs(shape, 1)
    mask = torch.ones(1, 2, 9, 5, dtype=torch.bool)
    mask[0, 1, 7] = False  # row 7 of head 1: fully masked by the boolean mask
    # causal with Nq > Nk: query i sees keys j <= i - 4, so rows 0..3 see nothing
    out, lse, dq, dk, dv = reference.attention_ref(q, k, v, dout, causal=True, mask=mask)
    dead = torch.zeros(1, 2, 9, dtype=torch.bool)
    dead[..., :4] = True
    dead[0, 1, 7] = True
    for t in (out, lse, dq, dk, dv):
        assert not torch.isnan(t).any()
    assert bool((out[dead] == 0).all()) and bool((dq[dead] == 0).all())
    assert bool((lse[dead] == -math.inf).all()) and bool(torch.isfinite(lse[~dead]).all())
    # the dead rows contribute nothing to dK, dV: removing their dout changes nothing
    dout2 = dout.clone()
    dout2[dead] = 0
    _, _, _, dk2, dv2 = reference.attention_ref(q, k, v, dout2, causal=True, mask=mask)
    assert torch.equal(dk, dk2) and torch.equal(dv, dv2)


def test_additive_mask_of_minus_inf_is_a_boolean_mask():
    shape = dict(batch=1, heads=1, kv_heads=1, seqlen_q=6, seqlen_k=7, head_dim=5, head_dim_v=5)
    q, k, v, dout = make_inputs(shape, 2)
    keep = torch.rand(6, 7, generator=torch.Generator().manual_seed(0)) < 0.6
    additive = torch.zeros(6, 7, dtype=torch.float64).masked_fill(~keep, -math.inf)
    a = reference.attention_ref(q, k, v, dout, mask=keep)
    b = reference.attention_ref(q, k, v, dout, mask=additive)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_nonfinite_inputs_propagate_as_documented():
    shape = dict(batch=1, heads=2, kv_heads=1, seqlen_q=6, seqlen_k=6, head_dim=4, head_dim_v=4)
    q, k, v, dout = make_inputs(shape, 3)
    clean, _ = reference.attention_forward(q, k, v)
    q_bad = q.clone()
    q_bad[0, 1, 2, 0] = math.nan
    out, _ = reference.attention_forward(q_bad, k, v)
    assert bool(torch.isnan(out[0, 1, 2]).all())
    others = torch.ones(6, dtype=torch.bool)
    others[2] = False
    assert torch.equal(out[0, 1, others], clean[0, 1, others]) and torch.equal(out[0, 0], clean[0, 0])
    # inf in a value row: every row of the group is NaN or inf, even where that key is masked
    v_bad = v.clone()
    v_bad[0, 0, 5, 1] = math.inf
    out, _ = reference.attention_forward(q, k, v_bad, causal=True)
    assert not bool(torch.isfinite(out[..., 1]).any())


_GOOD = dict(batch=1, heads=2, kv_heads=1, seqlen_q=4, seqlen_k=5, head_dim=3, head_dim_v=3)


def _bad_cases():
    q, k, v, dout = make_inputs(_GOOD, 0)
    yield "integer q", (q.long(), k, v), {}, TypeError, "float16, bfloat16"
    yield "3-d q", (q[0], k, v), {}, ValueError, "(batch, heads, seqlen, head_dim)"
    yield "mixed dtypes", (q.float(), k, v), {}, TypeError, "share one dtype"
    yield "head dims differ", (q, k[..., :2], v), {}, ValueError, "head_dim of q (3) and k (2)"
    yield "heads not a multiple", (torch.cat([q, q[:, :1]], 1), k.expand(1, 2, 5, 3), v.expand(1, 2, 5, 3)), {}, ValueError, "multiple of kv_heads"
    yield "k, v lengths differ", (q, k, v[:, :, :4]), {}, ValueError, "must agree"
    yield "batch differs", (q, torch.cat([k, k]), torch.cat([v, v])), {}, ValueError, "batch sizes differ"
    yield "empty", (q[:, :, :0], k, v), {}, ValueError, "empty dimension"
    yield "mask shape", (q, k, v), {"mask": torch.ones(4, 4, dtype=torch.bool)}, ValueError, "does not broadcast"
    yield "mask dtype", (q, k, v), {"mask": torch.ones(4, 5, dtype=torch.int32)}, TypeError, "mask must be bool"
    yield "scale zero", (q, k, v), {"scale": 0.0}, ValueError, "finite and positive"
    yield "scale nan", (q, k, v), {"scale": math.nan}, ValueError, "finite and positive"
    yield "scale inf", (q, k, v), {"scale": math.inf}, ValueError, "finite and positive"
    yield "scale string", (q, k, v), {"scale": "0.5"}, TypeError, "scale must be a float"
    yield "not a tensor", (q.numpy(), k, v), {}, TypeError, "torch.Tensor"


@pytest.mark.parametrize("case", list(_bad_cases()), ids=lambda c: c[0])
def test_bad_input_gets_a_clear_error(case):
    _, args, kwargs, error, words = case
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        reference.attention_forward(*args, **kwargs)


def test_dout_of_the_wrong_shape_is_rejected():
    q, k, v, dout = make_inputs(_GOOD, 0)
    out, lse = reference.attention_forward(q, k, v)
    with pytest.raises(ValueError, match="dout must have the output's shape"):
        reference.attention_backward(q, k, v, out, lse, dout[..., :2])
