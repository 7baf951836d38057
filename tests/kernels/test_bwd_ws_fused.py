"""The five-GEMM backward in Gluon (``bwd_ws.fused``: the dkdv kernel's warp-specialized CTAs with
dQ's partial of every query tile added into a float32 buffer) against the Triton five-GEMM
backward ``bwd_fused``, which tests/kernels/test_bwd_fused.py holds to the emulated reference.

- It compiles for sm_90a without a GPU at both head dims, causal and not, deterministic and not,
  within the warp-specialized register budget (producer 24, consumer 232); at D = 64 without
  spills. At D = 128 ptxas spills 108-180 B a thread (D = 128 holds dK, dV and the promoted
  chain's result in 192 of the consumer's 232 registers).
- It refuses what it does not run, one line each.
- On a Hopper GPU its dK and dV equal ``bwd_fused``'s (``torch.equal``): the same operations on
  the same FP8 operands in the same order (S^T, dP^T, P^T's and dS^T's casts and the promoted
  chains per 64-query tile are the dkdv kernel's, which equal the Triton dkdv kernel's,
  test_bwd_ws.py, and bwd_fused's dkdv half is that kernel's loop). dQ: in deterministic mode both
  add the key blocks' partials in key order, each partial the same wgmma chain over the same 64
  keys times the same two factors, so dQ is equal too; otherwise the float32 adds come in the
  order the CTAs reach them, and the two BF16 results are roundings of float32 sums of the same
  partials in two orders: within one BF16 unit in the last place plus the two orders' float32
  error bound (``_dq_order_bound``), which exceeds the ulp only where the partials cancel.
- Its deterministic mode is bit-identical run after run.
- Its two-consumer form (``consumers=2``: two consumer warp groups of 64 keys a CTA sharing the
  ring of query tiles, ``WsBwdTiles.fused_consumers``) compiles within one CTA an SM's budget
  (168 registers at launch, 240 for each consumer, 24 for the producer), at D = 64 without
  spills; on a GPU its dK and dV are the one-consumer kernel's bits, and deterministic, its dQ
  too (each consumer runs the one-consumer CTA's operations on its 64 keys, in its order).
"""

from __future__ import annotations

import math

import pytest
import torch

from kernel_inputs import ProblemShape, require_backend
from test_bwd_ws import _describe, _id, _problem
from warp_specialized_budget import compile_and_check_budget

_SCRIPT = """
import json
from dmref.kernels import bwd_ws
from dmref.kernels.compile_check import warp_specialized_budget
out = []
for d in (64, 128):
    for causal in (False, True):
        for det in (False, True):
            for n in (None, 4096):
                k = bwd_ws.compile_sm90(kernel="fused", head_dim=d, causal=causal, recipe="kernels_naive_fp8",
                                        deterministic=det, n=n)
                out.append(dict(d=d, causal=causal, det=det, n=n, **warp_specialized_budget(k)))
print(json.dumps(out))
"""


#: the fused kernel's other schedules of dQ^T at each head dim, as (consumers, dq_order, vec_tma): its
#: partial placed among dV and dK otherwise (``WsBwdTiles.fused_dq_order``) and the per-query vectors
#: through the ring (``fused_vec_tma``)
_DQ_ORDERS = {128: ((1, 1, False), (2, 1, False), (2, 3, False), (2, 0, True), (2, 3, True)),
              64: ((1, 2, False), (2, 2, False), (1, 0, True), (2, 2, True))}


@pytest.mark.slow
def test_bwd_ws_fused_compiles_for_sm90_with_its_register_budget():
    usage = compile_and_check_budget(_SCRIPT, 16, spills_ok=lambda u: u["d"] == 128)
    assert all(u["spills"] == 0 for u in usage if u["d"] == 64)


#: The two-consumer kernel (``consumers=2``) in the configurations above. ptxas's spill bytes count
#: the code of both consumer warp groups (one copy each in the kernel), the one-consumer kernel's one.
_SCRIPT_TWO_CONSUMERS = _SCRIPT.replace("deterministic=det, n=n)", "deterministic=det, n=n, consumers=2)")
#: The two-consumer kernel with TMA reduce-adds of dQ's own partials (dq_t=False): N a multiple of
#: 64, not deterministic, causal
#: (causal only: the non-causal variants differ by the causal mask alone, and each compile of the
#: fused kernel takes half a minute on two cores)
_SCRIPT_DQ_TMA = _SCRIPT.replace("for det in (False, True):", "for det in (False, ):").replace(
    "for causal in (False, True):", "for causal in (True, ):").replace(
    "for n in (None, 4096):", "for n, cons in ((4096, 2), ):").replace(
    "deterministic=det, n=n)", "deterministic=det, n=n, consumers=cons, dq_tma=True, dq_t=False)")
#: dQ^T (dq_t, the default with TMA reduce-adds) with one consumer and with two
_SCRIPT_DQ_T = _SCRIPT_DQ_TMA.replace("((4096, 2), )", "((4096, 1), (4096, 2))").replace(
    "dq_t=False)", "dq_t=True)")


@pytest.mark.slow
def test_two_consumer_bwd_ws_fused_compiles_for_sm90_with_its_register_budget():
    assert "consumers=2" in _SCRIPT_TWO_CONSUMERS
    usage = compile_and_check_budget(_SCRIPT_TWO_CONSUMERS, 16, consumers=2, spills_ok=lambda u: u["d"] == 128)
    assert all(u["spills"] == 0 for u in usage if u["d"] == 64)


@pytest.mark.slow
def test_two_consumer_bwd_ws_fused_with_tma_adds_compiles_for_sm90_with_its_register_budget():
    assert "dq_t=False" in _SCRIPT_DQ_TMA
    usage = compile_and_check_budget(_SCRIPT_DQ_TMA, 2, consumers=2, spills_ok=lambda u: u["d"] == 128)
    assert all(u["spills"] == 0 for u in usage if u["d"] == 64)


#: The dsq-row spec's kernel (dS for dQ scaled from the pre-pass's bound, partials unscaled): dQ^T
#: with one consumer and two, in the other schedules of ``_DQ_ORDERS`` of that many consumers, and dQ
#: by atomics (N not a multiple of 64, deterministic or not)
_SCRIPT_DSQ = """
import json
from dmref.kernels import bwd_ws
from dmref.kernels.compile_check import warp_specialized_budget
out = []
for d in (64, 128):
    others = [dict(n=4096, dq_tma=True, dq_t=True, consumers=c, dq_order=o, vec_tma=v)
              for c, o, v in ORDERS[d] if c == CONSUMERS]
    for kw in [dict(n=4096, dq_tma=True, dq_t=True, consumers=CONSUMERS), *others,
               dict(n=1000, dq_tma=False, consumers=CONSUMERS),
               dict(n=4096, deterministic=True, consumers=CONSUMERS)]:
        k = bwd_ws.compile_sm90(kernel="fused", head_dim=d, causal=True, recipe="kernels_folded_delta_prepass_dsq_row",
                                **kw)
        out.append(dict(d=d, **{key: val for key, val in kw.items() if key != "consumers"}, **warp_specialized_budget(k)))
print(json.dumps(out))
"""


@pytest.mark.slow
def test_dsq_row_bwd_ws_fused_compiles_for_sm90_with_its_register_budget():
    """The dsq-row kernel (``DSQ_ROW``), one consumer and two, within the budget; D = 64 without
    spills (D = 128 spills as the other fused kernels do)."""
    for consumers in (1, 2):
        script = _SCRIPT_DSQ.replace("CONSUMERS", str(consumers)).replace("ORDERS", repr(_DQ_ORDERS))
        others = sum(c == consumers for d in (64, 128) for c, _, _ in _DQ_ORDERS[d])
        got = compile_and_check_budget(script, 6 + others, consumers=consumers, spills_ok=lambda u: u["d"] == 128)
        assert all(u["spills"] == 0 for u in got if u["d"] == 64)


#: The Gluon pre-pass at the lower register caps (``WsBwdTiles.prepass_regs``), both head dims
_SCRIPT_PREPASS_REGS = """
import dataclasses, json
from dmref.kernels import bwd_ws
from dmref.kernels._sm90 import compile_launch
from dmref.kernels.compile_check import warp_specialized_budget
from dmref.kernels.config import get_spec
spec = get_spec("kernels_folded_delta_prepass_dsq_row")
out = []
for d in (64, 128):
    for regs in (64, 80):
        sp = spec.with_tiles(ws_bwd=dataclasses.replace(spec.ws_bwd_tiles(d), prepass_regs=regs))
        k = compile_launch(bwd_ws.launch(sp, head_dim=d, causal=True, kernel="prepass"))
        out.append(dict(d=d, cap=regs, **warp_specialized_budget(k)))
print(json.dumps(out))
"""


@pytest.mark.slow
def test_the_gluon_prepass_compiles_at_its_lower_register_caps():
    """At launch caps of 64 and 80 registers (four and three CTAs an SM) the pre-pass spills
    nothing, its consumer holds what the producer's drop leaves (2 cap - 24) and its shared memory
    fits that many CTAs an SM (228 KB less 1 KB a CTA)."""
    from dmref.kernels._gluon import PRODUCER_REGS
    from warp_specialized_budget import compiled_usage

    usage = compiled_usage(_SCRIPT_PREPASS_REGS)
    assert len(usage) == 4
    for u in usage:
        ctas = 65536 // (u["cap"] * u["threads"])
        assert ctas == {64: 4, 80: 3}[u["cap"]], u
        assert u["regs"] == u["cap"] and u["spills"] == 0 and not u["serialized"], u
        assert sorted(u["setmaxnreg"]) == [PRODUCER_REGS.value, 2 * u["cap"] - PRODUCER_REGS.value], u
        assert u["shared"] <= 228 * 1024 // ctas - 1024, u


@pytest.mark.slow
def test_dq_t_bwd_ws_fused_compiles_for_sm90_with_its_register_budget():
    """dQ^T (dq_t): one consumer (two CTAs an SM's budget) and two (one CTA an SM's); the budget
    check of each, D = 64 without spills."""
    assert "dq_t=True" in _SCRIPT_DQ_T and "((4096, 1), (4096, 2))" in _SCRIPT_DQ_T
    one = _SCRIPT_DQ_T.replace("((4096, 1), (4096, 2))", "((4096, 1), )")
    two = _SCRIPT_DQ_T.replace("((4096, 1), (4096, 2))", "((4096, 2), )")
    for script, consumers in ((one, 1), (two, 2)):
        got = compile_and_check_budget(script, 2, consumers=consumers, spills_ok=lambda u: u["d"] == 128)
        assert all(u["spills"] == 0 for u in got if u["d"] == 64)


def test_bwd_ws_fused_launches_one_or_two_consumers():
    """The fused kernel's consumer warp groups come from the spec's ``WsBwdTiles.fused_consumers``
    (1 by default) or a launch's ``consumers``: with two, 128 keys a CTA (the grid's first axis
    over 128-key blocks) and one CTA an SM's registers at launch; the dkdv kernel ignores the
    field."""
    pytest.importorskip("triton")
    import dataclasses

    from dmref.kernels import bwd_ws
    from dmref.kernels._gluon import LAUNCH_REGS, TWO_CONSUMER_LAUNCH_REGS
    from dmref.kernels.config import SPECS

    stale = SPECS["kernels_naive_fp8"]
    for d in (64, 128):
        two_spec = stale.with_tiles(ws_bwd=dataclasses.replace(stale.ws_bwd_tiles(d), fused_consumers=2))
        one = bwd_ws.launch(stale, head_dim=d, causal=True, kernel="fused")
        assert stale.ws_bwd_tiles(d).fused_consumers == 1
        assert (one.constexprs["CONSUMERS"], one.maxnreg, one.grid(1000, 4)) == (1, LAUNCH_REGS, (16, 4))
        for two in (bwd_ws.launch(stale, head_dim=d, causal=True, kernel="fused", consumers=2),
                    bwd_ws.launch(two_spec, head_dim=d, causal=True, kernel="fused")):
            assert (two.constexprs["CONSUMERS"], two.maxnreg, two.grid(1000, 4)) == (2, TWO_CONSUMER_LAUNCH_REGS,
                                                                                    (8, 4))
            # the rest as the one-consumer launch's (its ring and schedule)
            assert {k: v for k, v in two.constexprs.items() if k != "CONSUMERS"} == \
                {k: v for k, v in one.constexprs.items() if k != "CONSUMERS"}
        back = bwd_ws.launch(two_spec, head_dim=d, causal=True, kernel="fused", consumers=1)
        assert back.constexprs == one.constexprs and back.maxnreg == LAUNCH_REGS
        assert bwd_ws.launch(two_spec, head_dim=d, causal=True, kernel="dkdv").maxnreg == LAUNCH_REGS


def test_bwd_ws_fused_refuses_what_it_does_not_run():
    pytest.importorskip("triton")
    import dataclasses

    from dmref.kernels import bwd_ws
    from dmref.kernels._gluon import LAUNCH_REGS
    from dmref.kernels.bwd_fused import refusal as bwd_fused_refusal
    from dmref.kernels.config import SPECS, BwdTiles

    stale = SPECS["kernels_naive_fp8"]
    for spec, kwargs, match in [
        (SPECS["kernels_delta_matching"], {}, "delta"),
        (stale, dict(split=True), "whole"),
        (stale, dict(host_descriptors=False), "host-side"),
        (stale.with_tiles(bwd=BwdTiles(block_m2=128, block_n2=128)), {}, "block_n2"),
        (stale, dict(debug=True), "debug"),
    ]:
        with pytest.raises(ValueError, match=match) as exc:
            bwd_ws.launch(spec, head_dim=128, causal=False, kernel="fused", **kwargs)
        assert "\n" not in str(exc.value)
    with pytest.raises(ValueError, match="deterministic"):
        bwd_ws.launch(stale, head_dim=128, causal=False, kernel="dkdv", deterministic=True)
    # two consumer warp groups a CTA are the fused kernel's alone, and it runs one or two
    for kernel in ("dkdv", "dq", "prepass"):
        with pytest.raises(ValueError, match="fused kernel's") as exc:
            bwd_ws.launch(stale, head_dim=128, causal=False, kernel=kernel, consumers=2)
        assert "\n" not in str(exc.value)
    # dQ by TMA reduce-adds: whole 64-query tiles of one head, in any order
    for kwargs in (dict(n=1000), dict(n=None), dict(n=1024, deterministic=True)):
        with pytest.raises(ValueError, match="dq_tma needs") as exc:
            bwd_ws.launch(stale, head_dim=128, causal=False, kernel="fused", dq_tma=True, **kwargs)
        assert "\n" not in str(exc.value)
    assert bwd_ws.launch(stale, head_dim=64, causal=True, kernel="fused", dq_tma=True, n=1024).constexprs["DQ_TMA"]
    # dq_t: dQ^T by TMA reduce-adds
    with pytest.raises(ValueError, match="dq_t adds") as exc:
        bwd_ws.launch(stale, head_dim=64, causal=False, kernel="fused", n=1024, dq_t=True)
    assert "\n" not in str(exc.value)
    assert bwd_ws.launch(stale, head_dim=64, causal=False, kernel="fused", n=1024, dq_tma=True,
                         dq_t=True).constexprs["DQ_T"]
    assert not bwd_ws.launch(stale, head_dim=64, causal=False, kernel="fused", n=1024, dq_tma=True,
                             dq_t=False).constexprs["DQ_T"]
    # dq_tma=None (fused's default): TMA reduce-adds wherever they can be, else atomics; dq_t=None
    # (the default): dQ^T wherever the partials go by TMA reduce-adds
    for kwargs, want in ((dict(n=1024), True), (dict(n=1000), False), (dict(n=None), False),
                         (dict(n=1024, deterministic=True), False)):
        run = bwd_ws.launch(stale, head_dim=128, causal=False, kernel="fused", dq_tma=None, **kwargs)
        assert run.constexprs["DQ_TMA"] is want and run.constexprs["DQ_T"] is want, kwargs
    with pytest.raises(ValueError, match="fused kernel's"):
        bwd_ws.launch(stale, head_dim=128, causal=False, kernel="dkdv", dq_tma=True)
    # dQ^T's partial among dV and dK (dq_order): dQ^T only, 1 at D = 128, 2 at D = 64
    for d, order in ((128, 1), (128, 3), (64, 2)):
        run = bwd_ws.launch(stale, head_dim=d, causal=True, kernel="fused", n=1024, dq_tma=True, dq_t=True,
                            dq_order=order, consumers=2 if order == 3 else 1)
        assert run.constexprs["DQ_ORDER"] == order
        for kwargs, match in ((dict(head_dim=d, dq_order=2 if d == 128 else 1, dq_t=True), "runs at head dim"),
                              (dict(head_dim=d, dq_order=order, dq_t=False), "places dQ\\^T"),
                              (dict(head_dim=d, dq_order=4), "must be 0, 1, 2 or 3"),
                              (dict(head_dim=128, dq_order=3, dq_t=True), "two consumer warp groups")):
            with pytest.raises(ValueError, match=match) as exc:
                bwd_ws.launch(stale, causal=True, kernel="fused", n=1024, dq_tma=True, **kwargs)
            assert "\n" not in str(exc.value)
    run = bwd_ws.launch(stale, head_dim=64, causal=True, kernel="fused", n=1024, dq_tma=True)
    assert (run.constexprs["DQ_ORDER"], run.constexprs["VEC_TMA"]) == (0, False)
    # the pre-pass's register cap: the spec's prepass_regs, else the kernels' own
    dsq = SPECS["kernels_folded_delta_prepass_dsq_row"]
    assert bwd_ws.launch(dsq, head_dim=128, causal=True, kernel="prepass").maxnreg == LAUNCH_REGS
    for regs in (64, 80):
        sp = dsq.with_tiles(ws_bwd=dataclasses.replace(dsq.ws_bwd_tiles(128), prepass_regs=regs))
        assert bwd_ws.launch(sp, head_dim=128, causal=True, kernel="prepass").maxnreg == regs
    with pytest.raises(ValueError, match="prepass_regs=96 must be") as exc:
        dataclasses.replace(dsq.ws_bwd_tiles(128), prepass_regs=96)
    assert "\n" not in str(exc.value)
    # the per-query vectors through the ring (vec_tma): rows of 64 queries, N a multiple of 64
    assert bwd_ws.launch(stale, head_dim=64, causal=True, kernel="fused", n=1024, vec_tma=True).constexprs["VEC_TMA"]
    for kwargs, match in ((dict(kernel="fused", n=1000), "fused_vec_tma loads"), (dict(kernel="dkdv"), "fused kernel's"),
                          (dict(kernel="fused", n=1024, head_dim=128), "two consumer warp groups")):
        with pytest.raises(ValueError, match=match) as exc:
            bwd_ws.launch(stale, **{"head_dim": 64, **kwargs}, causal=True, vec_tma=True)
        assert "\n" not in str(exc.value)
    with pytest.raises(ValueError, match="fused kernel's"):
        bwd_ws.launch(stale, head_dim=64, causal=True, kernel="dkdv", dq_order=2)
    for consumers in (0, 3):
        with pytest.raises(ValueError, match="fused_consumers") as exc:
            bwd_ws.launch(stale, head_dim=128, causal=False, kernel="fused", consumers=consumers)
        assert "\n" not in str(exc.value)
    # the dsq-row spec's fused kernel scales dS for dQ from the bound (DSQ_ROW) and its pre-pass
    # computes the bound (BOUND); no other spec's does
    for name, spec in SPECS.items():
        if not bwd_fused_refusal(spec, 64):
            assert bwd_ws.launch(spec, head_dim=64, causal=True, kernel="fused").constexprs["DSQ_ROW"] is spec.dsq_row
        if spec.prepass:
            assert bwd_ws.launch(spec, head_dim=64, causal=True, kernel="prepass").constexprs["BOUND"] is spec.dsq_row


_CASES = [
    (ProblemShape(2, 4, 2, 1000, 128), False, "kernels_naive_fp8"),
    (ProblemShape(2, 4, 2, 1000, 128), True, "kernels_naive_fp8"),
    (ProblemShape(1, 4, 4, 777, 64), True, "kernels_naive_fp8"),
    (ProblemShape(1, 4, 1, 777, 64), False, "kernels_naive_fp8"),
    (ProblemShape(1, 2, 1, 203, 128), True, "kernels_naive_fp8"),
    (ProblemShape(2, 4, 2, 1024, 128), True, "kernels_naive_fp8"),  # N a multiple of 64: no mask on dQ's adds
    (ProblemShape(1, 4, 4, 1024, 64), False, "kernels_naive_fp8"),
    (ProblemShape(1, 4, 2, 515, 128), True, "kernels_folded_naive_fp8"),
]


def _ulp_bf16(x: torch.Tensor) -> torch.Tensor:
    """One BF16 unit in the last place at |x| (normal numbers; the subnormal spacing below)."""
    e = torch.floor(torch.log2(x.abs().float().clamp_min(2.0 ** -126)))
    return torch.exp2(e - 7)


def _dq_order_bound(saved, do8, delta, r, dims, dsq_bound=None) -> torch.Tensor:
    """How far apart two dQs may lie whose float32 buffers summed the same key blocks' partials
    p_j in different orders (atomic adds come in the order the CTAs reach them), each then
    rounded to BF16 after the factor s (``dims["scale"]``). Each order's sum of the n_b partials of
    an element, started from 0, lies within gamma(n_b - 1) * sum_j |p_j| of the exact sum
    (gamma(k) = k u / (1 - k u), u = 2**-24: Higham, Accuracy and Stability, 4.2), so the two
    float32 sums within twice that; each BF16 rounding adds at most half a unit in the last place
    of its result. sum_j |p_j| is bounded by A = |dS~| |K~| (float64), dS~ as the dQ matmul saw it
    (``bwd_fused``'s debug dump) and K~ its transposed copy dequantized, times 1 + 2**-20 for the
    chain's own float32 rounding and the two power-of-two and channel-scale products (3 roundings
    and the wgmma's truncating adds over 64 terms, each below 2**-23 relative to A). Returns
    s * 2 gamma(n_b - 1) * A * (1 + 2**-20) * (1 + u), (B, H, N, D): add the BF16 ulp at the
    comparison. Without cancellation this is far below a BF16 ulp; where the partials cancel (dQ
    small beside them) it is the term that allows more than one ulp. ``dsq_bound``: the U of a
    dsq-row spec (its partials are added unscaled and scaled once by powers of two: the same
    relative bound)."""
    from dmref.kernels import bwd_fused
    from dmref.kernels.config import QUANT_BLOCK

    b, h, hkv, n, d = dims["batch"], dims["heads"], dims["kv_heads"], dims["n"], dims["head_dim"]
    dbg = bwd_fused.backward(saved, do8, delta, recipe=r, debug=True, dsq_bound=dsq_bound, **dims)[3]
    kt = saved.k.cols.float() * saved.k.col_scale.repeat_interleave(QUANT_BLOCK, dim=1).transpose(1, 2)
    k_deq = kt.transpose(1, 2)[:, :n].reshape(b, hkv, n, d).repeat_interleave(h // hkv, dim=1)
    a = dbg["ds_dq"].double().abs() @ k_deq.reshape(b * h, n, d).double().abs()
    u = 2.0 ** -24
    n_b = -(-n // 64)
    gamma = (n_b - 1) * u / (1 - (n_b - 1) * u)
    return (dims["scale"] * 2 * gamma * (1 + 2.0 ** -20) * (1 + u) * a).reshape(b, h, n, d).float()


def _assert_within_order_bound(got, want, bound, what):
    diff = (got.float() - want.float()).abs()
    ok = diff <= torch.maximum(_ulp_bf16(got), _ulp_bf16(want)) + bound
    assert ok.all(), f"{what}: {_describe(got, want)}, {int((~ok).sum())} beyond the order bound"


@pytest.mark.gpu
@pytest.mark.parametrize("case", _CASES, ids=[_id(c) for c in _CASES])
def test_bwd_ws_fused_equals_the_triton_fused(case):
    device = require_backend("gpu")
    from dmref.kernels import bwd_fused, bwd_ws

    shape, causal, recipe = case
    saved, do8, delta, r, dims = _problem(shape, causal, recipe, device)
    dq_t, dk_t, dv_t, _ = bwd_fused.backward(saved, do8, delta, recipe=r, deterministic=True, **dims)
    dq_d, dk_d, dv_d, _ = bwd_ws.fused(saved, do8, delta, recipe=r, deterministic=True, **dims)
    dq_g, dk_g, dv_g, _ = bwd_ws.fused(saved, do8, delta, recipe=r, dq_tma=False, **dims)
    torch.cuda.synchronize()
    assert torch.isfinite(dq_t).all() and torch.isfinite(dk_t).all() and torch.isfinite(dv_t).all()
    for name, got, want in (("dK", dk_d, dk_t), ("dV", dv_d, dv_t), ("dQ (deterministic)", dq_d, dq_t),
                            ("dK", dk_g, dk_t), ("dV", dv_g, dv_t)):
        assert torch.equal(got, want), f"{name}: {_describe(got, want)}"
    bound = _dq_order_bound(saved, do8, delta, r, dims)
    _assert_within_order_bound(dq_g, dq_t, bound, "dQ")
    if shape.n % 64 == 0:
        # dQ's partials by TMA reduce-adds of a shared tile (dq_tma): the same partials, added in L2,
        # so within the same bound; and as dQ^T = K^T dS^T into a transposed buffer (dq_t, the
        # default with dq_tma): the same products in the same k order, within the same bound
        # dQ^T's partial placed among dV and dK otherwise (dq_order): the same values
        orders = tuple((c, True, o, v) for c, o, v in _DQ_ORDERS[shape.head_dim])
        for consumers, t, o, v in ((1, False, None, None), (2, False, None, None), (1, True, None, None),
                                   (2, True, None, None), (1, None, None, None), *orders):
            dq_r, dk_r, dv_r, _ = bwd_ws.fused(saved, do8, delta, recipe=r, dq_tma=True, consumers=consumers,
                                               dq_t=t, dq_order=o, vec_tma=v, **dims)
            torch.cuda.synchronize()
            what = f"dq_tma, {consumers} consumers, dq_t={t}, dq_order={o}, vec_tma={v}"
            assert torch.equal(dk_r, dk_t) and torch.equal(dv_r, dv_t), f"{what}: dK, dV"
            _assert_within_order_bound(dq_r, dq_t, bound, f"dQ ({what})")


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The BF16 tensor's bit patterns (``torch.equal`` on them tells -0 from +0)."""
    return x.contiguous().view(torch.int16)


#: The cases of the two-consumer test: those above, where the last 128-key CTA's second consumer
#: has keys below N (1000: 40, 203: 11) or none (777, 515), and N a multiple of 128 (1024); and
#: short sequences: N = 64, the second consumer's keys all past N (causal: its one query tile
#: released unread; not causal: every tile of every head, GQA), N = 65 (one key), N = 129 (the
#: second CTA's first consumer has one key, its second none).
_TWO_CONSUMER_CASES = _CASES + [
    (ProblemShape(1, 2, 1, 64, 64), False, "kernels_naive_fp8"),
    (ProblemShape(1, 4, 2, 64, 128), True, "kernels_naive_fp8"),
    (ProblemShape(1, 4, 2, 64, 64), False, "kernels_naive_fp8"),
    (ProblemShape(1, 2, 1, 65, 128), True, "kernels_naive_fp8"),
    (ProblemShape(1, 2, 2, 65, 64), False, "kernels_naive_fp8"),
    (ProblemShape(2, 4, 2, 129, 64), True, "kernels_naive_fp8"),
    (ProblemShape(1, 4, 1, 129, 128), False, "kernels_naive_fp8"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", _TWO_CONSUMER_CASES, ids=[_id(c) for c in _TWO_CONSUMER_CASES])
def test_two_consumers_give_the_one_consumer_bits(case):
    """Two consumer warp groups a CTA (``consumers=2``) run, for each 64-key block, the
    operations of the one-consumer CTA of that block on the same query tiles in the same order
    (the second consumer skips, unread, the CTA's first query tile of each head where causal, which
    precedes its keys, and every tile where its keys all lie past N), so dK and dV are the
    one-consumer kernel's bits, sign of zero included, at both ring depths and both schedules;
    deterministic, each block's dQ partial is added after the same blocks, so dQ is its bits too.
    Atomic dQ is within ``_dq_order_bound`` of the deterministic one (the same partials in another
    order). Where a consumer's keys all lie past N it still releases every stage, or the
    launch would not return."""
    device = require_backend("gpu")
    from dmref.kernels import bwd_ws

    shape, causal, recipe = case
    saved, do8, delta, r, dims = _problem(shape, causal, recipe, device)
    overlap = r.ws_bwd_tiles(shape.head_dim).dkdv_overlap
    bound = _dq_order_bound(saved, do8, delta, r, dims)
    for kw in (dict(), dict(stages=3), dict(overlap=1 - overlap)):
        want = bwd_ws.fused(saved, do8, delta, recipe=r, deterministic=True, consumers=1, **kw, **dims)[:3]
        got = bwd_ws.fused(saved, do8, delta, recipe=r, deterministic=True, consumers=2, **kw, **dims)[:3]
        atomic = bwd_ws.fused(saved, do8, delta, recipe=r, consumers=2, dq_tma=False, **kw, **dims)[:3]
        torch.cuda.synchronize()
        for name, a, b in zip(("dQ", "dK", "dV"), got, want):
            assert torch.equal(_bits(a), _bits(b)), f"{kw}: {name}: {_describe(a, b)}"
        for name, a, b in zip(("dK", "dV"), atomic[1:], want[1:]):
            assert torch.equal(_bits(a), _bits(b)), f"{kw}: {name} (atomic dQ): {_describe(a, b)}"
        _assert_within_order_bound(atomic[0], want[0], bound, f"{kw}: dQ (atomic)")


@pytest.mark.gpu
@pytest.mark.parametrize("consumers", [1, 2])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_bwd_ws_fused_deterministic_is_bit_identical_run_after_run(head_dim, consumers):
    device = require_backend("gpu")
    from dmref.kernels import bwd_ws

    saved, do8, delta, r, dims = _problem(ProblemShape(2, 8, 2, 2048, head_dim), True, "kernels_naive_fp8", device)
    first = bwd_ws.fused(saved, do8, delta, recipe=r, deterministic=True, consumers=consumers, **dims)[:3]
    for run in range(4):
        again = bwd_ws.fused(saved, do8, delta, recipe=r, deterministic=True, consumers=consumers, **dims)[:3]
        for name, a, b in zip(("dQ", "dK", "dV"), again, first):
            assert torch.equal(_bits(a), _bits(b)), f"run {run}: {name}: {_describe(a, b)}"


@pytest.mark.gpu
def test_the_api_fused_backward_is_the_gluon_one():
    """``attention_backward(fused=True)`` runs the Gluon kernel on a Hopper GPU (dK equal to
    ``bwd_ws.fused``'s), ``gluon=False`` the Triton one, and a caller's matched delta reaches the
    Gluon kernel (another D gives another dK)."""
    device = require_backend("gpu")
    from dmref.kernels import api, bwd_ws
    from dmref.kernels.config import SPECS
    from dmref.kernels.quantize import quantize
    from test_bwd_ws import _wide_inputs

    shape = ProblemShape(1, 4, 2, 777, 128)
    r = SPECS["kernels_naive_fp8"]
    q, k, v, do = _wide_inputs(shape, device)
    scale = 1.0 / math.sqrt(shape.head_dim)
    dims = dict(batch=shape.batch, heads=shape.heads, kv_heads=shape.kv_heads, n=shape.n,
                head_dim=shape.head_dim, causal=True, scale=scale)
    o, _, saved, _ = api.attention_forward(q, k, v, causal=True, scale=scale, recipe=r)
    do8, delta = quantize(do, r.recipe.do_dp.fmt.name, rows=True, cols=True, delta_with=o)
    kw = dict(shape=api.Shape.of(q, k, v), causal=True, scale=scale, recipe=r, fused=True, deterministic=True)
    _, dk_api, _, _ = api.attention_backward(saved, o, do, **kw)
    _, dk_ws, _, _ = bwd_ws.fused(saved, do8, delta, recipe=r, deterministic=True, **dims)
    _, dk_tr, _, _ = api.attention_backward(saved, o, do, gluon=False, **kw)
    assert torch.equal(dk_api, dk_ws) and torch.equal(dk_api, dk_tr)
    other = (delta * 1.5).reshape(shape.batch, shape.heads, shape.n)
    _, dk_other, _, _ = api.attention_backward(saved, o, do, delta=other, **kw)
    assert not torch.equal(dk_other, dk_api)


_PREPASS_CASES = [
    (ProblemShape(2, 4, 2, 1000, 128), True, "kernels_delta_matching"),
    (ProblemShape(1, 4, 1, 777, 64), False, "kernels_delta_matching"),
    (ProblemShape(1, 2, 2, 1024, 128), False, "kernels_folded_delta_matching"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", _PREPASS_CASES, ids=[_id(c) for c in _PREPASS_CASES])
def test_bwd_ws_prepass_is_the_dq_kernels_matched_delta(case):
    """The pre-pass (the dq kernel stopped at its row sums) gives the matched D of the dq kernels,
    Gluon and Triton, bit for bit: the same S, P, dP and row sums in the same order."""
    device = require_backend("gpu")
    from dmref.kernels import bwd, bwd_ws

    shape, causal, recipe = case
    saved, do8, delta_stale, r, dims = _problem(shape, causal, recipe, device)
    d_pre = bwd_ws.prepass(saved, do8, recipe=r, **dims)
    _, d_gluon = bwd_ws.dq(saved, do8, delta_stale, recipe=r, **dims)
    _, _, _, dbg = bwd.backward(saved, do8, do8, delta_stale, recipe=r, kernels=("dq",), **dims)
    assert torch.equal(d_pre, d_gluon), _describe(d_pre, d_gluon)
    assert torch.equal(d_pre, dbg["delta"]), _describe(d_pre, dbg["delta"])


_SEVEN_CASES = [
    (ProblemShape(2, 4, 2, 1000, 128), True, "kernels_delta_prepass"),
    (ProblemShape(1, 4, 1, 777, 64), False, "kernels_delta_prepass"),
    (ProblemShape(1, 4, 2, 1024, 128), True, "kernels_folded_delta_prepass"),
    (ProblemShape(1, 4, 2, 1024, 128), True, "kernels_folded_delta_prepass_dsq_row"),
    (ProblemShape(1, 4, 1, 777, 64), False, "kernels_folded_delta_prepass_dsq_row"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", _SEVEN_CASES, ids=[_id(c) for c in _SEVEN_CASES])
def test_the_seven_gemm_backward_in_gluon_equals_the_triton_one(case):
    """``attention_backward`` on a pre-pass spec runs the Gluon pre-pass and five-GEMM kernel on a
    Hopper GPU; deterministic, its D, dQ, dK and dV equal the Triton pre-pass and ``bwd_fused``'s
    bit for bit (the pre-pass: the dq kernels' matched D, above; the five-GEMM kernel: above)."""
    device = require_backend("gpu")
    from dmref.kernels import api
    from test_bwd_ws import _wide_inputs

    shape, causal, recipe = case
    q, k, v, do = _wide_inputs(shape, device)
    scale = 1.0 / math.sqrt(shape.head_dim)
    o, _, saved, _ = api.attention_forward(q, k, v, causal=causal, scale=scale, recipe=recipe)
    kw = dict(shape=api.Shape.of(q, k, v), causal=causal, scale=scale, recipe=recipe, deterministic=True)
    got = api.attention_backward(saved, o, do, **kw)
    want = api.attention_backward(saved, o, do, gluon=False, **kw)
    assert torch.equal(got[3]["delta"], want[3]["delta"]), _describe(got[3]["delta"], want[3]["delta"])
    for name, a, b in zip(("dQ", "dK", "dV"), got[:3], want[:3]):
        assert torch.equal(a, b), f"{name}: {_describe(a, b)}"


#: N a multiple of 64 (dQ^T) or not; 1088 = 17 x 64: the last CTA's second consumer's keys all past
#: N; 64: the one CTA's second consumer idle
_DSQ_CASES = [
    (ProblemShape(2, 4, 2, 1000, 128), True, "kernels_folded_delta_prepass_dsq_row"),
    (ProblemShape(1, 4, 1, 777, 64), False, "kernels_folded_delta_prepass_dsq_row"),
    (ProblemShape(1, 4, 2, 1024, 128), False, "kernels_folded_delta_prepass_dsq_row"),
    (ProblemShape(2, 4, 4, 1024, 64), True, "kernels_folded_delta_prepass_dsq_row"),
    (ProblemShape(1, 2, 1, 1088, 128), True, "kernels_folded_delta_prepass_dsq_row"),
    (ProblemShape(1, 4, 2, 1088, 64), False, "kernels_folded_delta_prepass_dsq_row"),
    (ProblemShape(1, 2, 1, 64, 64), True, "kernels_folded_delta_prepass_dsq_row"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", _DSQ_CASES, ids=[_id(c) for c in _DSQ_CASES])
def test_the_dsq_row_backward_in_gluon_equals_the_triton_one(case):
    """The dsq-row spec in Gluon against its Triton form (which test_bwd_prepass.py holds to the
    emulated reference): the Gluon pre-pass's D and bound U are ``bwd_prepass.delta(bound=True)``'s
    bit for bit (the same P and dP; U's maxima and two rounded products in the same order); the
    five-GEMM kernel that scales dS for dQ from U and adds dQ's partials unscaled (``DSQ_ROW``)
    gives ``bwd_fused.backward(dsq_bound=U)``'s dK and dV bits, one consumer or two, and
    deterministic its dQ bits too (each partial's factors, the head's K scale and the query's dS
    factor, are powers of two: scaling the key-ordered sum once scales each partial exactly, the
    partials being far above float32's subnormals here); with atomics and TMA reduce-adds (dQ and
    dQ^T, one and two consumers) dQ within the order bound."""
    device = require_backend("gpu")
    from dmref.kernels import bwd_fused, bwd_prepass, bwd_ws

    shape, causal, recipe = case
    saved, do8, _, r, dims = _problem(shape, causal, recipe, device)
    assert saved.kt_head
    d_t, u_t = bwd_prepass.delta(saved, do8, recipe=r, bound=True, **dims)
    d_g, u_g = bwd_ws.prepass(saved, do8, recipe=r, bound=True, **dims)
    assert torch.equal(d_g, d_t), _describe(d_g, d_t)
    assert torch.equal(u_g, u_t), _describe(u_g, u_t)
    want = bwd_fused.backward(saved, do8, d_t, recipe=r, deterministic=True, dsq_bound=u_t, **dims)[:3]
    assert all(bool(torch.isfinite(x).all()) for x in want)
    # deterministic, one and two consumers; and (N a multiple of 64) with the per-query vectors
    # through the ring, every bit of dQ too
    runs = [dict(consumers=c) for c in (1, 2)] + [dict(consumers=2, vec_tma=True)] * (shape.n % 64 == 0)
    for kw in runs:
        got = bwd_ws.fused(saved, do8, d_t, recipe=r, deterministic=True, dsq_bound=u_t, **kw, **dims)[:3]
        for name, a, b in zip(("dQ", "dK", "dV"), got, want):
            assert torch.equal(a, b), f"deterministic, {kw}: {name}: {_describe(a, b)}"
    bound = _dq_order_bound(saved, do8, d_t, r, dims, dsq_bound=u_t)
    variants = [dict(dq_tma=False, consumers=1)]
    if shape.n % 64 == 0:
        variants += [dict(dq_tma=True, dq_t=t, consumers=c) for t in (False, True) for c in (1, 2)]
        variants += [dict(dq_tma=True, dq_t=True, consumers=c, dq_order=o, vec_tma=v)
                     for c, o, v in _DQ_ORDERS[shape.head_dim]]
    for kw in variants:
        dq, dk, dv, _ = bwd_ws.fused(saved, do8, d_t, recipe=r, dsq_bound=u_t, **kw, **dims)
        torch.cuda.synchronize()
        assert torch.equal(dk, want[1]) and torch.equal(dv, want[2]), f"{kw}: dK, dV"
        _assert_within_order_bound(dq, want[0], bound, f"dQ ({kw})")
