"""Every flag of the public API takes a bool (or numpy.bool_) and nothing else: a string such
as "no" is truthy, so ``encode(saturate="no")`` would otherwise saturate."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dmref import recipes, testing, tiled
from dmref.cudnn import replay as attention_replay
from dmref.emulation import (MatmulModel, encode, encode_scalar, gemm, quantize, quantize_blocked)

_X = np.array([1.0, 500.0, -3.0])
_CODES = torch.full((4, 32), 0x38, dtype=torch.uint8)  # 1.0 in E4M3
_Q = torch.randn(1, 1, 8, 8, generator=torch.Generator().manual_seed(0))

#: (flag name, call with the flag set to the given value)
CALLS = {
    "encode": ("saturate", lambda f: encode(_X, "e4m3", saturate=f)),
    "quantize": ("saturate", lambda f: quantize(_X, "e4m3", saturate=f)),
    "encode_scalar": ("saturate", lambda f: encode_scalar(500.0, "e4m3", saturate=f)),
    "quantize_blocked.saturate": ("saturate", lambda f: quantize_blocked(_X[None], "e4m3", block="row",
                                                                         scale_rule="amax", saturate=f)),
    "quantize_blocked.transposed": ("transposed", lambda f: quantize_blocked(_X[None], "e4m3", block="row",
                                                                             scale_rule="amax", transposed=f)),
    "matmul": ("chain", lambda f: gemm.matmul(_CODES, _CODES, fa="e4m3", fb="e4m3", chain=f)),
    "MatmulModel": ("float64_result", lambda f: MatmulModel("exact", float64_result=f)),
    "triton_dot_schedule": ("chain", lambda f: gemm.triton_dot_schedule(32, chain=f)),
    "cublas_schedule": ("use_fast_accum", lambda f: gemm.cublas_schedule(f)),
    "QuantPoint": ("saturate", lambda f: recipes.QuantPoint("e4m3", saturate=f)),
    "tiled.attention": ("diagnostics", lambda f: tiled.attention(_Q, _Q, _Q, _Q, recipe="naive_fp8",
                                                                 diagnostics=f)),
    "ReplayOptions": ("ds_dq_fp16", lambda f: attention_replay.ReplayOptions(ds_dq_fp16=f)),
}
#: flags whose result is a hypothesis strategy (compared by their repr, not drawn)
STRATEGIES = {
    f"attention_problems.{flag}": (flag, lambda f, flag=flag: testing.attention_problems(**{flag: f}))
    for flag in ("causal", "probe", "gqa", "masks")
}


_BAD = ["no", "False", 0, 1, None]


@pytest.mark.parametrize("name, bad", [(n, b) for n in sorted(CALLS) + sorted(STRATEGIES) for b in _BAD
                                       if not (n == "attention_problems.causal" and b is None)])  # None: drawn
def test_a_flag_that_is_not_a_bool_is_refused_naming_it(name, bad):
    flag, call = {**CALLS, **STRATEGIES}[name]
    with pytest.raises(TypeError, match=rf"^{flag} must be True or False \(bool or numpy.bool_\), got "):
        call(bad)


def _same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return np.array_equal(a, b, equal_nan=a.dtype.kind == "f")


@pytest.mark.parametrize("name", sorted(CALLS))
def test_numpy_bool_is_taken_as_the_bool(name):
    _, call = CALLS[name]
    for flag in (True, False):
        got, want = call(np.bool_(flag)), call(flag)
        if isinstance(want, tuple) and hasattr(want[0], "out"):  # tiled.attention: (fwd, bwd)
            got, want = got[1].dq, want[1].dq
        if isinstance(want, (np.ndarray, torch.Tensor)):
            assert _same(got, want)
        elif isinstance(want, tuple):
            assert all(_same(a, b) for a, b in zip(got, want))
        else:
            assert got == want


def test_encode_saturate_false_is_not_saturate_true():
    """The flag matters on this input (500 overflows E4M3), so the tests above compare outputs
    that differ between the two values."""
    assert encode(_X, "e4m3", saturate=True)[1] != encode(_X, "e4m3", saturate=False)[1]
