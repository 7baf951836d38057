"""The backward kernels compile for Hopper (sm_90a) on a machine without a GPU.

Triton's interpreter does not apply the compiler's language rules (constexpr globals, layouts,
wgmma lowering), so a kernel can pass every interpreter test and still fail to compile on the
H200. This compiles the two largest kernels of the default recipe with Triton's own front end and
ptxas, in a subprocess with the interpreter off, and checks they fit the H100/H200 limits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

#: Hopper: 227 KB of shared memory per block (opt-in), 255 registers per thread.
MAX_SHARED_BYTES = 227 * 1024

_SCRIPT = """
import json
from dmref.kernels import compile_check as cc
out = [u.__dict__ for u in cc.check("delta_matching", head_dims=(128,), causal=(True,), only=("dq", "dkdv"))]
print(json.dumps(out))
"""


def test_backward_kernels_compile_for_sm90_within_shared_memory():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    usage = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {u["kernel"] for u in usage} == {"dq", "dkdv"}
    for u in usage:
        assert u["shared_bytes"] <= MAX_SHARED_BYTES, u
