"""Attention implementations for the oracle's tests: a correct FlashAttention-style one and the
same with one planted bug each, as small torch autograd Functions (imported by name: the
conftest beside this file puts this folder on sys.path; the ``dmref check`` test imports it in a
subprocess the same way).

``flash(q, k, v, *, causal, scale)``: forward and backward written out in float32 from inputs of
any dtype, O rounded to the input dtype and saved rounded (as FlashAttention-2 saves it), D from
that rounded O (a BF16-level stale delta, as in FlashAttention-2), gradients returned in the
input dtype. k, v may have fewer heads than q (GQA: ``repeat_interleave`` in, the group's sum
out). ``flash_masked`` is the same with a ``mask`` argument (boolean, True = attend, or additive,
added to the scaled scores). Bugs (``flash_<bug>``):

- ``stale_delta``: D from an E4M3 copy of O (one power-of-two scale per row), as cuDNN's FP8
  backward forms it, in an otherwise BF16-accurate implementation;
- ``bwd_scale``: the backward recomputes P with the default 1/sqrt(head_dim) instead of the
  forward's scale;
- ``bwd_causal``: the backward drops the causal mask;
- ``dk_transpose``: dK = scale dS Q instead of scale dSᵀ Q;
- ``kv_grouping``: dK and dV summed over the query heads of the wrong group (the grouping of
  ``repeat``, head h -> h % Hkv, instead of ``repeat_interleave``'s h // (H / Hkv)), forward right;
- ``mask_bwd`` (takes ``mask``): the backward recomputes P without the additive mask;
- ``mask_scaled`` (takes ``mask``): the additive mask is added before the softmax scale,
  scale (Q Kᵀ + M) instead of scale Q Kᵀ + M, in the forward and the backward;
- ``dv_bf16_sum``, ``dk_bf16_sum``, ``dq_bf16_sum``: dV, dK (summed over blocks of 64 queries) or
  dQ (over blocks of 64 keys) kept as a BF16 running sum, rounded after every block, as torch's
  CPU flash-attention backward keeps dK and dV (``RUNNING_SUM_BUGS``);

and ``naive_fp8_wrong_axis``: dmref's emulated ``naive_fp8`` except that K is quantized for
Q Kᵀ in 1x128 blocks along the sequence instead of along the head dim.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from dmref import emulation, recipes, tiled
from dmref.oracle import sdpa_math
from dmref.emulation import Block, dequantize_blocked, quantize_blocked

E4M3 = emulation.get_format("float8_e4m3fn")


def _causal_fill(s: torch.Tensor) -> torch.Tensor:
    nq, nk = s.shape[-2:]
    i = torch.arange(nq)[:, None]
    j = torch.arange(nk)[None, :]
    return s.masked_fill(j > i + (nk - nq), float("-inf"))


def _e4m3_rows(x: torch.Tensor) -> torch.Tensor:
    """x quantized to E4M3 with one power-of-two (pow2_down) scale per row."""
    codes, scales = quantize_blocked(x, E4M3, block=Block.rows(), scale_rule="pow2_down", saturate=True)
    return dequantize_blocked(codes, scales, E4M3, block=Block.rows()).to(x.dtype)


def _expand(t: torch.Tensor, groups: int) -> torch.Tensor:
    """k or v for every query head: head h reads key/value head h // groups."""
    return t.repeat_interleave(groups, dim=1)


def _group_sum(t: torch.Tensor, groups: int, bug) -> torch.Tensor:
    """dK or dV: the sum over the query heads that read one key/value head."""
    b, h, n, d = t.shape
    if bug == "kv_grouping":  # the grouping of repeat(): head h -> kv head h % Hkv
        return t.view(b, groups, h // groups, n, d).sum(dim=1)
    return t.view(b, h // groups, groups, n, d).sum(dim=2)


def _scores(q32, k32, mask, causal, scale, bug, backward):
    """Scaled scores with the causal mask and the boolean or additive mask applied."""
    qk = q32 @ k32.transpose(-1, -2)
    additive = mask is not None and mask.dtype != torch.bool
    if additive and bug == "mask_scaled":
        s = scale * (qk + mask.float())
    elif additive and not (bug == "mask_bwd" and backward):
        s = scale * qk + mask.float()
    else:
        s = scale * qk
    if mask is not None and mask.dtype == torch.bool:
        s = s.masked_fill(~mask, float("-inf"))
    if causal:
        s = _causal_fill(s)
    return s


def _probabilities(s, lse):
    """exp(S - lse); fully masked rows (lse = -inf) zero."""
    return torch.exp(s - torch.where(lse == float("-inf"), float("inf"), lse))


#: the rows (queries for dV and dK, keys for dQ) of one block of the running-sum bugs
RUNNING_SUM_BLOCK = 64


def _bf16_running_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b (float32) summed over the contraction in blocks of :data:`RUNNING_SUM_BLOCK`: each
    block's product in float32, added into a BF16 running sum that is rounded after every block
    (torch's CPU flash-attention backward keeps dK and dV so)."""
    acc = torch.zeros(*a.shape[:-1], b.shape[-1], dtype=torch.bfloat16)
    for start in range(0, a.shape[-1], RUNNING_SUM_BLOCK):
        block = a[..., start:start + RUNNING_SUM_BLOCK] @ b[..., start:start + RUNNING_SUM_BLOCK, :]
        acc = (acc.float() + block).to(torch.bfloat16)
    return acc.float()


class _Flash(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, causal, scale, bug):
        groups = q.shape[1] // k.shape[1]
        q32, k32, v32 = q.float(), _expand(k.float(), groups), _expand(v.float(), groups)
        s = _scores(q32, k32, mask, causal, scale, bug, backward=False)
        lse = torch.logsumexp(s, dim=-1, keepdim=True)
        out = (_probabilities(s, lse) @ v32).to(q.dtype)  # O rounded to the input dtype, saved so
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.causal, ctx.scale, ctx.bug = causal, scale, bug
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, mask = ctx.saved_tensors
        bug = ctx.bug
        groups = q.shape[1] // k.shape[1]
        q32, o32, do32 = (t.float() for t in (q, out, dout))
        k32, v32 = _expand(k.float(), groups), _expand(v.float(), groups)
        scale = 1.0 / math.sqrt(q.shape[-1]) if bug == "bwd_scale" else ctx.scale
        causal = ctx.causal and bug != "bwd_causal"
        # in the forward P = exp(S - lse), so now
        p = _probabilities(_scores(q32, k32, mask, causal, scale, bug, backward=True), lse)
        dv = _bf16_running_matmul(p.transpose(-1, -2), do32) if bug == "dv_bf16_sum" else p.transpose(-1, -2) @ do32
        dp = do32 @ v32.transpose(-1, -2)
        o_delta = _e4m3_rows(o32) if bug == "stale_delta" else o32
        delta = (do32 * o_delta).sum(-1, keepdim=True)
        ds = p * (dp - delta)
        dq = _bf16_running_matmul(scale * ds, k32) if bug == "dq_bf16_sum" else scale * (ds @ k32)
        if bug == "dk_transpose":
            dk = scale * (ds @ q32)
        elif bug == "dk_bf16_sum":
            dk = _bf16_running_matmul(scale * ds.transpose(-1, -2), q32)
        else:
            dk = scale * (ds.transpose(-1, -2) @ q32)
        dk, dv = _group_sum(dk, groups, bug), _group_sum(dv, groups, bug)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def _make(bug, *, takes_mask=False):
    if takes_mask:
        def fn(q, k, v, *, causal=False, scale=None, mask=None):
            scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
            return _Flash.apply(q, k, v, mask, causal, scale, bug)
    else:
        def fn(q, k, v, *, causal=False, scale=None):
            scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
            return _Flash.apply(q, k, v, None, causal, scale, bug)

    name = "flash" + ("_masked" if takes_mask and bug is None else "") + (f"_{bug}" if bug else "")
    fn.__name__ = fn.__qualname__ = name
    fn.causal_alignment = "bottom_right"  # _causal_fill: FlashAttention >= 2.1's alignment
    return fn


flash = _make(None)
flash_masked = _make(None, takes_mask=True)
flash_stale_delta = _make("stale_delta")
flash_bwd_scale = _make("bwd_scale")
flash_bwd_causal = _make("bwd_causal")
flash_dk_transpose = _make("dk_transpose")
flash_kv_grouping = _make("kv_grouping")
flash_mask_bwd = _make("mask_bwd", takes_mask=True)
flash_mask_scaled = _make("mask_scaled", takes_mask=True)
flash_dv_bf16_sum = _make("dv_bf16_sum")
flash_dk_bf16_sum = _make("dk_bf16_sum")
flash_dq_bf16_sum = _make("dq_bf16_sum")

#: the planted bug -> (implementation, the check that must fail)
BUGS = {
    "stale_delta": (flash_stale_delta, "rowsum"),
    "bwd_scale": (flash_bwd_scale, "dq"),
    "bwd_causal": (flash_bwd_causal, "dq"),
    "dk_transpose": (flash_dk_transpose, "dk"),
}

#: bugs that only a case of their own can show: bug -> (implementation, case, the checks that
#: must fail, the checks that must pass)
CASE_BUGS = {
    "kv_grouping": (flash_kv_grouping, "gqa", {"dk", "dv"}, {"out", "dq", "rowsum"}),
    "mask_bwd": (flash_mask_bwd, "additive_mask", {"dq", "dk", "dv"}, {"out"}),
    "mask_scaled": (flash_mask_scaled, "additive_mask", {"out"}, set()),
}

#: a gradient kept as a BF16 running sum -> (implementation, the case whose long one-signed
#: sums show it, the check that must fail there)
RUNNING_SUM_BUGS = {
    "dv": (flash_dv_bf16_sum, "long_sums_over_queries", "dv"),
    "dk": (flash_dk_bf16_sum, "long_sums_over_queries", "dk"),
    "dq": (flash_dq_bf16_sum, "long_sums_over_keys", "dq"),
}

_NAIVE_NO_K = replace(recipes.get_recipe("naive_fp8"), name="naive_fp8_k_prequantized", k=recipes.NONE)


def _k_along_sequence(k: torch.Tensor) -> torch.Tensor:
    """K quantized as naive_fp8 quantizes it (E4M3, 1x128 tiles, pow2_down) but with the tiles
    along the sequence (128 keys of one channel) instead of along the head dim."""
    block = Block.tile(128, 1)
    point = recipes.get_recipe("naive_fp8").k
    codes, scales = quantize_blocked(k.float(), point.fmt, block=block, scale_rule=point.scale_rule.value,
                                     saturate=point.saturate)
    # E4M3 values times power-of-two scales: exact in bfloat16 and wider
    return dequantize_blocked(codes, scales, point.fmt, block=block).to(k.dtype)


class _WrongAxis(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        k_hat = _k_along_sequence(k)
        fwd = tiled.forward(q, k_hat, v, recipe=_NAIVE_NO_K, causal=causal, scale=scale)
        ctx.save_for_backward(q, k, v, fwd.out, fwd.stats.ref, fwd.stats.l, fwd.stats.lse2)
        ctx.causal, ctx.scale = causal, scale
        return fwd.out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, ref, l, lse2 = ctx.saved_tensors
        fwd = tiled.ForwardResult(out, tiled.SoftmaxStats(ref, l, lse2))
        # the recompute sees the same wrongly blocked K; dS K quantizes K along the keys as the
        # recipe says (its blocks already are 128 keys of one channel: idempotent)
        bwd = tiled.backward(q, _k_along_sequence(k), v, fwd, dout.contiguous(), recipe=_NAIVE_NO_K,
                             causal=ctx.causal, scale=ctx.scale)
        return bwd.dq.to(q.dtype), bwd.dk.to(k.dtype), bwd.dv.to(v.dtype), None, None


def naive_fp8_wrong_axis(q, k, v, *, causal=False, scale=None):
    return _WrongAxis.apply(q, k, v, causal, scale)


naive_fp8_wrong_axis.causal_alignment = "bottom_right"  # dmref.tiled's


def wrong_signature(q, k):
    """Not an attention: the CLI must say so."""
    return q


# ----------------------------------------------------------------------------------------------
# One planted bug per axis of the problem (docs/oracle.md, "Every axis a bug can live on"): each
# is a plain float32 attention through autograd (correct at BF16 bounds, as the math backend of
# SDPA) with one mistake that only a case varying that axis shows.
# ----------------------------------------------------------------------------------------------


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _plain(q, k, v, causal, scale, bug=None, mask=None):
    """softmax(scale Q Kᵀ) V in float32 through autograd, output in the input dtype, GQA by
    repeat_interleave, an optional boolean or additive mask; ``bug`` plants one mistake."""
    if bug == "layout":  # reads the storage as if the tensors were contiguous
        q, k, v = (t.as_strided(t.shape, _contiguous_strides(t.shape), t.storage_offset()) for t in (q, k, v))
    if bug == "offset":  # ignores the storage offset
        q, k, v = (t.as_strided(t.shape, t.stride(), 0) for t in (q, k, v))
    dtype = q.dtype
    q, k, v = q.float(), k.float(), v.float()
    h, hkv = q.shape[1], k.shape[1]
    if bug == "batch":  # every batch element reads batch 0's keys and values
        k, v = k[:1].expand_as(k), v[:1].expand_as(v)
    if bug == "heads":  # query head h reads the values of head h + 1
        v = v.roll(1, dims=1)
    if h != hkv:
        groups = h // hkv
        # gqa_ratio: a group size of 4 written in; group_cap_8: the group size capped at 8 (a
        # kernel's compile-time maximum); group_pow2: rounded up to a power of two
        size = {"gqa_ratio": 4, "group_cap_8": min(groups, 8),
                "group_pow2": 1 << (groups - 1).bit_length()}.get(bug, groups)
        index = (torch.arange(h) // size).clamp(max=hkv - 1)
        if bug == "mqa_head0" and hkv == 1:  # the bug: dK, dV from query head 0 alone
            k = torch.cat([k, k.detach().expand(-1, h - 1, -1, -1)], dim=1)
            v = torch.cat([v, v.detach().expand(-1, h - 1, -1, -1)], dim=1)
        else:
            k, v = k[:, index], v[:, index]
    if bug == "dq_width_v":  # the bug: dQ sized by V's head dim (channels beyond it zero)
        q = _ZeroGradTail.apply(q, v.shape[-1])
    nq, nk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    rows = min(nq, nk) if bug == "more_queries" else nq  # query tiles sized by seqlen_k
    # the bug: one head-dim tile of 64 (head_dim) or 128 (head_dim_128) channels
    channels = {"head_dim": 64, "head_dim_128": min(d, 128)}.get(bug, d)
    qk = q[..., :rows, :channels] @ k[..., :channels].transpose(-1, -2)
    s = scale * qk
    if mask is not None:
        m = mask[:1] if bug == "mask_batch0" else mask  # the bug: batch element 0's mask for every element
        # -inf through masked_fill, whose backward is zero there: fully masked rows (softmax
        # NaN, zeroed below) then get zero gradients
        removed = ~m if m.dtype == torch.bool else ~torch.isfinite(m)
        if m.dtype != torch.bool:
            s = s + torch.where(removed, 0.0, m.float())
        s = s.masked_fill(removed, -math.inf)
    if causal and not (bug == "mask_no_causal" and mask is not None):
        keep = torch.ones(rows, nk, dtype=torch.bool).tril(nk - nq)
        s = s.masked_fill(~keep, -math.inf)
    if bug == "tail":  # keys beyond the last full block of 64 are dropped
        s = s.masked_fill(torch.arange(nk) >= nk // 64 * 64, -math.inf) if nk >= 64 else s
    if bug == "keys_2048":  # keys beyond 2,048 dropped (a grid sized for 2,048 keys)
        s = s.masked_fill(torch.arange(nk) >= 2048, -math.inf)
    if bug in ("no_max", "first_block_max", "full_blocks_max"):
        # no_max: softmax without the row maximum subtracted; first_block_max: the maximum of
        # the first 64 keys only (a running maximum never updated); full_blocks_max: the
        # maximum of the full blocks of 64 keys only (the tail exponentiated against it)
        width = {"no_max": 0, "first_block_max": 64, "full_blocks_max": nk // 64 * 64}[bug]
        m = s[..., :width].amax(-1, keepdim=True).detach() if width else torch.zeros_like(s[..., :1])
        e = torch.exp(s - torch.where(torch.isfinite(m), m, torch.zeros_like(m)))
        p = e / e.sum(-1, keepdim=True)
    else:
        p = torch.softmax(s, dim=-1)
    if bug not in ("no_max", "first_block_max", "full_blocks_max"):
        p = p.nan_to_num(0.0)  # rows with no key left: zero (their gradients are zero through masked_fill)
    out = (p.half() @ v.half()).float() if bug == "fp16_pv" else p @ v
    if rows < nq:
        out = torch.cat([out, out.new_zeros(*out.shape[:-2], nq - rows, out.shape[-1])], dim=-2)
    return out.to(dtype)


class _ZeroGradTail(torch.autograd.Function):
    """Identity whose backward zeroes the gradient's channels from ``width`` on."""

    @staticmethod
    def forward(ctx, x, width):
        ctx.width = width
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        g[..., ctx.width:] = 0
        return g, None


class _DoutContiguous(torch.autograd.Function):
    """Identity whose backward reads dO's storage as if dO were contiguous."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dout):
        return dout.as_strided(dout.shape, _contiguous_strides(dout.shape), dout.storage_offset())


def _window_and_documents(nq, nk, window, documents, bug):
    """A boolean (batch or 1, 1, nq, nk) mask of a sliding window (left, right) and document ids,
    written out here on its own (not dmref's), with the planted window and document bugs."""
    i, j = torch.arange(nq)[:, None], torch.arange(nk)[None, :]
    keep = torch.ones(1, 1, nq, nk, dtype=torch.bool)
    if window is not None:
        left, right = window
        lo = i - left + (1 if bug == "window_off_by_one" else 0)  # the bug: key i - left left out
        keep = keep & ((j >= lo) if left >= 0 else True) & ((j <= i + right) if right >= 0 else True)
    if documents is not None:
        docs = documents[:1].expand_as(documents) if bug == "documents_batch0" else documents
        keep = keep & (docs[:, None, :, None] == docs[:, None, None, :])
    return keep


def _make_axis(bug, *, takes_mask=False, features=False):
    if features:
        def fn(q, k, v, *, causal=False, scale=None, mask=None, window=None, documents=None):
            scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
            if window is not None or documents is not None:
                keep = _window_and_documents(q.shape[-2], k.shape[-2], window, documents, bug)
                mask = keep if mask is None else mask & keep
                causal = causal and bug != "documents_no_causal"
            return _plain(q, k, v, causal, scale, bug, mask)
    elif takes_mask:
        def fn(q, k, v, *, causal=False, scale=None, mask=None):
            scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
            return _plain(q, k, v, causal, scale, bug, mask)
    else:
        def fn(q, k, v, *, causal=False, scale=None):
            scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
            if bug == "dout_layout":
                return _DoutContiguous.apply(_plain(q, k, v, causal, scale))
            return _plain(q, k, v, causal, scale, bug)

    fn.__name__ = fn.__qualname__ = (("plain_features" if features else "plain_masked" if takes_mask else "plain")
                                     + (f"_{bug}" if bug else ""))
    fn.causal_alignment = "bottom_right"  # keep = tril(seqlen_k - seqlen_q), as FlashAttention >= 2.1
    return fn


plain = _make_axis(None)
plain_masked = _make_axis(None, takes_mask=True)
plain_features = _make_axis(None, features=True)  # mask=, window= and documents=

#: axis -> (implementation with a bug on that axis, the quick case that must fail it, what is wrong)
AXIS_BUGS = {
    "batch": (_make_axis("batch"), "batch_heads", "every batch element reads batch 0's keys and values"),
    "heads": (_make_axis("heads"), "realistic", "query head h reads the values of head h + 1"),
    "gqa_ratio": (_make_axis("gqa_ratio"), "gqa_ratio_2", "the query heads per key/value head written in as 4"),
    "seqlen_q_vs_k": (_make_axis("more_queries"), "more_queries",
                      "query rows beyond seqlen_k left zero (query tiles sized by seqlen_k)"),
    "head_dim": (_make_axis("head_dim"), "other_head_dim", "Q Kᵀ over the first 64 channels only"),
    "tails": (_make_axis("tail"), "tail_lengths", "keys beyond the last full block of 64 dropped"),
    "value_range": (_make_axis("fp16_pv"), "huge_values", "P V computed in float16"),
    "logit_range": (_make_axis("no_max"), "huge_logits", "softmax without the row maximum subtracted"),
    "layout": (_make_axis("layout"), "strided_inputs", "q, k, v read as if contiguous"),
    "offset": (_make_axis("offset"), "strided_inputs", "the storage offset of q, k, v ignored"),
    "dout_layout": (_make_axis("dout_layout"), "strided_inputs", "dO read as if contiguous in the backward"),
    "mask_per_batch": (_make_axis("mask_batch0", takes_mask=True), "additive_mask",
                       "batch element 0's mask applied to every batch element"),
    "mask_with_causal": (_make_axis("mask_no_causal", takes_mask=True), "fully_masked_rows",
                         "causal ignored whenever a mask is given"),
    "context_length": (_make_axis("keys_2048"), "long_context", "keys beyond 2,048 dropped"),
    "single_kv_head": (_make_axis("mqa_head0"), "single_kv_head", "with one key/value head, dK and dV from query head 0"),
    "gqa_ratio_16": (_make_axis("group_cap_8"), "gqa_ratio_16", "the query heads per key/value head capped at 8"),
    "gqa_ratio_7": (_make_axis("group_pow2"), "gqa_ratio_7",
                    "the query heads per key/value head rounded up to a power of two"),
    "head_dim_256": (_make_axis("head_dim_128"), "single_kv_head", "Q Kᵀ over the first 128 channels only"),
    "head_dim_v": (_make_axis("dq_width_v"), "mla_head_dims", "dQ sized by V's head dim (Q's channels beyond it zero)"),
    "window": (_make_axis("window_off_by_one", features=True), "sliding_window",
               "the window one key short (key i - left left out)"),
    "documents_per_batch": (_make_axis("documents_batch0", features=True), "documents",
                            "batch element 0's documents for every element"),
    "documents_with_causal": (_make_axis("documents_no_causal", features=True), "documents",
                              "causal ignored whenever documents are given"),
    "extreme_position": (_make_axis("first_block_max"), "extreme_positions",
                         "the row maximum of the first 64 keys only (a running maximum never updated)"),
    "extreme_in_tail": (_make_axis("full_blocks_max"), "extreme_positions",
                        "the row maximum of the full blocks of 64 keys only (the tail exponentiated against it)"),
}


def mha_only(q, k, v, *, causal=False, scale=None):
    """A correct float32 attention that knows nothing of GQA: on fewer key/value heads than
    query heads its matmul raises a shape RuntimeError."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = scale * (q.float() @ k.float().transpose(-1, -2))
    if causal:
        s = _causal_fill(s)
    return (torch.softmax(s, dim=-1).nan_to_num(0.0) @ v.float()).to(q.dtype)


mha_only.causal_alignment = "bottom_right"  # _causal_fill


def hangs(q, k, v, *, causal=False, scale=None):
    """Never returns in a check's lifetime: the CLI's --timeout must stop the check."""
    import time

    time.sleep(3600)
    return q


# ----------------------------------------------------------------------------------------------
# Verdicts that must hold in every dtype, and any exit of fn
# ----------------------------------------------------------------------------------------------


def float32_inside(q, k, v, *, causal=False, scale=None, mask=None):
    """torch's SDPA math backend on float32 copies of the inputs, the output cast back to the
    input dtype: right for bfloat16, float16 and float32, a silent downcast for float64."""
    out = sdpa_math(q.float(), k.float(), v.float(), causal=causal, scale=scale,
                    mask=mask.float() if mask is not None and mask.is_floating_point() else mask)
    return out.to(q.dtype)


def exits(q, k, v, *, causal=False, scale=None):
    """Ends the process with status 0 instead of returning: the oracle must fail the case."""
    raise SystemExit(0)


# ----------------------------------------------------------------------------------------------
# The calling contract: right numbers, surprising calls (docs/oracle.md, "The calling contract")
# ----------------------------------------------------------------------------------------------


class _DoutScaledInPlace(torch.autograd.Function):
    """Identity whose backward scales dO in place before using it (and undoes the scale in its
    result): the gradients are right, the caller's dO comes back doubled."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dout):
        return dout.mul_(2.0) / 2.0


_DQ_BUFFERS: dict = {}


class _DqAccumulated(torch.autograd.Function):
    """Identity whose backward adds dQ into a buffer kept per shape across calls and never
    zeroed: the first call is right, every later call on that shape returns the running sum."""

    @staticmethod
    def forward(ctx, q):
        return q.view_as(q)

    @staticmethod
    def backward(ctx, dq):
        buf = _DQ_BUFFERS.setdefault((tuple(dq.shape), dq.dtype), torch.zeros_like(dq))
        buf += dq
        return buf.clone()


def _contract(bug):
    def fn(q, k, v, *, causal=False, scale=None):
        if bug == "default_scale_one":  # the bug: a missing scale taken as 1
            scale = 1.0 if scale is None else scale
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        if bug == "dq_accumulated":
            q = _DqAccumulated.apply(q)
        out = _plain(q, k, v, causal, scale)
        if bug == "out_float32":  # the bug: the float32 result returned as it is
            return _plain(q.float(), k.float(), v.float(), causal, scale)
        if bug == "dout_in_place":
            return _DoutScaledInPlace.apply(out)
        return out

    if bug == "default_causal":  # the bug: causal unless told otherwise
        def causal_fn(q, k, v, *, causal=True, scale=None):
            return plain(q, k, v, causal=causal, scale=scale)

        causal_fn.__name__ = causal_fn.__qualname__ = "contract_default_causal"
        causal_fn.causal_alignment = "bottom_right"
        return causal_fn
    fn.__name__ = fn.__qualname__ = f"contract_{bug}"
    fn.causal_alignment = "bottom_right"
    return fn


#: contract item -> (implementation with a bug there, the check that must fail it, what is wrong)
CONTRACT_BUGS = {
    "output_dtype": (_contract("out_float32"), "output", "the output in float32 for bfloat16 inputs"),
    "inputs_unchanged": (_contract("dout_in_place"), "inputs", "the backward scales dO in place"),
    "default_scale": (_contract("default_scale_one"), "defaults", "a missing scale taken as 1"),
    "default_causal": (_contract("default_causal"), "defaults", "causal unless told otherwise"),
    "determinism": (_contract("dq_accumulated"), "repeat", "dQ added into a buffer kept across calls"),
}
