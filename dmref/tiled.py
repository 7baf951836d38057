"""FlashAttention-style attention, forward and backward, with every FP8 decision taken from a
:class:`~dmref.recipes.Recipe`.

Shapes as in :mod:`dmref.reference`: ``q (B, H, Nq, D)``, ``k (B, Hkv, Nk, D)``,
``v (B, Hkv, Nk, Dv)``, ``dout (B, H, Nq, Dv)``. Results are in the recipe's working precision
(float32, or float64 for the ``exact`` preset).

What is computed, one key tile ``[j0, j1)`` at a time (all query rows of the tile at once: rows
are independent, so this equals any query tiling; under ``causal`` the rows that see no key of
the tile are skipped)::

    forward   x    = (Q^ K^ᵀ) * fl(scale * log2 e)  [+ mask * log2 e]     base-2 logits
              m    = running row max of x;  alpha = 2^(m_old - m);  p = 2^(x - m)
              P~   = Q-point P (p * 2^offset) * 2^-offset
              l    = alpha l + rowsum(p or P~);  acc = alpha acc + P~ V^  (Recipe.pv_chain:
                                                    P~ V^ accumulated into fl(alpha acc))
              O    = acc / l;  lse = m + log2 l                          (saved: O, lse)
    delta     D    (one of the strategies below, its own step before the sweep)
    backward  P    = 2^(x - lse)   (FP32: the multiplier of dS)
              dV  += Q(Pᵀ) dO^;   dP^ = dO^ V^ᵀ;   dS = P ∘ (dP^ - D)
              dQ  += Q(dS) K^;    dK  = Q(dSᵀ) Q^;   dQ, dK *= scale

Every cast is one line marked ``# Q-point``; every matmul is a call to :func:`_matmul` with the
recipe's accumulation model for it. All casts go through :mod:`dmref.emulation`, in
:func:`_quantize` (the only call site).

Tails: a tile or scale block that runs past the end of a dimension is padded with zeros for the
scale computation (zeros change no amax) and the padding is dropped again, so any sequence length
and any head dim work. Fully masked rows give zero output, ``lse = -inf`` and zero gradients.
Non-finite inputs propagate as in :mod:`dmref.reference`; in addition a NaN or inf makes its
whole scale block NaN (its amax, hence its scale, is not finite), so with per-tensor scales one
bad value turns the whole operand NaN, as on the hardware.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .emulation import FLOAT8_E8M0FNU, Accumulation, MatmulModel, decode, encode
from .emulation.blocked import Block, block_amax, scales_from_amax
from .emulation.blocked_fast import abs_amax, fake_quantize_blocked
from .emulation.constants import LN2, LOG2E
from .emulation.formats import check_bool
from .recipes import (DeltaKind, DeltaStrategy, Granularity, Normalizer, PReference, QuantPoint, Recipe, ScaleRule,
                      get_recipe)
from .reference import AttentionShape, check_attention_inputs, check_causal, expand_kv, keep_mask, mask_window, reduce_kv

__all__ = ["BackwardResult", "ForwardResult", "RowsumStats", "SoftmaxStats", "attention", "backward", "forward",
           "global_amax_points", "group_amax"]

_NEG_INF = float("-inf")


# ==============================================================================================
# Quantization: every cast, through dmref.emulation
# ==============================================================================================

def _block(granularity: Granularity, contract_dim: int) -> Block:
    """The emulation's :class:`Block` of a granularity on an operand (..., rows, cols) whose
    matmul contracts over ``contract_dim`` (-1: cols, -2: rows)."""
    block = granularity.block  # laid out as (rows, contraction)
    return block if contract_dim == -1 or block.spans_batch else block.t()


def group_amax(x: torch.Tensor, point: QuantPoint, *, contract_dim: int) -> torch.Tensor:
    """amax of each scale block of x under a TENSOR or ROW ``point`` (blocks that span key
    tiles): 0-d for TENSOR, (..., R, 1) or (..., 1, C) for ROW."""
    if point.granularity is Granularity.TENSOR:
        return abs_amax(x)
    if point.granularity is Granularity.ROW:
        return abs_amax(x, dim=contract_dim, keepdim=True)
    raise ValueError("group_amax is only needed for TENSOR and ROW granularity")


def _dynamic_pow2(rule: ScaleRule) -> bool:
    """Whether ``rule`` chooses a power-of-two scale from the data."""
    return rule.is_dynamic and rule.is_pow2


def _quantize(x: torch.Tensor, point: QuantPoint, *, contract_dim: int, dtype: torch.dtype,
              fixed_log2: int = 0, amax: torch.Tensor | None = None) -> torch.Tensor:
    """s * Q(x / s): the operand the matmul sees, in ``dtype``: ``dequantize_blocked(
    *quantize_blocked(x, ...))`` of the emulation for the point's format, rule, rounding and
    saturation, with scale blocks along ``contract_dim`` (-1 or -2: the axis of x the matmul
    contracts over), computed by :func:`~dmref.emulation.blocked_fast.fake_quantize_blocked`.
    Every cast of dmref.tiled happens here.

    ``amax`` (:func:`group_amax` over a whole sweep) replaces the block amax for TENSOR and ROW
    granularity, whose blocks span several key tiles. ``fixed_log2``: the scale of
    ``ScaleRule.FIXED`` is 2^fixed_log2 (-offset for P).
    """
    if not point.quantized:
        return x.to(dtype)
    rule = point.scale_rule
    margin = fixed_log2 if rule is ScaleRule.FIXED else 0
    values = fake_quantize_blocked(x, point.fmt, block=_block(point.granularity, contract_dim), scale_rule=rule,
                                   margin=margin, rounding=point.rounding, saturate=point.saturate, amax=amax)
    return values.to(dtype)


# ==============================================================================================
# Accumulation models: the one place the seven matmuls are computed
# ==============================================================================================


def _matmul(a_deq: torch.Tensor, b_deq: torch.Tensor, model: MatmulModel, dtype: torch.dtype,
            points: tuple[QuantPoint, QuantPoint] | None = None, c: torch.Tensor | None = None) -> torch.Tensor:
    """``a_deq (..., m, k) @ b_deq (..., k, n)`` under the accumulation model ``model``, plus the
    initial accumulator ``c`` (..., m, n) where given.

    - ``FP32``: torch's float32 matmul of the dequantized operands. Products of FP8 or BF16
      values with power-of-two scales are exact in float32; the sum is rounded in torch's
      (BLAS's) order, which is not specified: the error bound is gamma_k * sum |a b|.
    - ``EXACT`` with ``float64_result`` (``"float64"``): float64 matmul, kept in float64.
    - ``EXACT``: float64 matmul rounded once to float32 (exact products; the float64 sum is
      exact unless the products span more than 2^29 in magnitude).
    - ``HOPPER`` (with ``promote_every``: promotion to float32 every N products): the emulated
      Hopper wgmma of ``dmref.emulation.gemm``, with the operands' FP8 formats and their scale
      blocks along k (``points``: the two operands' quantization points); ``c`` enters the
      wgmma chain as its accumulator (one scale block along k only).

    With ``c`` under ``FP32`` and ``EXACT`` the product is formed as above and ``c`` added once
    in its precision.
    """
    if model.accumulation is Accumulation.FP32:
        out = torch.matmul(a_deq.to(torch.float32), b_deq.to(torch.float32))
        if c is not None:
            out = out + c.to(torch.float32)
    elif model.accumulation is Accumulation.EXACT:
        out = torch.matmul(a_deq.to(torch.float64), b_deq.to(torch.float64))
        if c is not None:
            out = out + c.to(torch.float64)
        if not model.float64_result:
            out = out.to(torch.float32)
    else:
        out = _emulated_gemm(a_deq, b_deq, model, points, c)
    return out.to(dtype)


def _k_block(point: QuantPoint) -> int | None:
    """Extent along the contraction of one scale block (None: the whole contraction)."""
    return None if point.scale_rule is ScaleRule.FIXED else point.granularity.contraction_extent


def _pow2_blocks(x: torch.Tensor, fmt, block: int):
    """(values, scales): x (..., R, K) = values * scales per (row, K tile of ``block``), with
    power-of-two scales chosen so that values are exactly ``fmt`` values. Exact for operands
    quantized with power-of-two scale blocks that nest in these tiles: the Hopper model's
    result does not depend on which power of two carries the scale."""
    rows, k = x.shape[-2:]
    tiles = -(-k // block)
    xb = F.pad(x, (0, tiles * block - k)).reshape(*x.shape[:-1], tiles, block).to(torch.float32)
    # POW2_DOWN's s: the smallest power of two with amax <= s * max (for these amaxes, an FP8
    # value times a power of two, RN32(max / amax) is never rounded onto a power of two)
    s = scales_from_amax(abs_amax(xb, dim=-1, keepdim=True), fmt, ScaleRule.POW2_DOWN)
    values = (xb / s).reshape(*x.shape[:-1], tiles * block)[..., :k]
    return values, s[..., 0]


def _emulated_gemm(a_deq: torch.Tensor, b_deq: torch.Tensor, model: MatmulModel, points,
                   c: torch.Tensor | None = None) -> torch.Tensor:
    from .emulation import gemm  # imported only when a recipe asks for an emulated model

    if points is None or not all(p.quantized and p.fmt.is_fp8 for p in points):
        raise NotImplementedError(
            f"accumulation model {model.name!r} emulates FP8 tensor cores; both operands of this "
            f"matmul must be FP8 quantization points, got {points}"
        )
    blocks = [b for b in (_k_block(p) for p in points) if b is not None]
    # no scale block along the contraction: one tile of the whole contraction, padded to whole
    # k-steps (the scale of a padded tile is a power of two, which the model's result ignores)
    k_step = model.rules.k_step
    block = min(blocks) if blocks else -(-a_deq.shape[-1] // k_step) * k_step
    fa, fb = (p.fmt for p in points)
    a, sa = _pow2_blocks(a_deq, fa, block)
    bt, sb = _pow2_blocks(b_deq.transpose(-1, -2), fb, block)
    if c is not None:
        return _chained_gemm(a, sa, bt, sb, c, model, fa, fb)
    return gemm.matmul(a.contiguous(), bt.contiguous(), fa=fa, fb=fb, model=model.accumulation,
                       promote_every=model.promote_every, rules=model.rules,
                       scale_a=sa.contiguous(), scale_b=sb.contiguous(), scale_block_k=block)


def _chained_gemm(a, sa, bt, sb, c, model: MatmulModel, fa, fb) -> torch.Tensor:
    """The wgmma chain with the accumulator ``c`` fed in, for operands with one power-of-two scale
    per row of a and per row of bt: in units of sa_m sb_n the chain is scale-free (the Hopper
    model's alignment and truncation are relative, so a power of two common to every term of an
    element commutes with them), ``c`` enters in those units, and the result is scaled back."""
    from .emulation import gemm

    if sa.shape[-1] != 1 or sb.shape[-1] != 1:
        raise NotImplementedError("an accumulator fed into the wgmma chain needs one scale block along the contraction")
    s = sa[..., :, 0:1] * sb[..., :, 0].unsqueeze(-2)  # (..., m, n), powers of two
    c32 = c.to(torch.float32)
    c_units = c32 / s
    if not bool(((c_units * s == c32) | ~torch.isfinite(c32)).all()):
        raise NotImplementedError("the chained accumulator leaves float32's normal range in the operands' units")
    out = gemm.matmul(a.contiguous(), bt.contiguous(), c_units.contiguous(), fa=fa, fb=fb, model=model.accumulation,
                      promote_every=model.promote_every, rules=model.rules)
    return out * s


# ==============================================================================================
# Shared pieces of the forward and the backward
# ==============================================================================================


@dataclass
class _Problem:
    """Validated inputs, masks and constants of one call."""

    shape: AttentionShape
    recipe: Recipe
    causal: bool
    mask: torch.Tensor | None
    dtype: torch.dtype  # working precision
    c: float  # fl(scale * log2 e) in the working precision

    def key_tiles(self):
        """(j0, j1, i0): each key tile and the first query row (a multiple of block_q) that can
        see one of its keys."""
        n_q, n_k = self.shape.seqlen_q, self.shape.seqlen_k
        bq, bk = self.recipe.tiles.block_q, self.recipe.tiles.block_k
        for j0 in range(0, n_k, bk):
            i0 = 0
            if self.causal:
                first = j0 - (n_k - n_q)  # row i sees key j iff j <= i + (n_k - n_q)
                if first >= n_q:
                    continue
                i0 = max(0, first) // bq * bq
            yield j0, min(j0 + bk, n_k), i0


def _problem(q, k, v, recipe, causal, scale, mask, dout=None) -> _Problem:
    recipe = get_recipe(recipe)
    shape = check_attention_inputs(q, k, v, scale=scale, mask=mask, dout=dout)
    dtype = torch.float64 if recipe.precision == "float64" else torch.float32
    c = torch.tensor(shape.scale * LOG2E, dtype=dtype).item()
    if not math.isfinite(c) or c < torch.finfo(dtype).tiny:
        raise ValueError(
            f"scale={shape.scale!r} does not fit the working precision {recipe.precision} of recipe "
            f"{recipe.name!r}: scale * log2(e) rounds to {c}"
        )
    for name in ("p", "p_dv"):
        point = getattr(recipe, name)
        offset = (recipe.p_fwd if name == "p" else recipe.p_bwd).offset_log2
        if point.quantized and point.scale_rule is ScaleRule.FIXED:
            fmt = point.fmt
            if 2.0**offset > fmt.max:
                raise ValueError(
                    f"recipe {recipe.name!r}: P * 2^{offset} does not fit {fmt.name} (max {fmt.max}); "
                    "P = 1 would saturate"
                )
    return _Problem(shape, recipe, check_causal(causal), mask, dtype, c)


def _logits(pb: _Problem, q_hat, k_hat, i0: int, j0: int, j1: int, model: MatmulModel) -> torch.Tensor:
    """Base-2 logits x = (Q^ K^ᵀ) * fl(scale log2 e) [+ mask log2 e] of rows i0: and keys
    j0:j1; masked positions -inf. The forward and both backward sweeps call exactly this, so
    they see bit-identical x (assumption A1)."""
    s = _matmul(q_hat[..., i0:, :], k_hat[..., j0:j1, :].transpose(-1, -2), model, pb.dtype,
                (pb.recipe.q, pb.recipe.k))
    x = s.mul_(pb.c)
    rows, cols = slice(i0, pb.shape.seqlen_q), slice(j0, j1)
    bool_mask = None
    if pb.mask is not None:
        if pb.mask.dtype == torch.bool:
            bool_mask = pb.mask
        else:
            x = x.add_(mask_window(pb.mask, rows, cols).to(pb.dtype) * LOG2E)
    keep = keep_mask(pb.shape.seqlen_q, pb.shape.seqlen_k, causal=pb.causal, mask=bool_mask,
                     device=x.device, rows=rows, cols=cols)
    if keep is not None:
        x = x.masked_fill_(~keep, _NEG_INF)
    return x


def _exp2_split(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """2^(x - ref) for integer-valued ``ref``, computed as ldexp(2^f, n - ref) with n = floor(x)
    and f = x - n (both exact): the value for another integer reference differs by exactly a
    power of two (barring float underflow), which is what consistent P needs. -inf gives 0."""
    n = torch.floor(x)
    p = torch.ldexp(torch.exp2(x - n), n - ref)
    return torch.where(x == _NEG_INF, torch.zeros_like(p), p)


def _no_inf(ref: torch.Tensor) -> torch.Tensor:
    """A row reference of -inf (nothing seen yet / fully masked) replaced by 0, so that
    2^(x - ref) of a masked x = -inf is 0 and never NaN."""
    return torch.where(ref == _NEG_INF, torch.zeros_like(ref), ref)


# ==============================================================================================
# Forward
# ==============================================================================================


@dataclass
class SoftmaxStats:
    """What the forward saves per query row (all in base 2)."""

    ref: torch.Tensor  #: final reference: running max m, or the integer k for POW2_RUNNING_MAX
    l: torch.Tensor  #: the normalizer (per Recipe.normalizer), relative to ``ref``
    lse2: torch.Tensor  #: ref + log2(l); -inf for fully masked rows

    @property
    def lse(self) -> torch.Tensor:
        """Natural-log LSE, comparable with :func:`dmref.reference.attention_forward`."""
        return self.lse2 * LN2


@dataclass
class ForwardResult:
    out: torch.Tensor  #: O after the recipe's ``o`` point: what is returned and saved
    stats: SoftmaxStats
    #: with ``forward(..., p_codes=True)``: the codes of P~ = P * 2^offset at its quantization
    #: point (``recipe.p``'s format), (B, H, N_q, N_k) uint8, each key tile against the running
    #: max after it; 0 where a key is masked or a tile skipped
    p_codes: torch.Tensor | None = None


def forward(q, k, v, *, recipe="exact", causal: bool = False, scale=None, mask=None,
            p_codes: bool = False) -> ForwardResult:
    """The tiled forward of ``recipe``; see the module docstring. ``p_codes``: also return the
    codes of the quantized P of every tile (:attr:`ForwardResult.p_codes`), for differential
    tests of a kernel's P against the recipe's (the recipe's ``p`` point must be quantized)."""
    pb = _problem(q, k, v, recipe, causal, scale, mask)
    r, sh, wd = pb.recipe, pb.shape, pb.dtype
    acc_model = r.accumulation
    # Q-point Q (QKᵀ): input -> recipe.q, blocks along d
    q_hat = _quantize(q, r.q, contract_dim=-1, dtype=wd)
    # Q-point K (QKᵀ): input -> recipe.k, blocks along d
    k_hat = expand_kv(_quantize(k, r.k, contract_dim=-1, dtype=wd), sh.groups)
    # Q-point V (PV): input -> recipe.v, blocks along the keys (the contraction of P V)
    v_hat = expand_kv(_quantize(v, r.v, contract_dim=-2, dtype=wd), sh.groups)

    lead = (sh.batch, sh.heads, sh.seqlen_q)
    ref = torch.full(lead, _NEG_INF, dtype=wd, device=q.device)  # running max m (or integer k)
    l = torch.zeros(lead, dtype=wd, device=q.device)
    acc = torch.zeros(*lead, sh.head_dim_v, dtype=wd, device=q.device)
    pow2 = r.p_fwd.reference is PReference.POW2_RUNNING_MAX
    codes = None
    if p_codes:
        if not r.p.quantized:
            raise ValueError(f"p_codes: recipe {r.name!r} does not quantize P")
        codes = torch.zeros(*lead, sh.seqlen_k, dtype=torch.uint8, device=q.device)

    for j0, j1, i0 in pb.key_tiles():
        x = _logits(pb, q_hat, k_hat, i0, j0, j1, acc_model.qk)
        ref_old = ref[..., i0:]
        if pow2:  # k = ceil(running max): rescaling by 2^(k_old - k) is exact
            ref_new = torch.maximum(ref_old, torch.ceil(x.amax(dim=-1)))
            ref_use = _no_inf(ref_new)
            p = _exp2_split(x, ref_use[..., None])
        else:  # m = running max (FlashAttention)
            ref_new = torch.maximum(ref_old, x.amax(dim=-1))
            ref_use = _no_inf(ref_new)
            p = x.sub_(ref_use[..., None]).exp2_()  # x is not needed again
        alpha = torch.exp2(ref_old - ref_use)  # 0 where nothing was seen yet
        # Q-point P (PV): fp32 p * 2^offset -> recipe.p (FA3: E4M3, fixed scale 2^-8, RNE, satfinite)
        p_hat = _quantize(p, r.p, contract_dim=-1, dtype=wd, fixed_log2=-r.p_fwd.offset_log2)
        if codes is not None:  # P~ = p_hat * 2^offset is on the format's grid: encode is exact
            codes[..., i0:, j0:j1] = torch.as_tensor(
                encode((p_hat * 2.0 ** r.p_fwd.offset_log2).float(), r.p.fmt)).to(codes.device)
        mass = p if r.normalizer is Normalizer.FP32_SUM else p_hat
        l[..., i0:] = l[..., i0:] * alpha + mass.sum(dim=-1)
        acc[..., i0:, :] = _pv_product(p_hat, v_hat[..., j0:j1, :], r, acc[..., i0:, :] * alpha[..., None], wd)
        ref[..., i0:] = ref_new

    dead = l == 0  # fully masked rows (a NaN l stays NaN: non-finite inputs propagate)
    l_div = torch.where(dead, torch.ones_like(l), l)
    out = torch.where(dead[..., None], torch.zeros_like(acc), acc / l_div[..., None])
    lse2 = torch.where(dead, torch.full_like(l, _NEG_INF), _no_inf(ref) + torch.log2(l_div))
    # Q-point O (saved and returned): fp32 -> recipe.o (BF16 for FA2-style kernels, E4M3 for cuDNN FP8)
    out = _quantize(out, r.o, contract_dim=-1, dtype=wd)
    return ForwardResult(out, SoftmaxStats(ref, l, lse2), codes)


def _pv_product(p_hat: torch.Tensor, v_hat: torch.Tensor, r: Recipe, c: torch.Tensor, wd: torch.dtype) -> torch.Tensor:
    """P~ V^ of one key tile accumulated as ``r`` accumulates PV onto c = fl(alpha acc): with
    ``pv_chain`` the chain runs on from c (a wgmma with C = alpha acc, FA3's forward); promoted,
    the tile's product is formed from zero and c added once."""
    if r.pv_chain:
        return _matmul(p_hat, v_hat, r.accumulation.pv, wd, (r.p, r.v), c=c)
    return c + _matmul(p_hat, v_hat, r.accumulation.pv, wd, (r.p, r.v))


# ==============================================================================================
# Delta strategies
# ==============================================================================================


def _delta(pb: _Problem, strategy: DeltaStrategy, dout, fwd: ForwardResult, do_dp, sweep) -> torch.Tensor:
    """D_i, the row constant of dS = P ∘ (dP^ - D). Its own step, before the backward sweep.

    In exact arithmetic sum_j P_ij = 1 and sum_j P_ij dP_ij = dO_i . O_i = D_i, so every row
    of dS sums to zero. With rounding, sum_j dS_ij = sum_j P_ij dP^_ij - D_i sum_j P_ij, so a
    delta is only as good as its agreement with sum_j P_ij dP^_ij *as the sweep computes it*.
    """
    kind = strategy.kind
    if kind is DeltaKind.STALE:
        # Stale (FlashAttention-2/3 preprocess; cuDNN per-tensor with FP8 dO and O):
        #     D_i = sum_d dO'_id O'_id,  dO' = Q_delta.do(dO),  O' = Q_delta.o(O_saved)
        # Its O was made by the forward's P~ and V^ (other scales, other grids, BF16 rounding),
        # and its dO' is not the dP matmul's dO^: D_i = sum_j P_ij dP^_ij + delta_i, and row i
        # of dS sums to -delta_i.
        # Q-point dO (delta): input -> strategy.do (BF16; cuDNN: E5M2 per tensor)
        do_d = _quantize(dout, strategy.do, contract_dim=-1, dtype=pb.dtype)
        # Q-point O (delta): saved O -> strategy.o (cuDNN: E4M3 per tensor)
        o_d = _quantize(fwd.out, strategy.o, contract_dim=-1, dtype=pb.dtype)
        return (do_d * o_d).sum(dim=-1)
    if kind is DeltaKind.MATCHED:
        # Delta-Matching:
        #     D_i = sum_j P_ij dP^_ij,  dP^ = deq(dO^) deq(V^)ᵀ  (the dP matmul, its own scales)
        # with P exactly the FP32 multiplier of dS (recomputed from the same Q^, K^, lse by the
        # same code). Then sum_j dS_ij = D_i (1 - sum_j P_ij) + FP32 rounding: no stale term.
        # It costs a pre-sweep of the QKᵀ and dO Vᵀ matmuls.
        lead = (pb.shape.batch, pb.shape.heads, pb.shape.seqlen_q)
        d = torch.zeros(lead, dtype=pb.dtype, device=dout.device)
        for i0, j0, j1, p, dp in sweep():
            d[..., i0:] += (p * dp).sum(dim=-1)
        return d
    if kind is DeltaKind.CONSISTENT_P:
        # Consistent P: dS uses the forward's own P~/l~ (recomputed bit for bit, see
        # _backward_p), so O_i = sum_j (P~_ij / l~_i) V^_j up to FP32 accumulation, and
        #     D_i = sum_d dO^_id O_id   (dO^ = the dP matmul's operand, O the FP32 output)
        # equals sum_j P_ij dP^_ij when V^ is the same in P V and dO Vᵀ (128x128 blocks) and the
        # forward's and backward's P~ agree, which fails only where P * 2^offset is below the
        # smallest normal of its format at one reference and not at the other.
        return (do_dp * fwd.out.to(pb.dtype)).sum(dim=-1)
    raise ValueError(f"unknown delta kind {kind}")  # pragma: no cover


# ==============================================================================================
# Backward
# ==============================================================================================


@dataclass
class RowsumStats:
    """Per query row, in float64, from the working-precision dS tiles the backward computed."""

    residual: torch.Tensor  #: r_i = sum_j dS_ij, dS before its quantization
    abs_pdp: torch.Tensor  #: A_i = sum_j |P_ij dP^_ij|
    psum: torch.Tensor  #: sigma_i = sum_j P_ij (P: the multiplier of dS)
    residual_dq: torch.Tensor  #: sum_j of dS as the dQ matmul sees it (after its Q-point)
    residual_dk: torch.Tensor  #: sum_j of dS as the dK matmul sees it (after its Q-point)
    delta: torch.Tensor  #: D_i as used
    n_keys: int  #: keys per row (the length of the sums)
    sum_chain: int  #: roundings any product of a matched D passes through: block_k + key tiles


@dataclass
class BackwardResult:
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    rowsum: RowsumStats | None = None


def _head_unit(k: torch.Tensor, point: QuantPoint, *, dtype: torch.dtype) -> torch.Tensor:
    """(B, Hkv, 1, 1): u, the largest of a key/value head's scales under ``point`` with K
    blocked along the keys (as ``k_dq`` quantizes it; a block whose amax is 0 has scale 1): K / u
    stays within the format's range. 1 where the point has no power-of-two scale blocks."""
    ones = torch.ones(*k.shape[:2], 1, 1, dtype=dtype, device=k.device)
    if not point.quantized or not _dynamic_pow2(point.scale_rule) or point.granularity is Granularity.TENSOR:
        return ones
    # the scales of K's blocks along the keys: (B, Hkv, key blocks, channel blocks)
    scales = scales_from_amax(block_amax(k.to(torch.float32), _block(point.granularity, contract_dim=-2)),
                              point.fmt, point.scale_rule)
    s = decode(scales, FLOAT8_E8M0FNU) if point.scale_rule.is_e8m0 else scales
    return s.amax(dim=(-2, -1)).reshape(*k.shape[:2], 1, 1).to(dtype)


def global_amax_points(r: Recipe) -> dict[str, bool]:
    """Backward points whose dynamic scale blocks span several key tiles (they need an amax
    pre-sweep): TENSOR for P (dV) and both dS; ROW for the dS of dQ (a row spans all keys)."""
    def spans(point: QuantPoint, row_spans: bool) -> bool:
        if not (point.quantized and point.scale_rule.is_dynamic):
            return False
        return point.granularity is Granularity.TENSOR or (row_spans and point.granularity is Granularity.ROW)
    return {"p_dv": spans(r.p_dv, False), "ds_dq": spans(r.ds_dq, True), "ds_dk": spans(r.ds_dk, False)}


@dataclass
class _BackwardOperands:
    """The backward's quantized operands, each through its own Q-point (blocks along the
    contraction of the matmul it enters); k_hat, v_dp, k_dq expanded to the query heads."""

    q_hat: torch.Tensor
    k_hat: torch.Tensor
    do_dp: torch.Tensor
    v_dp: torch.Tensor
    do_dv: torch.Tensor
    k_dq_kv: torch.Tensor  #: K through k_dq, per key/value head (deferred dQ scales it by u)
    k_dq: torch.Tensor
    q_dk: torch.Tensor


def _backward_operands(pb: _Problem, q, k, v, dout) -> _BackwardOperands:
    r, wd, g = pb.recipe, pb.dtype, pb.shape.groups
    # In the forward these were the operands of S = Q Kᵀ, so now the recompute sees them again.
    # Q-point Q (QKᵀ recompute): input -> recipe.q, as in the forward
    q_hat = _quantize(q, r.q, contract_dim=-1, dtype=wd)
    # Q-point K (QKᵀ recompute): input -> recipe.k, as in the forward
    k_hat = expand_kv(_quantize(k, r.k, contract_dim=-1, dtype=wd), g)
    # Q-point dO (dP = dO Vᵀ): input -> recipe.do_dp, blocks along d
    do_dp = _quantize(dout, r.do_dp, contract_dim=-1, dtype=wd)
    # Q-point V (dP = dO Vᵀ): input -> recipe.v_dp, blocks along d (the forward blocked V along keys)
    v_dp = expand_kv(_quantize(v, r.v_dp, contract_dim=-1, dtype=wd), g)
    # Q-point dO (dV = Pᵀ dO): input -> recipe.do_dv, blocks along the queries
    do_dv = _quantize(dout, r.do_dv, contract_dim=-2, dtype=wd)
    # Q-point K (dQ = dS K): input -> recipe.k_dq, blocks along the keys
    k_dq_kv = _quantize(k, r.k_dq, contract_dim=-2, dtype=wd)
    # Q-point Q (dK = dSᵀ Q): input -> recipe.q_dk, blocks along the queries
    q_dk = _quantize(q, r.q_dk, contract_dim=-2, dtype=wd)
    return _BackwardOperands(q_hat, k_hat, do_dp, v_dp, do_dv, k_dq_kv, expand_kv(k_dq_kv, g), q_dk)


def _backward_p(pb: _Problem, stats: SoftmaxStats):
    """p(x, i0): P, the FP32 multiplier of dS, for the rows i0: of logits x (the forward had
    P = 2^(x - lse); consistent P recomputes the forward's quantized P~ / l~)."""
    r, wd = pb.recipe, pb.dtype
    consistent = r.delta.kind is DeltaKind.CONSISTENT_P
    if consistent or r.p_bwd.reference is PReference.SAVED_MAX:
        ref = _no_inf(stats.ref)[..., None]
        l_safe = torch.where(stats.l == 0, torch.ones_like(stats.l), stats.l)[..., None]
    else:  # fully masked rows: lse = -inf -> +inf, so that P = 2^(-inf) = 0
        lse2 = torch.where(stats.lse2 == _NEG_INF, torch.full_like(stats.lse2, float("inf")), stats.lse2)[..., None]

    def backward_p(x, i0):
        if consistent:
            # consistent P: the forward's own P~ (same x, same integer reference, same Q-point)
            # Q-point P (consistent recompute): fp32 -> recipe.p, exactly the forward's P Q-point
            p_t = _quantize(_exp2_split(x, ref[..., i0:, :]), r.p, contract_dim=-1, dtype=wd,
                            fixed_log2=-r.p_fwd.offset_log2)
            return p_t / l_safe[..., i0:, :]
        if r.p_bwd.reference is PReference.SAVED_MAX:
            return _exp2_split(x, ref[..., i0:, :]) / l_safe[..., i0:, :]
        return x.sub_(lse2[..., i0:, :]).exp2_()  # x is not needed again

    return backward_p


def _amax_pre_sweep(pb: _Problem, delta: torch.Tensor, sweep, device) -> dict:
    """amax of the backward points whose dynamic scale blocks span several key tiles (current
    scaling stands in for the delayed scaling of a real kernel): 0-d for TENSOR, per query row
    for the ROW dS of dQ; None for every other point."""
    r, sh, wd = pb.recipe, pb.shape, pb.dtype
    amax = {name: None for name in ("p_dv", "ds_dq", "ds_dk")}
    spans = global_amax_points(r)
    if r.delta.deferred_dq is not None and spans["ds_dq"]:
        raise NotImplementedError("deferred dQ with a dS_dq scale block spanning key tiles (TENSOR or ROW): "
                                  "no kernel does this; use a tile granularity")
    if not any(spans.values()):
        return amax
    lead = (sh.batch, sh.heads, sh.seqlen_q, 1)
    amax = {n: (torch.zeros((), dtype=wd, device=device) if spans[n] else None) for n in amax}
    if spans["ds_dq"] and r.ds_dq.granularity is Granularity.ROW:
        amax["ds_dq"] = torch.zeros(lead, dtype=wd, device=device)
    if r.ds_dq_bound:  # ds_dq from U_i = max_j P_ij |dP^_ij| + |D_i| max_j P_ij instead of its amax
        p_dp_max, p_max = torch.zeros(lead, dtype=wd, device=device), torch.zeros(lead, dtype=wd, device=device)
    for i0, j0, j1, p, dp in sweep():
        if r.ds_dq_bound:  # from the very P and dP^ of the sweep, before dP^ becomes dS below
            p_dp_max[..., i0:, :] = torch.maximum(p_dp_max[..., i0:, :], (p * dp.abs()).amax(dim=-1, keepdim=True))
            p_max[..., i0:, :] = torch.maximum(p_max[..., i0:, :], p.amax(dim=-1, keepdim=True))
        ds = dp.sub_(delta[..., i0:, :]).mul_(p)  # dS = P ∘ (dP^ - D), as in the sweep
        if spans["p_dv"]:
            amax["p_dv"] = torch.maximum(amax["p_dv"], abs_amax(p))
        if spans["ds_dk"]:
            amax["ds_dk"] = torch.maximum(amax["ds_dk"], abs_amax(ds))
        if spans["ds_dq"] and not r.ds_dq_bound:
            if amax["ds_dq"].dim():
                amax["ds_dq"][..., i0:, :] = torch.maximum(amax["ds_dq"][..., i0:, :], group_amax(ds, r.ds_dq, contract_dim=-1))
            else:
                amax["ds_dq"] = torch.maximum(amax["ds_dq"], abs_amax(ds))
    if r.ds_dq_bound:
        # |fl(P fl(dP - D))| <= P (|dP| + |D|) (1 + u)^2 and fl(U) >= P (|dP| + |D|) (1 - u)^3 for the
        # working precision's u = 2^-24 (float32): the factor 1 + 2^-21 > (1 + u)^2 / (1 - u)^3 covers
        # both roundings and its own, so no |dS| exceeds the amax its cast is given
        amax["ds_dq"] = (p_dp_max + delta.abs() * p_max) * (1 + 2.0**-21)
    return amax


class _DeferredDq:
    """Deferred dQ (dmref.kernels; recipes.DeferredDq): dQ from the stale predictor Dst,
    corrected by -(D - Dst) u kbar after the sweep. The emulation computes D first; the kernel
    accumulates it in the same sweep, which changes no number."""

    def __init__(self, pb: _Problem, fwd: ForwardResult, dout, k, ops: _BackwardOperands, sweep):
        r, sh, wd = pb.recipe, pb.shape, pb.dtype
        self.pb, self.spec = pb, r.delta.deferred_dq
        self.d_pred = _delta(pb, self.spec.predictor, dout, fwd, ops.do_dp, sweep)[..., None]
        # u: the head's largest K scale, as k_dq rounds K (kbar / u cannot overflow float16)
        self.unit = _head_unit(k, r.k_dq, dtype=wd)
        self.k_kbar = expand_kv(ops.k_dq_kv / self.unit, sh.groups)
        self.kbar = torch.zeros(sh.batch, sh.heads, sh.seqlen_q, sh.head_dim, dtype=wd, device=k.device)

    def ds_for_dq(self, p, dp, i0):
        """dQ's dS with the stale predictor: P ∘ (dP^ - Dst) (corrected after the sweep)."""
        return p * (dp - self.d_pred[..., i0:, :])

    def accumulate(self, p, i0, j0, j1):
        """kbar += the key tile's sum_j Q_kbar(P_ij) K^_j / u, tile by tile; returns Q_kbar(P)."""
        wd, spec = self.pb.dtype, self.spec
        # Q-point P (kbar): fp32 P * 2^offset -> deferred.p (the kernels: E4M3, 2^4, against LSE)
        p_kb = _quantize(p, spec.p, contract_dim=-1, dtype=wd, fixed_log2=-spec.p_offset_log2)
        for t0 in range(0, j1 - j0, spec.tile):
            t1 = min(t0 + spec.tile, j1 - j0)
            part = _matmul(p_kb[..., t0:t1], self.k_kbar[..., j0 + t0:j0 + t1, :], MatmulModel(), wd)
            # Q-point kbar tile: its float32 sum -> deferred.tile_result (float16 wgmma chain)
            part = _quantize(part, spec.tile_result, contract_dim=-1, dtype=wd)
            # Q-point kbar accumulator: kbar + tile -> deferred.accumulator (float16), per tile
            self.kbar[..., i0:, :] = _quantize(self.kbar[..., i0:, :] + part, spec.accumulator, contract_dim=-1,
                                               dtype=wd)
        return p_kb

    def correct(self, dq, delta):
        """The deferred correction: dQ_i -= (D_i - Dst_i) u kbar_i."""
        return dq - (delta - self.d_pred) * (self.kbar * expand_kv(self.unit, self.pb.shape.groups))


class _RowsumAccumulator:
    """Per query row, in float64, the sums behind :class:`RowsumStats`, from the very P, dP^
    and dS tiles the sweep computes."""

    def __init__(self, pb: _Problem, device):
        sh = pb.shape
        rows = (sh.batch, sh.heads, sh.seqlen_q)
        self.pb = pb
        self.res, self.abs_pdp, self.psum, self.res_dq, self.res_dk = (
            torch.zeros(rows, dtype=torch.float64, device=device) for _ in range(5))

    def add_p(self, p, dp, i0):
        """A_i and sigma_i from this tile's P and dP^ (before dP^ is overwritten by dS)."""
        p64 = p.to(torch.float64)
        self.abs_pdp[..., i0:] += (p64 * dp.to(torch.float64)).abs().sum(dim=-1)
        self.psum[..., i0:] += p64.sum(dim=-1)

    def add_ds(self, ds, ds_dq, ds_dk, i0, correction=None):
        """r_i and the row sums as the dQ and dK matmuls see dS; ``correction`` (deferred dQ):
        the correction's share -(D - Dst) sum_j Q_kbar(P_ij) of this tile."""
        self.res[..., i0:] += ds.to(torch.float64).sum(dim=-1)
        self.res_dq[..., i0:] += ds_dq.to(torch.float64).sum(dim=-1)
        if correction is not None:
            self.res_dq[..., i0:] -= correction
        self.res_dk[..., i0:] += ds_dk.to(torch.float64).sum(dim=-1)

    def stats(self, delta) -> RowsumStats:
        sh, tiles = self.pb.shape, self.pb.recipe.tiles
        n_tiles = -(-sh.seqlen_k // tiles.block_k)
        chain = min(sh.seqlen_k, tiles.block_k) + n_tiles  # torch's sum within a tile, then += per tile
        return RowsumStats(self.res, self.abs_pdp, self.psum, self.res_dq, self.res_dk,
                           delta[..., 0].to(torch.float64), sh.seqlen_k, chain)


def backward(q, k, v, fwd: ForwardResult, dout, *, recipe="exact", causal: bool = False, scale=None,
             mask=None, diagnostics: bool = False) -> BackwardResult:
    """The tiled backward of ``recipe`` from the forward's saved ``fwd``; see the module
    docstring. With ``diagnostics`` (a bool) the row sums of dS are collected (:class:`RowsumStats`)."""
    diagnostics = check_bool(diagnostics, "diagnostics")
    pb = _problem(q, k, v, recipe, causal, scale, mask, dout=dout)
    r, sh, wd = pb.recipe, pb.shape, pb.dtype
    acc_model = r.accumulation
    ops = _backward_operands(pb, q, k, v, dout)
    backward_p = _backward_p(pb, fwd.stats)

    def sweep():
        """(i0, j0, j1, P, dP^) per key tile: the recompute shared by every pass."""
        for j0, j1, i0 in pb.key_tiles():
            x = _logits(pb, ops.q_hat, ops.k_hat, i0, j0, j1, acc_model.qk_bwd)
            p = backward_p(x, i0)
            dp = _matmul(ops.do_dp[..., i0:, :], ops.v_dp[..., j0:j1, :].transpose(-1, -2), acc_model.dp, wd,
                         (r.do_dp, r.v_dp))
            yield i0, j0, j1, p, dp

    delta = _delta(pb, r.delta, dout, fwd, ops.do_dp, sweep)[..., None]  # the delta step
    deferred = _DeferredDq(pb, fwd, dout, k, ops, sweep) if r.delta.deferred_dq is not None else None
    amax = _amax_pre_sweep(pb, delta, sweep, q.device)

    # ---- the sweep -----------------------------------------------------------------------------
    dq = torch.zeros(sh.batch, sh.heads, sh.seqlen_q, sh.head_dim, dtype=wd, device=q.device)
    dk = torch.zeros(sh.batch, sh.heads, sh.seqlen_k, sh.head_dim, dtype=wd, device=q.device)
    dv = torch.zeros(sh.batch, sh.heads, sh.seqlen_k, sh.head_dim_v, dtype=wd, device=q.device)
    rowsums = _RowsumAccumulator(pb, q.device) if diagnostics else None
    for i0, j0, j1, p, dp in sweep():
        a_rows = None if amax["ds_dq"] is None or not amax["ds_dq"].dim() else amax["ds_dq"][..., i0:, :]
        # Q-point P (dV = Pᵀ dO): fp32 P * 2^offset -> recipe.p_dv, blocks along the queries
        p_dv = _quantize(p, r.p_dv, contract_dim=-2, dtype=wd, fixed_log2=-r.p_bwd.offset_log2,
                         amax=amax["p_dv"])
        dv[..., j0:j1, :] += _matmul(p_dv.transpose(-1, -2), ops.do_dv[..., i0:, :], acc_model.dv, wd,
                                     (r.p_dv, r.do_dv))
        if rowsums is not None:
            rowsums.add_p(p, dp, i0)
        ds_for_dq = deferred.ds_for_dq(p, dp, i0) if deferred is not None else None
        ds = dp.sub_(delta[..., i0:, :]).mul_(p)  # dS = P ∘ (dP^ - D); dP^ is not needed again
        if deferred is None:
            ds_for_dq = ds
        # Q-point dS (dQ = dS K): fp32 -> recipe.ds_dq, blocks along the keys
        ds_dq = _quantize(ds_for_dq, r.ds_dq, contract_dim=-1, dtype=wd,
                          amax=a_rows if a_rows is not None else amax["ds_dq"])
        dq[..., i0:, :] += _matmul(ds_dq, ops.k_dq[..., j0:j1, :], acc_model.dq, wd, (r.ds_dq, r.k_dq))
        p_kb = deferred.accumulate(p, i0, j0, j1) if deferred is not None else None
        # Q-point dS (dK = dSᵀ Q): fp32 -> recipe.ds_dk, blocks along the queries
        ds_dk = _quantize(ds, r.ds_dk, contract_dim=-2, dtype=wd, amax=amax["ds_dk"])
        dk[..., j0:j1, :] += _matmul(ds_dk.transpose(-1, -2), ops.q_dk[..., i0:, :], acc_model.dk, wd,
                                     (r.ds_dk, r.q_dk))
        if rowsums is not None:
            correction = None if deferred is None else (
                (delta - deferred.d_pred)[..., i0:, 0].to(torch.float64) * p_kb.to(torch.float64).sum(dim=-1))
            rowsums.add_ds(ds, ds_dq, ds_dk, i0, correction)

    if deferred is not None:
        dq = deferred.correct(dq, delta)
    dq = dq * sh.scale
    dk = reduce_kv(dk * sh.scale, sh.groups)
    dv = reduce_kv(dv, sh.groups)
    return BackwardResult(dq, dk, dv, rowsums.stats(delta) if rowsums is not None else None)


def attention(q, k, v, dout=None, *, recipe="exact", causal: bool = False, scale=None, mask=None,
              diagnostics: bool = False):
    """Forward (and backward when ``dout`` is given) in one call: ``ForwardResult`` or
    ``(ForwardResult, BackwardResult)``."""
    fwd = forward(q, k, v, recipe=recipe, causal=causal, scale=scale, mask=mask)
    if dout is None:
        return fwd
    bwd = backward(q, k, v, fwd, dout, recipe=recipe, causal=causal, scale=scale, mask=mask,
                   diagnostics=diagnostics)
    return fwd, bwd
