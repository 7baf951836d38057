"""The oracle against torch's scaled_dot_product_attention (math backend, CPU): a known answer
at the bounds of its input dtype, on every quick case (the boolean and additive masks and GQA
included)."""

from __future__ import annotations

import pytest
import torch

from dmref import oracle


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sdpa_math_passes_at_its_input_dtypes_bounds(dtype):
    report = oracle.check(oracle.sdpa_math, cases=oracle.make_cases("quick", dtype=dtype), dtype=dtype)
    report.raise_for_failures()
    assert not report.skipped
    assert {"gqa", "additive_mask"} <= {c.name for c in report.cases}
