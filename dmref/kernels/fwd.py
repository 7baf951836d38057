"""Forward FP8 attention kernel (FlashAttention-2 loop, Hopper FP8 wgmma operands).

Per program: ``BLOCK_M`` queries of one head, looping over ``BLOCK_N`` keys of its key/value head.

    S2 = dot(Q8, K8^T) * (q_scale_i * k_scale_j)          # S * log2(e); q_scale holds tau*log2(e)
    m  = max(m, rowmax(S2));  P = exp2(S2 - m)           # float32, against the running max
    l  = l * alpha + rowsum(P)                           # normalizer from float32 P
    acc = acc * alpha + dot(Q8(P * 2**8), V8T) * v_scale # promoted: one float32 add per tile
    O = acc / (l * 2**8);  LSE2 = m + log2(l)

The quantization points are those of ``KernelSpec.recipe`` (docs/kernels.md). P is quantized against the running
max with a fixed 2**8 offset; V comes from its transposed copy (tokens contiguous) so that the PV
wgmma reads both operands K-major.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from ._common import mul_rn, to_bf16, to_fp8
from ._runtime import Launch, interpreting
from .config import QUANT_BLOCK, FwdTiles, KernelSpec, triton_fwd_tiles
from ..emulation.constants import LN2, LOG2E  # noqa: F401  (bwd and api take them from here)

# log2(e): the kernels compute exp2(S * log2(e)) = exp(S); tau * log2(e) rides on Q's scale


@triton.jit
def _fwd_k_tile(K8, K_SCALE, kv, start_n, offs_n, offs_d, N,
                BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASK: tl.constexpr, TMA: tl.constexpr):
    """Load: the K row copy as a ``(D, BLOCK_N)`` tile, the head dim (the contraction)
    contiguous, and its per-key scales. With TMA keys past N read as zeros (the descriptor's
    bounds), else under ``MASK``; their logits are masked by the softmax stage."""
    if TMA:
        k = tl.trans(K8.load([kv, start_n, 0]).reshape(BLOCK_N, HEAD_DIM))
    elif MASK:
        k = tl.load(K8 + offs_n[None, :] * HEAD_DIM + offs_d[:, None], mask=offs_n[None, :] < N, other=0.0)
    else:
        k = tl.load(K8 + offs_n[None, :] * HEAD_DIM + offs_d[:, None])
    if MASK:
        k_scale = tl.load(K_SCALE + offs_n, mask=offs_n < N, other=0.0)
    else:
        k_scale = tl.load(K_SCALE + offs_n)
    return k, k_scale


@triton.jit
def _fwd_softmax(s, m_i, l_i, offs_m, offs_n, N, MASK: tl.constexpr, CAUSAL: tl.constexpr):
    """Online softmax of one key tile: P = exp2(S2 - m) against the running max m (updated with
    this tile's row maxima), alpha = exp2(m_old - m) rescales what was accumulated, and the
    normalizer l sums the float32 P. Returns (P, alpha, l, m)."""
    if MASK:
        valid = offs_n[None, :] < N
        if CAUSAL:
            valid = valid & (offs_m[:, None] >= offs_n[None, :])
        s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    if MASK:
        # a row with every key masked so far keeps m = -inf; subtract 0 there instead
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_sub = m_new
    p = tl.math.exp2(s - m_sub[:, None])
    alpha = tl.math.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return p, alpha, l_i, m_new


@triton.jit
def _fwd_v_tile(VT8, VT_SCALE, kv, start_n, offs_n, offs_d, NPAD,
                BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, QB: tl.constexpr, TMA: tl.constexpr):
    """Load: the V transposed copy as a ``(BLOCK_N, D)`` tile, the tokens (the contraction)
    contiguous, and its per-channel scales of this key tile's scale block; the padding up to
    NPAD holds zero codes, so no mask."""
    if TMA:
        vt = tl.trans(VT8.load([kv, 0, start_n]).reshape(HEAD_DIM, BLOCK_N))
    else:
        vt = tl.load(VT8 + offs_d[None, :] * NPAD + offs_n[:, None])
    v_scale = tl.load(VT_SCALE + (start_n // QB) * HEAD_DIM + offs_d)
    return vt, v_scale


@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q, q_scale, offs_m,
    K8, K_SCALE, VT8, VT_SCALE, kv, lo, hi, N, NPAD, P_DUMP,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, QB: tl.constexpr,
    MASK: tl.constexpr, CAUSAL: tl.constexpr, P_SCALE: tl.constexpr,
    TMA: tl.constexpr, DEBUG: tl.constexpr, INTERPRET: tl.constexpr,
):
    # K_SCALE, VT_SCALE and P_DUMP point at this program's head: offsets stay int32. With TMA,
    # K8 and VT8 are tensor descriptors of the (B*Hkv, N, D) and (B*Hkv, D, NPAD) copies and
    # ``kv`` selects the head; else they point at this head too.
    # Invariant at the top of each iteration, over the key tiles done so far: m = the running
    # row max of S2; l = sum of the float32 P = exp2(S2 - m_tile) rescaled to m; acc = sum of
    # Q8(2**8 P) deq(V) rescaled to m (float32, one add per tile).
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        # load
        k, k_scale = _fwd_k_tile(K8, K_SCALE, kv, start_n, offs_n, offs_d, N, BLOCK_N, HEAD_DIM, MASK, TMA)
        # QK^T: S2 rounded before m is subtracted (mul_rn): no fused multiply-add into exp2's
        # argument
        s = mul_rn(tl.dot(q, k), q_scale[:, None] * k_scale[None, :], INTERPRET)
        # softmax against the running max
        p, alpha, l_i, m_new = _fwd_softmax(s, m_i, l_i, offs_m, offs_n, N, MASK, CAUSAL)
        # Q-point P: float32 -> E4M3, scale 2**8 against the running max, RNE, satfinite
        p_scaled = p * P_SCALE
        p8 = to_fp8(p_scaled, False, INTERPRET)
        if DEBUG:
            # the float32 values the cast received; the host makes them codes (fp8_codes)
            tl.store(P_DUMP + offs_m[:, None] * N + offs_n[None, :], p_scaled,
                     mask=(offs_m[:, None] < N) & (offs_n[None, :] < N))
        # load
        vt, v_scale = _fwd_v_tile(VT8, VT_SCALE, kv, start_n, offs_n, offs_d, NPAD, BLOCK_N, HEAD_DIM, QB, TMA)
        # PV, promoted: the wgmma chain covers one tile, then one float32 add
        acc = acc * alpha[:, None] + tl.dot(p8, vt) * v_scale[None, :]
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(
    Q8, Q_SCALE, K8, K_SCALE, VT8, VT_SCALE,
    O, LSE2, P_DUMP,
    qk_scale, H, GROUP, N, NPAD,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    QB: tl.constexpr, CAUSAL: tl.constexpr, P_SCALE: tl.constexpr,
    TMA: tl.constexpr, DEBUG: tl.constexpr, INTERPRET: tl.constexpr,
):
    tl.static_assert(QB % BLOCK_N == 0)
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    kv = ((bh // H) * (H // GROUP) + (bh % H) // GROUP).to(tl.int64)
    bh64 = bh.to(tl.int64)
    # per-head base pointers (64-bit scalars); the tiles below use int32 offsets from them
    Q8 += bh64 * N * HEAD_DIM
    Q_SCALE += bh64 * N
    O += bh64 * N * HEAD_DIM
    LSE2 += bh64 * N
    if not TMA:
        K8 += kv * N * HEAD_DIM
        VT8 += kv * HEAD_DIM * NPAD
    K_SCALE += kv * N
    VT_SCALE += kv * (NPAD // QB) * HEAD_DIM
    if DEBUG:
        P_DUMP += bh64 * N * N
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    in_seq = offs_m < N
    q = tl.load(Q8 + offs_m[:, None] * HEAD_DIM + offs_d[None, :], mask=in_seq[:, None], other=0.0)
    # tau * log2(e) rides on the query scale: S2 = S * log2(e), so P = exp2(S2 - m)
    q_scale = tl.load(Q_SCALE + offs_m, mask=in_seq, other=0.0) * qk_scale
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    kv32 = kv.to(tl.int32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if CAUSAL:
        # key tiles wholly below the diagonal for every row: no mask; the rest up to the
        # diagonal: causal mask (tiles divide one another, so the split is tile-aligned)
        lo_diag = (start_m // BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, q_scale, offs_m, K8, K_SCALE, VT8, VT_SCALE, kv32,
                                   0, lo_diag, N, NPAD, P_DUMP,
                                   HEAD_DIM, BLOCK_N, QB, False, True, P_SCALE, TMA, DEBUG, INTERPRET)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, q_scale, offs_m, K8, K_SCALE, VT8, VT_SCALE, kv32,
                                   lo_diag, tl.minimum(start_m + BLOCK_M, N), N, NPAD, P_DUMP,
                                   HEAD_DIM, BLOCK_N, QB, True, True, P_SCALE, TMA, DEBUG, INTERPRET)
    else:
        n_full = (N // BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, q_scale, offs_m, K8, K_SCALE, VT8, VT_SCALE, kv32,
                                   0, n_full, N, NPAD, P_DUMP,
                                   HEAD_DIM, BLOCK_N, QB, False, False, P_SCALE, TMA, DEBUG, INTERPRET)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, q_scale, offs_m, K8, K_SCALE, VT8, VT_SCALE, kv32,
                                   n_full, N, N, NPAD, P_DUMP,
                                   HEAD_DIM, BLOCK_N, QB, True, False, P_SCALE, TMA, DEBUG, INTERPRET)
    o = acc / (l_i * P_SCALE)[:, None]
    tl.store(O + offs_m[:, None] * HEAD_DIM + offs_d[None, :],
             to_bf16(o, INTERPRET), mask=in_seq[:, None])
    tl.store(LSE2 + offs_m, m_i + tl.math.log2(l_i), mask=in_seq)


def launch(spec: KernelSpec, *, head_dim: int, causal: bool, debug: bool = False) -> Launch:
    """The forward kernel's launch for ``spec`` at ``head_dim``: key tiles of the recipe's
    ``Tiles.block_k``, P's fixed scale ``2**recipe.p_fwd.offset_log2``, the tiling's warps,
    stages, register cap and loads. The one description that :func:`forward` and
    ``compile_check`` read. A folded spec (K scaled per head, V per head and channel: special
    cases of the per-token and per-block scales this kernel reads, given broadcast) runs with
    ``config.triton_fwd_tiles``, its own tiling being the warp-specialized forward's; one whose
    PV is one chain over all keys (``Recipe.pv_chain``) is refused, as this kernel promotes PV
    once per key tile."""
    if spec.folded:
        if spec.recipe.pv_chain:
            raise ValueError(f"{spec.name}: PV as one wgmma chain over all keys (pv_chain) runs on the "
                             "warp-specialized forward only (a Hopper GPU); the Triton forward promotes it per key tile")
        tiles = triton_fwd_tiles(head_dim)
    else:
        tiles: FwdTiles = spec.fwd_tiles(head_dim)
    block_n = spec.recipe.tiles.block_k
    consts = dict(HEAD_DIM=head_dim, BLOCK_M=tiles.block_m, BLOCK_N=block_n, QB=QUANT_BLOCK, CAUSAL=causal,
                  P_SCALE=float(2 ** spec.recipe.p_fwd.offset_log2), TMA=tiles.tma, DEBUG=bool(debug),
                  INTERPRET=interpreting())
    descriptors = {"K8": [1, block_n, head_dim], "VT8": [1, head_dim, block_n]} if tiles.tma else {}
    return Launch(consts, tiles.num_warps, tiles.num_stages, tiles.maxnreg, descriptors, kernel=_fwd_kernel,
                  block_m=tiles.block_m)


def forward(
    q8, k8, vt, *, batch: int, heads: int, kv_heads: int, n: int, head_dim: int,
    causal: bool, scale: float, recipe: KernelSpec, debug: bool = False,
):
    """Run the forward kernel on quantized operands.

    ``q8`` / ``k8`` are row copies and ``vt`` a transposed copy (``quantize.Quantized``). Returns
    ``(O, LSE2, P codes or None)``: O ``(B, H, N, D)`` BF16, LSE2 ``(B*H, N)`` float32 in base 2
    (``LSE = LSE2 * ln 2``), and with ``debug`` the E4M3 codes of every quantized P as
    ``(B*H, N, N)`` uint8 (0 where masked).
    """
    run = launch(recipe, head_dim=head_dim, causal=causal, debug=debug)
    dev = q8.rows.device
    o = torch.empty((batch, heads, n, head_dim), device=dev, dtype=torch.bfloat16)
    lse2 = torch.empty((batch * heads, n), device=dev, dtype=torch.float32)
    p_dump = (torch.zeros((batch * heads, n, n), device=dev, dtype=torch.float32) if debug
              else torch.empty(1, device=dev, dtype=torch.float32))
    grid = run.grid(n, batch * heads)
    k_rows, v_cols = k8.rows, vt.cols
    if run.descriptors:
        from triton.tools.tensor_descriptor import TensorDescriptor

        k_rows = TensorDescriptor.from_tensor(k8.rows, run.descriptors["K8"])
        v_cols = TensorDescriptor.from_tensor(vt.cols, run.descriptors["VT8"])
    run.start(grid,
        q8.rows, q8.row_scale, k_rows, k8.row_scale, v_cols, vt.col_scale,
        o, lse2, p_dump,
        scale * LOG2E, heads, heads // kv_heads, n, vt.npad)
    return o, lse2, (fp8_codes(p_dump) if debug else None)


def fp8_codes(dump: torch.Tensor, fmt: str = "float8_e4m3fn") -> torch.Tensor:
    """uint8 codes of a debug dump: the float32 values the kernel's cast received, cast here
    with RNE satfinite (``dmref.emulation``, the model's cast; the kernels' ``cvt.rn.satfinite``
    computes the same, checked on its own in tests/kernels)."""
    from dmref.emulation import encode

    return encode(dump, fmt, saturate=True)


