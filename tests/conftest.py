"""Shared test configuration: hypothesis profiles and the `gpu` / `slow` markers.

Hypothesis profile is chosen by the environment variable ``DMREF_HYPOTHESIS_PROFILE``:

- ``ci``        the default, everywhere: derandomized, no example database, bounded example
                counts, so that every run of the test command gives the same result;
- ``dev``       random exploration, run on purpose (``DMREF_HYPOTHESIS_PROFILE=dev python -m
                pytest ...``): what it finds becomes an explicit ``@example`` or test case;
- ``thorough``  many random examples, for a long soak.

Markers (declared in pyproject.toml):

- ``slow``  exhaustive sweeps (every float32 input, every rbits value); opt-in: ``-m slow``;
- ``gpu``   needs a CUDA device of compute capability >= 9.0; skipped otherwise.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    max_examples=60,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.register_profile(
    "thorough",
    max_examples=5000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("DMREF_HYPOTHESIS_PROFILE", "ci"))


def _has_hopper_gpu() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return False
    if not torch.cuda.is_available():
        return False
    major, _minor = torch.cuda.get_device_capability()
    return major >= 9


def pytest_collection_modifyitems(config, items):
    if _has_hopper_gpu():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device of compute capability >= 9.0")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
