"""Experiment: the forward of ``dmref.kernels.fwd`` in Gluon, with wgmma kept in flight.

    python benchmarks/gluon_fwd_experiment.py --out DIR      # identity + speed on an H200
    python benchmarks/gluon_fwd_experiment.py --profile-one  # one launch of each forward, for ncu

Not part of the package: it asks whether FA3's intra-warpgroup overlap, which Triton 3.6 does
not generate on Hopper (every ``tl.dot`` is followed by ``wgmma.wait_group 0``, docs/kernels.md),
would reach the forward's speed goal. Same recipe and operands as ``fwd._fwd_kernel`` (as it
was before ``_common.mul_rn``: S2 is not forced to round on its own here); per 128-key tile j the
schedule is

    issue S_{j+1} = Q8 K8_{j+1}^T, then PV_j = P8_j V8_j       (async, fresh accumulators)
    wait until only PV_j is in flight                          (S_{j+1} is ready)
    softmax of S_{j+1} -> P8_{j+1}                             (tensor cores: PV_j)
    wait PV_j; acc = acc * alpha_j + PV_j * v_scale_j          (the per-tile promotion)
    TMA: refill the freed stage with tile j + STAGES

K and V tiles come through TMA into a ring of ``STAGES`` stages, one mbarrier each; Q is loaded
once. Findings (numbers in docs/kernels.md, "Gluon experiment"):

- ptxas waits for every wgmma in flight at a loop header. A first version that kept PV in
  flight across the back edge compiled to a wait at the top of the loop: no overlap at all (and
  bit-identical to the Triton forward). Hence the rotated loop above.
- At head dim 128 the overlap does not fit in 255 registers: S (64 registers per thread), the
  promoted accumulator (64), PV's in-flight temporary (64) and two P8 tiles (16 + 16) leave
  nothing for the softmax, and ptxas serializes the wgmma again (or spills, with P8 through
  shared memory).
- At head dim 64 the softmax overlaps PV (53 of 66 exp2 between the two waits), yet the kernel
  is slower than Triton's: its loop issues 954 instructions per tile against Triton's 772 (the
  FP8 layout conversion of P costs 120 byte permutes where Triton's costs 32), and the kernel
  is issue-bound, not latency-bound.

The flattened TMA views read K rows past a head's N (the next head's keys) in the last tile and
Q rows past N (the next head's queries): the former are masked to -inf before the softmax, the
latter are computed with scale 0 and never stored.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attention import SHAPES, _bench, _flops, forward_baseline  # noqa: E402

import triton  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from dmref.kernels.config import QUANT_BLOCK, KernelRecipe  # noqa: E402
from dmref.kernels.fwd import LOG2E  # noqa: E402


@gluon.jit
def _load_kv(k_desc, vt_desc, k_smem, vt_smem, bars, tile, slot, k_row0, vt_row0, pred,
             BLOCK_N: gl.constexpr):
    """TMA: key tile ``tile`` (K rows, V^T columns) into stage ``slot``, signalled on its barrier."""
    bar = bars.index(slot)
    mbarrier.expect(bar, k_desc.block_type.nbytes + vt_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(k_desc, [k_row0 + tile * BLOCK_N, 0], bar, k_smem.index(slot), pred=pred)
    tma.async_copy_global_to_shared(vt_desc, [vt_row0, tile * BLOCK_N], bar, vt_smem.index(slot), pred=pred)


@gluon.jit
def _softmax_tile(s_raw, q_scale, K_SCALE, m_i, l_i, start_n, offs_m, N,
                  BLOCK_N: gl.constexpr, MASK: gl.constexpr, CAUSAL: gl.constexpr, P_SCALE: gl.constexpr,
                  s_cols: gl.constexpr):
    """The float32 step of ``fwd._fwd_inner``: returns (P8, alpha, m, l). ``MASK``: apply the key
    mask (n < N, and n <= m when causal) to this tile."""
    offs_n = start_n + gl.arange(0, BLOCK_N, layout=s_cols)
    if MASK:
        k_scale = gl.load(K_SCALE + offs_n, mask=offs_n < N, other=0.0)
    else:
        k_scale = gl.load(K_SCALE + offs_n)
    s = s_raw * (q_scale[:, None] * k_scale[None, :])
    if MASK:
        # key n is valid for query m iff n < N and (causal) n <= m: one compare per element
        if CAUSAL:
            limit = gl.minimum(offs_m + 1, N)
        else:
            limit = gl.full(offs_m.shape, N, gl.int32, offs_m.type.layout)
        s = gl.where(offs_n[None, :] < limit[:, None], s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    if MASK:
        # a row with every key masked so far keeps m = -inf; subtract 0 there instead
        m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_sub = m_new
    p = gl.exp2(s - m_sub[:, None])
    alpha = gl.exp2(m_i - m_sub)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    # Q-point P: float32 -> E4M3, scale 2**8 against the running max, RNE, satfinite
    p8 = (p * P_SCALE).to(gl.float8e4nv)
    return p8, alpha, m_new, l_i


@gluon.jit
def _issue_pv(p8, p_smem, buf, vt_tile, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr,
              o_layout: gl.constexpr, p_layout: gl.constexpr, P_SMEM: gl.constexpr):
    """Issue PV = P8 V8 (async, fresh accumulator) with P8 from registers or shared memory."""
    o_zero = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    if P_SMEM:
        p_buf = p_smem.index(buf)
        p_buf.store(p8)
        fence_async_shared()
        gl.thread_barrier()
        tok = warpgroup_mma(p_buf, vt_tile.permute((1, 0)), o_zero, use_acc=False, is_async=True)
    else:
        tok = warpgroup_mma(gl.convert_layout(p8, p_layout), vt_tile.permute((1, 0)), o_zero,
                            use_acc=False, is_async=True)
    return tok


@gluon.jit
def _fwd_gluon_kernel(
    q_desc, k_desc, vt_desc, Q_SCALE, K_SCALE, VT_SCALE, O, LSE2,
    qk_scale, H, GROUP, N, NPAD,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, QB: gl.constexpr,
    CAUSAL: gl.constexpr, MASK: gl.constexpr, P_SCALE: gl.constexpr, STAGES: gl.constexpr,
    P_SMEM: gl.constexpr, num_warps: gl.constexpr,
):
    gl.static_assert(QB % BLOCK_N == 0)
    gl.static_assert(BLOCK_N % BLOCK_M == 0)  # only a program's last key tile needs a mask
    gl.static_assert(BLOCK_M == 16 * num_warps)  # one wgmma row block of 16 per warp
    # wgmma accumulators: m16 x n (whole tile) x k32 per instruction (FP8), warps along rows
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 32])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_DIM, 32])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    s_cols: gl.constexpr = gl.SliceLayout(0, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    o_cols: gl.constexpr = gl.SliceLayout(0, o_layout)

    start_m = gl.program_id(0) * BLOCK_M
    bh = gl.program_id(1)
    kv = (bh // H) * (H // GROUP) + (bh % H) // GROUP
    # rows of the flattened copies and per-head scale offsets; the launcher checks int32 range
    k_row0 = kv * N
    vt_row0 = kv * HEAD_DIM
    Q_SCALE += bh * N
    K_SCALE += kv * N
    VT_SCALE += kv * (NPAD // QB) * HEAD_DIM
    O += bh.to(gl.int64) * N * HEAD_DIM
    LSE2 += bh * N
    if CAUSAL:
        hi = gl.minimum(start_m + BLOCK_M, N)
    else:
        hi = N
    n_tiles = (hi + BLOCK_N - 1) // BLOCK_N

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    vt_smem = gl.allocate_shared_memory(vt_desc.dtype, [STAGES, HEAD_DIM, BLOCK_N], vt_desc.layout)
    if P_SMEM:
        # P8 as a shared-memory wgmma operand: frees P8's registers while PV is in flight
        p_smem = gl.allocate_shared_memory(gl.float8e4nv, [2, BLOCK_M, BLOCK_N],
                                           gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], gl.float8e4nv))
    else:
        p_smem = q_smem  # unused
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [bh * N + start_m, 0], q_bar, q_smem)
    for i in gl.static_range(STAGES):
        _load_kv(k_desc, vt_desc, k_smem, vt_smem, bars, i, i, k_row0, vt_row0, i < n_tiles, BLOCK_N)

    offs_m = start_m + gl.arange(0, BLOCK_M, layout=s_rows)
    offs_d = gl.arange(0, HEAD_DIM, layout=o_cols)
    # tau * log2(e) rides on the query scale: S2 = S * log2(e), so P = exp2(S2 - m)
    q_scale = gl.load(Q_SCALE + offs_m, mask=offs_m < N, other=0.0) * qk_scale
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, s_rows)
    l_i = gl.zeros([BLOCK_M], gl.float32, s_rows)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)

    mbarrier.wait(q_bar, 0)
    mbarrier.wait(bars.index(0), 0)
    s_tok = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)),
                          gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
    s_raw = warpgroup_mma_wait(0, deps=[s_tok])
    p8, alpha, m_i, l_i = _softmax_tile(s_raw, q_scale, K_SCALE, m_i, l_i, 0, offs_m, N,
                                        BLOCK_N, MASK, CAUSAL, P_SCALE, s_cols)
    # Nothing is in flight at the loop's back edge: ptxas waits for every wgmma at a loop header
    # that one crosses (a first version kept PV in flight across it and lost all overlap).
    for j in range(0, n_tiles - 1):
        slot = j % STAGES
        nxt = (j + 1) % STAGES
        # S_{j+1} first, then PV_j: waiting for one outstanding group leaves PV_j in flight
        mbarrier.wait(bars.index(nxt), ((j + 1) // STAGES) & 1)
        s_tok = warpgroup_mma(q_smem, k_smem.index(nxt).permute((1, 0)),
                              gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
        pv_tok = _issue_pv(p8, p_smem, j % 2, vt_smem.index(slot), BLOCK_M, HEAD_DIM, o_layout,
                           p_layout, P_SMEM)
        alpha_j = gl.convert_layout(alpha, o_rows)
        s_raw = warpgroup_mma_wait(1, deps=[s_tok])
        # softmax of tile j + 1 while PV_j runs
        p8, alpha, m_i, l_i = _softmax_tile(s_raw, q_scale, K_SCALE, m_i, l_i, (j + 1) * BLOCK_N, offs_m, N,
                                            BLOCK_N, MASK, CAUSAL, P_SCALE, s_cols)
        # retire PV_j (promotion: one float32 add per tile); its stage is free again
        v_scale = gl.load(VT_SCALE + ((j * BLOCK_N) // QB) * HEAD_DIM + offs_d)
        pv = warpgroup_mma_wait(0, deps=[pv_tok])
        acc = acc * alpha_j[:, None] + pv * v_scale[None, :]
        _load_kv(k_desc, vt_desc, k_smem, vt_smem, bars, j + STAGES, slot, k_row0, vt_row0,
                 j + STAGES < n_tiles, BLOCK_N)
    last = n_tiles - 1
    pv_tok = _issue_pv(p8, p_smem, last % 2, vt_smem.index(last % STAGES), BLOCK_M, HEAD_DIM, o_layout,
                       p_layout, P_SMEM)
    v_scale = gl.load(VT_SCALE + ((last * BLOCK_N) // QB) * HEAD_DIM + offs_d)
    pv = warpgroup_mma_wait(0, deps=[pv_tok])
    acc = acc * gl.convert_layout(alpha, o_rows)[:, None] + pv * v_scale[None, :]

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    l_o = gl.convert_layout(l_i, o_rows)
    o = acc / (l_o * P_SCALE)[:, None]
    offs_mo = start_m + gl.arange(0, BLOCK_M, layout=o_rows)
    gl.store(O + offs_mo[:, None] * HEAD_DIM + offs_d[None, :], o.to(gl.bfloat16),
             mask=(offs_mo < N)[:, None])
    gl.store(LSE2 + offs_m, m_i + gl.log2(l_i), mask=offs_m < N)


def descriptor_layouts(block_m: int, block_n: int, head_dim: int) -> dict:
    """Block shapes and shared-memory layouts (128-byte swizzle where rows allow) of the Q, K and
    V^T tiles."""
    f8 = gl.float8e4nv
    shapes = {"q_desc": [block_m, head_dim], "k_desc": [block_n, head_dim], "vt_desc": [head_dim, block_n]}
    return {name: (shape, gl.NVMMASharedLayout.get_default_for(shape, f8)) for name, shape in shapes.items()}


def forward(q8, k8, vt, *, batch: int, heads: int, kv_heads: int, n: int, head_dim: int,
            causal: bool, scale: float, recipe: KernelRecipe, p_smem: bool = False):
    """``fwd.forward`` (without debug dumps) through the Gluon kernel: returns ``(O, LSE2)``."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    tiles = recipe.fwd
    if tiles.block_n % tiles.block_m or tiles.block_m % 16:
        raise ValueError(f"the Gluon forward needs block_m | block_n and 16 | block_m, got {tiles}")
    rows = max(batch * heads * n, batch * kv_heads * head_dim) + tiles.block_n
    if rows >= 2 ** 31:
        raise ValueError(f"{batch}x{heads}x{n}: flattened row indices exceed int32")
    dev = q8.rows.device
    o = torch.empty((batch, heads, n, head_dim), device=dev, dtype=torch.bfloat16)
    lse2 = torch.empty((batch * heads, n), device=dev, dtype=torch.float32)
    lay = descriptor_layouts(tiles.block_m, tiles.block_n, head_dim)
    flat = {
        "q_desc": q8.rows.reshape(batch * heads * n, head_dim),
        "k_desc": k8.rows.reshape(batch * kv_heads * n, head_dim),
        "vt_desc": vt.cols.reshape(batch * kv_heads * head_dim, vt.npad),
    }
    descs = [TensorDescriptor.from_tensor(t, *lay[name]) for name, t in flat.items()]
    grid = (triton.cdiv(n, tiles.block_m), batch * heads)
    _fwd_gluon_kernel[grid](
        *descs, q8.row_scale, k8.row_scale, vt.col_scale, o, lse2,
        scale * LOG2E, heads, heads // kv_heads, n, vt.npad,
        HEAD_DIM=head_dim, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, QB=QUANT_BLOCK,
        CAUSAL=causal, MASK=causal or n % tiles.block_n != 0, P_SCALE=float(2 ** recipe.p_scale_log2),
        STAGES=tiles.num_stages, P_SMEM=p_smem, num_warps=tiles.block_m // 16,
    )
    return o, lse2


#: (B, H, HKV, N, D, causal, input kind)
CASES = [
    (1, 2, 2, 1, 128, False, "randn"), (1, 2, 2, 77, 64, True, "randn"),
    (2, 4, 2, 1000, 128, True, "outliers"), (2, 4, 2, 1000, 128, False, "outliers"),
    (1, 3, 1, 300, 64, False, "wide"), (1, 3, 3, 640, 128, True, "wide"),
    (2, 2, 2, 513, 128, False, "nan_row"), (1, 2, 2, 384, 64, True, "zero_block"),
    (1, 8, 8, 4096, 128, True, "outliers"), (1, 8, 8, 4096, 64, False, "outliers"),
]
#: (block_m, num_stages, P8 through shared memory)
VARIANTS = [(64, 3, False), (64, 3, True), (64, 2, True)]


def _inputs(b, h, hkv, n, d, kind, gen):
    def draw(heads):
        x = torch.randn(b, heads, n, d, device="cuda", generator=gen)
        if kind == "outliers":
            x[..., ::16] *= 4
            x[:, :, ::97] *= 50
        elif kind == "wide":
            x = x * torch.exp2(torch.randint(-20, 21, (b, heads, n, 1), device="cuda", generator=gen).float())
        return x.to(torch.bfloat16)
    q, k, v = draw(h), draw(hkv), draw(hkv)
    if kind == "nan_row":
        q[0, 0, 5] = float("nan")
    if kind == "zero_block":
        k[:, :, 128:256] = 0
        v[:, :, 128:256] = 0
    return q, k, v


def _bits_equal(a, b):
    ia, ib = a.contiguous().view(torch.int16 if a.dtype == torch.bfloat16 else torch.int32), \
        b.contiguous().view(torch.int16 if b.dtype == torch.bfloat16 else torch.int32)
    same = (ia == ib) | (torch.isnan(a) & torch.isnan(b))
    return int((~same).sum()), a.numel()


def check_identity(variants):
    from dmref.kernels import fwd
    from dmref.kernels.config import RECIPES, FwdTiles
    from dmref.kernels.quantize import quantize

    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for b, h, hkv, n, d, causal, kind in CASES:
        q, k, v = _inputs(b, h, hkv, n, d, kind, gen)
        q8, _ = quantize(q, "float8_e4m3fn", rows=True, cols=False)
        k8, _ = quantize(k, "float8_e4m3fn", rows=True, cols=False)
        v8, _ = quantize(v, "float8_e4m3fn", rows=False, cols=True)
        dims = dict(batch=b, heads=h, kv_heads=hkv, n=n, head_dim=d, causal=causal, scale=1 / math.sqrt(d))
        r = RECIPES["delta_matching"]
        o_t, lse_t, _ = fwd.forward(q8, k8, v8, recipe=r, **dims)
        for bm, st, psm in variants:
            rg = r.with_tiles(fwd=FwdTiles(bm, 128, bm // 16, st, True))
            o_g, lse_g = forward(q8, k8, v8, recipe=rg, p_smem=psm, **dims)
            torch.cuda.synchronize()
            bad_o, tot_o = _bits_equal(o_g, o_t)
            bad_l, tot_l = _bits_equal(lse_g, lse_t)
            rows.append({"case": [b, h, hkv, n, d, causal, kind], "variant": [bm, st, psm],
                         "o_bits_differ": bad_o, "o_elements": tot_o, "lse_bits_differ": bad_l,
                         "lse_elements": tot_l,
                         "o_max_abs_diff": float((o_g.float() - o_t.float()).abs().nan_to_num(0).max())})
            print(rows[-1], flush=True)
    return rows


def bench(variants, shapes):
    from dmref.kernels import fwd
    from dmref.kernels.config import RECIPES, FwdTiles

    rows = []
    for b, h, n, d in shapes:
        for causal in (False, True):
            t_cudnn, saved = forward_baseline(b, h, n, d, causal)
            scale = 1 / math.sqrt(d)
            dims = dict(batch=b, heads=h, kv_heads=h, n=n, head_dim=d, causal=causal, scale=scale)
            r = RECIPES["delta_matching"]
            t_triton = _bench(lambda: fwd.forward(saved.q, saved.k, saved.v, recipe=r, **dims))
            row = {"shape": [b, h, n, d], "causal": causal, "cudnn_ms": t_cudnn, "triton_ms": t_triton,
                   "triton_speedup_vs_cudnn": t_cudnn / t_triton, "gluon_ms": {}, "gluon_speedup_vs_cudnn": {},
                   "gluon_tflops": {}, "cudnn_tflops": _flops(b, h, n, d, causal) / t_cudnn / 1e9}
            for bm, st, psm in variants:
                rg = r.with_tiles(fwd=FwdTiles(bm, 128, bm // 16, st, True))
                key = f"bm{bm}_st{st}_psmem{int(psm)}"
                try:
                    t = _bench(lambda: forward(saved.q, saved.k, saved.v, recipe=rg, p_smem=psm, **dims))
                except Exception as exc:  # noqa: BLE001
                    row["gluon_ms"][key] = repr(exc)[:300]
                    continue
                row["gluon_ms"][key] = t
                row["gluon_speedup_vs_cudnn"][key] = t_cudnn / t
                row["gluon_tflops"][key] = _flops(b, h, n, d, causal) / t / 1e9
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def profile_one() -> int:
    """ncu --clock-control none -k regex:'_fwd_kernel|_fwd_gluon_kernel' --section SchedulerStats ..."""
    from dmref.kernels import fwd
    from dmref.kernels.api import attention_forward
    from dmref.kernels.config import RECIPES

    r = RECIPES["delta_matching"]
    for d in (128, 64):
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, 16, 4096, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        _, _, saved, _ = attention_forward(q, k, v, recipe=r)
        dims = dict(batch=1, heads=16, kv_heads=16, n=4096, head_dim=d, causal=False, scale=1 / math.sqrt(d))
        fwd.forward(saved.q, saved.k, saved.v, recipe=r, **dims)
        forward(saved.q, saved.k, saved.v, recipe=r, **dims)
    torch.cuda.synchronize()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--quick", action="store_true", help="first variant only")
    ap.add_argument("--profile-one", action="store_true",
                    help="one Triton and one Gluon forward at 1x16x4096x{128,64}, for ncu")
    args = ap.parse_args()
    if args.profile_one:
        return profile_one()
    if not args.out:
        ap.error("--out is required")
    variants = VARIANTS[:1] if args.quick else VARIANTS
    result = {
        "date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
        "torch": torch.__version__, "triton": __import__("triton").__version__,
        "method": "triton.testing.do_bench medians; FLOPs as DESIGN.md section 5",
        "identity": check_identity(variants), "speed": bench(variants, SHAPES),
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_fwd_gluon.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
