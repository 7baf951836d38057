"""The register and shared-memory budget of the warp-specialized Gluon kernels (``fwd_ws``,
``bwd_ws``), checked on the CPU from sm_90a compilations: a test passes a script that compiles
its configurations and prints ``compile_check.warp_specialized_budget`` of each, as JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

#: Hopper: 228 KB of shared memory per SM; two CTAs an SM need at most half of it each.
MAX_SHARED_TWO_CTAS = 228 * 1024 // 2


def compile_and_check_budget(script: str, configurations: int, spills_ok=lambda u: False) -> list[dict]:
    """Run ``script`` without Triton's interpreter (Gluon kernels are compiled, not
    interpreted) and check every configuration it reports: no spills (unless ``spills_ok(u)``
    says a configuration may spill), the launch register count,
    256 threads (the consumer warp group and the producer's, padded), setmaxnreg to the producer's
    24 and the consumer's 232, shared memory for two CTAs an SM, no serialized wgmma."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from dmref.kernels._gluon import LAUNCH_REGS, PRODUCER_REGS

    usage = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(usage) == configurations
    for u in usage:
        assert u["spills"] == 0 or spills_ok(u), u
        assert u["regs"] == LAUNCH_REGS, u
        assert u["threads"] == 256, u
        assert PRODUCER_REGS.value in u["setmaxnreg"] and 2 * LAUNCH_REGS - PRODUCER_REGS.value in u["setmaxnreg"], u
        assert u["shared"] <= MAX_SHARED_TWO_CTAS, u
        assert not u["serialized"], u
    return usage
