"""The engine of the emulated GEMM: :func:`matmul` runs the model of :mod:`.model` on torch
tensors (CPU or CUDA), the ``hopper`` model tile by tile over the K loop of :func:`.plan_k_tiles`
(its k-steps in :mod:`.hopper`), ``exact`` and ``fp32`` in :mod:`.exact`. The API is described
in :mod:`dmref.emulation.gemm`."""

from __future__ import annotations

import numpy as np
import torch

from ..formats import Format, check_bool
from . import exact, hopper
from .model import HOPPER, Accumulation, WgmmaRules, plan_k_tiles
from .operands import as_codes, as_float32, expand_scale
from .tables import canonicalize_nan, run_blocks


#: Output block of one pass on the CPU: the (32, TI, TJ) float32 products (1 MiB) stay in L2.
CPU_BLOCK = (64, 128)


def _block_shape(m: int, n: int, device: torch.device) -> tuple[int, int]:
    """On the CPU, :data:`CPU_BLOCK`; on CUDA as large as about 1 GiB of products allows."""
    if device.type == "cpu":
        return min(m, CPU_BLOCK[0]), min(n, CPU_BLOCK[1])
    per_row = 32 * 4 * n
    return max(1, min(m, (1 << 30) // per_row)), n


def _hopper(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, fa: Format, fb: Format,
            rules: WgmmaRules, promote_every, tile_k, chain, scales) -> torch.Tensor:
    m, k = a.shape
    n = b.shape[0]
    ks = rules.k_step
    k_padded = -(-k // ks) * ks
    align = hopper.alignment(fa, fb, rules)
    op_a = hopper.prepare(a, fa, rules, align.offset_a, align.dtype, k_padded)
    op_b = hopper.prepare(b, fb, rules, align.offset_b, align.dtype, k_padded)
    if scales is not None:
        tile_k, chain = scales[2], False
    plan = plan_k_tiles(k_padded, ks, promote_every, tile_k)
    specials = not bool(torch.isfinite(c).all())
    out = torch.empty((m, n), dtype=torch.float32, device=a.device)
    steps = k_padded // ks

    def block(rows: slice, cols: slice) -> None:
        kern = hopper.TileKernel(op_a, op_b, rows, cols, align, rules, step_block=8,
                                       specials=specials)
        zero = torch.zeros(kern.shape, dtype=torch.float32, device=a.device)

        def run(acc, k0, k1):
            for s in range(k0 // ks, k1 // ks):
                acc = kern.step(acc, s, steps)
            return acc

        acc = c[rows, cols]
        for t, tile in enumerate(plan):
            if chain and tile.segments is None:  # acc = dot(a, b, acc)
                acc = run(acc, tile.k0, tile.k1)
            elif chain:  # promotion: partial accumulators added to acc
                for s0, s1 in tile.segments:
                    acc = acc + run(zero, s0, s1)
            else:  # acc += dot(a, b): the tile from zero (its partials summed first)
                d = None
                for s0, s1 in tile.segments or ((tile.k0, tile.k1),):
                    p = run(zero, s0, s1)
                    d = p if d is None else d + p
                if scales is None:
                    acc = acc + d
                else:  # y = fma(partial * sx, sw, y)
                    acc = exact.fma_f32(d * scales[0][rows, t, None], scales[1][None, cols, t], acc)
        out[rows, cols] = acc

    ti, tj = _block_shape(m, n, a.device)
    blocks = [(slice(r0, min(m, r0 + ti)), slice(c0, min(n, c0 + tj)))
              for r0 in range(0, m, ti) for c0 in range(0, n, tj)]
    run_blocks(block, blocks, a.device)
    return out


def _scaled_tiles(a, b, c, fa, fb, model, scales):
    """exact / fp32 with block scales: per K tile the model's partial, then the TE epilogue."""
    sa, sb, block = scales
    y = c
    zero = torch.zeros_like(c)
    for t, k0 in enumerate(range(0, a.shape[1], block)):
        at, bt = a[:, k0:k0 + block], b[:, k0:k0 + block]
        if model is Accumulation.EXACT:
            p = exact.exact_matmul(at, bt, zero, fa, fb)
        else:
            p = exact.fp32_matmul(at, bt, zero, fa, fb)
        y = exact.fma_f32(p * sa[:, t, None], sb[None, :, t], y)
    return y


# ----------------------------------------------------------------------------------------------
# The public function
# ----------------------------------------------------------------------------------------------


def matmul(a, bt, c=None, *, fa=None, fb=None, model: Accumulation | str = Accumulation.HOPPER,
           promote_every: int | None = None, tile_k: int | None = None, chain: bool = True,
           scale_a=None, scale_b=None, scale_block_k: int = 128,
           rules: WgmmaRules = HOPPER):
    """``a @ bt.T + c`` from FP8 operands under an accumulation model (module docstring).

    With M = 0, N = 0 or an empty batch the result is empty; with K = 0 it is ``c`` itself (no
    products, no k-step: +0 where c is None) in every model, NaN written as 0x7FFFFFFF.

    ``fa``/``fb``: 8-bit element formats (e8m0, a scale format, is refused); ``c``: float32 of
    shape (..., M, N) or one that broadcasts to it; ``scale_block_k``: a positive int (the K
    extent of one block scale); ``chain``: a bool. ValueError or TypeError otherwise, naming the
    value."""
    model = Accumulation(model)
    chain = check_bool(chain, "chain")
    if isinstance(scale_block_k, bool) or not isinstance(scale_block_k, (int, np.integer)):
        raise TypeError(f"scale_block_k must be an int (K elements per block scale), got {scale_block_k!r}")
    if scale_block_k <= 0:
        raise ValueError(f"scale_block_k={scale_block_k} must be positive (K elements per block scale)")
    scale_block_k = int(scale_block_k)
    was_numpy = isinstance(a, np.ndarray)
    a, fa = as_codes(a, fa, "a")
    bt, fb = as_codes(bt, fb, "bt")
    bt = bt.to(a.device)
    if a.ndim < 2 or a.shape[:-2] != bt.shape[:-2] or a.shape[-1] != bt.shape[-1]:
        raise ValueError(f"a {tuple(a.shape)} and bt {tuple(bt.shape)} must be (..., M, K) and "
                         "(..., N, K) with the same batch dimensions and K")
    if model is not Accumulation.HOPPER and (promote_every is not None or tile_k is not None
                                             or not chain):
        raise ValueError(f"promote_every, tile_k and chain describe wgmma kernels; the "
                         f"{model.value!r} model is defined on the whole sum")
    batch, (m, k), n = a.shape[:-2], a.shape[-2:], bt.shape[-2]
    c = torch.zeros((), dtype=torch.float32) if c is None else c
    c = as_float32(c, a.device, "c")
    try:
        fits = torch.broadcast_shapes(c.shape, (*batch, m, n)) == (*batch, m, n)
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(f"c has shape {tuple(c.shape)}; expected the result's shape {(*batch, m, n)} "
                         "(..., M, N) or one that broadcasts to it")
    c = c.expand(*batch, m, n)
    if (scale_a is None) != (scale_b is None):
        raise ValueError("give both scale_a and scale_b, or neither")
    tiles = -(-k // scale_block_k)
    if scale_a is not None and tile_k is not None and tile_k != scale_block_k:
        raise ValueError(f"block scales fix the K tile: {tile_k=} != {scale_block_k=}")
    if scale_a is not None and model is Accumulation.HOPPER and scale_block_k % rules.k_step:
        raise ValueError(f"scale_block_k={scale_block_k} must be a multiple of the k-step {rules.k_step}: "
                         "under the hopper model each block scale applies to whole wgmma k-steps")

    # explicit sizes: a dimension of size 0 leaves -1 undetermined
    nb = int(np.prod(batch, dtype=np.int64))
    a2, b2 = a.reshape(nb, m, k), bt.reshape(nb, n, k)
    c2 = c.reshape(nb, m, n)

    def item(s, i):  # the batch entry i of a block scale; a 0-d or 1-d scale serves them all
        return s.reshape(nb, *s.shape[-2:])[i] if batch and s.ndim >= 2 else s

    outs = []
    for i in range(nb):
        scales = None
        if scale_a is not None:
            sa = expand_scale(item(scale_a, i), m, tiles, a.device, "scale_a")
            sb = expand_scale(item(scale_b, i), n, tiles, a.device, "scale_b")
            scales = (sa, sb, scale_block_k)
        ai, bi, ci = a2[i], b2[i], c2[i].contiguous()
        if ai.numel() == 0 or bi.numel() == 0:
            # no products (K = 0: the sum is exactly zero, out = c in every model) or no
            # outputs (M = 0 or N = 0)
            out = ci.clone()
        elif model is Accumulation.HOPPER:
            out = _hopper(ai, bi, ci, fa, fb, rules, promote_every, tile_k, chain, scales)
        elif scales is not None:
            out = _scaled_tiles(ai, bi, ci, fa, fb, model, scales)
        elif model is Accumulation.EXACT:
            out = exact.exact_matmul(ai, bi, ci, fa, fb)
        else:
            out = exact.fp32_matmul(ai, bi, ci, fa, fb)
        outs.append(canonicalize_nan(out))
    if outs:
        out = torch.stack(outs).reshape(*batch, m, n)
    else:  # an empty batch
        out = torch.empty((*batch, m, n), dtype=torch.float32, device=a.device)
    return out.cpu().numpy() if was_numpy else out


__all__ = ["CPU_BLOCK", "matmul"]
