"""dmref.cudnn.target (cuDNN's FP8 target) on the CPU: the module imports without the frontend or a GPU, and a call that
cannot run says in one line what is missing (TargetUnavailable), what the case lacks
(CaseUnsupported, which the oracle skips) or which argument is wrong (ValueError)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

import dmref.cudnn.target as targets
from dmref import oracle
from dmref.emulation import get_format


def _problem(head_dim=128, heads=2, kv_heads=2, n=16):
    q = torch.randn(1, heads, n, head_dim, dtype=torch.bfloat16)
    k = torch.randn(1, kv_heads, n, head_dim, dtype=torch.bfloat16)
    return q, k, k.clone()


@pytest.fixture
def no_frontend(monkeypatch):
    monkeypatch.setitem(sys.modules, "cudnn", None)  # import cudnn raises ImportError


@pytest.fixture
def fake_frontend(monkeypatch):
    monkeypatch.setitem(sys.modules, "cudnn", types.ModuleType("cudnn"))


def test_import_needs_neither_frontend_nor_gpu():
    assert "cudnn" not in vars(targets)
    assert oracle.validate_signature(targets.cudnn_fp8) is False  # fn(q, k, v, *, causal, scale), no mask


def test_unavailable_is_runtime_error_and_unsupported_is_skipped_by_the_oracle():
    assert issubclass(targets.TargetUnavailable, RuntimeError)
    assert issubclass(targets.CaseUnsupported, targets.TargetUnavailable)
    assert issubclass(targets.CaseUnsupported, NotImplementedError)
    assert not issubclass(targets.TargetUnavailable, NotImplementedError)


def test_call_without_frontend_names_the_package(no_frontend):
    q, k, v = _problem()
    with pytest.raises(targets.TargetUnavailable) as info:
        targets.cudnn_fp8(q, k, v, causal=False, scale=None)
    message = str(info.value)
    assert "nvidia-cudnn-frontend" in message and "dmref[cudnn]" in message
    assert "\n" not in message
    assert not isinstance(info.value, NotImplementedError)  # the oracle must not skip it as a case


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_call_without_gpu_names_the_gpu(fake_frontend):
    q, k, v = _problem()
    with pytest.raises(targets.TargetUnavailable) as info:
        targets.cudnn_fp8(q, k, v, causal=True, scale=0.1)
    assert "CUDA GPU of compute capability 9.0" in str(info.value)
    assert "\n" not in str(info.value)


def test_cpu_tensors_are_refused_when_a_gpu_exists(fake_frontend, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(targets.TargetUnavailable, match="needs CUDA tensors .*got device cpu"):
        targets.require_cudnn_fp8(torch.device("cpu"))


def test_head_dim_other_than_128_is_an_unsupported_case(fake_frontend, monkeypatch):
    monkeypatch.setattr(targets, "require_cudnn_fp8", lambda device=None: sys.modules["cudnn"])
    q, k, v = _problem(head_dim=64)
    with pytest.raises(targets.CaseUnsupported, match=r"head dim 128 only on Hopper \(got 64"):
        targets.cudnn_fp8(q, k, v, causal=False, scale=None)


@pytest.mark.parametrize(
    "shapes, kwargs, match",
    [
        (((1, 3, 16, 128), (1, 2, 16, 128), (1, 2, 16, 128)), {}, "heads=3 must be a multiple of kv_heads=2"),
        (((1, 2, 16, 128), (1, 2, 16, 64), (1, 2, 16, 128)), {}, "head dims differ: 128 and 64"),
        (((1, 2, 16, 128), (1, 2, 16, 128), (1, 2, 15, 128)), {}, "must share"),
        (((2, 16, 128), (2, 16, 128), (2, 16, 128)), {}, "must be \\(batch, heads, seqlen, head_dim\\)"),
        (((1, 2, 16, 128),) * 3, {"grad_format": "e5m3"}, "grad_format='e5m3'; accepted: e4m3, e5m2"),
    ],
)
def test_inconsistent_arguments_raise_value_error_before_any_availability_check(no_frontend, shapes, kwargs,
                                                                                 match):
    q, k, v = (torch.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match=match):
        targets.cudnn_fp8(q, k, v, causal=False, scale=None, **kwargs)


def test_grad_formats_are_the_torch_fp8_formats_by_name():
    for name in targets.GRAD_FORMATS:
        assert targets._fmax(name) == torch.finfo(get_format(name).torch_dtype).max


def _quantize_dequantize_bound(fmt: str) -> float:
    """Relative error of codes * descale against x for values in the normal range: one RNE to
    the format (its unit roundoff u8) and three float32 roundings (x * scale, 1 / scale, the
    product with descale)."""
    u8 = torch.finfo(get_format(fmt).torch_dtype).eps / 2
    u32 = torch.finfo(torch.float32).eps / 2
    return (1 + u8) * (1 + u32) ** 3 - 1


def test_quantize_is_per_tensor_current_scaling():
    """amax maps to fmax, scale = fmax / amax in float32, and codes * descale is x within one
    rounding to the format; the codes sit in BSHD storage."""
    x = torch.tensor([0.5, -3.0, 0.0, 1.5, 0.3], dtype=torch.float32).reshape(1, 1, 5, 1).expand(1, 1, 5, 2)
    for fmt in targets.GRAD_FORMATS:
        codes, scale, descale, amax = targets._quantize(x, fmt)
        assert amax.item() == 3.0
        assert scale.item() == torch.tensor(targets._fmax(fmt) / 3.0, dtype=torch.float32).item()  # one rounding
        assert descale.item() == torch.tensor(1.0 / scale.item(), dtype=torch.float32).item()
        assert codes.shape == x.shape and codes.dtype == get_format(fmt).torch_dtype
        assert codes.transpose(1, 2).is_contiguous()
        assert codes.float().abs().max().item() == targets._fmax(fmt)
        err = (targets.dequantize(codes, descale, torch.float64) - x.double()).abs()
        assert (err <= _quantize_dequantize_bound(fmt) * x.double().abs()).all()
        assert err.max().item() > 0  # 0.3 * fmax / 3 is not on either grid: the rounding is real


def test_quantize_of_zeros_uses_scale_one():
    codes, scale, descale, amax = targets._quantize(torch.zeros(1, 1, 3, 4), "e4m3")
    assert amax.item() == 0.0 and scale.item() == 1.0 and descale.item() == 1.0
    assert (codes.view(torch.uint8) == 0).all()


@pytest.mark.parametrize("extra", [[], ["--head-dim", "128"]])
def test_check_of_cudnn_fp8_where_it_cannot_run_is_one_line_and_status_2(no_frontend, capsys, extra):
    """Where the frontend (or the GPU) is missing, `dmref check dmref.targets:cudnn_fp8` stops at
    once with what is missing, instead of failing every case and blaming the implementation."""
    from dmref.cli import main

    code = main(["check", "dmref.targets:cudnn_fp8", "--cases", "quick", *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "nvidia-cudnn-frontend" in err and "Traceback" not in err


def test_the_oracle_stops_on_a_target_that_cannot_run_here():
    def unavailable(q, k, v, *, causal, scale):
        raise targets.TargetUnavailable("needs a thing this machine lacks")

    with pytest.raises(targets.TargetUnavailable, match="needs a thing"):
        oracle.check(unavailable, cases="quick")
