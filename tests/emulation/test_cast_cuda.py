"""On a CUDA device, encode and decode (the integer-arithmetic route) give the same codes as on
the CPU (the table and native routes), for every format, mode and saturation setting."""

import numpy as np
import pytest
import torch

from dmref.emulation import FORMATS, Rounding, decode, encode

pytestmark = pytest.mark.gpu


def _inputs(dtype):
    rng = np.random.default_rng(11)
    n = 1 << 16
    x = rng.standard_normal(n) * np.exp2(rng.uniform(-40, 40, n))
    x[:64] = [np.nan, np.inf, -np.inf, 0.0, -0.0] + list(np.exp2(np.arange(-20, 39, 1.0)))
    with np.errstate(over="ignore"):
        return x.astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("rounding", list(Rounding))
@pytest.mark.parametrize("saturate", [False, True])
def test_cuda_encode_equals_cpu_encode(dtype, name, rounding, saturate):
    x = _inputs(dtype)
    rbits = None
    if rounding is Rounding.STOCHASTIC:
        rbits = np.random.default_rng(12).integers(0, 1 << 16, x.shape).astype(np.uint16)
    cpu = encode(x, name, rounding=rounding, saturate=saturate, rbits=rbits)
    rb_cuda = None if rbits is None else torch.from_numpy(rbits.astype(np.int32)).cuda().to(torch.uint16)
    gpu = encode(torch.from_numpy(x).cuda(), name, rounding=rounding, saturate=saturate, rbits=rb_cuda)
    assert gpu.device.type == "cuda"
    assert np.array_equal(gpu.cpu().numpy().view(cpu.dtype), cpu)


@pytest.mark.parametrize("name", [n for n, f in FORMATS.items() if f.bits == 8])
def test_cuda_decode_of_every_code_equals_cpu(name):
    codes = np.arange(256, dtype=np.uint8)
    cpu = decode(codes, name)
    gpu = decode(torch.from_numpy(codes).cuda(), name).cpu().numpy()
    assert np.array_equal(gpu.view(np.uint32), cpu.view(np.uint32))
