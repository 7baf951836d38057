"""The backward kernels (and the forward's other load path) compile for Hopper (sm_90a) on a
machine without a GPU.

Triton's interpreter does not apply the compiler's language rules (constexpr globals, layouts,
wgmma lowering), so a kernel can pass every interpreter test and still fail to compile on the
H200. This compiles the two largest kernels of the default recipe with Triton's own front end and
ptxas, in a subprocess with the interpreter off, and checks they fit the H100/H200 limits.
"""

from __future__ import annotations

import pytest

#: Hopper: 227 KB of shared memory per block (opt-in), 255 registers per thread.
MAX_SHARED_BYTES = 227 * 1024

_SCRIPT = """
import dataclasses, json
from dmref.kernels import compile_check as cc
from dmref.kernels.config import SPECS
r = SPECS["kernels_delta_matching"]
# the other load path too (TMA descriptors or pointers, whichever the defaults do not use)
other = r.with_tiles(fwd=dataclasses.replace(r.fwd, tma=not r.fwd.tma),
                     bwd=dataclasses.replace(r.bwd, tma=not r.bwd.tma))
out = [u.__dict__ for u in cc.check(r, head_dims=(128,), causal=(True,), only=("dq", "dkdv"))]
out += [u.__dict__ for u in cc.check(other, head_dims=(128,), causal=(True,), only=("fwd", "dq", "dkdv"))]
print(json.dumps(out))
"""


@pytest.mark.slow
def test_backward_kernels_compile_for_sm90_within_shared_memory():
    from warp_specialized_budget import compiled_usage

    usage = compiled_usage(_SCRIPT)
    assert {u["kernel"] for u in usage} == {"fwd", "dq", "dkdv"}
    for u in usage:
        assert u["shared_bytes"] <= MAX_SHARED_BYTES, u
