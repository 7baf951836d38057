"""Warp-specialized FP8 backward kernels for Hopper, in Gluon: what ``bwd._bwd_dkdv_kernel`` and
``bwd._bwd_dq_kernel`` compute (the dq kernel at the end of this docstring).

The dkdv kernel: one CTA per ``BLOCK_N = 64`` keys of one key/value head, looping over its ``GROUP`` query heads
and, per head, over query tiles of ``BLOCK_M`` (the recipe's ``block_m1``, 64). A consumer warp
group (the default partition, four warps) runs the wgmmas and the elementwise work; a one-warp
producer (a worker partition whose registers ``setmaxnreg`` lowers to 24) loads K and V once and
streams each query tile's four operand tiles into a ring of ``STAGES`` shared-memory buffers
through TMA. Two CTAs share an SM (128 registers a thread at launch; the consumer rises to 232),
so one CTA's elementwise work overlaps the other's wgmmas.

The consumer, for its key tile (K8, V8 and their per-token scales) and every query tile, the
same operations in the same order as the Triton kernel, so its dK and dV are the Triton kernel's
value for value (the sign of a zero aside, below):

    S2^T = wgmma(K8, Q8^T) * (k_scale_j * q_scale_i * tau * log2 e)   # one rounded multiply
    P^T  = exp2(S2^T - LSE2_i), 0 where masked (causal, queries past N)
    dP^T = wgmma(V8, dO8^T) * (v_scale_j * do_scale_i)                 # one rounded multiply
    dS^T = P^T (dP^T - D_i);  Q-point dS: E4M3, one POW2_DOWN scale per key row of the tile
    dV  += wgmma(E4M3(2**8 P^T), dO^T copy) * dO^T scale_c          # a chain per tile, promoted
    dK  += wgmma(E4M3(dS^T), Q^T copy) * Q^T scale_c * dS scale_j

S^T and dP^T are m64 wgmmas over keys (A: the K and V row tiles, B: the Q and dO row tiles
permuted, the head dim contiguous in both), so P^T and dS^T are born in the accumulator layout
of an m64 wgmma over keys and become the A operand of the accumulating wgmmas by a register
layout conversion (as ``fwd_ws`` does with P); their B operands are the transposed copies (tokens
contiguous), permuted.

Why 64 keys and one warp group: at D = 128 dK and dV are 64 float32 registers a thread each for
64 keys, and the per-tile promotion needs a third such tile (the wgmma chain's result before its
float32 add): 192 registers beside S^T or dP^T (32) and the FP8 operands (8 each). 128 keys in one
warp group would need twice that, beyond the 255 a thread can hold; so a warp group holds one
key tile of 64 and ptxas fits it in 232 registers without spills (``compile_sm90``;
tests/kernels/test_bwd_ws.py). ``BLOCK_M = 64`` is the recipe's dS block (1 x 64) and promotion
interval, and must stay so. What makes it fit (the spills of the alternatives:
docs/kernels_speed.md): the transposed copies' per-channel scales come through TMA into shared
memory with the Q^T and dO^T tiles and are read after the wgmma that needs them; the per-query
vectors (Q's scale, LSE2, dO's scale, D) are moved into S^T's column layout through shared
memory where they are used; S^T, the softmax, then dP^T.

Schedules (``OVERLAP``; the same operations on the same values in every one, so the same bits):

- 0, serial (the default at D = 128): every wgmma is waited on before the next is issued.
- 1 (the default at D = 64): dP^T is issued right behind S^T and runs during the softmax
  (``warpgroup_mma_wait(1)``).
- 2 (not with ``SPLIT``): 1, and P^T dO is issued right behind dP^T and runs during dS.

Nothing is in flight across the loop's back edge. At D = 64 all three compile without spills
and without ptxas serializing the wgmmas (C7514); at D = 128, 1 and 2 spill (the dP^T or P^T dO
accumulator in flight beside dK and dV), so there the serial schedule is the default; at D = 64,
1 is the default as the faster one (``config.default_ws_bwd_tiles``; docs/kernels_speed.md).

Barriers, in the order each role uses them:

- ``kv_ready``: the producer arms it once, TMA completes it with K and V.
- ``rows_ready[s]`` / ``cols_ready[s]``: the Q and dO row tiles (for S^T and dP^T), and the Q^T
  and dO^T tiles with their scales (for dK and dV), of the query tile in stage s; the consumer
  waits with phase ``(i // STAGES) & 1`` for iteration i.
- ``rows_free[s]`` / ``cols_free[s]``: the consumer arrives once the wgmmas that read them have
  been waited on, after ``fence_async_shared``; the producer waits (phase flipped: the first
  round passes) before overwriting. The fence orders the consumer's own reads of the stage
  (the scale rows, loaded by every warp; the per-query vectors' layout conversions) before the
  producer's next TMA writes into it (without it a later tile's scales were read:
  docs/kernels_speed.md, "A proxy fence before each ring release").

Tensors are those ``bwd.backward`` passes to the Triton kernel, read through 2-D TMA descriptors
built on the host once a launch (``_descriptors``; or, ``host_descriptors=False``, in every CTA
as ``fwd_ws`` does: eight serialized tensor-map writes before the first load): the row copies as
``(B*H*N, D)``, the transposed copies as ``(B*H*D, NPAD)`` (padded with zero codes) and their
scales as ``(B*H*NPAD/128, D)``. A tile past a head's N reads the next head's tokens (or TMA's
zeros), where the Triton kernel reads zeros: queries past N get LSE2 = +inf (P = exp2(-inf) = 0, the
Triton kernel's masked 0) and zero scales, so they add nothing to any sum (at most the sign of a
zero dS differs); keys past N are not masked, since a row of P^T or dS^T reaches only its own
row of dK and dV, which is not stored. Not supported (``dkdv`` raises): the debug dumps.

The dq kernel (``_bwd_dq_ws_kernel``, launched by :func:`dq`): what ``bwd._bwd_dq_kernel``
computes, for the stale and the matched delta, on the same inputs. One CTA per 64 queries of one
query head (``DQ_BLOCK_M``; the Triton kernel takes 128 at D = 128, which no stored value sees:
every row of dQ and D depends on its own rows of P and dP alone), looping over the key tiles of
``BLOCK_N`` = the recipe's ``block_n2`` = 64 keys (its dS block for dQ, its promotion interval and
kbar's tile). The producer warp loads the Q and dO row tiles once, then streams each key tile's
K and V row tiles and the K^T tile with its scale row into a ring of ``STAGES`` stages
(``WsBwdTiles.dq_stages``). The consumer, for every key tile, the Triton kernel's operations in
its order:

    S2 = wgmma(Q8, K8^T) * (q_scale_i * tau * log2 e * k_scale_j)   # one rounded multiply
    P  = exp2(S2 - LSE2_i), 0 where masked (causal; keys past N)
    dP = wgmma(dO8, V8^T) * (do_scale_i * v_scale_j)                # one rounded multiply
    pdp_i += sum_j P dP                                             # matched: the D it stores
    dS = P (dP - Dst_i);  Q-point dS: E4M3, one POW2_DOWN scale per query row of the tile
    dQ += wgmma(E4M3(dS), K^T copy) * K^T scale_c * dS scale_i      # a chain per tile, promoted
    kbar = f16(kbar + f16wgmma(E4M3(2**4 P), K^T copy) * K^T scale_c / (2**4 u))   # matched

and after the last tile (matched) D = pdp is stored and dQ -= (D - Dst) kbar u; dQ * tau is
stored in BF16. S and dP are m64 wgmmas over queries (A: the Q and dO tiles, loaded once; B: the
K and V row tiles permuted), so P and dS are born in the accumulator layout of S and become the
A operands of dS K and kbar's wgmma by a register layout conversion; their B is the K^T tile
permuted. The per-query vectors (Q's scale, dO's scale, LSE2, Dst) are loaded once, two
registers a thread each in S's row layout; the per-key scales one element a thread, moved into
S's column layout where used; the K^T channel scales come with the tile by TMA. Registers at
D = 128: dQ 64 float32 a thread, kbar 32 (float16 pairs), the promoted chain's result 64 (kbar's
float16 one 32), S and dP 32 each; serial, this fits 232 without spills, and so do
``OVERLAP`` 1 (dP issued behind S, running during the softmax) and 3 (S of the next key tile
issued behind dS K, stale, or behind kbar's wgmma, matched, running during that promotion and
waited on before the loop's back edge; then dP runs during the softmax; the producer loads one K
tile past the last, which that last issue reads and nothing uses); ``OVERLAP`` 2 (matched: kbar's
wgmma issued behind dS K) spills about 60 B at D = 128 and none at D = 64, where it is the
matched dq's default (``config.default_ws_bwd_tiles``). In the SASS, ptxas
places the softmax's exp2s after dP's wait (1 and 3), while 3's next S does run during the
promotion it is issued before. Queries past N get
LSE2 = +inf (P = 0) and are not stored; keys past N (the last tile reads the next head's K and
V rows, or TMA's zeros, where the Triton kernel reads zeros) are masked by the causal compare or,
non-causal, by one compare of their own, and the K^T copy is zero there: the extra zeros the
Triton kernel's causal tiles add beyond a row's diagonal and these differ from it at most in
the sign of a zero term, which no sum it adds to can show (dQ, kbar and the row sums start at
+0). Not supported (``dq`` raises): the debug row sums.

The five-GEMM kernel (``_bwd_fused_ws_kernel``, launched by :func:`fused`, ``launch(...,
kernel="fused")``): the dkdv kernel with a fifth GEMM per query tile, ``bwd_fused``'s
computation on the dkdv kernel's CTAs. K's transposed tile and its channel scales come with K
and V (``kv_ready``) and stay in shared memory. Per query tile, right after dS^T is formed:

    Q-point dS (dQ): E4M3, one POW2_DOWN scale per query (a column of dS^T) over the 64 keys
    dQ_acc[queries] += wgmma(Q8(dS), K^T copy^T) * K^T scale_c * dS scale_i   # float32 atomics

dS, a (queries, keys) A operand, is moved from dS^T's layout by a register layout conversion;
at D = 128 the wgmma runs on two 64-channel halves (the same chains). It runs before the dV and
dK wgmmas so that nothing of it lives across their promotion, which fills the registers. Keys
past N are masked in P^T (they would reach dQ's sums and its per-query scale). Rows past N are
not added (no mask where N is a multiple of 64, ``EVEN_N``). ``DETERMINISTIC``: the counters of
``bwd_fused`` (key block j adds after the blocks before it). The D it subtracts is read from a
buffer, as ``bwd_fused``'s: the stale one, or a matched one computed ahead by the pre-pass. For a spec that
scales dS for dQ from the pre-pass's bound (``KernelSpec.dsq_row``, ``DSQ_ROW``), each query's
scale is POW2_DOWN of its bound U (``DSQ_U``, loaded with the other per-query vectors) instead of
its amax over the CTA's keys, and the partial is added unscaled: its factors, K's head scale and
the query's 2^-k, are the same in every key block, and the postprocess applies them once.
ptxas spills 108-180 B a thread at D = 128 (tests/kernels/test_bwd_ws_fused.py); none at
D = 64.

With ``consumers=2`` (``WsBwdTiles(fused_consumers=2)``, or ``fused(..., consumers=2)``; not the
default) a CTA of the five-GEMM kernel takes 128 keys on two consumer warp groups that share one
ring of query tiles, FlashAttention-3's backward structure: the default partition takes keys
0..63, a four-warp worker partition keys 64..127, each with its own K, V and K^T tiles in shared
memory (all four loads on ``kv_ready``; K^T's channel scales are one row for the 128 keys), so
each query tile's Q, dO, Q^T, dO^T and their scales cross into shared memory once for 128 keys
instead of once for 64. One CTA of 384 threads an SM (``_gluon.TWO_CONSUMER_LAUNCH_REGS``, 168
registers at launch; the producer drops to 24, each consumer rises to 240); the free barriers
count one arrival from each consumer. Each consumer runs the one-consumer CTA of its 64 keys,
the same query tiles in the same order, so dK and dV are to be the one-consumer kernel's bits,
and deterministic dQ too (the consumer of key block j = ``start_n // 64`` adds after the counter
reads j, as before). The ring starts at the CTA's first query tile (causal: the one of the first
consumer's keys). The second consumer releases, unread, the tiles its one-consumer CTA does not
run, after their loads have landed (an earlier arrival could complete the stage's previous phase
before the first consumer has released it): causal, the first tile of each query head, whose
queries all precede its keys, and every tile where its keys all lie past N (the last CTA of a
head; it stores nothing and adds nothing to dQ). Computing those tiles instead, with P = 0 from
the masks, would add signed zeros: the dV and dK chains of zero codes times codes of either sign
may give -0, and a float32 add of a zero leaves every accumulator bit for bit but a -0 one, which
+0 makes +0 (dQ's atomic adds alike). An accumulator, which starts at +0, turns -0 only where a
multiply-add's exact result is negative and rounds to zero (a product below the smallest
subnormal; the adds do not flush to zero, and an exact zero sum is +0), rare but possible, and
BF16 keeps the sign of a zero: the skip keeps the bits without that proviso.

Compiled for sm_90a (``compile_sm90(kernel="fused", consumers=2)``,
tests/kernels/test_bwd_ws_fused.py), causal or not, deterministic or not, N a multiple of 64 or
not: 168 registers at launch, no serialized wgmma. D = 64: no spills, 66,896 B of shared memory
with two stages (the one-consumer kernel: 50,508 B a CTA, two CTAs an SM). D = 128: 48-160 B of
spills a thread by ptxas's count, which sums the code of both consumers (by the SASS's local
loads and stores 12-52 B in the first's and 32-96 B in the second's, where the one-consumer
kernel's consumer has 108-180 B), 125,520 B of shared memory (the one-consumer kernel: 96,844 B).
It has not run on a GPU.

The pre-pass (``launch(..., kernel="prepass")``, :func:`prepass`): the dq kernel stopped at its row
sums (``PREPASS``), S, P, dP and D = sum_j P dP, the matched D of the dq kernels bit for bit,
for the seven-GEMM recipe (pre-pass, then the five-GEMM kernel with that D); the K^T tiles are
not loaded.
"""

from __future__ import annotations

import os

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from ._gluon import LAUNCH_REGS, PRODUCER_REGS, TWO_CONSUMER_LAUNCH_REGS, TWO_CONSUMER_REGS, allocator
from ._gluon import shared_layout as _shared_layout
from ._gluon import unswizzled_layout as _unswizzled_layout
from ._gluon import tma_reduce_add as _tma_reduce_add
from ._gluon import exp2_int as _exp2_int
from ._gluon import mul_rn as _mul_rn
from ._gluon import pow2_down_exponent as _pow2_down_exponent
from ._gluon import to_fp8 as _to_fp8
from ._runtime import Launch, triton_type
from .config import QUANT_BLOCK as _QUANT_BLOCK

#: tokens per scale block of a transposed copy (``config.QUANT_BLOCK``)
QUANT_BLOCK = gl.constexpr(_QUANT_BLOCK)
#: keys per CTA: one m64 wgmma row block of the consumer warp group
BLOCK_N = gl.constexpr(64)
#: consumer warps (one warp group)
NUM_WARPS = 4

@gluon.jit
def _producer(k_desc, v_desc, q_desc, do_desc, qt_desc, dot_desc, qts_desc, dots_desc, kt_desc, kts_desc, k_smem,
              v_smem, kt_smem, kts_smem, q_bufs, do_bufs, qt_bufs, dot_bufs, qts_bufs, dots_bufs, kv_ready,
              rows_ready, rows_free, cols_ready, cols_free, kv_row, bkv, start_n, bh0, lo, n_m, n_iter, N, NPAD,
              HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, FUSED: gl.constexpr,
              k_smem1=None, v_smem1=None, kt_smem1=None, CONSUMERS: gl.constexpr = 1, VEC_TMA: gl.constexpr = False,
              vec_descs=None, vec_bufs=None, NV: gl.constexpr = 0):
    """TMA loads: K and V row tiles once (``FUSED``: and K's transposed tile with its scale row;
    ``CONSUMERS`` 2: those of keys ``start_n + 64 ..`` too, into ``k_smem1``, ``v_smem1``,
    ``kt_smem1``, the scale row being one for the CTA's 128 keys), then per iteration i (query
    head ``bh0 + i // n_m``, query tile ``lo + (i % n_m) * BLOCK_M``) the Q and dO row tiles, and
    the Q^T and dO^T tiles with their scales (the row of ``(NPAD // QUANT_BLOCK, D)`` factors of
    the tile's token block). ``VEC_TMA``: with the row tiles, the query tile's ``NV`` per-query
    vectors (``vec_descs``: Q's scale, LSE2, dO's scale, D and, ``NV`` 5, U; rows of ``BLOCK_M``
    float32) into ``vec_bufs[s * NV + j]``."""
    if FUSED:
        mbarrier.expect(kv_ready, CONSUMERS * (k_desc.block_type.nbytes + v_desc.block_type.nbytes
                                               + kt_desc.block_type.nbytes) + kts_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(kt_desc, [bkv * HEAD_DIM, start_n], kv_ready, kt_smem)
        tma.async_copy_global_to_shared(kts_desc, [bkv * (NPAD // QUANT_BLOCK) + start_n // QUANT_BLOCK, 0],
                                        kv_ready, kts_smem)
        if CONSUMERS == 2:
            tma.async_copy_global_to_shared(kt_desc, [bkv * HEAD_DIM, start_n + BLOCK_N], kv_ready, kt_smem1)
            tma.async_copy_global_to_shared(k_desc, [kv_row + BLOCK_N, 0], kv_ready, k_smem1)
            tma.async_copy_global_to_shared(v_desc, [kv_row + BLOCK_N, 0], kv_ready, v_smem1)
    else:
        mbarrier.expect(kv_ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [kv_row, 0], kv_ready, k_smem)
    tma.async_copy_global_to_shared(v_desc, [kv_row, 0], kv_ready, v_smem)
    for i in range(n_iter):
        s = i % STAGES
        ph = ((i // STAGES) & 1) ^ 1
        bh = bh0 + i // n_m
        start_m = lo + (i % n_m) * BLOCK_M
        mbarrier.wait(rows_free.index(s), ph)
        # NV is 0 without VEC_TMA
        mbarrier.expect(rows_ready.index(s), q_desc.block_type.nbytes + do_desc.block_type.nbytes
                        + NV * vec_descs[0].block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [bh * N + start_m, 0], rows_ready.index(s), q_bufs.index(s))
        tma.async_copy_global_to_shared(do_desc, [bh * N + start_m, 0], rows_ready.index(s), do_bufs.index(s))
        if VEC_TMA:
            vrow = (bh * N + start_m) // BLOCK_M  # N a multiple of BLOCK_M: one row of one head
            for j in gl.static_range(NV):
                tma.async_copy_global_to_shared(vec_descs[j], [vrow, 0], rows_ready.index(s),
                                                vec_bufs.index(s * NV + j))
        mbarrier.wait(cols_free.index(s), ph)
        mbarrier.expect(cols_ready.index(s), qt_desc.block_type.nbytes + dot_desc.block_type.nbytes
                        + qts_desc.block_type.nbytes + dots_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(qt_desc, [bh * HEAD_DIM, start_m], cols_ready.index(s), qt_bufs.index(s))
        tma.async_copy_global_to_shared(dot_desc, [bh * HEAD_DIM, start_m], cols_ready.index(s), dot_bufs.index(s))
        sc_row = bh * (NPAD // QUANT_BLOCK) + start_m // QUANT_BLOCK
        tma.async_copy_global_to_shared(qts_desc, [sc_row, 0], cols_ready.index(s), qts_bufs.index(s))
        tma.async_copy_global_to_shared(dots_desc, [sc_row, 0], cols_ready.index(s), dots_bufs.index(s))


@gluon.jit
def _promote(acc, a8, b_smem, t_old, scale_smem, row_factor, acc_layout: gl.constexpr, ROW: gl.constexpr):
    """acc + wgmma(a8, b) * scale_c (* row_factor_j with ``ROW``): one wgmma chain over the query
    tile, waited on, then one float32 multiply-add. ``t_old``: a dead tile of acc's shape, the
    wgmma's ignored accumulator (``use_acc=False``), so that no zero tile is written. Returns
    (acc, the chain's result, now dead)."""
    t = warpgroup_mma(a8, b_smem, t_old, use_acc=False, is_async=True)
    t = warpgroup_mma_wait(num_outstanding=0, deps=(t, ))
    return _promote_add(acc, t, scale_smem, row_factor, acc_layout, ROW), t


@gluon.jit
def _promote_add(acc, t, scale_smem, row_factor, acc_layout: gl.constexpr, ROW: gl.constexpr):
    """:func:`_promote`'s float32 multiply-add of a chain's result ``t``, waited on: acc + t *
    scale_c (* row_factor_j with ``ROW``)."""
    # the channel scales, from shared memory after the wait (not held across the wgmma)
    scale = gl.expand_dims(scale_smem.load(gl.SliceLayout(0, acc_layout)), 0)
    if ROW:
        acc += t * scale * gl.expand_dims(row_factor, 1)
    else:
        acc += t * scale
    return acc


@gluon.jit
def _dq_tile_out(dq, desc, dq_smem, row, col, PENDING: gl.constexpr = 0):
    """A float32 dQ (or dQ^T) partial tile's way out with TMA reduce-adds: through ``dq_smem``,
    once the previous reduce has read that tile, by one reduce-add into ``desc`` at ``(row, col)``.
    ``PENDING``: reduces issued since the one that read ``dq_smem`` last, which may go on (1 where
    two shared tiles take turns)."""
    tma.store_wait(PENDING)  # the previous reduce from dq_smem has read it
    dq_smem.store(dq)
    fence_async_shared()
    gl.thread_barrier()  # every thread's part of the tile is in shared memory
    _tma_reduce_add(desc, [row, col], dq_smem)


@gluon.jit
def _dq_add(dsq_a, kt_b, kts_row, dsq_inv, DQ_ACC, dq_smem, bh, row0, start_q, c0, N, HEAD_DIM: gl.constexpr,
            CH: gl.constexpr, q_layout: gl.constexpr, EVEN_N: gl.constexpr, DQ_TMA: gl.constexpr,
            DSQ_ROW: gl.constexpr = False):
    """dQ's partial over the tile's keys for channels ``c0 .. c0 + CH``: one wgmma chain of dS
    (``dsq_a``) and K (``kt_b``), times the K^T channel scales and dS's query factors, added into
    ``DQ_ACC`` (float32 atomics; rows past N are not added). ``DQ_TMA``: ``DQ_ACC`` is the
    buffer's TMA descriptor ``(B*H*N, D)`` and the tile goes through ``dq_smem`` by one TMA
    reduce-add (N a multiple of the tile: no tile crosses a head), once the previous one has read
    ``dq_smem``. ``DSQ_ROW``: the partial is added unscaled (its factors, the head's K scale and
    each query's dS factor, are the same in every key block: the postprocess applies them)."""
    t = warpgroup_mma(dsq_a, kt_b, gl.zeros([dsq_a.shape[0], CH], gl.float32, q_layout), use_acc=False,
                      is_async=True)
    t = warpgroup_mma_wait(num_outstanding=0, deps=(t, ))
    if DSQ_ROW:
        dq = t
    else:
        dq = t * gl.expand_dims(kts_row.load(gl.SliceLayout(0, q_layout)), 0) * gl.expand_dims(dsq_inv, 1)
    if DQ_TMA:
        _dq_tile_out(dq, DQ_ACC, dq_smem, (bh * N + start_q).to(gl.int32), c0)
    else:
        rows_q = gl.arange(0, dsq_a.shape[0], layout=gl.SliceLayout(1, q_layout))
        cols = gl.arange(0, CH, layout=gl.SliceLayout(0, q_layout))
        # one scalar base a tile and int32 offsets within it (per-element 64-bit pointers, which the
        # compiler forms before the loop, spilled 0.5 KB a thread at D = 128)
        ptrs = (DQ_ACC + (row0 + start_q * HEAD_DIM + c0)) + (gl.expand_dims(rows_q * HEAD_DIM, 1) + gl.expand_dims(cols, 0))
        if DQ_PROBE == 1:
            gl.store(ptrs, dq, mask=gl.expand_dims(start_q + rows_q < -1, 1))
        elif DQ_PROBE == 2:
            gl.store(ptrs, dq)
        elif EVEN_N:  # no query tile runs past N: no mask (a masked atomic is a branch each)
            gl.atomic_add(ptrs, dq, sem="relaxed")
        else:
            gl.atomic_add(ptrs, dq, mask=gl.expand_dims(start_q + rows_q < N, 1), sem="relaxed")


#: channels of one dQ wgmma in the fused kernel (two halves at D = 128: _dq_partial)
DQ_CH = gl.constexpr(64)
#: a timing probe of the fused kernel's dQ path, read once at import from the environment variable
#: ``DMREF_FUSED_DQ_PROBE`` (``benchmarks/bench_bwd_fused_parts.py`` sets it in a process of its
#: own): 0 (unset) the kernel as it is; 1 dQ's partial computed but not added (its stores masked
#: off); 2 added by plain stores instead of atomics; 3 no fifth GEMM at all (neither dS's
#: quantization for dQ nor the wgmma). dQ is wrong under 1-3: those runs are timed, never read.
DQ_PROBE = gl.constexpr(int(os.environ.get("DMREF_FUSED_DQ_PROBE", "0")))
#: the accumulator layout of that wgmma: dQ's (queries, DQ_CH channels) tile on one warp group
DQ_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                   instr_shape=[16, DQ_CH.value, 32]))


@gluon.jit
def _ds_for_dq_exponent(ds_t):
    """The POW2_DOWN exponent of each query's dS-for-dQ scale from dS^T ``(keys, queries)``: of
    its amax over the tile's keys (a column; the recipe's ``ds_dq``, 1 x ``BLOCK_N``), in S^T's
    column layout. (``DSQ_ROW`` takes it from the pre-pass's bound instead.)"""
    return _pow2_down_exponent(gl.max(gl.abs(ds_t), axis=0), False)


@gluon.jit
def _quantize_ds_for_dq(ds_t, k_dq):
    """Q-point dS for dQ from dS^T ``(keys, queries)``: E4M3, each query (a column) scaled by
    2^``k_dq`` (:func:`_ds_for_dq_exponent`, or the bound's under ``DSQ_ROW``; as
    ``bwd_fused._quantize_ds_cols`` of the amax). Returns dS ``(queries, keys)`` as the A operand of
    :func:`_dq_partial`'s wgmma, and each query's dequantization factor. Done where dS^T is formed,
    so that only the FP8 codes, not the float32 tile, live across the dK and dV wgmmas."""
    q_layout: gl.constexpr = DQ_LAYOUT
    dsq = _to_fp8(ds_t * gl.expand_dims(_exp2_int(k_dq), 0), False, False)
    dsq_a = gl.convert_layout(gl.permute(dsq, [1, 0]), gl.DotOperandLayout(operand_index=0, parent=q_layout,
                                                                            k_width=4))
    return dsq_a, gl.convert_layout(_exp2_int(-k_dq), gl.SliceLayout(1, q_layout))


@gluon.jit
def _quantize_ds_for_dq_t(ds_t, k_dq, dsq_smem):
    """:func:`_quantize_ds_for_dq`'s codes and factors for dQ^T = K^T dS^T (``DQ_T``): the codes
    stored as dS ``(queries, keys)`` into ``dsq_smem``, the wgmma's B operand (K-major: FP8 wgmma
    has no transpose), instead of moved into registers; each query's factor stays in S^T's column
    layout, which is the dQ^T accumulator's."""
    dsq = _to_fp8(ds_t * gl.expand_dims(_exp2_int(k_dq), 0), False, False)
    dsq_smem.store(gl.permute(dsq, [1, 0]))
    fence_async_shared()  # the generic stores before the wgmma's reads
    gl.thread_barrier()  # every thread's part of the tile
    return _exp2_int(-k_dq)


@gluon.jit
def _dq_add_t(kt_a, dsq_b, kts_row, dsq_inv, DQT_ACC, dq_smem, bh, start_q, c0, HEAD_DIM: gl.constexpr,
              CH: gl.constexpr, BLOCK_M: gl.constexpr, q_layout: gl.constexpr, DSQ_ROW: gl.constexpr = False,
              PENDING: gl.constexpr = 0):
    """:func:`_dq_add` transposed (``DQ_T``): dQ^T's partial for channels ``c0 .. c0 + CH``, one
    wgmma chain of K^T (``kt_a``, as it lies) and dS^T (``dsq_b``: the shared dS codes), times the
    K^T channel scales (rows) and dS's query factors (columns), in that order; by one TMA
    reduce-add into dQ^T's buffer ``DQT_ACC`` ``(B*H*D, N)``; ``DSQ_ROW``: unscaled (:func:`_dq_add`);
    ``PENDING``: :func:`_dq_tile_out`'s."""
    t = warpgroup_mma(kt_a, dsq_b, gl.zeros([CH, BLOCK_M], gl.float32, q_layout), use_acc=False, is_async=True)
    t = warpgroup_mma_wait(num_outstanding=0, deps=(t, ))
    _dq_t_out(t, kts_row, dsq_inv, DQT_ACC, dq_smem, bh, start_q, c0, HEAD_DIM, q_layout, DSQ_ROW, PENDING)


@gluon.jit
def _dq_t_out(t, kts_row, dsq_inv, DQT_ACC, dq_smem, bh, start_q, c0, HEAD_DIM: gl.constexpr,
              q_layout: gl.constexpr, DSQ_ROW: gl.constexpr, PENDING: gl.constexpr):
    """:func:`_dq_add_t`'s part after the wgmma: its result ``t`` times the K^T channel scales and
    dS's query factors (unscaled with ``DSQ_ROW``), by one TMA reduce-add (:func:`_dq_tile_out`)."""
    if DSQ_ROW:
        dq = t
    else:
        dq = t * gl.expand_dims(kts_row.load(gl.SliceLayout(1, q_layout)), 1) * gl.expand_dims(dsq_inv, 0)
    _dq_tile_out(dq, DQT_ACC, dq_smem, (bh * HEAD_DIM + c0).to(gl.int32), start_q, PENDING)


@gluon.jit
def _dq_t_half(h, kt_smem, dsq_smem, kts_smem, dsq_inv, DQT_ACC, dq_smem, bh, start_q, HEAD_DIM: gl.constexpr,
               BLOCK_M: gl.constexpr, DSQ_ROW: gl.constexpr, PENDING: gl.constexpr = 0):
    """:func:`_dq_add_t` for channels ``h * DQ_CH .. + DQ_CH`` of dQ^T: K^T's rows and scales of
    those channels, the shared dS codes ``dsq_smem`` ``(queries, keys)``."""
    _dq_add_t(kt_smem.slice(h * DQ_CH, DQ_CH, dim=0), dsq_smem.permute((1, 0)),
              kts_smem.reshape([HEAD_DIM]).slice(h * DQ_CH, DQ_CH), dsq_inv, DQT_ACC, dq_smem, bh, start_q,
              h * DQ_CH, HEAD_DIM, DQ_CH, BLOCK_M, DQ_LAYOUT, DSQ_ROW, PENDING)


@gluon.jit
def _dq_partial(dsq_a, dsq_inv, kt_smem, kts_smem, DQ_ACC, dq_smem, SEM, bh, start_m, start_n, N,
                HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, DETERMINISTIC: gl.constexpr, EVEN_N: gl.constexpr,
                DQ_TMA: gl.constexpr, DQ_T: gl.constexpr = False, DSQ_ROW: gl.constexpr = False):
    """The fifth GEMM of the fused backward: dQ's partial over this CTA's keys, added into the
    float32 ``DQ_ACC`` ``(B*H, N, D)``: dS (``dsq_a``, :func:`_quantize_ds_for_dq`) times K (keys,
    D) = K's transposed copy permuted, one wgmma chain per output element, then the K^T channel
    scale and dS's query factor (``bwd_fused``'s order). At D = 128 the channels go in two halves
    of ``DQ_CH`` (the same chains: an output element depends on its row of A, its column of B and
    the k order only). ``DETERMINISTIC``: the adds into a (query head, query tile) follow key
    order (``bwd_fused``'s counters: key block j waits until the counter reads j, adds, raises it
    to j + 1). ``DQ_T``: dQ^T by :func:`_dq_add_t`, ``dsq_a`` the shared dS
    codes (:func:`_quantize_ds_for_dq_t`), ``DQ_ACC`` dQ^T's buffer's descriptor. ``DSQ_ROW``:
    dS's codes scaled per query from the pre-pass's bound, the partial added unscaled
    (:func:`_dq_add`)."""
    CH: gl.constexpr = DQ_CH
    q_layout: gl.constexpr = DQ_LAYOUT
    gl.static_assert(not (DQ_TMA and (DETERMINISTIC or not EVEN_N)))
    gl.static_assert(not DQ_T or DQ_TMA)
    row0 = bh * N * HEAD_DIM
    kts = kts_smem.reshape([HEAD_DIM])
    if DETERMINISTIC:
        counter = SEM + bh * gl.cdiv(N, BLOCK_M) + start_m // BLOCK_M
        seen = gl.atomic_add(counter, 0, sem="acquire")
        while seen < start_n // BLOCK_M:
            seen = gl.atomic_add(counter, 0, sem="acquire")
    for h in gl.static_range(HEAD_DIM // CH):
        if DQ_T:
            _dq_t_half(h, kt_smem, dsq_a, kts_smem, dsq_inv, DQ_ACC, dq_smem, bh, start_m, HEAD_DIM, BLOCK_M, DSQ_ROW)
        else:
            _dq_add(dsq_a, kt_smem.slice(h * CH, CH, dim=0).permute((1, 0)), kts.slice(h * CH, CH), dsq_inv,
                    DQ_ACC, dq_smem, bh, row0, start_m, h * CH, N, HEAD_DIM, CH, q_layout, EVEN_N, DQ_TMA, DSQ_ROW)
    if DETERMINISTIC:
        gl.thread_barrier()  # every thread's adds are issued before the release
        gl.atomic_add(counter, 1, sem="release")


@gluon.jit
def _ring_vector(vec_bufs, s, j, NV: gl.constexpr, BLOCK_M: gl.constexpr, layout: gl.constexpr):
    """Per-query vector ``j`` of stage ``s`` of the ring (``VEC_TMA``, :func:`_producer`), read in
    ``layout``."""
    return vec_bufs.index(s * NV + j).reshape([BLOCK_M]).load(layout)


@gluon.jit
def _release(rows_ready, rows_free, cols_ready, cols_free, i, STAGES: gl.constexpr):
    """Stage i of the ring released by a consumer that does not read it: once its loads have
    landed (an arrival before then could complete the stage's previous phase, which the other
    consumer may not have released yet)."""
    s = i % STAGES
    ph = (i // STAGES) & 1
    mbarrier.wait(rows_ready.index(s), ph)
    mbarrier.arrive(rows_free.index(s), count=1)
    mbarrier.wait(cols_ready.index(s), ph)
    mbarrier.arrive(cols_free.index(s), count=1)


@gluon.jit
def _consumer(k_smem, v_smem, kt_smem, kts_smem, q_bufs, do_bufs, qt_bufs, dot_bufs, qts_bufs, dots_bufs, kv_ready,
              rows_ready, rows_free, cols_ready, cols_free, Q_SCALE, K_SCALE, V_SCALE, DO_SCALE, LSE2, DELTA, DK, DV,
              DQ_ACC, SEM, qk_scale, sm_scale, bkv, bh0, start_n, lo, n_m, n_iter, N, NPAD,
              HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
              P_SCALE: gl.constexpr, SPLIT: gl.constexpr, OVERLAP: gl.constexpr, FUSED: gl.constexpr,
              DETERMINISTIC: gl.constexpr, EVEN_N: gl.constexpr, SKIP: gl.constexpr = False, dq_smem=None,
              DQ_TMA: gl.constexpr = False, dsq_smem=None, DQ_T: gl.constexpr = False, DSQ_U=None,
              DSQ_ROW: gl.constexpr = False, DQ_ORDER: gl.constexpr = 0, VEC_TMA: gl.constexpr = False,
              vec_bufs=None, NV: gl.constexpr = 0):
    """The consumer warp group: the key tile's scales, every query tile, the stores. With
    ``SPLIT`` dK and dV are held as two halves of the head dim, each accumulated by its own
    wgmma (the same per-element chains: a wgmma's output element depends on its row of A, its
    column of B and the k order only). ``FUSED``: the fifth GEMM, dQ's partial over this key tile
    added into ``DQ_ACC`` (:func:`_dq_partial`). ``SKIP`` (the second consumer of a two-consumer
    CTA, whose ring starts at the CTA's first query tile): the query tiles a one-consumer CTA of
    keys ``start_n ..`` does not run are released without being computed. ``DSQ_ROW``
    (``KernelSpec.dsq_row``): dS for dQ scaled per query from the pre-pass's bound of its amax over
    all keys (``DSQ_U``) instead of its amax over the tile's keys, dQ's partials added unscaled.
    ``DQ_ORDER`` (``FUSED`` with ``DQ_T``; ``config.WsBwdTiles.fused_dq_order``): where dQ^T's
    partial goes among dV and dK, the same values in every order: 0 before both; 1 (D = 128) its
    first half before dV and its second between dV and dK, so that the second half's wait for the
    first's reduce-add to have read the shared tile falls behind dV's wgmma; 2 (D = 64) its wgmma
    and those of dV and dK issued together, each waited on in turn (three results in flight), so
    that dQ^T's way out runs under dV's and dK's wgmmas and their promotions under each other's; 3
    (D = 128) before both, its two halves through two shared tiles of their own (``dq_smem``
    ``[2, D/2, BLOCK_M]``), so that neither waits for the other's reduce-add. ``VEC_TMA``: the
    per-query vectors come with the row tiles through the ring (``vec_bufs``, :func:`_producer`)
    and are read from shared memory in S^T's column layout where they are used, instead of loaded
    one element a thread and moved into that layout through shared memory (two barriers of the
    warp group each)."""
    CH: gl.constexpr = HEAD_DIM // 2 if SPLIT else HEAD_DIM
    gl.static_assert(OVERLAP < 2 or not SPLIT)
    gl.static_assert(not FUSED or (not SPLIT and OVERLAP < 2 and BLOCK_M == BLOCK_N))
    gl.static_assert(DQ_ORDER == 0 or (FUSED and DQ_T and DQ_PROBE == 0))
    gl.static_assert(DQ_ORDER != 1 or HEAD_DIM == 2 * DQ_CH)
    gl.static_assert(DQ_ORDER != 3 or HEAD_DIM == 2 * DQ_CH)
    gl.static_assert(DQ_ORDER != 2 or HEAD_DIM == DQ_CH)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 32])
    a_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, CH, 32])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=a_layout, k_width=4)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)  # per key of S^T
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)  # per query of S^T
    row_a: gl.constexpr = gl.SliceLayout(1, a_layout)  # per key of dK, dV
    col_a: gl.constexpr = gl.SliceLayout(0, a_layout)  # per channel of dK, dV
    vec_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    offs_n = start_n + gl.arange(0, BLOCK_N, layout=row_s)
    in_seq = offs_n < N
    # causal: the first query that sees key j is j (a key past N: none)
    first_q = gl.where(in_seq, offs_n, 2**31 - 1)
    kv64 = bkv.to(gl.int64)
    k_scale = gl.load(K_SCALE + kv64 * N + offs_n, mask=in_seq, other=0.0)
    v_scale = gl.load(V_SCALE + kv64 * N + offs_n, mask=in_seq, other=0.0)
    offs_c = gl.arange(0, CH, layout=col_a)
    dk0 = gl.zeros([BLOCK_N, CH], gl.float32, a_layout)
    dv0 = gl.zeros([BLOCK_N, CH], gl.float32, a_layout)
    if SPLIT:
        dk1 = gl.zeros([BLOCK_N, CH], gl.float32, a_layout)
        dv1 = gl.zeros([BLOCK_N, CH], gl.float32, a_layout)
    mbarrier.wait(kv_ready, 0)
    n_run = n_iter
    if SKIP:
        # the second consumer of a two-consumer CTA runs the query tiles of a one-consumer CTA of
        # its keys: none where they all lie past N (it releases every stage), else, causal, all but
        # the first tile of each query head (the CTA's first, whose queries all precede its keys),
        # released before the next one is computed
        past_n = start_n >= N
        for i in range(gl.where(past_n, n_iter, 0)):
            _release(rows_ready, rows_free, cols_ready, cols_free, i, STAGES)
        n_run = gl.where(past_n, 0, n_iter - n_iter // n_m if CAUSAL else n_iter)
    # Invariant at the top of each iteration, over the query tiles (and query heads) done so far:
    # dk = sum of deq(Q8(dS^T)) Q, dv = sum of Q8(2**8 P^T) deq(dO) (float32, one add per tile;
    # dv carries P's 2**8, taken out at the store): the Triton kernel's
    for k in range(n_run):
        if SKIP and CAUSAL:
            # tile t = 1 .. n_m - 1 of head g = k // (n_m - 1) is iteration i = g * n_m + t
            i = k + k // (n_m - 1) + 1
            if i % n_m == 1:
                _release(rows_ready, rows_free, cols_ready, cols_free, i - 1, STAGES)
        else:
            i = k
        s = i % STAGES
        ph = (i // STAGES) & 1
        bh = (bh0 + i // n_m).to(gl.int64)
        start_m = lo + (i % n_m) * BLOCK_M
        offs_m = start_m + gl.arange(0, BLOCK_M, layout=col_s)
        # the per-query vectors: loaded one element a thread, moved into S^T's column layout
        # (16 registers a thread each) through shared memory where they are used, so that none
        # is held across a wgmma
        if not VEC_TMA:
            offs_v = start_m + gl.arange(0, BLOCK_M, layout=vec_layout)
            v_in = offs_v < N
            head = bh * N
            q_scale_v = gl.load(Q_SCALE + head + offs_v, mask=v_in, other=0.0) * qk_scale
            lse2_v = gl.load(LSE2 + head + offs_v, mask=v_in, other=float("inf"))
            do_scale_v = gl.load(DO_SCALE + head + offs_v, mask=v_in, other=0.0)
            delta_v = gl.load(DELTA + head + offs_v, mask=v_in, other=0.0)
            if DSQ_ROW:  # the exponent of each query's dS-for-dQ scale, POW2_DOWN of its bound U
                dsq_k_v = _pow2_down_exponent(gl.load(DSQ_U + head + offs_v, mask=v_in, other=0.0), False)
        # S^T (with OVERLAP, dP^T issued behind it runs during the softmax)
        mbarrier.wait(rows_ready.index(s), ph)
        st = warpgroup_mma(k_smem, q_bufs.index(s).permute((1, 0)),
                           gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout), use_acc=False, is_async=True)
        if OVERLAP >= 1:
            dpt = warpgroup_mma(v_smem, do_bufs.index(s).permute((1, 0)),
                                gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout), use_acc=False, is_async=True)
            st = warpgroup_mma_wait(num_outstanding=1, deps=(st, ))
        else:
            st = warpgroup_mma_wait(num_outstanding=0, deps=(st, ))
        # the softmax, transposed: P^T = exp2(S2^T - LSE2), 0 where masked
        if VEC_TMA:  # every query below N (N a multiple of BLOCK_M): no mask
            q_scale = _ring_vector(vec_bufs, s, 0, NV, BLOCK_M, col_s) * qk_scale
            lse2 = _ring_vector(vec_bufs, s, 1, NV, BLOCK_M, col_s)
        else:
            q_scale = gl.convert_layout(q_scale_v, col_s)
            lse2 = gl.convert_layout(lse2_v, col_s)
        s2 = _mul_rn(st, gl.expand_dims(k_scale, 1) * gl.expand_dims(q_scale, 0), False)
        # masks: queries past N have LSE2 = +inf, so their P is exp2(-inf) = 0 (the Triton
        # kernel's select gives the same 0); causal, one compare a element. Keys past N are not
        # masked: a row of P^T or dS^T reaches only its own row of dK and dV (a wgmma's output row
        # depends on that row of A alone), and those rows are not stored
        p_t = gl.exp2(s2 - gl.expand_dims(lse2, 0))
        if CAUSAL:
            p_t = gl.where(gl.expand_dims(offs_m, 0) >= gl.expand_dims(first_q, 1), p_t, 0.0)
        elif FUSED:
            # keys past N reach dQ's partial (a column of dS^T's block scale and its sum over keys)
            p_t = gl.where(gl.expand_dims(in_seq, 1), p_t, 0.0)
        # Q-point P (dV): float32 -> E4M3, scale 2**8 against LSE
        p8 = gl.convert_layout(_to_fp8(p_t * P_SCALE, False, False), op_layout)
        dot_s = dot_bufs.index(s)
        qt_s = qt_bufs.index(s)
        dots_s = dots_bufs.index(s).reshape([HEAD_DIM])
        qts_s = qts_bufs.index(s).reshape([HEAD_DIM])
        if OVERLAP == 0:
            # dP^T after the softmax (serial)
            dpt = warpgroup_mma(v_smem, do_bufs.index(s).permute((1, 0)), st, use_acc=False, is_async=True)
            dpt = warpgroup_mma_wait(num_outstanding=0, deps=(dpt, ))
        elif OVERLAP == 1:
            dpt = warpgroup_mma_wait(num_outstanding=0, deps=(dpt, ))
        else:
            # P^T dO issued behind dP^T: it runs during dS
            mbarrier.wait(cols_ready.index(s), ph)
            t = warpgroup_mma(p8, dot_s.permute((1, 0)), gl.zeros([BLOCK_N, CH], gl.float32, a_layout),
                              use_acc=False, is_async=True)
            dpt = warpgroup_mma_wait(num_outstanding=1, deps=(dpt, ))
        if VEC_TMA:  # read before the stage is released
            do_scale = _ring_vector(vec_bufs, s, 2, NV, BLOCK_M, col_s)
            delta = _ring_vector(vec_bufs, s, 3, NV, BLOCK_M, col_s)
            if DSQ_ROW:  # the exponents of U (bwd_fused.dsq_exponents), int32 bits in the float32 ring
                k_dq_row = _ring_vector(vec_bufs, s, 4, NV, BLOCK_M, col_s).to(gl.int32, bitcast=True)
        fence_async_shared()  # the reads of this stage before the next TMA writes into it
        mbarrier.arrive(rows_free.index(s), count=1)
        if not VEC_TMA:
            do_scale = gl.convert_layout(do_scale_v, col_s)
            delta = gl.convert_layout(delta_v, col_s)
        dp_t = _mul_rn(dpt, gl.expand_dims(v_scale, 1) * gl.expand_dims(do_scale, 0), False)
        # dS = P (dP - D); Q-point dS: one POW2_DOWN scale per key row of the tile
        ds_t = p_t * (dp_t - gl.expand_dims(delta, 0))
        k_ds = _pow2_down_exponent(gl.max(gl.abs(ds_t), axis=1), False)
        ds8 = gl.convert_layout(_to_fp8(ds_t * gl.expand_dims(_exp2_int(k_ds), 1), False, False), op_layout)
        ds_inv = gl.convert_layout(_exp2_int(-k_ds), row_a)
        if FUSED and DQ_PROBE != 3:
            # dQ's partial first: nothing of it lives across the dK and dV wgmmas and their
            # promotion, which fill the registers
            # Q-point dS (dQ): E4M3, each query's scale from its amax over the tile's keys, or
            # (DSQ_ROW) from U over all keys, whose factor the postprocess applies
            if DSQ_ROW and VEC_TMA:
                k_dq = k_dq_row
            elif DSQ_ROW:
                k_dq = gl.convert_layout(dsq_k_v, col_s)
            else:
                k_dq = _ds_for_dq_exponent(ds_t)
            if DQ_T:
                dsq_inv = _quantize_ds_for_dq_t(ds_t, k_dq, dsq_smem)
                dsq_a = dsq_smem
            else:
                dsq_a, dsq_inv = _quantize_ds_for_dq(ds_t, k_dq)
            if DQ_ORDER == 0:
                _dq_partial(dsq_a, dsq_inv, kt_smem, kts_smem, DQ_ACC, dq_smem, SEM, bh, start_m, start_n, N,
                            HEAD_DIM, BLOCK_M, DETERMINISTIC, EVEN_N, DQ_TMA, DQ_T, DSQ_ROW)
            elif DQ_ORDER == 3:  # the two halves through two shared tiles taking turns
                for h in gl.static_range(2):
                    _dq_t_half(h, kt_smem, dsq_smem, kts_smem, dsq_inv, DQ_ACC, dq_smem.index(h), bh, start_m,
                               HEAD_DIM, BLOCK_M, DSQ_ROW, 1)
            elif DQ_ORDER == 1:  # the first half of the channels; the second between dV and dK
                _dq_t_half(0, kt_smem, dsq_smem, kts_smem, dsq_inv, DQ_ACC, dq_smem, bh, start_m, HEAD_DIM, BLOCK_M,
                           DSQ_ROW)
        # P^T dO and dS^T Q, promoted: one wgmma chain per tile, then one float32 add
        if DQ_ORDER == 2:
            # dQ^T, dV and dK issued together, retired in that order (wgmma groups complete in order)
            mbarrier.wait(cols_ready.index(s), ph)
            tq = warpgroup_mma(kt_smem, dsq_smem.permute((1, 0)), gl.zeros([DQ_CH, BLOCK_M], gl.float32, DQ_LAYOUT),
                               use_acc=False, is_async=True)
            tv = warpgroup_mma(p8, dot_s.permute((1, 0)), gl.zeros([BLOCK_N, CH], gl.float32, a_layout),
                               use_acc=False, is_async=True)
            tk = warpgroup_mma(ds8, qt_s.permute((1, 0)), gl.zeros([BLOCK_N, CH], gl.float32, a_layout),
                               use_acc=False, is_async=True)
            tq = warpgroup_mma_wait(num_outstanding=2, deps=(tq, ))
            _dq_t_out(tq, kts_smem.reshape([HEAD_DIM]), dsq_inv, DQ_ACC, dq_smem, bh, start_m, 0, HEAD_DIM, DQ_LAYOUT,
                      DSQ_ROW, 0)
            tv = warpgroup_mma_wait(num_outstanding=1, deps=(tv, ))
            dv0 = _promote_add(dv0, tv, dots_s, ds_inv, a_layout, False)
            tk = warpgroup_mma_wait(num_outstanding=0, deps=(tk, ))
            dk0 = _promote_add(dk0, tk, qts_s, ds_inv, a_layout, True)
        elif OVERLAP == 2:
            t = warpgroup_mma_wait(num_outstanding=0, deps=(t, ))
            dv0 += t * gl.expand_dims(dots_s.load(col_a), 0)
            dk0, t = _promote(dk0, ds8, qt_s.permute((1, 0)), t, qts_s, ds_inv, a_layout, True)
        else:
            mbarrier.wait(cols_ready.index(s), ph)
            t = gl.zeros([BLOCK_N, CH], gl.float32, a_layout)
            if SPLIT:
                dv0, t = _promote(dv0, p8, dot_s.slice(0, CH, dim=0).permute((1, 0)), t, dots_s.slice(0, CH),
                                  ds_inv, a_layout, False)
                dv1, t = _promote(dv1, p8, dot_s.slice(CH, CH, dim=0).permute((1, 0)), t, dots_s.slice(CH, CH),
                                  ds_inv, a_layout, False)
                dk0, t = _promote(dk0, ds8, qt_s.slice(0, CH, dim=0).permute((1, 0)), t, qts_s.slice(0, CH),
                                  ds_inv, a_layout, True)
                dk1, t = _promote(dk1, ds8, qt_s.slice(CH, CH, dim=0).permute((1, 0)), t, qts_s.slice(CH, CH),
                                  ds_inv, a_layout, True)
            else:
                dv0, t = _promote(dv0, p8, dot_s.permute((1, 0)), t, dots_s, ds_inv, a_layout, False)
                if DQ_ORDER == 1:  # dQ^T's second half
                    _dq_t_half(1, kt_smem, dsq_smem, kts_smem, dsq_inv, DQ_ACC, dq_smem, bh, start_m, HEAD_DIM,
                               BLOCK_M, DSQ_ROW)
                dk0, t = _promote(dk0, ds8, qt_s.permute((1, 0)), t, qts_s, ds_inv, a_layout, True)
        fence_async_shared()  # the reads of this stage before the next TMA writes into it
        mbarrier.arrive(cols_free.index(s), count=1)
    if DQ_TMA:
        tma.store_wait(0)  # the last reduce has read dq_smem before the CTA's shared memory goes
    # stores
    offs_na = start_n + gl.arange(0, BLOCK_N, layout=row_a)
    rows = kv64 * N * HEAD_DIM + gl.expand_dims(offs_na, 1) * HEAD_DIM + gl.expand_dims(offs_c, 0)
    mask = gl.expand_dims(offs_na < N, 1)
    gl.store(DK + rows, (dk0 * sm_scale).to(gl.bfloat16), mask=mask)
    gl.store(DV + rows, (dv0 * (1.0 / P_SCALE)).to(gl.bfloat16), mask=mask)
    if SPLIT:
        gl.store(DK + rows + CH, (dk1 * sm_scale).to(gl.bfloat16), mask=mask)
        gl.store(DV + rows + CH, (dv1 * (1.0 / P_SCALE)).to(gl.bfloat16), mask=mask)


@gluon.jit
def _ring_barriers(STAGES: gl.constexpr, CONSUMERS: gl.constexpr = 1):
    """The two rings' barriers of both kernels, initialized: ``rows_ready`` / ``rows_free`` (the
    row tiles of a stage) and ``cols_ready`` / ``cols_free`` (its transposed tiles and scales),
    one arrival each; the free ones one arrival from each of ``CONSUMERS`` consumers (a stage is
    free once every consumer has released it)."""
    rows_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    rows_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    cols_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    cols_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(rows_ready.index(i), count=1)
        mbarrier.init(rows_free.index(i), count=CONSUMERS)
        mbarrier.init(cols_ready.index(i), count=1)
        mbarrier.init(cols_free.index(i), count=CONSUMERS)
    return rows_ready, rows_free, cols_ready, cols_free


@gluon.jit
def _body(k_desc, v_desc, q_desc, do_desc, qt_desc, dot_desc, qts_desc, dots_desc, kt_desc, kts_desc, Q_SCALE,
          K_SCALE, V_SCALE, DO_SCALE, LSE2, DELTA, DK, DV, DQ_ACC, SEM, qk_scale, sm_scale, H, HKV, N, NPAD,
          HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, GROUP: gl.constexpr, STAGES: gl.constexpr,
          CAUSAL: gl.constexpr, P_SCALE: gl.constexpr, SPLIT: gl.constexpr, OVERLAP: gl.constexpr,
          FUSED: gl.constexpr, DETERMINISTIC: gl.constexpr, EVEN_N: gl.constexpr, CONSUMERS: gl.constexpr = 1,
          DQ_TMA: gl.constexpr = False, DQ_T: gl.constexpr = False, DSQ_U=None, DSQ_ROW: gl.constexpr = False,
          DQ_ORDER: gl.constexpr = 0, VEC_TMA: gl.constexpr = False):
    """The kernel on its TMA descriptors: K, V rows ``(B*HKV*N, D)``, Q, dO rows ``(B*H*N, D)``,
    Q^T, dO^T ``(B*H*D, NPAD)`` and their scales ``(B*H*NPAD/128, D)``; ``FUSED``: K^T
    ``(B*HKV*D, NPAD)`` and its scales, dQ's float32 buffer and (``DETERMINISTIC``) its counters
    (without ``FUSED`` these arguments are placeholders, never read). ``CONSUMERS`` (2: ``FUSED``
    only) consumer warp groups of ``BLOCK_N`` keys each share the ring of query tiles, which
    starts at the CTA's first query tile. ``DQ_TMA``: ``DQ_ACC`` is dQ's buffer as a TMA
    descriptor, each consumer's partials reaching it through a shared tile of its own;
    ``DQ_T`` (with ``DQ_TMA``): dQ^T's partials, ``DQ_ACC`` dQ^T's buffer ``(B*H*D, N)``, dS's codes
    through a shared tile of each consumer's own. ``VEC_TMA`` (``FUSED``, N a multiple of
    ``BLOCK_M``): ``Q_SCALE``, ``LSE2``, ``DO_SCALE``, ``DELTA`` and ``DSQ_U`` are TMA descriptors
    of those vectors viewed as ``(B*H*N / BLOCK_M, BLOCK_M)``, loaded with the row tiles;
    ``DSQ_U`` then holds U's POW2_DOWN exponents (``bwd_fused.dsq_exponents``), int32 bits read as
    float32."""
    gl.static_assert(QUANT_BLOCK % BLOCK_M == 0)
    gl.static_assert(BLOCK_N % BLOCK_M == 0 or BLOCK_M % BLOCK_N == 0)
    gl.static_assert(CONSUMERS == 1 or (FUSED and CONSUMERS == 2))
    # the CTA's keys lie in one token block of K^T's scales (one scale row for both consumers)
    gl.static_assert(QUANT_BLOCK % (CONSUMERS * BLOCK_N) == 0)
    start_n = gl.program_id(0) * (CONSUMERS * BLOCK_N)
    bkv = gl.program_id(1)
    # first query head of this key/value head; its GROUP heads are consecutive
    bh0 = (bkv // HKV) * H + (bkv % HKV) * GROUP
    if CAUSAL:
        # the first query tile that sees a key of this block (tiles divide one another)
        lo = (start_n // BLOCK_M) * BLOCK_M
    else:
        lo = 0
    n_m = gl.cdiv(N - lo, BLOCK_M)
    n_iter = GROUP * n_m
    k_smem = gl.allocate_shared_memory(k_desc.dtype, k_desc.block_shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, v_desc.block_shape, v_desc.layout)
    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_shape, q_desc.layout)
    do_bufs = gl.allocate_shared_memory(do_desc.dtype, [STAGES] + do_desc.block_shape, do_desc.layout)
    qt_bufs = gl.allocate_shared_memory(qt_desc.dtype, [STAGES] + qt_desc.block_shape, qt_desc.layout)
    dot_bufs = gl.allocate_shared_memory(dot_desc.dtype, [STAGES] + dot_desc.block_shape, dot_desc.layout)
    qts_bufs = gl.allocate_shared_memory(qts_desc.dtype, [STAGES] + qts_desc.block_shape, qts_desc.layout)
    dots_bufs = gl.allocate_shared_memory(dots_desc.dtype, [STAGES] + dots_desc.block_shape, dots_desc.layout)
    if FUSED:
        kt_smem = gl.allocate_shared_memory(kt_desc.dtype, kt_desc.block_shape, kt_desc.layout)
        kts_smem = gl.allocate_shared_memory(kts_desc.dtype, kts_desc.block_shape, kts_desc.layout)
    else:
        kt_smem = k_smem
        kts_smem = k_smem
    if CONSUMERS == 2:
        k_smem1 = gl.allocate_shared_memory(k_desc.dtype, k_desc.block_shape, k_desc.layout)
        v_smem1 = gl.allocate_shared_memory(v_desc.dtype, v_desc.block_shape, v_desc.layout)
        kt_smem1 = gl.allocate_shared_memory(kt_desc.dtype, kt_desc.block_shape, kt_desc.layout)
    if DQ_TMA:
        # DQ_ORDER 3: two tiles a consumer, taking turns
        dq_tiles: gl.constexpr = [2] + DQ_ACC.block_shape if DQ_ORDER == 3 else DQ_ACC.block_shape
        dq_smem = gl.allocate_shared_memory(gl.float32, dq_tiles, DQ_ACC.layout)
        if CONSUMERS == 2:
            dq_smem1 = gl.allocate_shared_memory(gl.float32, dq_tiles, DQ_ACC.layout)
        else:
            dq_smem1 = dq_smem
    else:
        dq_smem = k_smem
        dq_smem1 = k_smem
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    gl.static_assert(not DQ_T or DQ_TMA)
    gl.static_assert(not VEC_TMA or (FUSED and EVEN_N))
    # the per-query vectors a query tile, through the ring (VEC_TMA): Q's scale, LSE2, dO's scale, D, U
    NV: gl.constexpr = (5 if DSQ_ROW else 4) if VEC_TMA else 0
    if VEC_TMA:
        if DSQ_ROW:
            vec_descs = (Q_SCALE, LSE2, DO_SCALE, DELTA, DSQ_U)
        else:
            vec_descs = (Q_SCALE, LSE2, DO_SCALE, DELTA)
        vec_bufs = gl.allocate_shared_memory(gl.float32, [STAGES * NV] + Q_SCALE.block_shape, Q_SCALE.layout)
    else:
        vec_descs = (k_desc, )  # placeholders, never read
        vec_bufs = k_smem
    if DQ_T:
        dsq_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], gl.float8e4nv)
        dsq_smem = gl.allocate_shared_memory(gl.float8e4nv, [BLOCK_M, BLOCK_N], dsq_layout)
        if CONSUMERS == 2:
            dsq_smem1 = gl.allocate_shared_memory(gl.float8e4nv, [BLOCK_M, BLOCK_N], dsq_layout)
        else:
            dsq_smem1 = dsq_smem
    else:
        dsq_smem = k_smem  # placeholders, never read
        dsq_smem1 = k_smem
    rows_ready, rows_free, cols_ready, cols_free = _ring_barriers(STAGES, CONSUMERS)
    fence_async_shared()
    if CONSUMERS == 1:
        gl.warp_specialize([
            (_consumer, (k_smem, v_smem, kt_smem, kts_smem, q_bufs, do_bufs, qt_bufs, dot_bufs, qts_bufs, dots_bufs,
                         kv_ready, rows_ready, rows_free, cols_ready, cols_free, Q_SCALE, K_SCALE, V_SCALE, DO_SCALE,
                         LSE2, DELTA, DK, DV, DQ_ACC, SEM, qk_scale, sm_scale, bkv, bh0, start_n, lo, n_m, n_iter, N,
                         NPAD, HEAD_DIM, BLOCK_M, STAGES, CAUSAL, P_SCALE, SPLIT, OVERLAP, FUSED, DETERMINISTIC,
                         EVEN_N, False, dq_smem, DQ_TMA, dsq_smem, DQ_T, DSQ_U, DSQ_ROW, DQ_ORDER, VEC_TMA,
                         vec_bufs, NV)),
            (_producer, (k_desc, v_desc, q_desc, do_desc, qt_desc, dot_desc, qts_desc, dots_desc, kt_desc, kts_desc,
                         k_smem, v_smem, kt_smem, kts_smem, q_bufs, do_bufs, qt_bufs, dot_bufs, qts_bufs, dots_bufs,
                         kv_ready, rows_ready, rows_free, cols_ready, cols_free, bkv * N + start_n, bkv, start_n, bh0,
                         lo, n_m, n_iter, N, NPAD, HEAD_DIM, BLOCK_M, STAGES, FUSED, k_smem, v_smem, kt_smem,
                         CONSUMERS, VEC_TMA, vec_descs, vec_bufs, NV)),
        ], [1], [PRODUCER_REGS])
    else:
        # consumer 0 (the default partition) takes keys start_n .. + 63, consumer 1 (a worker
        # partition of one warp group) keys start_n + 64 .. + 127; both wait on every stage of the
        # ring (the query tiles from the CTA's lo, which is consumer 0's) and release it, consumer 1
        # computing only the tiles a one-consumer CTA of its keys runs (``SKIP``)
        gl.warp_specialize([
            (_consumer, (k_smem, v_smem, kt_smem, kts_smem, q_bufs, do_bufs, qt_bufs, dot_bufs, qts_bufs, dots_bufs,
                         kv_ready, rows_ready, rows_free, cols_ready, cols_free, Q_SCALE, K_SCALE, V_SCALE, DO_SCALE,
                         LSE2, DELTA, DK, DV, DQ_ACC, SEM, qk_scale, sm_scale, bkv, bh0, start_n, lo, n_m, n_iter, N,
                         NPAD, HEAD_DIM, BLOCK_M, STAGES, CAUSAL, P_SCALE, SPLIT, OVERLAP, FUSED, DETERMINISTIC,
                         EVEN_N, False, dq_smem, DQ_TMA, dsq_smem, DQ_T, DSQ_U, DSQ_ROW, DQ_ORDER, VEC_TMA,
                         vec_bufs, NV)),
            (_consumer, (k_smem1, v_smem1, kt_smem1, kts_smem, q_bufs, do_bufs, qt_bufs, dot_bufs, qts_bufs,
                         dots_bufs, kv_ready, rows_ready, rows_free, cols_ready, cols_free, Q_SCALE, K_SCALE, V_SCALE,
                         DO_SCALE, LSE2, DELTA, DK, DV, DQ_ACC, SEM, qk_scale, sm_scale, bkv, bh0, start_n + BLOCK_N,
                         lo, n_m, n_iter, N, NPAD, HEAD_DIM, BLOCK_M, STAGES, CAUSAL, P_SCALE, SPLIT, OVERLAP, FUSED,
                         DETERMINISTIC, EVEN_N, True, dq_smem1, DQ_TMA, dsq_smem1,
                         DQ_T, DSQ_U, DSQ_ROW, DQ_ORDER, VEC_TMA, vec_bufs, NV)),
            (_producer, (k_desc, v_desc, q_desc, do_desc, qt_desc, dot_desc, qts_desc, dots_desc, kt_desc, kts_desc,
                         k_smem, v_smem, kt_smem, kts_smem, q_bufs, do_bufs, qt_bufs, dot_bufs, qts_bufs, dots_bufs,
                         kv_ready, rows_ready, rows_free, cols_ready, cols_free, bkv * N + start_n, bkv, start_n, bh0,
                         lo, n_m, n_iter, N, NPAD, HEAD_DIM, BLOCK_M, STAGES, FUSED, k_smem1, v_smem1, kt_smem1,
                         CONSUMERS, VEC_TMA, vec_descs, vec_bufs, NV)),
        ], [4, 1], [TWO_CONSUMER_REGS, PRODUCER_REGS])


@gluon.jit
def _bwd_dkdv_ws_kernel(k_desc, v_desc, q_desc, do_desc, qt_desc, dot_desc, qts_desc, dots_desc, Q_SCALE, K_SCALE,
                        V_SCALE, DO_SCALE, LSE2, DELTA, DK, DV, qk_scale, sm_scale, H, HKV, N, NPAD,
                        HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, GROUP: gl.constexpr,
                        STAGES: gl.constexpr, CAUSAL: gl.constexpr, P_SCALE: gl.constexpr,
                        SPLIT: gl.constexpr, OVERLAP: gl.constexpr):
    """The kernel on host-side TMA descriptors (``_descriptors``): no descriptor is built per CTA."""
    _body(k_desc, v_desc, q_desc, do_desc, qt_desc, dot_desc, qts_desc, dots_desc, k_desc, qts_desc, Q_SCALE,
          K_SCALE, V_SCALE, DO_SCALE, LSE2, DELTA, DK, DV, DK, DK, qk_scale, sm_scale, H, HKV, N, NPAD, HEAD_DIM,
          BLOCK_M, GROUP, STAGES, CAUSAL, P_SCALE, SPLIT, OVERLAP, False, False, False)


@gluon.jit
def _bwd_fused_ws_kernel(k_desc, v_desc, q_desc, do_desc, qt_desc, dot_desc, qts_desc, dots_desc, kt_desc, kts_desc,
                         Q_SCALE, K_SCALE, V_SCALE, DO_SCALE, LSE2, DELTA, DSQ_U, DK, DV, DQ_ACC, SEM, qk_scale,
                         sm_scale, H, HKV, N, NPAD, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                         GROUP: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, P_SCALE: gl.constexpr,
                         OVERLAP: gl.constexpr, DETERMINISTIC: gl.constexpr, EVEN_N: gl.constexpr,
                         CONSUMERS: gl.constexpr, DQ_TMA: gl.constexpr, DQ_T: gl.constexpr, DSQ_ROW: gl.constexpr,
                         DQ_ORDER: gl.constexpr, VEC_TMA: gl.constexpr):
    """The five-GEMM backward (``bwd_fused``'s computation) on host-side TMA descriptors: the dkdv
    kernel with dQ's partial of every query tile added into ``DQ_ACC`` (:func:`fused`), on
    ``CONSUMERS`` consumer warp groups of 64 keys a CTA; ``DQ_TMA``: by TMA reduce-adds, ``DQ_ACC``
    a descriptor, else by float32 atomics; ``DSQ_ROW``: dS for dQ scaled from the bound ``DSQ_U``, the
    partials unscaled; ``DQ_ORDER``: where dQ^T's partial goes among dV and dK (:func:`_consumer`);
    ``VEC_TMA``: the per-query vectors as TMA descriptors, through the ring (:func:`_body`)."""
    _body(k_desc, v_desc, q_desc, do_desc, qt_desc, dot_desc, qts_desc, dots_desc, kt_desc, kts_desc, Q_SCALE,
          K_SCALE, V_SCALE, DO_SCALE, LSE2, DELTA, DK, DV, DQ_ACC, SEM, qk_scale, sm_scale, H, HKV, N, NPAD, HEAD_DIM,
          BLOCK_M, GROUP, STAGES, CAUSAL, P_SCALE, False, OVERLAP, True, DETERMINISTIC, EVEN_N, CONSUMERS, DQ_TMA,
          DQ_T, DSQ_U, DSQ_ROW, DQ_ORDER, VEC_TMA)


@gluon.jit
def _bwd_dkdv_ws_kernel_dev(Q8, Q_SCALE, QT8, QT_SCALE, K8, K_SCALE, V8, V_SCALE, DO8, DO_SCALE, DOT8, DOT_SCALE,
                            LSE2, DELTA, DK, DV, qk_scale, sm_scale, H, HKV, N, NPAD, ROWS_Q, ROWS_KV,
                            HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, GROUP: gl.constexpr,
                            STAGES: gl.constexpr, CAUSAL: gl.constexpr, P_SCALE: gl.constexpr,
                            SPLIT: gl.constexpr, OVERLAP: gl.constexpr):
    """The kernel on device-side TMA descriptors, as ``fwd_ws`` builds them: every CTA writes its
    eight 128-byte tensor maps and waits for them before its first load (``dkdv(..., host_descriptors=False)``)."""
    row_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], gl.float8e4nv)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], gl.float8e4nv)
    col_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HEAD_DIM, BLOCK_M], gl.float8e4nv)
    k_desc = tma.make_tensor_descriptor(K8, [ROWS_KV, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_N, HEAD_DIM], kv_layout)
    v_desc = tma.make_tensor_descriptor(V8, [ROWS_KV, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_N, HEAD_DIM], kv_layout)
    q_desc = tma.make_tensor_descriptor(Q8, [ROWS_Q, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_M, HEAD_DIM], row_layout)
    do_desc = tma.make_tensor_descriptor(DO8, [ROWS_Q, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_M, HEAD_DIM], row_layout)
    qt_desc = tma.make_tensor_descriptor(QT8, [ROWS_Q // N * HEAD_DIM, NPAD], [NPAD, 1], [HEAD_DIM, BLOCK_M],
                                         col_layout)
    dot_desc = tma.make_tensor_descriptor(DOT8, [ROWS_Q // N * HEAD_DIM, NPAD], [NPAD, 1], [HEAD_DIM, BLOCK_M],
                                          col_layout)
    sc_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    sc_rows = ROWS_Q // N * (NPAD // QUANT_BLOCK)
    qts_desc = tma.make_tensor_descriptor(QT_SCALE, [sc_rows, HEAD_DIM], [HEAD_DIM, 1], [1, HEAD_DIM], sc_layout)
    dots_desc = tma.make_tensor_descriptor(DOT_SCALE, [sc_rows, HEAD_DIM], [HEAD_DIM, 1], [1, HEAD_DIM], sc_layout)
    _body(k_desc, v_desc, q_desc, do_desc, qt_desc, dot_desc, qts_desc, dots_desc, k_desc, qts_desc, Q_SCALE,
          K_SCALE, V_SCALE, DO_SCALE, LSE2, DELTA, DK, DV, DK, DK, qk_scale, sm_scale, H, HKV, N, NPAD, HEAD_DIM,
          BLOCK_M, GROUP, STAGES, CAUSAL, P_SCALE, SPLIT, OVERLAP, False, False, False)


def _constexprs(spec, head_dim: int, causal: bool, group: int) -> dict:
    """The dkdv kernel's constexprs for ``spec`` (a ``config.KernelSpec``) at ``head_dim``: the
    query tile is the backward tiling's ``block_m1`` (the recipe's dS block and promotion
    interval), P's scale the recipe's ``p_bwd``, the ring and schedule ``spec.ws_bwd_tiles``."""
    t, ws = spec.bwd_tiles(head_dim), spec.ws_bwd_tiles(head_dim)
    return dict(HEAD_DIM=head_dim, BLOCK_M=t.block_m1, GROUP=group, STAGES=ws.dkdv_stages, CAUSAL=bool(causal),
                P_SCALE=float(2 ** spec.recipe.p_bwd.offset_log2), SPLIT=bool(ws.dkdv_split),
                OVERLAP=int(ws.dkdv_overlap))


def _check_delta(recipe) -> None:
    """Raise for a spec whose D comes from a pre-pass (``bwd.prepass_refusal``), as the Triton dq
    and dkdv kernels do."""
    from .bwd import prepass_refusal

    why = prepass_refusal(recipe)
    if why:
        raise ValueError(f"bwd_ws: {why}")


def _check(recipe, head_dim: int, debug: bool = False, prepass: bool = False) -> None:
    """Raise for what the kernel does not run (``prepass``: the five-GEMM kernel, which runs the
    specs whose D comes from a pre-pass too)."""
    if not prepass:
        _check_delta(recipe)
    if debug:
        raise ValueError("bwd_ws: the debug dumps exist for the Triton dkdv kernel only (bwd.backward)")
    if head_dim not in (64, 128):
        raise ValueError(f"bwd_ws: head dim {head_dim} must be 64 or 128")
    bm = recipe.bwd_tiles(head_dim).block_m1
    if bm != 64:
        raise ValueError(f"bwd_ws: the query tile (block_m1={bm}) must be 64: the S^T tile of an m64 wgmma "
                         "over keys, 64 queries wide")


def _row_desc(x, block: int):
    """Host-side TMA descriptor of a row copy ``(..., N, D)`` viewed as ``(rows, D)``, ``block``
    tokens a tile (the device-side path's shared-memory layout)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    d = x.shape[-1]
    layout = _shared_layout((block, d), _gl_dtype(x.dtype))
    return TensorDescriptor.from_tensor(x.reshape(-1, d), [block, d], layout)


def _col_desc(x, head_dim: int, block: int):
    """Host-side TMA descriptor of a transposed copy ``(..., D, NPAD)`` viewed as
    ``(rows * D, NPAD)``, ``(D, block)`` tiles."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    layout = _shared_layout((head_dim, block), _gl_dtype(x.dtype))
    return TensorDescriptor.from_tensor(x.reshape(-1, x.shape[-1]), [head_dim, block], layout)


def _dq_desc(dq_acc, block: int):
    """Host-side TMA descriptor of dQ's float32 buffer ``(..., N, D)`` viewed as ``(rows, D)``,
    ``(block, DQ_CH)`` tiles: the fused kernel's TMA reduce-adds (``dq_tma``)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    layout = _shared_layout((block, DQ_CH.value), gl.float32)
    return TensorDescriptor.from_tensor(dq_acc.reshape(-1, dq_acc.shape[-1]), [block, DQ_CH.value], layout)


def _vec_desc(x, block: int):
    """Host-side TMA descriptor of a per-query vector ``(B*H, N)`` (N a multiple of ``block``)
    viewed as ``(B*H*N / block, block)``, one row a query tile: the fused kernel's ``VEC_TMA``."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor.from_tensor(x.reshape(-1, block), [1, block], _unswizzled_layout(32))


def _scale_desc(x, head_dim: int):
    """Host-side TMA descriptor of a transposed copy's scales ``(..., NPAD / 128, D)`` viewed as
    ``(rows, D)``, one row of D factors a tile."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor.from_tensor(x.reshape(-1, head_dim), [1, head_dim], _unswizzled_layout(32))


def _descriptors(q_rows, q_cols, q_col_scale, k_rows, v_rows, do_rows, do_cols, do_col_scale, block_m: int):
    """Host-side TMA descriptors of the kernel's operands, in ``_body``'s order (K, V, Q, dO rows;
    Q^T, dO^T; their scales), each of its copy viewed as 2-D: rows ``(B*H*N, D)``, transposed
    copies ``(B*H*D, NPAD)``, scales ``(B*H*NPAD/128, D)``; the shared-memory layouts are those
    of the device-side path."""
    d = q_rows.shape[-1]
    return (_row_desc(k_rows, BLOCK_N.value), _row_desc(v_rows, BLOCK_N.value), _row_desc(q_rows, block_m),
            _row_desc(do_rows, block_m), _col_desc(q_cols, d, block_m), _col_desc(do_cols, d, block_m),
            _scale_desc(q_col_scale, d), _scale_desc(do_col_scale, d))


def _gl_dtype(dtype):
    """Gluon's element type of a torch ``dtype`` (``_runtime.TRITON_TYPES``)."""
    return gl.dtype(triton_type(str(dtype).removeprefix("torch.")))


def _check_fused(spec, head_dim: int, debug: bool = False) -> None:
    """Raise for what the fused kernel does not run: what ``bwd_fused.refusal`` refuses (the
    recipe's delta must be one the kernel reads from a buffer), and what the dkdv kernel refuses,
    and a dQ key tile (``block_n2``) other than the CTA's 64 keys."""
    from .bwd_fused import refusal

    why = refusal(spec, head_dim)
    if why:
        raise ValueError(f"bwd_ws: {why}")
    _check(spec, head_dim, debug, prepass=True)
    bn = spec.bwd_tiles(head_dim).block_n2
    if bn != BLOCK_N.value:
        raise ValueError(f"bwd_ws: the fused kernel's dQ key block (block_n2={bn}) must be its CTA's {BLOCK_N.value} "
                         "keys")


#: the head dim each nonzero ``WsBwdTiles.fused_dq_order`` runs at (1, 3: dQ^T in two channel halves)
DQ_ORDER_HEAD_DIM = {1: 128, 2: 64, 3: 128}


def launch(spec, *, head_dim: int, causal: bool, kernel: str, group: int = 1, debug: bool = False,
           host_descriptors: bool = True, stages: int | None = None, split: bool | None = None,
           overlap: int | None = None, deterministic: bool = False, n: int | None = None,
           consumers: int | None = None, dq_tma: bool | None = False, dq_t: bool | None = None,
           dq_order: int | None = None, vec_tma: bool | None = None) -> Launch:
    """The launch of the Gluon backward kernel ``kernel`` (``"dq"``, ``"dkdv"`` or ``"fused"``, the
    five-GEMM one: dkdv with dQ's partials, :func:`fused`) for ``spec`` (a
    ``config.KernelSpec`` or its name) at ``head_dim``, ``group`` query heads per key/value head:
    P's scale ``2**recipe.p_bwd.offset_log2`` (dkdv), the matched delta where
    ``recipe.delta.deferred_dq`` is set (dq), the query tile ``block_m1`` (dkdv) and key tile
    ``block_n2`` (dq) of the backward tiling, which the recipe's dS blocks, promotion and kbar's
    tile follow; the ring's depth and the schedule of the spec's ``ws_bwd_tiles(head_dim)``
    (``config.default_ws_bwd_tiles`` by default), or ``stages``, ``split``, ``overlap`` where
    given (the spec with them: ``config.WsBwdTiles``). ``host_descriptors`` (dkdv): TMA descriptors
    built on the host once a launch, else in every CTA. The one description that :func:`dkdv`,
    :func:`dq`, :func:`fused` and ``compile_check.compile_launch`` read. ``deterministic`` (fused):
    dQ's partials added in key order; ``n`` (fused): the sequence length, whose multiples of 64
    need no mask on dQ's adds (None: masked); ``consumers`` (fused): its consumer warp groups a
    CTA, else the spec's ``fused_consumers`` (2: 128 keys a CTA, one CTA an SM at
    ``_gluon.TWO_CONSUMER_LAUNCH_REGS`` registers); ``dq_tma`` (fused): dQ's partials added by TMA
    reduce-adds of a shared tile instead of float32 atomics from registers (N a multiple of 64,
    not deterministic), None: wherever they can be; ``dq_t`` (fused, TMA reduce-adds): dQ^T's partials, K^T dS^T with dS's codes as the
    wgmma's shared B operand instead of moved into registers, into a transposed buffer; None (the
    default): wherever dQ's partials go by TMA reduce-adds (faster than dQ's own partials at every
    shape of the bench: ``benchmarks/results/h100_bench_attention.json``, ``ours_bwd_fused_t``
    against ``ours_bwd_fused_tma``); ``dq_order`` (fused, dQ^T): where its partial goes among dV
    and dK, else the spec's ``fused_dq_order`` (``_consumer``'s ``DQ_ORDER``); ``vec_tma`` (fused,
    N a multiple of 64): the per-query vectors through the ring by TMA, else the spec's
    ``fused_vec_tma`` (``_body``'s ``VEC_TMA``). Raises ValueError,
    with the reason, for what the kernel does not run."""
    from .config import get_spec

    import dataclasses

    if kernel == "fused" and dq_tma is None:
        dq_tma = n is not None and n % BLOCK_N.value == 0 and not deterministic
    if dq_t is None:
        dq_t = kernel == "fused" and bool(dq_tma)
    if (dq_tma or dq_t) and kernel != "fused":
        raise ValueError(f"bwd_ws: dq_tma and dq_t are the fused kernel's (the {kernel} kernel adds no dQ "
                         "partials)")
    if consumers is not None and kernel != "fused":
        raise ValueError(f"bwd_ws: consumers={consumers!r} is the fused kernel's (the {kernel} kernel runs one "
                         "consumer warp group a CTA)")
    r = get_spec(spec)
    ws = r.ws_bwd_tiles(head_dim)
    given = {f"{'dkdv' if kernel == 'fused' else kernel}_{k}": v for k, v in dict(stages=stages, split=split, overlap=overlap).items() if v is not None}
    if consumers is not None:
        given["fused_consumers"] = consumers
    if dq_order is not None:
        if kernel != "fused":
            raise ValueError(f"bwd_ws: dq_order={dq_order!r} is the fused kernel's")
        given["fused_dq_order"] = dq_order
    if vec_tma is not None:
        if kernel != "fused":
            raise ValueError(f"bwd_ws: vec_tma={vec_tma!r} is the fused kernel's")
        given["fused_vec_tma"] = bool(vec_tma)
    if given:
        r = r.with_tiles(ws_bwd=dataclasses.replace(ws, **given))
    if kernel == "dq":
        if split is not None:
            raise ValueError("bwd_ws: split is the dkdv kernel's")
        _check_dq(r, head_dim, debug)
        consts = _dq_constexprs(r, head_dim, causal)
        return Launch(consts, num_warps=NUM_WARPS, num_stages=None, maxnreg=LAUNCH_REGS, kernel=_bwd_dq_ws_kernel,
                      block_m=DQ_BLOCK_M.value, signature=_signature)
    if kernel == "prepass":
        if split is not None:
            raise ValueError("bwd_ws: split is the dkdv kernel's")
        _check_dq(r, head_dim, debug, prepass=True)
        consts = _dq_constexprs(r, head_dim, causal)
        # S and dP, then the row sums: dP issued behind S runs during the softmax (the dq kernel's
        # other schedules overlap its dS K and kbar, which the pre-pass does not run)
        # BOUND: the bound of each row's dS amax too, for a spec that scales dS for dQ from it
        consts.update(MATCHED=True, PREPASS=True, OVERLAP=1, BOUND=r.dsq_row)
        # the launch's register cap: the spec's (WsBwdTiles.prepass_regs: more CTAs an SM), else the kernels'
        regs = r.ws_bwd_tiles(head_dim).prepass_regs or LAUNCH_REGS
        return Launch(consts, num_warps=NUM_WARPS, num_stages=None, maxnreg=regs, kernel=_bwd_dq_ws_kernel,
                      block_m=DQ_BLOCK_M.value, signature=_signature)
    if kernel == "fused":
        if split:
            raise ValueError("bwd_ws: the fused kernel holds dK and dV whole (split=False)")
        if not host_descriptors:
            raise ValueError("bwd_ws: the fused kernel reads host-side TMA descriptors only")
        _check_fused(r, head_dim, debug)
        consts = _constexprs(r, head_dim, causal, group)
        del consts["SPLIT"]
        consts["DETERMINISTIC"] = bool(deterministic)
        consts["EVEN_N"] = n is not None and n % BLOCK_N.value == 0
        tiles = r.ws_bwd_tiles(head_dim)
        two = tiles.fused_consumers == 2
        consts["CONSUMERS"] = 2 if two else 1
        if dq_tma and (deterministic or not consts["EVEN_N"]):
            raise ValueError(f"bwd_ws: dq_tma needs N a multiple of {BLOCK_N.value} (n={n}: a tile would cross "
                             f"into the next head's rows) and deterministic=False (deterministic={deterministic})")
        consts["DQ_TMA"] = bool(dq_tma)
        if dq_t and not dq_tma:
            raise ValueError("bwd_ws: dq_t adds dQ^T's partials by TMA reduce-adds: it needs dq_tma (N a multiple of "
                             f"{BLOCK_N.value}, not deterministic)")
        consts["DQ_T"] = bool(dq_t)
        # dS for dQ scaled per query from the pre-pass's bound, its partials unscaled (fused(dsq_bound=))
        consts["DSQ_ROW"] = r.dsq_row
        order = tiles.fused_dq_order
        if order and not dq_t:
            raise ValueError(f"bwd_ws: fused_dq_order={order} places dQ^T's partial (dq_t); this launch adds dQ's "
                             "own (dq_t=False, or no TMA reduce-adds: N not a multiple of "
                             f"{BLOCK_N.value}, or deterministic)")
        if order and head_dim != DQ_ORDER_HEAD_DIM[order]:
            raise ValueError(f"bwd_ws: fused_dq_order={order} runs at head dim {DQ_ORDER_HEAD_DIM[order]} "
                             "only (1, 3: two channel halves of dQ^T; 2: three wgmma results in flight), not "
                             f"{head_dim}")
        if order == 3 and not two:
            raise ValueError("bwd_ws: fused_dq_order=3 runs with two consumer warp groups (fused_consumers=2): with "
                             "one, its second dQ^T tile takes a CTA's shared memory past half an SM's")
        consts["DQ_ORDER"] = int(order)
        consts["VEC_TMA"] = bool(tiles.fused_vec_tma)
        if consts["VEC_TMA"] and not consts["EVEN_N"]:
            raise ValueError(f"bwd_ws: fused_vec_tma loads the per-query vectors in rows of {BLOCK_N.value}: it needs N "
                             f"a multiple of {BLOCK_N.value} (n={n})")
        if consts["VEC_TMA"] and head_dim == 128 and not two:
            raise ValueError("bwd_ws: fused_vec_tma at head dim 128 runs with two consumer warp groups (fused_consumers"
                             "=2): with one, the vectors' ring takes a CTA's shared memory past half an SM's")
        return Launch(consts, num_warps=NUM_WARPS, num_stages=None,
                      maxnreg=TWO_CONSUMER_LAUNCH_REGS if two else LAUNCH_REGS, kernel=_bwd_fused_ws_kernel,
                      block_m=consts["CONSUMERS"] * BLOCK_N.value, signature=_signature)
    if deterministic:
        raise ValueError("bwd_ws: deterministic is the fused kernel's (the dq and dkdv kernels are deterministic)")
    if kernel != "dkdv":
        raise ValueError(f"bwd_ws: kernel={kernel!r} is not one of ('dq', 'dkdv', 'fused')")
    _check(r, head_dim, debug)
    consts = _constexprs(r, head_dim, causal, group)
    return Launch(consts, num_warps=NUM_WARPS, num_stages=None, maxnreg=LAUNCH_REGS,
                  kernel=_bwd_dkdv_ws_kernel if host_descriptors else _bwd_dkdv_ws_kernel_dev,
                  block_m=BLOCK_N.value, signature=_signature)


def _signature(run: Launch, n_multiple_of_16: bool = True, do_format: str = "float8_e4m3fn") -> tuple[dict, dict]:
    """The argument types and divisibility attributes of ``run``'s kernel, as a launch specializes
    it (``compile_check.compile_launch``): descriptors of small CPU tensors (their type holds only
    dtype, block shape and layout), every pointer 16-byte aligned (torch's allocations), NPAD a
    multiple of 16, and N too with ``n_multiple_of_16`` (else N is a plain integer, as for
    N = 1000); dO's copies in ``do_format``."""
    import torch
    from triton.runtime.jit import mangle_type

    d = run.constexprs["HEAD_DIM"]
    fp8, fp32, bf16 = (triton_type(f) for f in ("float8_e4m3fn", "float32", "bfloat16"))
    n = npad = 128
    do_dt = getattr(torch, do_format)
    rows = torch.zeros(n, d, dtype=torch.float8_e4m3fn)
    cols = torch.zeros(d, npad, dtype=torch.float8_e4m3fn)
    sc = torch.zeros(npad // QUANT_BLOCK.value, d)
    if run.kernel is _bwd_dq_ws_kernel:
        descs = _dq_descriptors(rows, rows.to(do_dt), rows, rows, cols, sc, run.constexprs["BLOCK_N"])
        names = ("q_desc", "do_desc", "k_desc", "v_desc", "kt_desc", "kts_desc")
        sig = {k: mangle_type(x) for k, x in zip(names, descs)}
        sig.update({k: "*" + fp32 for k in ("Q_SCALE", "K_SCALE", "V_SCALE", "K_UNIT", "DO_SCALE", "LSE2",
                                            "DELTA_STALE", "DELTA_MATCHED", "DSQ_U")})
        sig.update(DQ="*" + bf16, qk_scale=fp32, sm_scale=fp32, H="i32", GROUP="i32", N="i32", NPAD="i32")
    else:
        scalars = {"qk_scale": fp32, "sm_scale": fp32, "H": "i32", "HKV": "i32", "N": "i32", "NPAD": "i32"}
        vectors = {name: "*" + fp32 for name in ("Q_SCALE", "K_SCALE", "V_SCALE", "DO_SCALE", "LSE2", "DELTA",
                                                 "DSQ_U")}
        vectors.update(DK="*" + bf16, DV="*" + bf16)
        if run.kernel in (_bwd_dkdv_ws_kernel, _bwd_fused_ws_kernel):
            descs = _descriptors(rows, cols, sc, rows, rows, rows.to(do_dt), cols.to(do_dt), sc, run.constexprs["BLOCK_M"])
            names = ("k_desc", "v_desc", "q_desc", "do_desc", "qt_desc", "dot_desc", "qts_desc", "dots_desc")
            if run.kernel is _bwd_fused_ws_kernel:
                descs += (_col_desc(cols, d, BLOCK_N.value), _scale_desc(sc, d))
                names += ("kt_desc", "kts_desc")
                vectors.update(SEM="*i32")
                if run.constexprs["DQ_TMA"]:
                    descs += (_dq_desc(torch.zeros(n, d), run.constexprs["BLOCK_M"]), )
                    names += ("DQ_ACC", )
                else:
                    vectors.update(DQ_ACC="*" + fp32)
                if run.constexprs["VEC_TMA"]:
                    vec = ("Q_SCALE", "LSE2", "DO_SCALE", "DELTA", "DSQ_U")
                    descs += tuple(_vec_desc(torch.zeros(n), run.constexprs["BLOCK_M"]) for _ in vec)
                    names += vec
                    for name in vec:
                        del vectors[name]
            sig = {**{k: mangle_type(x) for k, x in zip(names, descs)}, **vectors, **scalars}
        else:
            vectors.update(QT_SCALE="*" + fp32, DOT_SCALE="*" + fp32)
            sig = {**{name: "*" + fp8 for name in ("Q8", "QT8", "K8", "V8")}, **vectors, **scalars,
                   **{name: "*" + triton_type(do_format) for name in ("DO8", "DOT8")}, "ROWS_Q": "i32", "ROWS_KV": "i32"}
    names = list(run.kernel.arg_names)
    aligned = {"NPAD", "N"} if n_multiple_of_16 else {"NPAD"}
    sig = {k: sig[k] for k in names if k in sig}
    attrs = {k: [["tt.divisibility", 16]] for k, t in sig.items() if t.startswith("*") or k in aligned}
    return sig, attrs


def compile_sm90(head_dim: int = 128, causal: bool = False, group: int = 1, recipe="kernels_delta_matching",
                 stages: int | None = None, split: bool | None = None, overlap: int | None = None,
                 host_descriptors: bool = True, n_multiple_of_16: bool = True, kernel: str = "dkdv",
                 deterministic: bool = False, n: int | None = None, consumers: int | None = None,
                 dq_tma: bool = False, dq_t: bool | None = None, dq_order: int | None = None,
                 vec_tma: bool | None = None):
    """Compile ``kernel`` for sm_90a without a GPU (ptxas included) as :func:`launch` describes it
    (``group``, ``split`` and ``host_descriptors`` are the dkdv kernel's only; GQA is a run-time
    argument of the dq kernel; ``deterministic``, ``n``, ``consumers`` and ``dq_tma`` the fused
    kernel's),
    specialized as :func:`_signature` says; returns the compiled kernel."""
    from ._sm90 import compile_launch

    from .config import get_spec

    spec = get_spec(recipe)
    run = launch(spec, head_dim=head_dim, causal=causal, kernel=kernel, group=group,
                 host_descriptors=host_descriptors, stages=stages, split=split, overlap=overlap,
                 deterministic=deterministic, n=n, consumers=consumers, dq_tma=dq_tma, dq_t=dq_t, dq_order=dq_order,
                 vec_tma=vec_tma)
    return compile_launch(run, n_multiple_of_16=n_multiple_of_16, do_format=spec.recipe.do_dp.fmt.name)


def prepass(saved, do8, *, batch: int, heads: int, kv_heads: int, n: int, head_dim: int, causal: bool,
            scale: float, recipe, bound: bool = False):
    """The seven-GEMM recipe's pre-pass in Gluon: D_i = sum_j P_ij dP_ij ``(B*H, N)`` float32 from
    the dq kernel's very S, P and dP (its ``PREPASS`` form, which stops after the row sums), so
    the matched D its dq kernel makes, bit for bit; ``saved``: the forward's ``SavedForward``,
    ``do8``: dO's row copy. ``bound`` (a spec with ``KernelSpec.dsq_row``, and only there):
    ``(D, U)``, U_i = (max_j P_ij |dP_ij| + |D_i| max_j P_ij)(1 + 2^-21), ``bwd_prepass.delta(...,
    bound=True)``'s U bit for bit."""
    import torch

    from .fwd import LOG2E

    run = launch(recipe, head_dim=head_dim, causal=causal, kernel="prepass")
    consts = run.constexprs
    if bool(bound) != consts["BOUND"]:
        raise ValueError(f"bwd_ws.prepass: bound={bound!r}, but the bound of dS for dQ is the pre-pass's for the "
                         f"specs that scale dS for dQ from it (KernelSpec.dsq_row: {consts['BOUND']})")
    saved = saved.with_q_copies()  # where the forward left them to the backward
    q8, k8, v8 = saved.q, saved.k, saved.v
    dev = do8.rows.device
    delta = torch.empty((batch * heads, n), device=dev, dtype=torch.float32)
    u = torch.empty_like(delta) if bound else delta
    descs = _dq_descriptors(q8.rows, do8.rows, k8.rows, v8.rows, k8.cols, k8.col_scale, consts["BLOCK_N"])
    npad = triton.cdiv(n, QUANT_BLOCK.value) * QUANT_BLOCK.value
    run.start(run.grid(n, batch * heads),
              *descs, q8.row_scale, k8.row_scale, v8.row_scale, delta, do8.row_scale, saved.lse2, delta, delta, u,
              delta, scale * LOG2E, scale, heads, heads // kv_heads, n, npad)
    return (delta, u) if bound else delta


def fused(saved, do8, delta, *, batch: int, heads: int, kv_heads: int, n: int, head_dim: int, causal: bool,
          scale: float, recipe, deterministic: bool = False, stages: int | None = None, overlap: int | None = None,
          consumers: int | None = None, dq_tma: bool | None = None, dq_t: bool | None = None, dsq_bound=None,
          dq_order: int | None = None, vec_tma: bool | None = None):
    """The five-GEMM backward in Gluon: ``bwd_fused.backward``'s computation (the same operands,
    the same D from ``delta``, the same recipe) on the dkdv kernel's warp-specialized CTAs, each
    adding dQ's partial of its 64 keys into a float32 buffer, then ``bwd_fused``'s postprocess.
    dK and dV are ``bwd_fused``'s bit for bit; dQ too with ``deterministic`` (both add the
    partials in key order), else up to the order of float32 adds. ``stages``, ``overlap``,
    ``consumers``: another ring depth, schedule or number of consumer warp groups a CTA than the
    spec's; ``dq_tma``: dQ's partials added by TMA reduce-adds (:func:`launch`), by default
    wherever they can be (N a multiple of 64, not ``deterministic``: faster than the atomics at
    every shape of the bench, ``benchmarks/results/h100_bench_attention.json``,
    ``ours_bwd_fused_tma``), else by float32 atomics; ``dq_t``: dQ^T's partials, dS's codes the
    wgmma's shared operand (:func:`launch`), by default wherever the partials go by TMA
    reduce-adds. ``dsq_bound``: with a spec whose dS for dQ is scaled from the pre-pass's bound
    (``KernelSpec.dsq_row``), and only there, that bound (``prepass(..., bound=True)``'s U, as
    ``bwd_fused.backward`` reads it): dQ's partials are added unscaled and the postprocess applies
    each query's factor and the head's K scale (powers of two: the same values as scaling each
    partial, but for partials below float32's normal range). ``dq_order``: where dQ^T's partial
    goes among dV and dK, if not the spec's (:func:`launch`); ``vec_tma``: the per-query vectors
    through the ring by TMA (N a multiple of 64), if not the spec's (:func:`launch`). Returns ``(dq, dk, dv, {"delta": delta})``."""
    import torch

    from .bwd_fused import check_dsq, postprocess_dq
    from .config import get_spec
    from .fwd import LOG2E

    dsq_bound = check_dsq(get_spec(recipe), saved, dsq_bound, batch, heads, n, do8.rows.device)

    run = launch(recipe, head_dim=head_dim, causal=causal, kernel="fused", group=heads // kv_heads,
                 stages=stages, overlap=overlap, deterministic=deterministic, n=n, consumers=consumers,
                 dq_tma=dq_tma, dq_t=dq_t, dq_order=dq_order, vec_tma=vec_tma)
    saved = saved.with_q_copies()  # where the forward left them to the backward
    q8, k8, v8 = saved.q, saved.k, saved.v
    dev = do8.rows.device
    dk = torch.empty((batch, kv_heads, n, head_dim), device=dev, dtype=torch.bfloat16)
    dv = torch.empty_like(dk)
    transposed = run.constexprs["DQ_T"]
    dq_acc = torch.zeros((batch * heads, head_dim, n) if transposed else (batch * heads, n, head_dim), device=dev,
                         dtype=torch.float32)
    n_qtiles = -(-n // run.constexprs["BLOCK_M"])
    sem = torch.zeros((batch * heads, n_qtiles) if deterministic else (1,), device=dev, dtype=torch.int32)
    descs = _descriptors(q8.rows, q8.cols, q8.col_scale, k8.rows, v8.rows, do8.rows, do8.cols, do8.col_scale,
                         run.constexprs["BLOCK_M"])
    descs += (_col_desc(k8.cols, head_dim, BLOCK_N.value), _scale_desc(k8.col_scale, head_dim))
    vec = (q8.row_scale, do8.row_scale, saved.lse2, delta, delta if dsq_bound is None else dsq_bound)
    if run.constexprs["VEC_TMA"]:  # the per-query vectors as TMA descriptors of rows of BLOCK_M
        if dsq_bound is not None:  # U's exponents instead of U: int32 bits through the float32 ring
            from .bwd_fused import dsq_exponents

            vec = vec[:4] + (dsq_exponents(dsq_bound).view(torch.float32), )
        vec = tuple(_vec_desc(x, run.constexprs["BLOCK_M"]) for x in vec)
    q_sc, do_sc, lse2, dlt, u = vec
    run.start(run.grid(n, batch * kv_heads),
        *descs, q_sc, k8.row_scale, v8.row_scale, do_sc, lse2, dlt, u, dk, dv,
        _dq_desc(dq_acc, run.constexprs["BLOCK_M"]) if run.constexprs["DQ_TMA"] else dq_acc, sem,
        scale * LOG2E, scale, heads, kv_heads, n, do8.npad)
    factors = None if dsq_bound is None else (dsq_bound, k8.col_scale, heads // kv_heads)
    return (postprocess_dq(dq_acc, batch, heads, n, head_dim, scale, transposed, factors=factors), dk, dv,
            {"delta": delta})


def dkdv(saved, do8, do_t, delta, *, batch: int, heads: int, kv_heads: int, n: int, head_dim: int,
         causal: bool, scale: float, recipe, debug: bool = False, stages: int | None = None, split: bool | None = None,
         overlap: int | None = None, host_descriptors: bool = True):
    """The Gluon dkdv kernel on what ``bwd.backward`` passes the Triton one: ``saved`` (the
    forward's ``SavedForward``: Q's row and transposed copies, K's and V's row copies, LSE2),
    ``do8`` / ``do_t`` (dO's row and transposed copies) and ``delta`` (the D that dS = P (dP - D)
    subtracts: the dq kernel's matched one or the stale one). ``stages``, ``split``, ``overlap``:
    another ring depth and schedule than the spec's (:func:`launch`); ``host_descriptors``: the TMA
    descriptors' side (host: built once a launch; device: per CTA, as ``fwd_ws``). Returns dk, dv
    ``(B, HKV, N, D)`` BF16, the Triton kernel's values."""
    import torch

    from .fwd import LOG2E

    run = launch(recipe, head_dim=head_dim, causal=causal, kernel="dkdv", group=heads // kv_heads, debug=debug,
                 host_descriptors=host_descriptors, stages=stages, split=split, overlap=overlap)
    saved = saved.with_q_copies()  # where the forward left them to the backward
    q8, k8, v8 = saved.q, saved.k, saved.v
    dev = do8.rows.device
    dk = torch.empty((batch, kv_heads, n, head_dim), device=dev, dtype=torch.bfloat16)
    dv = torch.empty_like(dk)
    grid = run.grid(n, batch * kv_heads)
    scalars = (scale * LOG2E, scale, heads, kv_heads, n, do_t.npad)
    if host_descriptors:
        descs = _descriptors(q8.rows, q8.cols, q8.col_scale, k8.rows, v8.rows, do8.rows, do_t.cols, do_t.col_scale,
                             run.constexprs["BLOCK_M"])
        run.start(grid, *descs, q8.row_scale, k8.row_scale, v8.row_scale, do8.row_scale, saved.lse2, delta,
                  dk, dv, *scalars)
    else:
        triton.set_allocator(allocator)
        run.start(grid,
            q8.rows, q8.row_scale, q8.cols, q8.col_scale, k8.rows, k8.row_scale, v8.rows, v8.row_scale,
            do8.rows, do8.row_scale, do_t.cols, do_t.col_scale, saved.lse2, delta, dk, dv,
            *scalars, batch * heads * n, batch * kv_heads * n)
    return dk, dv


def backward_ws(saved, do8, do_t, delta_stale, *, batch: int, heads: int, kv_heads: int, n: int, head_dim: int,
                causal: bool, scale: float, recipe, debug: bool = False, kernels: tuple[str, ...] = ("dkdv",)):
    """``bwd.backward`` with the steps named in ``kernels`` (of ``"dq"``, ``"dkdv"``) run by the Gluon
    kernels, the others by the Triton ones: the dq step first (it makes the matched D, when
    matched), then the dkdv step on the D the dq step hands it (the stale D when stale). By
    default only dkdv is Gluon; ``kernels=("dq", "dkdv")`` is the whole backward in Gluon (bit for
    bit the Triton backward on the H200 at both head dims: docs/kernels_speed.md). Returns ``(dq, dk, dv, {"delta": D})``, ``bwd.backward``'s
    gradients."""
    import dataclasses

    from dmref.recipes import STALE

    from . import bwd
    from .config import get_spec

    unknown = sorted(set(kernels) - {"dq", "dkdv"})
    if unknown:
        raise ValueError(f"bwd_ws: kernels={kernels!r}: {unknown} not among ('dq', 'dkdv')")
    r = get_spec(recipe)
    if "dq" in kernels:
        _check_dq(r, head_dim, debug)
    if "dkdv" in kernels:
        _check(r, head_dim, debug)
    saved = saved.with_q_copies()  # once for both kernels
    dims = dict(batch=batch, heads=heads, kv_heads=kv_heads, n=n, head_dim=head_dim, causal=causal, scale=scale)
    if "dq" in kernels:
        dq_, delta = dq(saved, do8, delta_stale, recipe=r, **dims)
    else:
        dq_, _, _, dbg = bwd.backward(saved, do8, do_t, delta_stale, recipe=r, kernels=("dq",), **dims)
        delta = dbg["delta"]
    if "dkdv" in kernels:
        dk, dv = dkdv(saved, do8, do_t, delta, recipe=r, **dims)
    else:
        # the Triton dkdv on this D: the stale recipe's launch runs the same dkdv kernel (bwd.launch
        # reads no delta for it) on the D it is given as the stale one
        r_st = dataclasses.replace(r, recipe=dataclasses.replace(r.recipe, delta=STALE,
                                                                 name=f"{r.recipe.name}_dkdv_on_a_given_delta"))
        _, dk, dv, _ = bwd.backward(saved, do8, do_t, delta, recipe=r_st, kernels=("dkdv",), **dims)
    return dq_, dk, dv, {"delta": delta}


# --------------------------------------------------------------------------------------------
# dq: what bwd._bwd_dq_kernel computes, one CTA per 64 queries of one query head
# --------------------------------------------------------------------------------------------

#: queries per CTA of the dq kernel: one m64 wgmma row block of the consumer warp group
DQ_BLOCK_M = gl.constexpr(64)


@gluon.jit
def _dq_producer(q_desc, do_desc, k_desc, v_desc, kt_desc, kts_desc, q_smem, do_smem, k_bufs, v_bufs, kt_bufs,
                 kts_bufs, q_ready, rows_ready, rows_free, cols_ready, cols_free, q_row, kv, n_iter, N, NPAD,
                 HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, NEXT_S: gl.constexpr,
                 COLS: gl.constexpr = True):
    """TMA loads: the Q and dO row tiles once, then per key tile i (keys ``i * BLOCK_N``) the K and
    V row tiles, and the K^T tile with its scales (the row of ``(NPAD // QUANT_BLOCK, D)`` factors
    of the tile's token block)."""
    mbarrier.expect(q_ready, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, 0], q_ready, q_smem)
    tma.async_copy_global_to_shared(do_desc, [q_row, 0], q_ready, do_smem)
    for i in range(n_iter):
        s = i % STAGES
        ph = ((i // STAGES) & 1) ^ 1
        start_n = i * BLOCK_N
        mbarrier.wait(rows_free.index(s), ph)
        mbarrier.expect(rows_ready.index(s), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [kv * N + start_n, 0], rows_ready.index(s), k_bufs.index(s))
        tma.async_copy_global_to_shared(v_desc, [kv * N + start_n, 0], rows_ready.index(s), v_bufs.index(s))
        if COLS:  # the K^T tiles (not for the pre-pass, which runs no dS K)
            mbarrier.wait(cols_free.index(s), ph)
            mbarrier.expect(cols_ready.index(s), kt_desc.block_type.nbytes + kts_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(kt_desc, [kv * HEAD_DIM, start_n], cols_ready.index(s), kt_bufs.index(s))
            sc_row = kv * (NPAD // QUANT_BLOCK) + start_n // QUANT_BLOCK
            tma.async_copy_global_to_shared(kts_desc, [sc_row, 0], cols_ready.index(s), kts_bufs.index(s))
    if NEXT_S:
        # the consumer issues S of tile i + 1 behind dS K of tile i, the last one too: one more K
        # row tile (past the last key tile: the next head's keys or TMA's zeros), never used
        s = n_iter % STAGES
        mbarrier.wait(rows_free.index(s), ((n_iter // STAGES) & 1) ^ 1)
        mbarrier.expect(rows_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [kv * N + n_iter * BLOCK_N, 0], rows_ready.index(s), k_bufs.index(s))


@gluon.jit
def _dq_next_s(q_smem, k_bufs, rows_ready, j, s_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               STAGES: gl.constexpr):
    """``OVERLAP`` 3: S of key tile j issued (not waited on), once its K rows have landed."""
    mbarrier.wait(rows_ready.index(j % STAGES), (j // STAGES) & 1)
    return warpgroup_mma(q_smem, k_bufs.index(j % STAGES).permute((1, 0)),
                         gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)


@gluon.jit
def _dq_consumer(q_smem, do_smem, k_bufs, v_bufs, kt_bufs, kts_bufs, q_ready, rows_ready, rows_free, cols_ready,
                 cols_free, Q_SCALE, K_SCALE, V_SCALE, K_UNIT, DO_SCALE, LSE2, DELTA_STALE, DELTA_MATCHED, DSQ_U, DQ,
                 qk_scale, sm_scale, bh, kv, start_m, n_iter, N,
                 HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                 CAUSAL: gl.constexpr, MATCHED: gl.constexpr, KBAR_P_SCALE: gl.constexpr, OVERLAP: gl.constexpr,
                 PREPASS: gl.constexpr = False, BOUND: gl.constexpr = False):
    """The consumer warp group of the dq kernel: its queries' scales, every key tile, the matched
    delta's correction, the stores. ``PREPASS`` (with ``MATCHED``; ``OVERLAP`` 0 or 1): the
    seven-GEMM recipe's pre-pass, S and dP and D = sum_j P dP alone, stored to ``DELTA_MATCHED``
    (no dS, no dQ); with ``BOUND`` also U_i = (max_j P |dP| + |D_i| max_j P)(1 + 2^-21), the bound of
    the row's dS amax (``bwd_prepass``'s, from the same P and dP), stored to ``DSQ_U``. ``OVERLAP`` 1: dP is issued right behind S and runs during
    the softmax; 2 (matched): also kbar's wgmma right behind dS K, running during dQ's promotion;
    3: S of tile i + 1 is issued right behind dS K of tile i (running during dQ's promotion and
    kbar) and waited on before the loop's back edge, and dP of tile i + 1 runs during its softmax."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 32])
    a_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 32])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=a_layout, k_width=4)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)  # per query of S
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)  # per key of S
    row_a: gl.constexpr = gl.SliceLayout(1, a_layout)  # per query of dQ
    col_a: gl.constexpr = gl.SliceLayout(0, a_layout)  # per channel of dQ
    vec_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    bh64 = bh.to(gl.int64)
    kv64 = kv.to(gl.int64)
    # the per-query vectors, in S's row layout (two registers a thread each), for the whole loop;
    # queries past N get LSE2 = +inf, so their P is exp2(-inf) = 0 (their rows are not stored: a
    # row of dQ and of D depends on that row of P and dP alone)
    offs_m = start_m + gl.arange(0, BLOCK_M, layout=row_s)
    in_seq = offs_m < N
    head = bh64 * N
    q_scale = gl.load(Q_SCALE + head + offs_m, mask=in_seq, other=0.0) * qk_scale
    do_scale = gl.load(DO_SCALE + head + offs_m, mask=in_seq, other=0.0)
    lse2 = gl.load(LSE2 + head + offs_m, mask=in_seq, other=float("inf"))
    d_stale = gl.load(DELTA_STALE + head + offs_m, mask=in_seq, other=0.0)
    dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, a_layout)
    # kbar is second order (it is multiplied by D - D_stale): float16, in units u of the largest
    # K scale of this head (K_UNIT), so |kbar / u| <= 448 can never overflow float16
    kbar = gl.zeros([BLOCK_M, HEAD_DIM], gl.float16, a_layout)
    if MATCHED:
        unit = gl.load(K_UNIT + kv64)
        kb_c = gl.div_rn(1.0 / KBAR_P_SCALE, unit)  # powers of two: exact
    pdp = gl.zeros([BLOCK_M], gl.float32, row_s)
    if BOUND:  # max_j P |dP| and max_j P over the key tiles done so far
        pdp_max = gl.zeros([BLOCK_M], gl.float32, row_s)
        p_max = gl.zeros([BLOCK_M], gl.float32, row_s)
    mbarrier.wait(q_ready, 0)
    if OVERLAP == 3:
        s_next = _dq_next_s(q_smem, k_bufs, rows_ready, 0, s_layout, BLOCK_M, BLOCK_N, STAGES)
        s_next = warpgroup_mma_wait(num_outstanding=0, deps=(s_next, ))
    # Invariant at the top of each iteration, over the key tiles done so far: the Triton kernel's
    # dq = sum of deq(Q8(P (dP - Dst))) K (float32, one add per tile); kbar (MATCHED) = the float16
    # sum of Q8(2**4 P) K / (2**4 u); pdp (MATCHED) = sum_j P dP
    for i in range(n_iter):
        s = i % STAGES
        ph = (i // STAGES) & 1
        start_n = i * BLOCK_N
        # the per-key scales: loaded one element a thread, moved into S's column layout (16
        # registers a thread each) through shared memory where they are used, so that none is
        # held across a wgmma
        offs_v = start_n + gl.arange(0, BLOCK_N, layout=vec_layout)
        v_in = offs_v < N
        k_scale_v = gl.load(K_SCALE + kv64 * N + offs_v, mask=v_in, other=0.0)
        v_scale_v = gl.load(V_SCALE + kv64 * N + offs_v, mask=v_in, other=0.0)
        # QK^T: S2 = wgmma(Q8, K8^T) * (q_scale_i * tau * log2 e * k_scale_j), one rounded multiply
        if OVERLAP == 3:
            # S done (issued in the previous iteration, or before the loop); dP runs during the
            # softmax
            st = s_next
            dpt = warpgroup_mma(do_smem, v_bufs.index(s).permute((1, 0)),
                                gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
        else:
            mbarrier.wait(rows_ready.index(s), ph)
            st = warpgroup_mma(q_smem, k_bufs.index(s).permute((1, 0)),
                               gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
        if OVERLAP == 1 or OVERLAP == 2:
            dpt = warpgroup_mma(do_smem, v_bufs.index(s).permute((1, 0)),
                                gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
            st = warpgroup_mma_wait(num_outstanding=1, deps=(st, ))
        elif OVERLAP == 0:
            st = warpgroup_mma_wait(num_outstanding=0, deps=(st, ))
        k_scale = gl.convert_layout(k_scale_v, col_s)
        s2 = _mul_rn(st, gl.expand_dims(q_scale, 1) * gl.expand_dims(k_scale, 0), False)
        # the softmax: P = exp2(S2 - LSE2), 0 where masked. Keys past N (the last tile reads the
        # next head's K rows, or TMA's zeros) are masked, by the causal compare (a key past N is
        # past every stored query) or by one of its own
        p = gl.exp2(s2 - gl.expand_dims(lse2, 1))
        offs_n = start_n + gl.arange(0, BLOCK_N, layout=col_s)
        if CAUSAL:
            p = gl.where(gl.expand_dims(offs_m, 1) >= gl.expand_dims(offs_n, 0), p, 0.0)
        else:
            p = gl.where(gl.expand_dims(offs_n < N, 0), p, 0.0)
        # dP = wgmma(dO8, V8^T) * (do_scale_i * v_scale_j), one rounded multiply
        if OVERLAP == 0:
            dpt = warpgroup_mma(do_smem, v_bufs.index(s).permute((1, 0)), st, use_acc=False, is_async=True)
        dpt = warpgroup_mma_wait(num_outstanding=0, deps=(dpt, ))
        fence_async_shared()  # the reads of this stage before the next TMA writes into it
        mbarrier.arrive(rows_free.index(s), count=1)
        v_scale = gl.convert_layout(v_scale_v, col_s)
        dp = _mul_rn(dpt, gl.expand_dims(do_scale, 1) * gl.expand_dims(v_scale, 0), False)
        if MATCHED:
            # the matched delta: sum_j P dP from the very float32 P and dP that dS uses
            pdp += gl.sum(p * dp, axis=1)
        if BOUND:
            pdp_max = gl.maximum(pdp_max, gl.max(p * gl.abs(dp), axis=1))
            p_max = gl.maximum(p_max, gl.max(p, axis=1))
        if not PREPASS:  # the pre-pass stops at the row sums
            # dS against the stale D (the matched D is not known yet: deferred correction below);
            # Q-point dS: one POW2_DOWN scale per query row of the tile (its 64 keys)
            ds = p * (dp - gl.expand_dims(d_stale, 1))
            k_ds = _pow2_down_exponent(gl.max(gl.abs(ds), axis=1), False)
            ds8 = gl.convert_layout(_to_fp8(ds * gl.expand_dims(_exp2_int(k_ds), 1), False, False), op_layout)
            ds_inv = gl.convert_layout(_exp2_int(-k_ds), row_a)
            if MATCHED:
                # Q-point P (kbar): E4M3, scale KBAR_P_SCALE against LSE
                p8 = gl.convert_layout(_to_fp8(p * KBAR_P_SCALE, False, False), op_layout)
            # dS K, promoted: one wgmma chain per tile, then one float32 multiply-add (the channel
            # scales from shared memory after the wait, not held across the wgmma)
            mbarrier.wait(cols_ready.index(s), ph)
            kt_s = kt_bufs.index(s).permute((1, 0))
            kts_s = kts_bufs.index(s).reshape([HEAD_DIM])
            t = warpgroup_mma(ds8, kt_s, gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, a_layout), use_acc=False,
                              is_async=True)
            if OVERLAP == 3 and not MATCHED:
                # S of tile i + 1 behind it, running during dQ's promotion
                s_next = _dq_next_s(q_smem, k_bufs, rows_ready, i + 1, s_layout, BLOCK_M, BLOCK_N, STAGES)
                t = warpgroup_mma_wait(num_outstanding=1, deps=(t, ))
            elif MATCHED and OVERLAP == 2:
                kb = warpgroup_mma(p8, kt_s, gl.zeros([BLOCK_M, HEAD_DIM], gl.float16, a_layout), use_acc=False,
                                   is_async=True)
                t = warpgroup_mma_wait(num_outstanding=1, deps=(t, ))
            else:
                t = warpgroup_mma_wait(num_outstanding=0, deps=(t, ))
            dq += t * gl.expand_dims(kts_s.load(col_a), 0) * gl.expand_dims(ds_inv, 1)
            if MATCHED:
                # kbar: a float16 wgmma chain per tile, scaled to units u in float32, added and
                # rounded to float16
                if OVERLAP != 2:
                    kb = warpgroup_mma(p8, kt_s, gl.zeros([BLOCK_M, HEAD_DIM], gl.float16, a_layout), use_acc=False,
                                       is_async=True)
                if OVERLAP == 3:
                    # S of tile i + 1 behind it, running during kbar's promotion (dQ's chain result is
                    # dead by then: fewer registers than behind dS K)
                    s_next = _dq_next_s(q_smem, k_bufs, rows_ready, i + 1, s_layout, BLOCK_M, BLOCK_N, STAGES)
                    kb = warpgroup_mma_wait(num_outstanding=1, deps=(kb, ))
                else:
                    kb = warpgroup_mma_wait(num_outstanding=0, deps=(kb, ))
                kbar = (kbar.to(gl.float32) + kb.to(gl.float32) * gl.expand_dims(kts_s.load(col_a) * kb_c, 0)
                        ).to(gl.float16)
            if OVERLAP == 3:
                # nothing in flight across the loop's back edge
                s_next = warpgroup_mma_wait(num_outstanding=0, deps=(s_next, ))
            fence_async_shared()  # the reads of this stage before the next TMA writes into it
            mbarrier.arrive(cols_free.index(s), count=1)
    if PREPASS:
        gl.store(DELTA_MATCHED + head + offs_m, pdp, mask=in_seq)
        if BOUND:
            # each product rounded on its own (bwd_prepass's order; dmref/proofs/delta_study.md, Lemma 2)
            u = _mul_rn(pdp_max + _mul_rn(gl.abs(pdp), p_max, False), 1.0 + 2.0**-21, False)
            gl.store(DSQ_U + head + offs_m, u, mask=in_seq)
        return
    offs_ma = start_m + gl.arange(0, BLOCK_M, layout=row_a)
    if MATCHED:
        # the matched delta, after the last key tile: D = sum_j P dP, and dQ's deferred correction
        # dS K = (P (dP - Dst)) K - (D - Dst) (P K), with P K = kbar * u
        gl.store(DELTA_MATCHED + head + offs_m, pdp, mask=in_seq)
        corr = gl.convert_layout(pdp - d_stale, row_a)
        dq -= gl.expand_dims(corr, 1) * (kbar.to(gl.float32) * unit)
    # stores
    offs_c = gl.arange(0, HEAD_DIM, layout=col_a)
    rows = head * HEAD_DIM + gl.expand_dims(offs_ma, 1) * HEAD_DIM + gl.expand_dims(offs_c, 0)
    gl.store(DQ + rows, (dq * sm_scale).to(gl.bfloat16), mask=gl.expand_dims(offs_ma < N, 1))


@gluon.jit
def _bwd_dq_ws_kernel(q_desc, do_desc, k_desc, v_desc, kt_desc, kts_desc, Q_SCALE, K_SCALE, V_SCALE, K_UNIT,
                      DO_SCALE, LSE2, DELTA_STALE, DELTA_MATCHED, DSQ_U, DQ, qk_scale, sm_scale, H, GROUP, N, NPAD,
                      HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                      MATCHED: gl.constexpr, KBAR_P_SCALE: gl.constexpr, OVERLAP: gl.constexpr,
                      PREPASS: gl.constexpr = False, BOUND: gl.constexpr = False):
    """The dq kernel on host-side TMA descriptors: Q, dO rows ``(B*H*N, D)``, K, V rows
    ``(B*HKV*N, D)``, K^T ``(B*HKV*D, NPAD)`` and its scales ``(B*HKV*NPAD/128, D)``.
    ``PREPASS``: the pre-pass alone (:func:`prepass`; the K^T tiles are not loaded), with ``BOUND``
    also the bound of each row's dS amax into ``DSQ_U``."""
    gl.static_assert(not PREPASS or (MATCHED and OVERLAP < 2))
    gl.static_assert(PREPASS or not BOUND)
    BLOCK_M: gl.constexpr = DQ_BLOCK_M
    gl.static_assert(QUANT_BLOCK % BLOCK_N == 0)
    pid = gl.program_id(0)
    if CAUSAL:
        # the longest rows first (the last query tile sees every key)
        pid = gl.num_programs(0) - 1 - pid
    start_m = pid * BLOCK_M
    bh = gl.program_id(1)
    # the key/value head query head bh reads (its GROUP heads are consecutive)
    kv = (bh // H) * (H // GROUP) + (bh % H) // GROUP
    if CAUSAL:
        n_iter = gl.cdiv(gl.minimum(start_m + BLOCK_M, N), BLOCK_N)
    else:
        n_iter = gl.cdiv(N, BLOCK_N)
    q_smem = gl.allocate_shared_memory(q_desc.dtype, q_desc.block_shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, do_desc.block_shape, do_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_shape, v_desc.layout)
    kt_bufs = gl.allocate_shared_memory(kt_desc.dtype, [STAGES] + kt_desc.block_shape, kt_desc.layout)
    kts_bufs = gl.allocate_shared_memory(kts_desc.dtype, [STAGES] + kts_desc.block_shape, kts_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    rows_ready, rows_free, cols_ready, cols_free = _ring_barriers(STAGES)
    fence_async_shared()
    gl.warp_specialize([
        (_dq_consumer, (q_smem, do_smem, k_bufs, v_bufs, kt_bufs, kts_bufs, q_ready, rows_ready, rows_free,
                        cols_ready, cols_free, Q_SCALE, K_SCALE, V_SCALE, K_UNIT, DO_SCALE, LSE2, DELTA_STALE,
                        DELTA_MATCHED, DSQ_U, DQ, qk_scale, sm_scale, bh, kv, start_m, n_iter, N, HEAD_DIM, BLOCK_M,
                        BLOCK_N, STAGES, CAUSAL, MATCHED, KBAR_P_SCALE, OVERLAP, PREPASS, BOUND)),
        (_dq_producer, (q_desc, do_desc, k_desc, v_desc, kt_desc, kts_desc, q_smem, do_smem, k_bufs, v_bufs,
                        kt_bufs, kts_bufs, q_ready, rows_ready, rows_free, cols_ready, cols_free, bh * N + start_m,
                        kv, n_iter, N, NPAD, HEAD_DIM, BLOCK_N, STAGES, OVERLAP == 3, not PREPASS)),
    ], [1], [PRODUCER_REGS])


def _dq_constexprs(spec, head_dim: int, causal: bool) -> dict:
    """The dq kernel's constexprs for ``spec`` at ``head_dim``: the key tile is the backward
    tiling's ``block_n2`` (the recipe's dS block for dQ, its promotion interval and kbar's tile),
    the matched delta where the recipe has a deferred dQ (kbar's P scale its ``p_offset_log2``), the ring and schedule
    ``spec.ws_bwd_tiles``."""
    t, ws = spec.bwd_tiles(head_dim), spec.ws_bwd_tiles(head_dim)
    from .bwd import kbar_p_scale

    return dict(HEAD_DIM=head_dim, BLOCK_N=t.block_n2, STAGES=ws.dq_stages, CAUSAL=bool(causal),
                MATCHED=spec.matched, KBAR_P_SCALE=kbar_p_scale(spec), OVERLAP=int(ws.dq_overlap), PREPASS=False,
                BOUND=False)


def _check_dq(recipe, head_dim: int, debug: bool = False, prepass: bool = False) -> None:
    """Raise for what the dq kernel does not run (``prepass``: its pre-pass form, which runs the
    specs whose D comes from a pre-pass too)."""
    if not prepass:
        _check_delta(recipe)
    if debug:
        raise ValueError("bwd_ws: the debug row sums exist for the Triton dq kernel only (bwd.backward)")
    if head_dim not in (64, 128):
        raise ValueError(f"bwd_ws: head dim {head_dim} must be 64 or 128")
    bn = recipe.bwd_tiles(head_dim).block_n2
    if bn != 64:
        raise ValueError(f"bwd_ws: the dq key tile (block_n2={bn}) must be 64: the S tile of an m64 wgmma over "
                         "queries, 64 keys wide")


def _dq_descriptors(q_rows, do_rows, k_rows, v_rows, k_cols, k_col_scale, block_n: int):
    """Host-side TMA descriptors of the dq kernel's operands, in its order (Q, dO, K, V rows;
    K^T; its scales)."""
    d = q_rows.shape[-1]
    bm = DQ_BLOCK_M.value
    return (_row_desc(q_rows, bm), _row_desc(do_rows, bm), _row_desc(k_rows, block_n), _row_desc(v_rows, block_n),
            _col_desc(k_cols, d, block_n), _scale_desc(k_col_scale, d))


def compile_sm90_dq(head_dim: int = 128, causal: bool = False, recipe="kernels_delta_matching",
                    stages: int | None = None, n_multiple_of_16: bool = True, overlap: int | None = None):
    """:func:`compile_sm90` of the dq kernel."""
    return compile_sm90(head_dim=head_dim, causal=causal, recipe=recipe, stages=stages,
                        n_multiple_of_16=n_multiple_of_16, overlap=overlap, kernel="dq")


def dq(saved, do8, delta_stale, *, batch: int, heads: int, kv_heads: int, n: int, head_dim: int, causal: bool,
       scale: float, recipe, debug: bool = False, stages: int | None = None, overlap: int | None = None):
    """The Gluon dq kernel on what ``bwd.backward`` passes the Triton one: ``saved`` (the forward's
    ``SavedForward``: Q's row copy, K's row and transposed copies, V's row copy, LSE2), ``do8``
    (dO's row copy) and ``delta_stale`` (the preprocess's rowsum(dO * O)). Returns ``(dq, delta)``:
    dQ ``(B, H, N, D)`` BF16 and the D the dkdv kernel is to subtract (matched: the D this kernel
    made, ``sum_j P dP``; stale: ``delta_stale`` itself), the Triton kernel's values."""
    import torch

    from . import bwd
    from .fwd import LOG2E

    run = launch(recipe, head_dim=head_dim, causal=causal, kernel="dq", debug=debug, stages=stages, overlap=overlap)
    consts = run.constexprs
    saved = saved.with_q_copies()  # where the forward left them to the backward
    q8, k8, v8 = saved.q, saved.k, saved.v
    dev = do8.rows.device
    out = torch.empty((batch, heads, n, head_dim), device=dev, dtype=torch.bfloat16)
    matched = consts["MATCHED"]
    delta = torch.empty_like(delta_stale) if matched else delta_stale
    k_unit = bwd.kbar_unit(k8) if matched else delta_stale
    descs = _dq_descriptors(q8.rows, do8.rows, k8.rows, v8.rows, k8.cols, k8.col_scale, consts["BLOCK_N"])
    npad = triton.cdiv(n, QUANT_BLOCK.value) * QUANT_BLOCK.value
    run.start(run.grid(n, batch * heads),
              *descs, q8.row_scale, k8.row_scale, v8.row_scale, k_unit, do8.row_scale, saved.lse2, delta_stale, delta,
              delta_stale, out, scale * LOG2E, scale, heads, heads // kv_heads, n, npad)
    return out, delta
