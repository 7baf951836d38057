"""The oracle's ready-made targets under one name, for ``dmref check dmref.targets:<name>``:
torch's SDPA, FlexAttention and dmref's emulated recipes (:mod:`dmref.oracle.targets`) and
cuDNN's FP8 attention (:mod:`dmref.cudnn.target`)."""

from __future__ import annotations

from .cudnn.target import (GRAD_FORMATS, cudnn_fp8, cudnn_fp8_backward, cudnn_fp8_forward, dequantize,
                           require_cudnn_fp8)
from .oracle.targets import (CaseUnsupported, TargetUnavailable, causal_into_mask, emulated, features_into_mask, flex,
                             gqa_kwargs, sdpa, sdpa_math)
from .oracle.targets import __getattr__  # noqa: F401 (emulated_<preset>)

__all__ = ["TargetUnavailable", "CaseUnsupported", "GRAD_FORMATS", "causal_into_mask", "cudnn_fp8",
           "cudnn_fp8_backward", "cudnn_fp8_forward", "dequantize", "emulated", "features_into_mask", "flex", "gqa_kwargs",
           "require_cudnn_fp8", "sdpa", "sdpa_math"]
