"""The black-box zero-row-sum probe: measure r_i = sum_j dS_ij of any attention implementation
from its dQ alone.

The argument. Add one vector c to every key, K' = K + 1 cᵀ. Every logit of
row i moves by the same tau q_i . c, so softmax, O, D and dS are unchanged, and

    dQ_i(K') - dQ_i(K) = tau sum_j dS_ij (K_j + c) - tau sum_j dS_ij K_j = tau r_i c.

Done naively on an FP8 implementation this is not a measurement: the block scales of K move with
c, so K^' != K^ + 1 cᵀ; the computed logits move by rounding, so dS' != dS; and dQ's rounding
error, ~u |dQ|, is subtracted away only to leave noise of that size. The probe removes all three
by choosing the inputs and c (:func:`prepare`):

1. *Null channels.* A set C0 of head-dim channels (two of them) is zero in Q and in K. c is
   supported on C0. Every product q_id k'_jd with d in C0 is 0 * x = 0 exactly, so the computed
   logits, P, O, D and dS are bit for bit those of the unshifted run, in any summation order
   and any accumulation model (assumption A: the implementation is deterministic; checked, see
   :attr:`ProbeResult.invariant`).
2. *Scales that do not move.* Each c_d is at most half the smallest block amax of K's other
   channels in the aligned 16-channel group around d (over every key, head and batch): 2^e on
   the first null channel, 3 * 2^(e-3) (three quarters of the next lower power) on the
   second, so both have at most two significant bits and their ratio is not a power of two.
   Any block of K along the head dim of 16 or more aligned channels (1x128, MX-32, a whole row,
   128x128, the whole tensor) then keeps its amax and so its scale, under every amax-based rule,
   and c_d (two significant bits) is exact in BF16, E4M3 and E5M2 at any power-of-two scale
   within 2^6 of it. A block along the keys in a channel of C0 holds only c_d (its amax is
   c_d), so every such block gets the same scale s: c_d / s is exact under the power-of-two
   rules and is fmt.max under the ``amax`` rule, whose float32 s = RN32(c_d / fmt.max) makes
   the dequantized value c_d (1 + eps), |eps| <= 2^-24, the same for every key. For the
   per-tensor ``amax`` rule (s = amax / fmt.max, not a power of two), :func:`prepare` sets K's
   largest element to exactly 7 * 2^e, which makes s = 2^(e - 6) (E4M3) or 2^(e - 13) (E5M2) a
   power of two: c_d / s is again exact. So for all these quantizers K^' = K^ + 1 c^ᵀ, with
   c^ = c (1 + eps).
3. *Nothing to subtract.* K is zero in C0, so dQ_id(K) = 0 exactly for d in C0, and
   dQ_id(K') = tau c_d sum_j dS^q_ij, where dS^q is dS as the dQ matmul sees it (after any
   quantization of dS). The products dS^q_ij c_d are exact for FP8 and BF16 dS (at most 8 + 2
   significant bits), and for float32 dS they round once (counted in u_acc), so

       r^_i = dQ_id(K') / (tau c_d)
       |r^_i - sum_j dS^q_ij| <= gamma_n(u_acc) S_i + rho |r^_i|,
       rho = (2 u_acc + u_out + 2^-24) / (1 - 2 u_acc - u_out - 2^-24)

   with n the number of keys, u_acc the accumulation unit roundoff (float32: 2^-24; the Hopper
   FP8 model: 2^-13 per 32-product step, see :func:`accumulation_bound`), u_out the unit roundoff
   of the dQ output dtype, and S_i = sum_j |dS^q_ij| (the caller supplies an upper bound; the
   oracle uses twice the exact sum_j P_ij (|dP_ij| + |D_i|)). Two channels with different c_d
   give two readings; their agreement within the bound is checked
   (:attr:`ProbeResult.consistent`): a quantizer that rounds c_d (a per-row non-power-of-two
   scale) rounds 2^e and 3 * 2^(e-3) differently, and the readings part.

GQA and masks. With k of fewer heads than q (query head h reads key/value head h // groups)
the argument holds per query head: :func:`prepare` zeroes the null channels in every query and
every key/value head and guards c by the amax over all of them, so the shifted keys reach every
query head of a group, and each query head's dQ gives its own row sums (readings are
``(batch, heads, seqlen_q)``, like dQ). A mask, boolean or additive, is passed to both runs
unchanged; it moves no logit between them, and fully masked rows read zero.

What the probe measures is sum_j dS^q_ij: the row sum of dS *as the dQ matmul sees it*. For an
FP8 implementation that includes the rounding of dS to FP8 (unbiased noise); a stale delta adds
-delta_i on top. :mod:`dmref.tiled` reports the same quantity as ``RowsumStats.residual_dq``,
and tests/oracle/test_probe.py checks that the probe recovers it from outside, for every preset.

What breaks the probe. (a) A quantizer of K that moves when a constant is added to a null
channel: blocks of fewer than 16 aligned channels, or a per-row non-power-of-two scale that
rounds c_d differently per key. The invariance check (O, dK and dV identical in both runs) and the two-channel consistency check flag it (:attr:`ProbeResult.valid` is False)
rather than report a wrong number; tests/oracle/test_probe.py plants such a quantizer. (b) An
implementation that transforms K itself in the dQ matmul (e.g. subtracts the key mean there):
c never reaches dQ and the probe reads zero. Nothing from outside can tell that apart from a
zero residual; the oracle's error checks on dQ still see such an implementation.
(c) Non-determinism: the reading is the residual of the shifted run, which is the residual of
the case when the two runs compute the same dS; an implementation whose dS varies from run to
run shows it in the invariance check.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..emulation.constants import U_BF16, U_FP16, U_FP32, U_FP64

__all__ = [
    "GROUP",
    "ProbeResult",
    "ProbeSetup",
    "accumulation_bound",
    "null_channels",
    "prepare",
    "run_probe",
    "run_shifted",
    "unit_roundoff_of",
]

#: Width of the aligned channel groups whose amax the shift must not change: any head-dim
#: block of at least this many aligned channels contains the whole group.
GROUP = 16

_UNIT_ROUNDOFF = {
    torch.float64: U_FP64,
    torch.float32: U_FP32,
    torch.bfloat16: U_BF16,
    torch.float16: U_FP16,
}


def unit_roundoff_of(dtype: torch.dtype) -> float:
    """Unit roundoff (round to nearest) of a torch floating dtype: 2^-(significant bits)."""
    try:
        return _UNIT_ROUNDOFF[dtype]
    except KeyError:
        raise TypeError(f"no unit roundoff known for {dtype}") from None


def null_channels(head_dim: int) -> tuple[int, ...]:
    """The two channels the probe zeroes in Q and K: one in each half of the head dim, away from
    the edges of the 16-channel groups, so that each group keeps at least 15 live channels."""
    if head_dim < GROUP:
        raise ValueError(f"the probe needs head_dim >= {GROUP}, got {head_dim=}")
    a = 5
    b = head_dim // 2 + 9 if head_dim // 2 + 9 < head_dim else head_dim - 3
    if b // GROUP == a // GROUP:  # head_dim 16..31: one group; two channels in it
        b = a + 6
    return (a, b)


@dataclass(frozen=True)
class ProbeSetup:
    """Where the probe acts: ``channels`` (zero in Q and K) and the shift ``c`` (head_dim,)
    float64: 2^e or 3 * 2^(e-3) on those channels, zero elsewhere."""

    channels: tuple[int, ...]
    shift: torch.Tensor

    def shifted(self, k: torch.Tensor) -> torch.Tensor:
        """K + 1 cᵀ in k's dtype (exact: k is zero on the channels, c has two significant bits)."""
        out = k.detach().clone()
        for d in self.channels:
            out[..., d] = self.shift[d].to(k.dtype)
        return out


def _round_max_to_seven_pow2(k: torch.Tensor) -> torch.Tensor:
    """K with its largest-magnitude element replaced by +-7 * 2^e >= it (the smallest such), so
    that a per-tensor ``amax`` scale amax / fmt.max is a power of two for E4M3 (448 = 7 * 2^6)
    and E5M2 (57344 = 7 * 2^13). The element grows by less than a factor 8/7."""
    flat = k.reshape(-1)
    idx = int(flat.abs().argmax())
    x = float(flat[idx])
    if x == 0.0 or not math.isfinite(x):
        return k
    e = math.ceil(math.log2(abs(x) / 7.0))
    while 7.0 * 2.0 ** (e - 1) >= abs(x):  # guard the float log2 near powers of two
        e -= 1
    while 7.0 * 2.0**e < abs(x):
        e += 1
    out = k.clone()
    out.reshape(-1)[idx] = math.copysign(7.0 * 2.0**e, x)
    return out


def prepare(q: torch.Tensor, k: torch.Tensor, *, channels: tuple[int, ...] | None = None):
    """Make (q, k) probe-ready: returns ``(q0, k0, setup)`` with Q and K zero on the null
    channels, K's largest element rounded up to 7 * 2^e (see the module docstring), and the shift
    ``setup.shift``. Tensors keep their dtype; every value written is exact in it.

    Raises ValueError when head_dim < 16 or when some key has no nonzero element in a null
    channel's group (no shift can then be guarded)."""
    head_dim = q.shape[-1]
    channels = channels or null_channels(head_dim)
    q0, k0 = q.detach().clone(), k.detach().clone()
    for d in channels:
        q0[..., d] = 0
        k0[..., d] = 0
    k0 = _round_max_to_seven_pow2(k0)
    shift = torch.zeros(head_dim, dtype=torch.float64)
    k64 = k0.detach().to(torch.float64).abs()
    for rank, d in enumerate(channels):
        g0 = d // GROUP * GROUP
        live = [c for c in range(g0, min(g0 + GROUP, head_dim)) if c not in channels]
        guard = k64[..., live].amax(dim=-1).min().item()  # smallest block amax around d
        if not guard > 0:
            raise ValueError(f"a key has no nonzero element in channels {live}: no shift of channel {d} keeps its scale")
        e = math.floor(math.log2(guard))
        if 2.0**e > guard:  # float log2 rounded up across a power of two
            e -= 1
        # at most guard / 2; the second channel 3/4 of the next power down, so that a quantizer
        # that rounds the shift rounds the two channels differently
        shift[d] = 2.0 ** (e - 1) if rank % 2 == 0 else 3.0 * 2.0 ** (e - 4)
    return q0, k0, ProbeSetup(tuple(channels), shift)


def accumulation_bound(n: int, u_acc: float) -> float:
    """gamma_n(u_acc) = n u / (1 - n u): the relative bound of a sum of n terms in any order
    with unit roundoff u_acc (Higham, Lemma 3.1). For truncating accumulation (the Hopper FP8
    model: 13 fractional bits per 32-product step) pass u_acc = 2^-13, which bounds each step's
    truncation of every term relative to the step's largest term."""
    if n * u_acc >= 1:
        return math.inf
    return n * u_acc / (1 - n * u_acc)


@dataclass
class ProbeResult:
    """What the probe measured, per query row (shapes ``(batch, heads, seqlen_q)``, float64)."""

    residual: torch.Tensor  #: r^_i: the mean of the per-channel readings
    readings: torch.Tensor  #: (..., len(channels)) one reading per null channel
    error_bound: torch.Tensor  #: bound on |r^_i - sum_j dS^q_ij| (needs ``abs_ds_bound``; else NaN)
    spread: torch.Tensor  #: max - min of the readings: the probe's noise, measured
    consistent: bool  #: every pair of readings agrees within the sum of their bounds
    invariant: bool  #: O, dK and dV bit-identical in both runs (the shift moved no scale)
    invariance_detail: str  #: which output changed, if any (dQ outside the null channels too)
    zero_before: bool  #: dQ was exactly zero on the null channels in the unshifted run
    #: max over rows of the readings' spread / the sum of their error bounds (above 1: not
    #: consistent; NaN without ``abs_ds_bound``)
    disagreement: float = math.nan

    @property
    def valid(self) -> bool:
        """Whether the reading can be trusted: invariant, consistent, zero before the shift."""
        return self.invariant and self.consistent and self.zero_before


def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()


def _run(fn, q, k, v, dout, kwargs, leaf=_copy):
    q_, k_, v_ = (leaf(t).requires_grad_(True) for t in (q, k, v))
    out = fn(q_, k_, v_, **kwargs)
    out.backward(leaf(dout))
    return out.detach(), q_.grad, k_.grad, v_.grad


def run_shifted(fn, q, k, v, dout, setup: ProbeSetup, *, causal: bool = False, scale: float | None = None,
                mask=None, leaf=_copy):
    """The outputs ``(out, dq, dk, dv)`` of fn on (q, k + 1 cᵀ): the run :func:`run_probe`
    reads (pass them as its ``shifted`` to judge one run against several bounds)."""
    kwargs = dict(causal=causal, scale=scale)
    if mask is not None:
        kwargs["mask"] = mask
    return _run(fn, q, setup.shifted(k), v, dout, kwargs, leaf)


def run_probe(fn, q, k, v, dout, setup: ProbeSetup, *, causal: bool = False, scale: float | None = None,
              mask=None, base=None, abs_ds_bound: torch.Tensor | None = None,
              u_acc: float = U_FP32, leaf=_copy, shifted=None) -> ProbeResult:
    """Run ``fn`` on (q, k) and on (q, k + 1 cᵀ) and read r_i = sum_j dS_ij off dQ.

    ``q``, ``k`` must come from :func:`prepare` (zero on ``setup.channels``). ``base``: the
    outputs ``(out, dq, dk, dv)`` of the unshifted run if the caller has them already (the oracle
    does). ``abs_ds_bound``: an upper bound on S_i = sum_j |dS^q_ij| per row, for the error
    bound. ``u_acc``: the accumulation unit roundoff of the implementation's dQ matmul.
    ``fn(q, k, v, *, causal, scale[, mask])`` returns the attention output; the backward is
    taken through autograd with ``dout``. k and v may have fewer heads than q (GQA); ``mask``
    (boolean or additive) is passed to fn in both runs. ``leaf(t)``: the tensor fn is given for
    each of q, k, v and dout (default a contiguous copy; the oracle passes its case's memory
    layout, so that both runs see the layout of ``base``). ``shifted``: the outputs of
    :func:`run_shifted` if the caller has them already (fn is then not called at all when
    ``base`` is given too).
    """
    kwargs = dict(causal=causal, scale=scale)
    if mask is not None:
        kwargs["mask"] = mask
    head_dim = q.shape[-1]
    tau = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    if base is None:
        base = _run(fn, q, k, v, dout, kwargs, leaf)
    if shifted is None:
        shifted = _run(fn, q, setup.shifted(k), v, dout, kwargs, leaf)
    ch = list(setup.channels)
    others = [d for d in range(head_dim) if d not in setup.channels]

    changed, notes = [], []
    for name, a, b in (("out", base[0], shifted[0]), ("dk", base[2], shifted[2]), ("dv", base[3], shifted[3]),
                       ("dq outside the null channels", base[1][..., others], shifted[1][..., others])):
        if not torch.equal(a, b):
            diff = (a.to(torch.float64) - b.to(torch.float64)).abs().max().item()
            # dQ alone may differ through a run-to-run summation order (atomics): only a note
            (notes if name.startswith("dq") else changed).append(f"{name} (max |change| {diff:.3g})")
    zero_before = bool((base[1][..., ch] == 0).all())  # on fn's device; a bool either way

    c = setup.shift[ch].to(torch.float64)
    readings = shifted[1][..., ch].detach().to("cpu", torch.float64) / (tau * c)
    residual = readings.mean(dim=-1)
    n_keys = k.shape[-2]
    u_out = unit_roundoff_of(shifted[1].dtype)
    eps = 2 * u_acc + u_out + U_FP32  # the scale multiply, the output rounding, c^ = c (1 + eps)
    rel = eps / (1 - eps)
    if abs_ds_bound is not None:
        per = accumulation_bound(n_keys, u_acc) * abs_ds_bound.to("cpu", torch.float64)[..., None] + rel * readings.abs()
        bound = per.amax(dim=-1)
        spread = (readings[..., :, None] - readings[..., None, :]).abs()
        allowed = per[..., :, None] + per[..., None, :]
        consistent = bool((spread <= allowed).all())
        ratio = torch.where(spread == 0, torch.zeros_like(spread), spread / allowed)
        disagreement = ratio.max().item() if ratio.numel() else 0.0
    else:
        bound = torch.full_like(residual, math.nan)
        consistent = True
        disagreement = math.nan
    spread_rows = readings.amax(dim=-1) - readings.amin(dim=-1)
    return ProbeResult(residual, readings, bound, spread_rows, consistent, not changed, "; ".join(changed + notes),
                       zero_before, disagreement)
