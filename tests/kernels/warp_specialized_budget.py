"""The register and shared-memory budget of the warp-specialized Gluon kernels (``fwd_ws``,
``bwd_ws``), checked on the CPU from sm_90a compilations: a test passes a script that compiles
its configurations and prints ``compile_check.warp_specialized_budget`` of each, as JSON
(:func:`compile_and_check_budget`); :func:`compiled_usage` runs such a script for any kernel."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

#: Hopper: 228 KB of shared memory per SM, of which the system reserves 1 KB a CTA
#: (``cudaDevAttrReservedSharedMemoryPerBlock``); two CTAs an SM need at most half of the rest each.
MAX_SHARED_TWO_CTAS = 228 * 1024 // 2 - 1024
#: Hopper: 227 KB of shared memory per block (opt-in), what one CTA an SM may take.
MAX_SHARED_ONE_CTA = 227 * 1024


def compiled_usage(script: str) -> list[dict]:
    """Run ``script`` without Triton's interpreter (kernels are compiled for sm_90a, not
    interpreted) and return what it prints on its last line, as JSON: one dict per compiled
    configuration. Skips where triton is missing; fails with the script's stderr."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compile_and_check_budget(script: str, configurations: int, consumers: int = 1,
                             spills_ok=lambda u: False) -> list[dict]:
    """Run ``script`` without Triton's interpreter (Gluon kernels are compiled, not
    interpreted) and check every configuration it reports: no spills (unless ``spills_ok(u)`` says a
    configuration may spill), no serialized wgmma, and
    the budget of ``consumers`` consumer warp groups a CTA. One (two CTAs an SM): the launch's 128
    registers, 256 threads (the consumer warp group and the producer's, padded), setmaxnreg to the
    producer's 24 and the consumer's 232, shared memory for two CTAs an SM. Two (``fwd_ws``'s
    ``consumers=2``, one CTA an SM): 168 at launch, 384 threads, setmaxnreg to 24 and to 240 for
    both consumers, shared memory for one CTA an SM."""
    usage = compiled_usage(script)
    from dmref.kernels._gluon import LAUNCH_REGS, PRODUCER_REGS, TWO_CONSUMER_LAUNCH_REGS, TWO_CONSUMER_REGS

    if consumers == 1:
        launch, consumer, threads, shared = LAUNCH_REGS, 2 * LAUNCH_REGS - PRODUCER_REGS.value, 256, MAX_SHARED_TWO_CTAS
    else:
        launch, consumer, threads, shared = (TWO_CONSUMER_LAUNCH_REGS, TWO_CONSUMER_REGS.value, 384,
                                             MAX_SHARED_ONE_CTA)
        # the registers the setmaxnreg values hold at once fit the SM: each warp group at most its
        # share of the launch's budget after the producer's drop
        assert 2 * consumer + PRODUCER_REGS.value <= 3 * launch and launch * threads <= 65536
    assert len(usage) == configurations
    for u in usage:
        assert u["spills"] == 0 or spills_ok(u), u
        assert u["regs"] == launch, u
        assert u["threads"] == threads, u
        assert PRODUCER_REGS.value in u["setmaxnreg"] and consumer in u["setmaxnreg"], u
        assert u["shared"] <= shared, u
        assert not u["serialized"], u
    return usage
