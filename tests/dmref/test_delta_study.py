"""The delta chosen for the five-GEMM backward (docs/delta_study.md): Delta-Matching's D from a
pre-pass of QKᵀ and dO Vᵀ, with the kernels' quantization and Hopper accumulation, keeps every
row sum of dS within the float32 bound on adversarial inputs; consistent P, whose D is known
before the backward, does not once dP is accumulated on FP8 tensor cores."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dmref import tiled
from dmref.problems import make_problem
from dmref.diagnostics import matched_rowsum_bound
from dmref.recipes import DELTA_STUDY, get_recipe, with_prepass_delta

#: The choice: today's kernels' recipe with D from a pre-pass instead of the deferred dQ.
CHOSEN = with_prepass_delta(get_recipe("kernels_delta_matching"), "kernels_delta_prepass")


@st.composite
def adversarial_problems(draw):
    """Demo problems pushed to the edges: outlier channels up to 30x, per-row scales of dO over
    2^-30 .. 2^30 (on top of a gradient scale of 1e-6 .. 1), peaked and sink logits up to 25,
    lengths that leave tail tiles (of the 64-key dS blocks and the 128-key tiles), grouped
    heads, and rows the mask hides entirely."""
    kv_heads = draw(st.integers(1, 2))
    seqlen = draw(st.integers(1, 200))
    return dict(
        shape=dict(batch=1, heads=kv_heads * draw(st.sampled_from([1, 2])), seqlen=seqlen,
                   head_dim=draw(st.sampled_from([32, 64]))),
        problem=dict(kv_heads=kv_heads, seed=draw(st.integers(0, 2**31 - 1)),
                     outlier_channels=draw(st.integers(0, 8)),
                     qk_outlier_scale=draw(st.sampled_from([1.0, 6.0])),
                     v_outlier_scale=draw(st.sampled_from([1.0, 30.0])),
                     peaked_fraction=draw(st.sampled_from([0.0, 0.5])),
                     peak_logit=draw(st.sampled_from([5.0, 25.0])),
                     sink_logit=draw(st.sampled_from([0.0, 10.0])),
                     grad_scale=draw(st.sampled_from([1e-6, 1e-3, 1.0]))),
        row_exponent=draw(st.integers(0, 30)),
        masked_rows=draw(st.lists(st.integers(0, seqlen - 1), max_size=3, unique=True)),
        causal=draw(st.booleans()),
    )


def _inputs(case):
    shape = case["shape"]
    q, k, v, dout = make_problem(shape["batch"], shape["heads"], shape["seqlen"], shape["head_dim"], **case["problem"])
    g = torch.Generator().manual_seed(case["problem"]["seed"])
    e = case["row_exponent"]
    dout = dout * torch.exp2(torch.randint(-e, e + 1, (*dout.shape[:-1], 1), generator=g).to(dout.dtype))
    mask = torch.ones(shape["seqlen"], shape["seqlen"], dtype=torch.bool)
    mask[case["masked_rows"]] = False
    return q, k, v, dout, mask


@settings(max_examples=10, deadline=None)
@given(case=adversarial_problems())
def test_the_chosen_delta_keeps_every_row_sum_within_the_fp32_bound(case):
    """Theorem 1′ with Theorem 3: D_i = sum_j P_ij dP^_ij from the very dP^ the sweep uses (the
    Hopper wgmma's numbers), so |r_i| <= matched_rowsum_bound_i, whatever the FP8 dP's error;
    rows the mask hides have no products and a zero row sum."""
    q, k, v, dout, mask = _inputs(case)
    _, bwd = tiled.attention(q, k, v, dout, recipe=CHOSEN, causal=case["causal"], mask=mask, diagnostics=True)
    rs = bwd.rowsum
    bound = matched_rowsum_bound(rs)
    excess = rs.residual.abs() - bound
    assert bool(torch.isfinite(rs.residual).all())
    assert excess.max().item() <= 0, f"row sum of dS over the float32 bound by {excess.max().item():.3g}"
    hidden = torch.zeros(rs.residual.shape[-1], dtype=torch.bool)
    hidden[case["masked_rows"]] = True
    assert bool((rs.residual[..., hidden] == 0).all()) and bool((rs.abs_pdp[..., hidden] == 0).all())


def test_hopper_dp_breaks_consistent_p_and_not_the_chosen_delta():
    """The study's finding at a size the tests afford (demo problem, 512 keys, causal): with dP
    on FP8 tensor cores, consistent P (D = dO^ . O, known before the backward) leaves rows of dS
    outside the float32 bound, most of them by more than the bound itself; the same problem with
    D from the pre-pass keeps every row inside. With PV and dP accumulated in float32 instead,
    consistent P's median row is inside again (its own bound, dmref/proofs/delta_study.md, is
    wider than Delta-Matching's by sum_k |dO^_ik| W_ik / A_i)."""
    q, k, v, dout = make_problem(1, 1, 512, 64, seed=5)
    ratios = {}
    for recipe in (CHOSEN, get_recipe("consistent_p_tile@hopper"), DELTA_STUDY["consistent_p_fp32_pv_dp"]):
        _, bwd = tiled.attention(q, k, v, dout, recipe=recipe, causal=True, diagnostics=True)
        rs = bwd.rowsum
        live = rs.abs_pdp > 0
        ratios[recipe.name] = (rs.residual.abs() / matched_rowsum_bound(rs))[live]
    assert ratios[CHOSEN.name].max().item() <= 1
    assert ratios["consistent_p_tile@hopper"].median().item() > 1
    assert ratios["consistent_p_fp32_pv_dp"].median().item() <= 1


def test_with_prepass_delta_needs_a_matched_recipe():
    with pytest.raises(ValueError, match="not a matched one"):
        with_prepass_delta(get_recipe("naive_fp8"))
    assert with_prepass_delta(get_recipe("delta_matching")).name == "delta_matching_prepass"
    assert CHOSEN.delta.deferred_dq is None and get_recipe("kernels_delta_matching").delta.deferred_dq is not None


#: dS for dQ scaled per query over all keys from the pre-pass's bound (Recipe.ds_dq_bound), in
#: float32 accumulation so that the adversarial problems stay cheap; and the same with the exact
#: row amax, which no one-pass kernel knows before its pass.
DSQ_ROW = get_recipe("kernels_folded_delta_prepass_dsq_row@fp32")
DSQ_ROW_EXACT = dataclasses.replace(DSQ_ROW, name="dsq_row_exact_amax", ds_dq_bound=False)


def _ds_for_dq_amaxes(recipe, q, k, v, dout, causal, mask):
    """(the amax each key tile's dS-for-dQ cast was given, the row amax of the dS it cast), per
    query row over all key tiles: the casts of ``recipe.ds_dq`` seen through ``tiled._quantize``."""
    lead = (*q.shape[:-1], 1)
    told, seen = torch.zeros(lead), torch.zeros(lead)
    real = tiled._quantize

    def spy(x, point, *args, **kw):
        if point is recipe.ds_dq:
            i0 = q.shape[-2] - x.shape[-2]  # a key tile's dS holds the query rows i0: of the head
            told[..., i0:, :] = torch.maximum(told[..., i0:, :], kw["amax"].expand(*x.shape[:-1], 1))
            seen[..., i0:, :] = torch.maximum(seen[..., i0:, :], x.abs().amax(dim=-1, keepdim=True))
        return real(x, point, *args, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tiled, "_quantize", spy)
        tiled.attention(q, k, v, dout, recipe=recipe, causal=causal, mask=mask)
    return told, seen


@settings(max_examples=10, deadline=None)
@given(case=adversarial_problems())
def test_the_pre_pass_bound_holds_every_row_of_ds_for_dq(case):
    """U_i = max_j P_ij |dP^_ij| + |D_i| max_j P_ij >= max_j |P_ij (dP^_ij - D_i)|, on the sweep's
    very P and dP^: with ``ds_dq_bound`` every key tile's cast of dS for dQ is given a row amax of
    at least the row's largest |dS| over all keys (so one scale per row serves every key block,
    and no code saturates beyond what the amax allows); without it, the row amax itself."""
    q, k, v, dout, mask = _inputs(case)
    given_b, seen_b = _ds_for_dq_amaxes(DSQ_ROW, q, k, v, dout, case["causal"], mask)
    assert bool(torch.isfinite(given_b).all())
    assert bool((given_b >= seen_b).all()), f"bound below the row amax by {(seen_b - given_b).max().item():.3g}"
    given_e, seen_e = _ds_for_dq_amaxes(DSQ_ROW_EXACT, q, k, v, dout, case["causal"], mask)
    assert torch.equal(given_e, seen_e) and torch.equal(seen_e, seen_b)


def test_ds_dq_bound_needs_a_dynamic_row_point_and_the_final_delta():
    with pytest.raises(ValueError, match="not a dynamically scaled ROW point"):
        dataclasses.replace(get_recipe("kernels_folded_delta_prepass"), ds_dq_bound=True)
    with pytest.raises(ValueError, match="deferred dQ"):
        dataclasses.replace(get_recipe("kernels_folded_delta_matching"), ds_dq=DSQ_ROW.ds_dq, ds_dq_bound=True)
    assert "pre-pass bound" in DSQ_ROW.describe()


def test_the_kernels_run_the_dsq_row_recipe_and_refuse_its_scales_elsewhere():
    """``kernels_folded_delta_prepass_dsq_row`` is a kernel spec by name and as a Recipe (the same
    spec); its dS-for-dQ and K-for-dQ scales on a recipe without the folded forward's K or the
    pre-pass's D are refused in one line, saying why."""
    from dmref.kernels.config import SPECS, KernelSpec, get_spec

    spec = get_spec("kernels_folded_delta_prepass_dsq_row")
    assert spec.dsq_row and spec.prepass and spec.folded and spec is SPECS[spec.name]
    assert get_spec(get_recipe("kernels_folded_delta_prepass_dsq_row")) == spec
    assert not any(s.dsq_row for name, s in SPECS.items() if name != spec.name)
    per_token = dataclasses.replace(get_recipe("kernels_delta_prepass"), name="per_token_k_dsq_row",
                                    ds_dq=DSQ_ROW.ds_dq, ds_dq_bound=True, k_dq=DSQ_ROW.k_dq)
    with pytest.raises(ValueError, match="ds_dq_bound: the kernels scale") as err:
        KernelSpec(per_token)
    assert "\n" not in str(err.value)
