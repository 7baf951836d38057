"""Whether a bug is caught does not depend on the seed: a gradient kept as a BF16 running sum
(dV, dK or dQ rounded to BF16 after every block of 64 rows, as torch's CPU flash-attention
backward keeps dK and dV) fails the standard cases at every seed, and correct implementations
(a float32 one with FlashAttention-2's numerics, torch's math SDPA in BF16 and float32) pass
them at the same seeds.

The cases that show the running sums are ``long_sums_over_queries`` (dV, dK) and
``long_sums_over_keys`` (dQ): long sums of terms of one sign, which the zero-mean inputs of the
other cases keep small (docs/oracle.md, "No seed luck")."""

from __future__ import annotations

import planted
import pytest
import torch

from dmref import oracle

SEEDS = range(5)
# the standard cases made for long sums of one sign (O's, and the gradients')
ACCUMULATION_CASES = [c.name for c in oracle.make_cases("standard", probe=False) if "accumulation" in c.tags]
CORRECT = {
    "flash fp32 accumulation, bf16": (planted.flash, torch.bfloat16),
    "sdpa math, bf16": (oracle.sdpa_math, torch.bfloat16),
    "sdpa math, float32": (oracle.sdpa_math, torch.float32),
}


def test_the_accumulation_cases_sum_gradients_over_thousands_of_rows():
    names = {n for _, n, _ in planted.RUNNING_SUM_BUGS.values()}
    assert names <= set(ACCUMULATION_CASES)
    for case in oracle.make_cases("standard", names=sorted(names), probe=False):
        rows = max(case.q.shape[-2], case.k.shape[-2])
        assert rows > 64 * 64, f"{case.name}: {rows} rows are fewer than 64 blocks of 64"


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gradient", sorted(planted.RUNNING_SUM_BUGS))
def test_a_bf16_running_sum_of_a_gradient_fails_at_every_seed(gradient, seed):
    fn, case, check = planted.RUNNING_SUM_BUGS[gradient]
    report = oracle.check(fn, cases=ACCUMULATION_CASES, seed=seed, probe=False)
    assert f"{case}:{check}" in {c.id for c in report.failed}, report.summary()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("target", sorted(CORRECT))
def test_correct_implementations_pass_the_accumulation_cases_at_every_seed(target, seed):
    fn, dtype = CORRECT[target]
    oracle.check(fn, cases=ACCUMULATION_CASES, seed=seed, dtype=dtype).raise_for_failures()


@pytest.mark.slow  # 30 runs of the standard set: about 4 minutes of CPU time (10 on a loaded 2-core machine)
@pytest.mark.parametrize("seed", SEEDS)
def test_the_standard_cases_catch_every_running_sum_and_pass_correct_implementations_at_every_seed(seed):
    for gradient, (fn, case, check) in planted.RUNNING_SUM_BUGS.items():
        report = oracle.check(fn, seed=seed)
        assert f"{case}:{check}" in {c.id for c in report.failed}, f"{gradient}: {report.summary()}"
    for fn, dtype in CORRECT.values():
        oracle.check(fn, seed=seed, dtype=dtype).raise_for_failures()
