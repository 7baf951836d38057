"""``matmul`` with a dimension of size 0: M = 0 or N = 0 give empty results, K = 0 gives c (the
sum of no products is exactly zero; +0 where c is None), in every accumulation model, with and
without block scales and batch dimensions."""

import numpy as np
import pytest
import torch

from dmref.emulation import matmul

MODELS = ["exact", "fp32", "hopper"]
SHAPES = [((), 0, 4, 32), ((), 4, 0, 32), ((), 0, 0, 0), ((), 0, 4, 0), ((3,), 0, 5, 64),
          ((0,), 3, 4, 32), ((2, 0), 3, 4, 32)]


def _operands(batch, m, n, k, scaled, kind):
    rng = np.random.default_rng(m * 100 + n * 10 + k)
    a = rng.integers(0, 0x7F, (*batch, m, k)).astype(np.uint8)
    bt = rng.integers(0, 0x7F, (*batch, n, k)).astype(np.uint8)
    kw = {}
    if scaled:
        t = -(-k // 128)
        kw = {"scale_a": np.full((*batch, m, t), 2.0, np.float32),
              "scale_b": np.full((*batch, n, t), 0.5, np.float32)}
    if kind == "torch":
        a, bt = torch.from_numpy(a), torch.from_numpy(bt)
        kw = {key: torch.from_numpy(v) for key, v in kw.items()}
    return a, bt, kw


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize(("batch", "m", "n", "k"), SHAPES)
def test_no_outputs_give_an_empty_float32_result(batch, m, n, k, model, scaled, kind):
    a, bt, kw = _operands(batch, m, n, k, scaled, kind)
    out = matmul(a, bt, fa="e4m3", fb="e4m3", model=model, **kw)
    assert tuple(out.shape) == (*batch, m, n)
    assert (out.dtype == np.float32) if kind == "numpy" else (out.dtype == torch.float32)
    assert isinstance(out, np.ndarray) == (kind == "numpy")


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("batch", [(), (2,)])
def test_k_zero_gives_c_exactly_and_zeros_without_c(batch, model, scaled):
    m, n = 3, 5
    a, bt, kw = _operands(batch, m, n, 0, scaled, "numpy")
    out = matmul(a, bt, fa="e4m3", fb="e5m2", model=model, **kw)
    assert out.shape == (*batch, m, n)
    assert np.array_equal(out.view(np.uint32), np.zeros((*batch, m, n), np.uint32))  # +0, bit for bit
    c = np.array([[1.5, -0.0, np.inf, -np.inf, 3e-45]] * m, np.float32)
    c[0, 0] = np.nan
    out = matmul(a, bt, c, fa="e4m3", fb="e5m2", model=model, **kw)
    want = np.broadcast_to(c, (*batch, m, n)).copy()
    want.view(np.uint32)[..., 0, 0] = 0x7FFFFFFF  # the NaN NVIDIA GPUs write
    assert np.array_equal(out.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("model", ["exact", "fp32"])
def test_k_zero_equals_k_of_zero_codes_up_to_the_sign_of_zero(model):
    """The same result as K = 32 products that are all +0 (where c is not -0: c + 0 = c). Not
    so under ``hopper``: a k-step of zero products still truncates c to 14 significant bits,
    while K = 0 runs no k-step."""
    c = np.linspace(-3, 3, 12, dtype=np.float32).reshape(3, 4)
    empty = matmul(np.zeros((3, 0), np.uint8), np.zeros((4, 0), np.uint8), c, fa="e4m3", fb="e4m3",
                   model=model)
    zeros = matmul(np.zeros((3, 32), np.uint8), np.zeros((4, 32), np.uint8), c, fa="e4m3",
                   fb="e4m3", model=model)
    assert np.array_equal(empty.view(np.uint32), zeros.view(np.uint32))


def test_shapes_that_disagree_are_still_errors_when_empty():
    with pytest.raises(ValueError, match="must be"):
        matmul(np.zeros((0, 32), np.uint8), np.zeros((4, 0), np.uint8), fa="e4m3", fb="e4m3")
