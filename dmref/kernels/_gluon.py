"""What the warp-specialized Gluon kernels (``fwd_ws``, ``bwd_ws``) share: their register budget,
the Triton helpers of ``_common`` compiled as Gluon, and the allocator that device-side TMA
descriptors draw their workspace from.

Importing this module imports triton; only the kernel modules do that.
"""

from __future__ import annotations

import functools

from triton._C.libtriton import ir as _ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin

from . import _common

#: registers per thread of the producer warp (setmaxnreg's minimum)
PRODUCER_REGS = gl.constexpr(24)
#: registers per thread at launch: two CTAs of 256 threads (the consumer warp group and the
#: producer warp, padded to a warp group) share an SM's 65,536. The producer gives up 128 - 24,
#: which lifts the consumer to 128 + 104 = 232 (what Gluon's setmaxnreg asks for)
LAUNCH_REGS = 128
#: registers per thread at launch with two consumer warp groups a CTA (``fwd_ws``'s
#: ``FwdTiles(consumers=2)``): one CTA of 384 threads (two consumer warp groups and the producer
#: warp, padded to a warp group) an SM, 65,536 // 384 = 170, rounded down to setmaxnreg's multiple
#: of 8
TWO_CONSUMER_LAUNCH_REGS = 65536 // 384 // 8 * 8
#: registers per thread of each of the two consumer warp groups: what the producer gives up,
#: 168 - 24 = 144, shared between them, 168 + 72 = 240 (the worker partition's setmaxnreg; Gluon
#: gives the default partition what is left, 3 * 168 - 24 - 240 = 240)
TWO_CONSUMER_REGS = gl.constexpr((3 * TWO_CONSUMER_LAUNCH_REGS - PRODUCER_REGS.value) // 2 // 8 * 8)

# The kernels' power-of-two scale rule, FP8 cast and separately rounded multiply
pow2_down_exponent = gluon.jit(_common.pow2_down_exponent.fn)
exp2_int = gluon.jit(_common.exp2_int.fn)
to_fp8 = gluon.jit(_common.to_fp8.fn)
mul_rn = gluon.jit(_common.mul_rn.fn)


@builtin
def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """TMA reduce-add: the shared-memory tile ``src`` added element by element (float32: in L2,
    round to nearest) into the global tile of ``tensor_desc`` at ``coord``, elements past the
    tensor's bounds skipped (``cp.reduce.async.bulk.tensor ... .add``, FA3's dQ accumulation). An
    asynchronous bulk operation like ``tma.async_copy_shared_to_global``: ``tma.store_wait``
    says when ``src`` may be written again. Triton 3.6's Gluon builder has the operation
    (``create_async_tma_reduce``); its Python API exposes it on Hopper only through this."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@functools.lru_cache(maxsize=None)
def shared_layout(block_shape: tuple, dtype) -> gl.NVMMASharedLayout:
    """``gl.NVMMASharedLayout.get_default_for(block_shape, dtype)``, built once: a host-side TMA
    descriptor needs its shared-memory layout, and building one costs about 15 us of Python, which
    every launch would pay for each of its descriptors (docs/kernels_speed.md, the host's share)."""
    return gl.NVMMASharedLayout.get_default_for(list(block_shape), dtype)


@functools.lru_cache(maxsize=None)
def unswizzled_layout(element_bitwidth: int) -> gl.NVMMASharedLayout:
    """The unswizzled 2-D shared layout of ``element_bitwidth``-bit elements (one row of scales a
    tile), built once (:func:`shared_layout`)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=element_bitwidth, rank=2)


def allocator(size: int, alignment: int, stream):
    """The global workspace of device-side TMA descriptors (``triton.set_allocator``)."""
    import torch

    return torch.empty(size, dtype=torch.int8, device="cuda")
