"""Warp-specialized FP8 attention forward for Hopper, in Gluon (the ``folded`` recipes).

One CTA per ``BLOCK_M = 64`` queries of one head: a consumer warp group (the default partition,
four warps) quantizes its Q tile, runs the wgmmas and the softmax; a one-warp producer (a worker
partition whose registers ``setmaxnreg`` lowers to 24) streams K and V tiles into a ring of
``STAGES`` shared-memory buffers through TMA. Two CTAs share an SM (128 registers a thread at
launch; the consumer rises to 232), so one CTA's softmax overlaps the other's wgmmas. What it
computes comes from its ``config.KernelSpec`` through :func:`launch`: P's scale
``2**e = 2**recipe.p_fwd.offset_log2``, PV promoted or chained (``recipe.pv_chain``), key tiles of
``recipe.tiles.block_k``, the ring's depth, the schedule and the consumers (the forward tiling's
``num_stages``, ``overlap`` and ``consumers``; its defaults: ``config.default_fwd_tiles``).

With ``consumers=2`` (``FwdTiles(block_m=128, consumers=2)``, not the default) a CTA takes 128
queries on two consumer warp groups that share one ring, FlashAttention-3's structure: the default
partition takes rows 0..63 and a four-warp worker partition rows 64..127, each with its own Q tile
in shared memory, so each K/V tile crosses into shared memory once for 128 queries instead of once
for 64. One CTA of 384 threads fills an SM (168 registers at launch; the producer drops to 24, each
consumer rises to 240); the two consumers meet only at the ring's barriers, each on a named barrier
of its own warp group inside its loop (no barrier orders one's softmax against the other's wgmmas,
as FlashAttention-3's ping-pong does). One default partition of eight warps (an M = 128 wgmma split
between its two warp groups) compiles within the same budget too, but its loop holds barriers of
all 256 consumer threads (``bar.sync 0, 256``, one before every release of a stage, which one
thread arrives on for the partition), which would hold the two warp groups in lock-step. Every
consumer runs the one-consumer code on its 64 rows with the key tiles of a one-consumer CTA of
those rows (the key tile of 128 is a multiple of the CTA's 128 queries, so the causal bounds and
the masked tile are the same), so O and LSE are to be the one-consumer kernel's bits
(``tests/kernels/test_fwd_ws.py``, ``test_two_consumers_give_the_one_consumer_bits``, GPU). In the
last CTA of a head the second consumer may have no row below N: it runs every key tile all the
same, storing nothing, so that it releases every stage the producer waits on. Compiled for sm_90a
(``compile_sm90(consumers=2)``), at head dim 64 and 128, causal or not, serial or overlapped,
promoted or chained: 168 registers at launch, no spills, no serialized wgmma; 41,544 B of shared
memory at D = 64 and 82,504 B at D = 128 with two stages (the one-consumer kernel: 37,188 and
74,052 B a CTA, two CTAs an SM).

The consumer, for its Q tile and then for every key tile of ``BLOCK_N`` keys:

    Q8 = Q(Q * 2**k_i), q_scale_i = 2**-k_i                 # Q-point Q: E4M3, per token, POW2_DOWN
    S  = wgmma(Q8, K8^T)                                    # float32, Hopper's FP8 chain
    c  = q_scale_i * k_scale * tau * log2 e                 # one factor per row, c > 0
    m  = max(m, fl(rowmax(S) * c))                          # = the running max of fl(S c)
    P8 = exp2(fma(S, c, e - m))                             # P * 2**e, the argument one FFMA
    l  = l * alpha + rowsum(P8)                             # float32
    acc = acc * alpha + wgmma(Q(P8), V8)                    # Q-point P: E4M3, fixed 2**e; a
                                                            # chain per tile, promoted
    O  = acc * fl(1 / l) * v_scale_d;  LSE2 = m - e + log2(l)

``OVERLAP = 1`` (the default) issues QK^T of tile j + 1 before the softmax of tile j, with the
serial schedule's bits for the same PV accumulation; it is the default because it hides the
next QK^T behind the softmax at no cost in bits (its speed: docs/kernels_speed.md). ``CHAIN=True`` runs PV as one chain over all keys,
``acc = wgmma(Q(P8), V8, C = acc * alpha)`` (a recipe with ``pv_chain=True``: FA3's
accumulation, which loses the products of a long row once the accumulator outgrows them,
docs/kernels_speed.md). Promoted and overlapped, the PV tile T takes the registers of the S tile
whose softmax made its P (dead by then) where the two have one shape (D = 128), so the loop
carries three 64-register tiles (acc, S and the next S), not four. ``dmref.tiled`` computes the
same recipe with exp2's argument rounded as fl(fl(S c) - m) and O as fl(acc / l): the kernel
differs from it in the last bits of float32 intermediates, below the code-flip bound its tests
hold it to.

K is scaled per (batch, key/value head) and V per (batch, key/value head, channel) over all
tokens (``dmref.kernels.quantize.quantize_kv_folded``), so every scale folds into a per-row factor of S or a
per-column factor of O and the loop loads no scales. Barriers, in the order each role uses them:

- ``k_ready[s]`` / ``v_ready[s]``: the producer arms them (``expect``) and TMA completes them;
  the consumer waits on them with phase ``(i // STAGES) & 1`` for tile i.
- ``k_free[s]`` / ``v_free[s]``: every consumer arrives once the wgmma that read the buffer has
  been waited on (one thread of its warp group; the barrier counts ``CONSUMERS`` arrivals); the
  producer waits on them before it overwrites the buffer (phase flipped, so the first round
  passes).
"""

from __future__ import annotations

import math

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from ._gluon import LAUNCH_REGS, PRODUCER_REGS, TWO_CONSUMER_LAUNCH_REGS, TWO_CONSUMER_REGS, allocator
from ._gluon import shared_layout as _shared_layout
from ._runtime import Launch, triton_type
from .config import WS_FWD_BLOCK_M
from ._gluon import exp2_int as _exp2_int
from ._gluon import pow2_down_exponent as _pow2_down_exponent
from ._gluon import to_fp8 as _to_fp8

#: queries per consumer warp group: one m64 wgmma row block (``config.WS_FWD_BLOCK_M``); a CTA
#: takes ``CONSUMERS * BLOCK_M``
BLOCK_M = gl.constexpr(WS_FWD_BLOCK_M)


@gluon.jit
def _load_k(k_desc, k_bufs, k_ready, k_free, kv_row, i, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    s = i % STAGES
    mbarrier.wait(k_free.index(s), ((i // STAGES) & 1) ^ 1)
    mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [kv_row + i * BLOCK_N, 0], k_ready.index(s), k_bufs.index(s))


@gluon.jit
def _load_v(v_desc, v_bufs, v_ready, v_free, kv_col, i, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    s = i % STAGES
    mbarrier.wait(v_free.index(s), ((i // STAGES) & 1) ^ 1)
    mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(v_desc, [kv_col, i * BLOCK_N], v_ready.index(s), v_bufs.index(s))


@gluon.jit
def _producer(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_free, v_free, kv_row, kv_col, n_tiles,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """TMA loads of K (``(BLOCK_N, D)`` row tiles) and V^T (``(D, BLOCK_N)`` tiles) for key tiles
    0..n_tiles, in the order the consumer frees them: K_i, V_i. Waits on ``*_free[s]`` (phase
    flipped: the first round passes), arms ``*_ready[s]``."""
    for i in range(n_tiles):
        _load_k(k_desc, k_bufs, k_ready, k_free, kv_row, i, BLOCK_N, STAGES)
        _load_v(v_desc, v_bufs, v_ready, v_free, kv_col, i, BLOCK_N, STAGES)


@gluon.jit
def _quantize_q(Q, stride_qn, q_smem, start_m, N, HEAD_DIM: gl.constexpr):
    """Q-point Q: the consumer's BLOCK_M x D BF16 tile -> E4M3 codes in shared memory, one POW2_DOWN
    scale per token (the rule of ``quantize.quantize``'s row copy); returns the dequantization
    factors 2**-k. Rows past N read as 0 (code 0, factor 1)."""
    TPW_D: gl.constexpr = HEAD_DIM // 8
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPW_D, TPW_D], [4, 1], [1, 0])
    rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    x = gl.load(Q + gl.expand_dims(rows, 1) * stride_qn + gl.expand_dims(cols, 0),
                mask=gl.expand_dims(rows < N, 1), other=0.0).to(gl.float32)
    k = _pow2_down_exponent(gl.max(gl.abs(x), axis=1), False)
    q_smem.store(_to_fp8(x * gl.expand_dims(_exp2_int(k), 1), False, False))
    fence_async_shared()
    gl.thread_barrier()  # every warp's codes are in shared memory before the warp group's wgmma
    return _exp2_int(-k)


@gluon.jit
def _softmax(sc, cs, m_i, l_i, i, offs_m, N, s_layout: gl.constexpr, o_layout: gl.constexpr,
             p_layout: gl.constexpr, BLOCK_N: gl.constexpr, MASK: gl.constexpr, CAUSAL: gl.constexpr,
             P_SCALE: gl.constexpr, PD, NPAD, DEBUG: gl.constexpr):
    """Tile i's scores S -> (P codes in the wgmma operand layout, alpha per O row, m, l), with l
    summing P * P_SCALE in float32."""
    if MASK:
        offs_n = i * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        valid = gl.expand_dims(offs_n, 0) < N
        if CAUSAL:
            valid = valid & (gl.expand_dims(offs_m, 1) >= gl.expand_dims(offs_n, 0))
        sc = gl.where(valid, sc, float("-inf"))
    # the running max of S2 = fl(S cs): fl(rowmax(S) cs), as cs > 0 and rounding is monotonic
    m_new = gl.maximum(m_i, gl.max(sc, axis=1) * cs)
    if MASK:
        m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows with every key masked so far
    else:
        m_sub = m_new
    # P * P_SCALE = exp2(S cs - m + log2 P_SCALE), the argument one fused multiply-add
    x = gl.fma(sc, gl.expand_dims(cs, 1), gl.expand_dims(gl.log2(P_SCALE) - m_sub, 1))
    p = gl.exp2(x)
    alpha = gl.exp2(m_i - m_sub)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    if DEBUG:  # the float32 values the cast receives, (B*H, N, NPAD) row-major from PD (this head's rows)
        offs_nd = i * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        gl.store(PD + gl.expand_dims(offs_m.to(gl.int64) * NPAD, 1) + gl.expand_dims(offs_nd, 0), p,
                 mask=gl.expand_dims(offs_m < N, 1))
    # Q-point P: float32 -> E4M3 (P_SCALE is in p), RNE, satfinite
    p8 = p.to(gl.float8e4nv)
    p8 = gl.convert_layout(p8, p_layout)
    alpha_o = gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    return p8, alpha_o, m_new, l_i


@gluon.jit
def _issue_qk(q_smem, k_bufs, k_ready, j, s_old, STAGES: gl.constexpr):
    """QK^T of key tile j issued, not waited on, once its K tile has landed; ``s_old``: dead
    registers of S's shape, the wgmma's ignored accumulator (``use_acc=False``)."""
    mbarrier.wait(k_ready.index(j % STAGES), (j // STAGES) & 1)
    return warpgroup_mma(q_smem, k_bufs.index(j % STAGES).permute((1, 0)), s_old, use_acc=False, is_async=True)


@gluon.jit
def _qk(q_smem, k_bufs, k_ready, k_free, j, s_old, STAGES: gl.constexpr):
    """QK^T of key tile j, waited on, its K buffer released."""
    sc = warpgroup_mma_wait(num_outstanding=0, deps=(_issue_qk(q_smem, k_bufs, k_ready, j, s_old, STAGES), ))
    mbarrier.arrive(k_free.index(j % STAGES), count=1)
    return sc


@gluon.jit
def _pv(p8, v_bufs, v_ready, v_free, s, ph, acc, alpha_o, t_old, s_next, CHAIN: gl.constexpr):
    """acc <- acc * alpha + P V for the tile in stage s, waited on together with every wgmma in
    flight (``s_next``, the next tile's QK^T, when overlapped). Returns (acc, T, s_next)."""
    mbarrier.wait(v_ready.index(s), ph)
    if CHAIN:
        # the wgmma chain runs on across tiles, its accumulator rescaled by alpha in float32
        t = t_old
        acc = warpgroup_mma(p8, v_bufs.index(s).permute((1, 0)), acc * alpha_o, use_acc=True, is_async=True)
        acc, s_next = warpgroup_mma_wait(num_outstanding=0, deps=(acc, s_next))
    else:
        # promoted: the wgmma chain covers one tile, then one float32 multiply-add
        t = warpgroup_mma(p8, v_bufs.index(s).permute((1, 0)), t_old, use_acc=False, is_async=True)
        t, s_next = warpgroup_mma_wait(num_outstanding=0, deps=(t, s_next))
        acc = acc * alpha_o + t
    mbarrier.arrive(v_free.index(s), count=1)
    return acc, t, s_next


@gluon.jit
def _tile(i, q_smem, k_bufs, v_bufs, k_ready, v_ready, k_free, v_free, acc, s_old, t_old, m_i, l_i, cs,
          offs_m, N, s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr,
          BLOCK_N: gl.constexpr, STAGES: gl.constexpr, MASK: gl.constexpr, CAUSAL: gl.constexpr,
          P_SCALE: gl.constexpr, CHAIN: gl.constexpr, PD, NPAD, DEBUG: gl.constexpr):
    """Key tile i: QK^T, the softmax, PV, each waited on. ``s_old`` / ``t_old`` are the previous
    tile's dead registers, passed as the wgmmas' ignored accumulators (``use_acc=False``) so that
    no zero tile is written. Returns (acc, S, T, m, l)."""
    s = i % STAGES
    ph = (i // STAGES) & 1
    sc = _qk(q_smem, k_bufs, k_ready, k_free, i, s_old, STAGES)
    p8, alpha_o, m_i, l_i = _softmax(sc, cs, m_i, l_i, i, offs_m, N, s_layout, o_layout, p_layout, BLOCK_N, MASK,
                                     CAUSAL, P_SCALE, PD, NPAD, DEBUG)
    acc, t, sc = _pv(p8, v_bufs, v_ready, v_free, s, ph, acc, alpha_o, t_old, sc, CHAIN)
    return acc, sc, t, m_i, l_i


@gluon.jit
def _tile_overlap(i, q_smem, k_bufs, v_bufs, k_ready, v_ready, k_free, v_free, acc, sc, s_old, t_old, m_i,
                  l_i, cs, offs_m, N, s_layout: gl.constexpr, o_layout: gl.constexpr,
                  p_layout: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, MASK: gl.constexpr,
                  CAUSAL: gl.constexpr, P_SCALE: gl.constexpr, CHAIN: gl.constexpr,
                  NEXT: gl.constexpr, PD, NPAD, DEBUG: gl.constexpr):
    """Key tile i, its QK^T ``sc`` done: QK^T of tile i + 1 is issued (``NEXT``) into the dead
    registers ``s_old`` and runs during the softmax of tile i (FA3's intra-warp-group overlap);
    both it and PV are waited on before the call returns, so no wgmma is in flight across the
    loop's back edge. Returns (acc, QK^T of tile i + 1, S, T, m, l)."""
    s = i % STAGES
    ph = (i // STAGES) & 1
    s_next = s_old
    if NEXT:
        s_next = _issue_qk(q_smem, k_bufs, k_ready, i + 1, s_old, STAGES)
    p8, alpha_o, m_i, l_i = _softmax(sc, cs, m_i, l_i, i, offs_m, N, s_layout, o_layout, p_layout, BLOCK_N, MASK,
                                     CAUSAL, P_SCALE, PD, NPAD, DEBUG)
    # promoted PV where S and T have one shape and layout (BLOCK_N == D): T takes the registers of
    # S_i, dead once P is formed, so that no third tile is carried round the loop
    REUSE: gl.constexpr = (not CHAIN) and s_layout == o_layout
    if REUSE:
        t_old = sc
    acc, t, s_next = _pv(p8, v_bufs, v_ready, v_free, s, ph, acc, alpha_o, t_old, s_next, CHAIN)
    if NEXT:
        mbarrier.arrive(k_free.index((i + 1) % STAGES), count=1)
    if REUSE:
        return acc, s_next, t, t, m_i, l_i
    return acc, s_next, sc, t, m_i, l_i


@gluon.jit
def _consumer(Q, stride_qn, q_smem, k_bufs, v_bufs, k_ready, v_ready, k_free, v_free, V_SCALE, O, LSE2,
              cs_head, bh, kv, start_m, n_plain, n_tiles, N,
              BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
              CAUSAL: gl.constexpr, P_SCALE: gl.constexpr, CHAIN: gl.constexpr,
              OVERLAP: gl.constexpr, PD, NPAD, DEBUG: gl.constexpr):
    """The consumer warp group: Q, the key tiles (masked from n_plain on), the epilogue."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 32])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 32])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    q_scale = _quantize_q(Q, stride_qn, q_smem, start_m, N, HEAD_DIM)
    # tau * log2(e) and the head's K scale ride on the query's scale: one factor per row
    cs = gl.convert_layout(q_scale, row_s) * cs_head
    offs_m = start_m + gl.arange(0, BLOCK_M, layout=row_s)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_s)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    s_old = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    t_old = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    if OVERLAP:
        s_next = _qk(q_smem, k_bufs, k_ready, k_free, 0, s_old, STAGES)
        # every tile but the last is unmasked: a tail, or the causal diagonal of a 64-row Q tile
        # (BLOCK_N a multiple of BLOCK_M), lies in the last key tile alone
        gl.static_assert(BLOCK_N % BLOCK_M == 0)
        # two tiles an iteration: S_i and S_i+1 trade the two register tiles, so no copy of an
        # accumulator in flight is needed at the back edge (ptxas would serialize the wgmmas)
        n_pairs = (n_tiles - 1) // 2
        for j in range(0, n_pairs):
            acc, s_next, s_old, t_old, m_i, l_i = _tile_overlap(
                2 * j, q_smem, k_bufs, v_bufs, k_ready, v_ready, k_free, v_free, acc, s_next, s_old, t_old, m_i,
                l_i, cs, offs_m, N, s_layout, o_layout, p_layout, BLOCK_N, STAGES, False, CAUSAL, P_SCALE,
                CHAIN, True, PD, NPAD, DEBUG)
            acc, s_next, s_old, t_old, m_i, l_i = _tile_overlap(
                2 * j + 1, q_smem, k_bufs, v_bufs, k_ready, v_ready, k_free, v_free, acc, s_next, s_old, t_old, m_i,
                l_i, cs, offs_m, N, s_layout, o_layout, p_layout, BLOCK_N, STAGES, False, CAUSAL, P_SCALE,
                CHAIN, True, PD, NPAD, DEBUG)
        if (n_tiles - 1) % 2 == 1:
            acc, s_next, s_old, t_old, m_i, l_i = _tile_overlap(
                n_tiles - 2, q_smem, k_bufs, v_bufs, k_ready, v_ready, k_free, v_free, acc, s_next, s_old, t_old,
                m_i, l_i, cs, offs_m, N, s_layout, o_layout, p_layout, BLOCK_N, STAGES, False, CAUSAL, P_SCALE,
                CHAIN, True, PD, NPAD, DEBUG)
        acc, s_next, s_old, t_old, m_i, l_i = _tile_overlap(
            n_tiles - 1, q_smem, k_bufs, v_bufs, k_ready, v_ready, k_free, v_free, acc, s_next, s_old, t_old, m_i,
            l_i, cs, offs_m, N, s_layout, o_layout, p_layout, BLOCK_N, STAGES, True, CAUSAL, P_SCALE,
            CHAIN, False, PD, NPAD, DEBUG)
    else:
        for i in range(0, n_plain):
            acc, s_old, t_old, m_i, l_i = _tile(i, q_smem, k_bufs, v_bufs, k_ready, v_ready, k_free, v_free, acc,
                                                s_old, t_old, m_i, l_i, cs, offs_m, N, s_layout, o_layout,
                                                p_layout, BLOCK_N, STAGES, False, CAUSAL, P_SCALE, CHAIN,
                                                PD, NPAD, DEBUG)
        for i in range(n_plain, n_tiles):
            acc, s_old, t_old, m_i, l_i = _tile(i, q_smem, k_bufs, v_bufs, k_ready, v_ready, k_free, v_free, acc,
                                                s_old, t_old, m_i, l_i, cs, offs_m, N, s_layout, o_layout,
                                                p_layout, BLOCK_N, STAGES, True, CAUSAL, P_SCALE, CHAIN,
                                                PD, NPAD, DEBUG)
    # epilogue: O = acc * fl(1 / l) * v_scale (l sums P * P_SCALE; v_scale per channel, a power of
    # two), one division per row; LSE2 = m - log2(P_SCALE) + log2(l)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    v_scale = gl.load(V_SCALE + kv.to(gl.int64) * HEAD_DIM + offs_d)
    l_o = gl.convert_layout(l_i, row_o)
    inv_l = gl.div_rn(gl.full_like(l_o, 1.0), l_o)
    o = acc * gl.expand_dims(inv_l, 1) * gl.expand_dims(v_scale, 0)
    lse2 = (m_i - gl.log2(P_SCALE)) + gl.log2(l_i)
    offs_mo = start_m + gl.arange(0, BLOCK_M, layout=row_o)
    o_ptrs = O + bh.to(gl.int64) * N * HEAD_DIM + gl.expand_dims(offs_mo, 1) * HEAD_DIM + gl.expand_dims(offs_d, 0)
    gl.store(o_ptrs, o.to(gl.bfloat16), mask=gl.expand_dims(offs_mo < N, 1))
    gl.store(LSE2 + bh.to(gl.int64) * N + offs_m, lse2, mask=offs_m < N)


@gluon.jit
def _body(k_desc, v_desc, Q, stride_qb, stride_qh, stride_qn, K_SCALE, V_SCALE, O, LSE2, PD, qk_scale, H, GROUP,
          N, NPAD, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
          P_SCALE: gl.constexpr, CHAIN: gl.constexpr, OVERLAP: gl.constexpr,
          CONSUMERS: gl.constexpr, DEBUG: gl.constexpr):
    """The kernel on its TMA descriptors: K rows ``(B*HKV*N, D)`` and V^T ``(B*HKV*D, NPAD)``. A
    key tile past this head's N reads the next head's rows, masked in the softmax; V^T's padding
    columns hold code 0. ``CONSUMERS`` consumer warp groups of ``BLOCK_M`` queries each (1 or 2)
    share the ring."""
    CTA_M: gl.constexpr = CONSUMERS * BLOCK_M
    # every consumer's key tiles, the masked one included, are those of a CTA of its 64 rows alone
    # (the bounds below with CTA_M for BLOCK_M are equal where BLOCK_N is a multiple of CTA_M)
    gl.static_assert(BLOCK_N % CTA_M == 0)
    n_m = gl.cdiv(N, CTA_M)
    # causal: the longest rows first (the grid's tail is then the short work)
    pid_m = (n_m - 1 - gl.program_id(0)) if CAUSAL else gl.program_id(0)
    start_m = pid_m * CTA_M
    bh = gl.program_id(1)
    kv = (bh // H) * (H // GROUP) + (bh % H) // GROUP
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], gl.float8e4nv)
    q_smem = gl.allocate_shared_memory(gl.float8e4nv, [BLOCK_M, HEAD_DIM], q_layout)
    if CONSUMERS == 2:
        q_smem1 = gl.allocate_shared_memory(gl.float8e4nv, [BLOCK_M, HEAD_DIM], q_layout)
    k_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, HEAD_DIM, BLOCK_N], v_desc.layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        # a stage is free once every consumer has released it
        mbarrier.init(k_free.index(i), count=CONSUMERS)
        mbarrier.init(v_free.index(i), count=CONSUMERS)
    fence_async_shared()
    if CAUSAL:
        n_tiles = gl.cdiv(gl.minimum(start_m + CTA_M, N), BLOCK_N)
        n_plain = start_m // BLOCK_N  # key tiles wholly at or below the diagonal
    else:
        n_tiles = gl.cdiv(N, BLOCK_N)
        n_plain = N // BLOCK_N  # full key tiles
    cs_head = gl.load(K_SCALE + kv) * qk_scale
    q_ptr = Q + (bh // H).to(gl.int64) * stride_qb + (bh % H).to(gl.int64) * stride_qh
    pd = PD + bh.to(gl.int64) * N * NPAD
    if CONSUMERS == 1:
        gl.warp_specialize([
            (_consumer, (q_ptr, stride_qn, q_smem, k_bufs, v_bufs, k_ready, v_ready, k_free, v_free, V_SCALE, O,
                         LSE2, cs_head, bh, kv, start_m, n_plain, n_tiles, N, BLOCK_N, HEAD_DIM, STAGES, CAUSAL,
                         P_SCALE, CHAIN, OVERLAP, pd, NPAD, DEBUG)),
            (_producer, (k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_free, v_free, kv * N, kv * HEAD_DIM,
                         n_tiles, BLOCK_N, STAGES)),
        ], [1], [PRODUCER_REGS])
    else:
        # the second consumer (a worker partition of one warp group) takes the CTA's rows 64..127 and
        # runs every key tile of the CTA even where all its rows lie past N (stored nowhere), so it
        # releases every stage the producer waits on
        gl.warp_specialize([
            (_consumer, (q_ptr, stride_qn, q_smem, k_bufs, v_bufs, k_ready, v_ready, k_free, v_free, V_SCALE, O,
                         LSE2, cs_head, bh, kv, start_m, n_plain, n_tiles, N, BLOCK_N, HEAD_DIM, STAGES, CAUSAL,
                         P_SCALE, CHAIN, OVERLAP, pd, NPAD, DEBUG)),
            (_consumer, (q_ptr, stride_qn, q_smem1, k_bufs, v_bufs, k_ready, v_ready, k_free, v_free, V_SCALE, O,
                         LSE2, cs_head, bh, kv, start_m + BLOCK_M, n_plain, n_tiles, N, BLOCK_N, HEAD_DIM, STAGES,
                         CAUSAL, P_SCALE, CHAIN, OVERLAP, pd, NPAD, DEBUG)),
            (_producer, (k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_free, v_free, kv * N, kv * HEAD_DIM,
                         n_tiles, BLOCK_N, STAGES)),
        ], [4, 1], [TWO_CONSUMER_REGS, PRODUCER_REGS])


@gluon.jit
def _fwd_ws_kernel(k_desc, v_desc, Q, stride_qb, stride_qh, stride_qn, K_SCALE, V_SCALE, O, LSE2, PD,
                   qk_scale, H, GROUP, N, NPAD,
                   HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                   CAUSAL: gl.constexpr, P_SCALE: gl.constexpr, CHAIN: gl.constexpr,
                   OVERLAP: gl.constexpr, CONSUMERS: gl.constexpr, DEBUG: gl.constexpr):
    """The kernel on host-side TMA descriptors (:func:`_descriptors`, built once a launch)."""
    _body(k_desc, v_desc, Q, stride_qb, stride_qh, stride_qn, K_SCALE, V_SCALE, O, LSE2, PD, qk_scale, H, GROUP, N,
          NPAD, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, P_SCALE, CHAIN, OVERLAP, CONSUMERS, DEBUG)


@gluon.jit
def _fwd_ws_kernel_dev(Q, stride_qb, stride_qh, stride_qn, K8, K_SCALE, VT8, V_SCALE, O, LSE2, PD,
                       qk_scale, H, GROUP, N, NPAD, ROWS_KV,
                       HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                       CAUSAL: gl.constexpr, P_SCALE: gl.constexpr, CHAIN: gl.constexpr,
                       OVERLAP: gl.constexpr, CONSUMERS: gl.constexpr, DEBUG: gl.constexpr):
    """The kernel on device-side TMA descriptors: every CTA writes its two 128-byte tensor maps
    (``forward(..., host_descriptors=False)``; not the default)."""
    k_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], gl.float8e4nv)
    v_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HEAD_DIM, BLOCK_N], gl.float8e4nv)
    k_desc = tma.make_tensor_descriptor(K8, [ROWS_KV, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_N, HEAD_DIM], k_layout)
    v_desc = tma.make_tensor_descriptor(VT8, [ROWS_KV // N * HEAD_DIM, NPAD], [NPAD, 1], [HEAD_DIM, BLOCK_N],
                                        v_layout)
    _body(k_desc, v_desc, Q, stride_qb, stride_qh, stride_qn, K_SCALE, V_SCALE, O, LSE2, PD, qk_scale, H, GROUP, N,
          NPAD, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, P_SCALE, CHAIN, OVERLAP, CONSUMERS, DEBUG)


def _descriptors(k8, vt8, block_n: int):
    """Host-side TMA descriptors of K rows ``(B*HKV*N, D)`` in ``(BLOCK_N, D)`` tiles and of V^T
    ``(B*HKV*D, NPAD)`` in ``(D, BLOCK_N)`` tiles, with the device-side path's shared layouts."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    d = k8.shape[-1]
    return (TensorDescriptor.from_tensor(k8.reshape(-1, d), [block_n, d], _shared_layout((block_n, d), gl.float8e4nv)),
            TensorDescriptor.from_tensor(vt8.reshape(-1, vt8.shape[-1]), [d, block_n],
                                         _shared_layout((d, block_n), gl.float8e4nv)))


def launch(spec, *, head_dim: int, causal: bool, debug: bool = False, host_descriptors: bool = True) -> Launch:
    """The kernel's launch for ``spec`` (a ``config.KernelSpec`` of a folded recipe, or its name)
    at ``head_dim``: everything it computes read from the spec, P's fixed scale
    ``2**recipe.p_fwd.offset_log2``, PV promoted per key tile or chained (``recipe.pv_chain``), key
    tiles of ``recipe.tiles.block_k``, the ring's depth, the schedule and the consumer warp groups
    of the tiling (``spec.fwd_tiles(head_dim)``: ``num_stages``, ``overlap``, ``consumers``; with
    two, 128 queries a CTA, one CTA an SM at ``_gluon.TWO_CONSUMER_LAUNCH_REGS`` registers).
    ``host_descriptors``: K's and V's
    TMA descriptors built on the host once a launch (:func:`_fwd_ws_kernel`), else in every CTA
    (:func:`_fwd_ws_kernel_dev`). The one description that :func:`forward` and
    :func:`compile_sm90` read. Raises ValueError, with the reason, for a spec it does not run."""
    from .config import default_fwd_tiles, fwd_refusal, get_spec

    spec = get_spec(spec)
    if not spec.folded:
        raise ValueError(f"fwd_ws runs the folded recipes (K scaled per head); recipe {spec.name!r} scales K "
                         f"{spec.recipe.k.describe()}: its forward is fwd.launch's")
    if head_dim not in (64, 128):
        raise ValueError(f"fwd_ws: head dim {head_dim} must be 64 or 128")
    tiles = spec.fwd_tiles(head_dim)
    why = fwd_refusal(spec.recipe, tiles)
    if why:
        raise ValueError(f"fwd_ws: {why}")
    overlap = default_fwd_tiles(spec.recipe, head_dim).overlap if tiles.overlap is None else tiles.overlap
    consts = dict(HEAD_DIM=head_dim, BLOCK_N=spec.recipe.tiles.block_k, STAGES=tiles.num_stages,
                  CAUSAL=bool(causal), P_SCALE=float(2 ** spec.recipe.p_fwd.offset_log2),
                  CHAIN=bool(spec.recipe.pv_chain), OVERLAP=int(overlap), CONSUMERS=tiles.consumers,
                  DEBUG=bool(debug))
    kernel = _fwd_ws_kernel if host_descriptors else _fwd_ws_kernel_dev
    regs = LAUNCH_REGS if tiles.consumers == 1 else TWO_CONSUMER_LAUNCH_REGS
    return Launch(consts, num_warps=tiles.num_warps, num_stages=None, maxnreg=regs, kernel=kernel,
                  block_m=tiles.block_m, signature=signature)


def variant(recipe="kernels_folded_naive_fp8", *, chain: bool | None = None, overlap: bool | int | None = None,
            stages: int | None = None, consumers: int | None = None):
    """The folded spec ``recipe`` with PV chained over all keys or promoted per tile (``chain``:
    a recipe of its own, ``<name>_pv_chain`` or ``<name>_pv_promoted``, which ``dmref.tiled``
    takes as it is) and another schedule, ring depth or number of consumer warp groups
    (``overlap``, ``stages``, ``consumers``: its forward tiling at every head dim, ``consumers``
    with its ``block_m`` of ``consumers * 64`` queries); None keeps the spec's."""
    import dataclasses

    from .config import get_spec

    spec = get_spec(recipe)
    if chain is not None and bool(chain) != spec.recipe.pv_chain:
        r = spec.recipe
        spec = dataclasses.replace(spec, recipe=dataclasses.replace(
            r, pv_chain=bool(chain), name=f"{r.name}_pv_{'chain' if chain else 'promoted'}"))
    if overlap is None and stages is None and consumers is None:
        return spec
    tiles = {d: spec.fwd_tiles(d) for d in (64, 128)}
    fwd = {d: dataclasses.replace(t, overlap=t.overlap if overlap is None else int(overlap),
                                  num_stages=t.num_stages if stages is None else stages) for d, t in tiles.items()}
    if consumers is not None:
        fwd = {d: dataclasses.replace(t, consumers=consumers, block_m=consumers * WS_FWD_BLOCK_M)
               for d, t in fwd.items()}
    return dataclasses.replace(spec, fwd=fwd[128], fwd_d64=fwd[64])


def compile_sm90(head_dim: int = 128, causal: bool = False, recipe="kernels_folded_delta_matching", *,
                 chain: bool | None = None, overlap: bool | int | None = None, stages: int | None = None,
                 consumers: int | None = None, debug: bool = False,
                 host_descriptors: bool = True):
    """Compile the kernel for sm_90a without a GPU (ptxas included), as :func:`launch` describes it
    for ``recipe`` (or its :func:`variant` with ``chain``, ``overlap``, ``stages``,
    ``consumers``); returns the compiled kernel."""
    from ._sm90 import compile_launch

    spec = variant(recipe, chain=chain, overlap=overlap, stages=stages, consumers=consumers)
    return compile_launch(launch(spec, head_dim=head_dim, causal=causal, debug=debug,
                                 host_descriptors=host_descriptors))


def signature(run: Launch, n_multiple_of_16: bool = True, do_format: str = "float8_e4m3fn") -> tuple[dict, dict]:
    """The argument types of ``run``'s kernel for a compilation without a launch
    (``compile_check.compile_launch``; it reads no dO), and no divisibility attributes: host-side descriptors of
    small CPU tensors (the type holds only dtype, block shape and layout), or the pointers the
    device-side kernel takes."""
    import torch
    from triton.runtime.jit import mangle_type

    d, block_n = run.constexprs["HEAD_DIM"], run.constexprs["BLOCK_N"]
    rest = {"Q": "*bf16", "stride_qb": "i32", "stride_qh": "i32", "stride_qn": "i32", "K_SCALE": "*fp32",
            "V_SCALE": "*fp32", "O": "*bf16", "LSE2": "*fp32", "PD": "*fp32", "qk_scale": "fp32", "H": "i32",
            "GROUP": "i32", "N": "i32", "NPAD": "i32"}
    if run.kernel is _fwd_ws_kernel:
        k_desc, v_desc = _descriptors(torch.zeros(128, d, dtype=torch.float8_e4m3fn),
                                      torch.zeros(d, 128, dtype=torch.float8_e4m3fn), block_n)
        return {"k_desc": mangle_type(k_desc), "v_desc": mangle_type(v_desc), **rest}, {}
    fp8 = "*" + triton_type("float8_e4m3fn")
    return {**rest, "K8": fp8, "VT8": fp8, "ROWS_KV": "i32"}, {}


def forward(q, k8, k_scale, vt8, v_scale, *, kv_heads: int, causal: bool, scale: float,
            recipe="kernels_folded_naive_fp8", debug: bool = False, host_descriptors: bool = True):
    """Run the warp-specialized forward of ``recipe`` (a folded ``config.KernelSpec`` or its name;
    :func:`launch`): ``q (B, H, N, D)`` BF16 (quantized inside, per token; its last dim
    contiguous), ``k8 (B*HKV, N, D)`` with ``k_scale (B*HKV,)``, ``vt8 (B*HKV, D, NPAD)`` with
    ``v_scale (B*HKV, D)`` (:func:`dmref.kernels.quantize.quantize_kv_folded`). Returns O
    ``(B, H, N, D)`` BF16 and LSE2 ``(B*H, N)`` float32 (base 2), and with ``debug`` a third
    result, the codes of P~ = P * 2**offset (E4M3) of every tile, ``(B*H, N, NPAD)`` uint8 (0
    where masked; columns past N unused): the kernel stores the float32 values its cast receives
    and :func:`dmref.kernels.fwd.fp8_codes` casts them (stored as bytes, the codes were wrong on
    the H200 in half the rows when N % 16 != 0: docs/kernels.md). ``host_descriptors``: K's and
    V's TMA descriptors built on the host once a launch (the default: faster than building them
    in every CTA, docs/kernels_speed.md, Speed), else in every CTA."""
    import torch

    from ..emulation.constants import LOG2E
    from .fwd import fp8_codes

    b, h, n, d = q.shape
    if q.stride(-1) != 1:
        raise ValueError(f"q's last dim must be contiguous, got strides {q.stride()}")
    run = launch(recipe, head_dim=d, causal=causal, debug=debug, host_descriptors=host_descriptors)
    triton.set_allocator(allocator)
    o = torch.empty((b, h, n, d), device=q.device, dtype=torch.bfloat16)
    lse2 = torch.empty((b * h, n), device=q.device, dtype=torch.float32)
    # the P dump's buffer; without debug the kernel does not touch it (lse2 stands in: no launch)
    p_dump = torch.zeros((b * h, n, vt8.shape[-1]), device=q.device, dtype=torch.float32) if debug else lse2
    grid = run.grid(n, b * h)
    scalars = (scale * LOG2E, h, h // kv_heads, n, vt8.shape[-1])
    if host_descriptors:
        run.start(grid, *_descriptors(k8, vt8, run.constexprs["BLOCK_N"]), q, q.stride(0), q.stride(1), q.stride(2),
                  k_scale, v_scale, o, lse2, p_dump, *scalars)
    else:
        run.start(grid, q, q.stride(0), q.stride(1), q.stride(2), k8, k_scale, vt8, v_scale, o, lse2,
                  p_dump, *scalars, b * kv_heads * n)
    return (o, lse2, fp8_codes(p_dump)) if debug else (o, lse2)


def attention_forward(q, k, v, *, causal: bool = False, scale: float | None = None,
                      recipe="kernels_folded_naive_fp8", debug: bool = False, host_descriptors: bool = True,
                      chain: bool | None = None, overlap: bool | int | None = None, stages: int | None = None,
                      consumers: int | None = None):
    """Quantize k (per head) and v (per head and channel), then :func:`forward` (which quantizes q)
    of ``recipe``, or of its :func:`variant` with ``chain``, ``overlap``, ``stages``,
    ``consumers``. Returns (O, LSE2, the FP8 operands of K and V as a ``FoldedKV``), and with
    ``debug`` the P codes of :func:`forward` last."""
    from .quantize import quantize_kv_folded

    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    spec = variant(recipe, chain=chain, overlap=overlap, stages=stages, consumers=consumers)
    kv = quantize_kv_folded(k, v)
    o, lse2, *p_codes = forward(q, kv.k8, kv.k_scale, kv.vt8, kv.v_scale, kv_heads=k.shape[1], causal=causal,
                                scale=scale, recipe=spec, debug=debug, host_descriptors=host_descriptors)
    return (o, lse2, kv, *p_codes)
