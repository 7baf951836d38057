"""Small Triton kernels the tests use to probe one piece of the kernels' arithmetic in isolation.
Imported lazily (it imports triton)."""

from __future__ import annotations

import triton
import triton.language as tl

from dmref.kernels._common import to_fp8


@triton.jit
def cast_to_e4m3(X, Y, n, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    """Y = bytes of to_fp8(X) (E4M3), in a 1-D blocked layout: no layout conversion."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n, other=0.0)
    tl.store(Y + offs, to_fp8(x, False, INTERPRET).to(tl.uint8, bitcast=True), mask=offs < n)
