"""The former path of :mod:`dmref.emulation.gemm.captures`, kept so that ``from
dmref.emulation._gemm_npz import verify`` still works; new code imports the captures module."""

from .gemm.captures import (ENGINES, META_KEYS, PARTS, REQUIRED, Case, GemmFileError, GroupResult, group_key,
                            load_cases, replay, replay_kwargs, settings, ulp_distance, verify)

__all__ = ["ENGINES", "META_KEYS", "PARTS", "REQUIRED", "Case", "GemmFileError", "GroupResult", "group_key",
           "load_cases", "replay", "replay_kwargs", "settings", "ulp_distance", "verify"]
