"""Every axis an attention bug can live on is varied by some case of each case set, and a bug
planted on that axis (planted.AXIS_BUGS) fails the case that varies it, while the same
implementation without the bug passes."""

from __future__ import annotations

import planted
import pytest
import torch

from dmref import oracle
from dmref.oracle.cases import LAYOUTS

_AXIS_CASES = sorted({case for _, case, _ in planted.AXIS_BUGS.values()})


@pytest.mark.slow  # 30 cases; sdpa_math passes every quick case in test_vs_torch_sdpa.py
def test_the_plain_attention_without_a_bug_passes_every_axis_case():
    report = oracle.check(planted.plain_features, cases=oracle.make_cases("quick", names=_AXIS_CASES))
    report.raise_for_failures()
    assert not report.skipped


# a second bug on an axis already shown above runs with the slow tests
_SECOND = {"gqa_ratio_7", "head_dim_256", "extreme_in_tail", "documents_with_causal", "offset", "dout_layout"}


@pytest.mark.parametrize("axis", [pytest.param(a, marks=pytest.mark.slow) if a in _SECOND else a
                                  for a in sorted(planted.AXIS_BUGS)])
def test_a_bug_on_each_axis_fails_the_case_that_varies_it(axis):
    fn, case, what = planted.AXIS_BUGS[axis]
    report = oracle.check(fn, cases=oracle.make_cases("quick", names=[case]))
    assert case in report.failed_cases(), f"{axis} ({what}): {report.summary()}"


@pytest.mark.parametrize("size", oracle.CASE_SETS)
def test_every_case_set_varies_every_axis(size):
    cases = {c.name: c for c in oracle.make_cases(size, probe=False)}
    assert set(_AXIS_CASES) <= set(cases)
    shapes = [(c.q.shape, c.k.shape) for c in cases.values()]
    assert len({q[0] for q, _ in shapes}) > 1  # batch
    assert len({q[1] for q, _ in shapes}) > 1  # heads
    assert len({q[1] // k[1] for q, k in shapes}) > 2  # GQA ratio: 1 and two more
    assert any(q[2] > k[2] for q, k in shapes) and any(q[2] < k[2] for q, k in shapes)
    assert any(q[2] == 1 for q, _ in shapes)  # a single query
    assert len({q[3] for q, _ in shapes}) > 1  # head dim
    assert {c.layout for c in cases.values()} == set(LAYOUTS)
    assert {c.causal for c in cases.values()} == {True, False}
    assert len({round(c.scale * c.q.shape[-1] ** 0.5, 12) for c in cases.values()}) > 3  # softmax scale
    # accumulation: a long sum of terms of one sign (V's mean far from zero over thousands of keys)
    assert any(c.k.shape[-2] > 2048 and c.v.double().mean() > 2 * c.v.double().std() for c in cases.values())
    # and in the gradients: dV summed over thousands of queries whose dO has one sign
    assert any(c.q.shape[-2] > 2048 and c.dout.double().mean() > 2 * c.dout.double().std() for c in cases.values())
    # each optional feature crossed with the other axes: batch > 1, heads > 1, causal and not, tails
    for feature in oracle.OPTIONAL_FEATURES:
        of = [c for c in cases.values() if c.feature == feature]
        assert any(c.q.shape[0] > 1 for c in of) and all(c.q.shape[1] > 1 for c in of), feature
        assert {c.causal for c in of} == {True, False}, feature
        assert any(c.k.shape[-2] % 64 for c in of), feature
    # masks that differ between batch elements
    assert all(c.mask.shape[0] > 1 and not bool((c.mask == c.mask[:1]).all())
               for c in cases.values() if c.mask is not None)


def test_the_extreme_sits_in_the_first_block_the_last_full_block_and_the_tail():
    from dmref.oracle.cases import SPIKE_POSITIONS

    (case,) = oracle.make_cases("quick", names=["extreme_positions"], probe=False)
    s = case.scale * (case.q.double() @ case.k.double().transpose(-1, -2))
    top = s.argmax(-1)  # (batch, heads, queries)
    for e, j in enumerate(SPIKE_POSITIONS):
        assert bool((top[e] == j).all())
        others = s[e].clone()
        others[..., j] = -torch.inf
        # beyond exp's float32 range (88.7) above every other key of the row
        assert bool((s[e][..., j] - others.amax(-1) > 88.7).all())
    n = case.k.shape[-2]
    assert SPIKE_POSITIONS[0] < 64 and 128 <= SPIKE_POSITIONS[1] < n // 64 * 64 <= SPIKE_POSITIONS[2] < n


def test_a_given_head_dim_holds_for_every_case():
    cases = oracle.make_cases("quick", head_dim=128, probe=False)
    assert {c.q.shape[-1] for c in cases} == {128}
    fn, _, _ = planted.AXIS_BUGS["head_dim"]  # Q Kᵀ over the first 64 channels
    report = oracle.check(fn, cases=["realistic"], head_dim=128)
    assert "realistic" in report.failed_cases()
    correct = oracle.check(planted.plain, cases=oracle.make_cases("quick", names=["realistic"], head_dim=128))
    correct.raise_for_failures()


def test_strided_inputs_are_not_contiguous_and_start_at_an_offset():
    (case,) = oracle.make_cases("quick", names=["strided_inputs"])
    q = case.leaf(case.q)
    assert not q.is_contiguous() and q.storage_offset() == 1 and q.is_leaf
    assert bool((q == case.q).all())


def test_windows_and_documents_are_unsupported_without_their_argument_and_fail_when_required():
    cases = oracle.make_cases("quick", names=["sliding_window", "documents", "tail_lengths"])
    report = oracle.check(planted.plain_masked, cases=cases)
    assert report.passed and {(c.case, c.unsupported) for c in report.unsupported} == {
        ("sliding_window", "window"), ("documents", "documents")}
    required = oracle.check(planted.plain_masked, cases=cases, require=("window", "documents"))
    assert required.failed_cases("runs") == {"sliding_window", "documents"}
