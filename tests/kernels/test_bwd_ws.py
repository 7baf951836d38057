"""The warp-specialized Gluon dkdv kernel (``dmref.kernels.bwd_ws``).

- it compiles for sm_90a on a machine without a GPU, at both head dims, causal and not, with the
  register budget its docstring states and no spills (Gluon kernels do not run in Triton's
  interpreter);
- it refuses what it does not run (debug dumps, a query tile other than 64);
- on the H200 its dK and dV equal the Triton dkdv kernel's (``bwd._bwd_dkdv_kernel``), value for
  value, on wide-range inputs with GQA, tails and causal masks: it runs the same operations in
  the same order on the same FP8 operands (the same wgmma chains over the same k order, the same
  promotion per 64-query tile, the same rounded multiplies, casts and float32 adds), so no
  tolerance is derived; the one freedom is the sign of a zero (a masked query past N reads the
  next head's dO codes, whose dP is then multiplied by a zero scale), which ``torch.equal``
  ignores and the BF16 values cannot show otherwise;
- ``backward_ws`` is ``bwd.backward`` with the dkdv step replaced: dQ and the delta are the same
  tensors' values, so the matched delta's row-sum property (dS = P (dP - D) with D = sum_j P dP,
  ``test_kernels_intermediates::test_matched_delta_ds_rowsums_within_delta_matching_bound``, checked
  there on the Triton kernel's dS) holds for the Gluon kernel's dS, which it forms from the same
  float32 P, dP and D; and the kernel does read that D (another D gives other dK).

The warp-specialized Gluon dq kernel (``bwd_ws.dq``), the same way:

- it compiles for sm_90a at both head dims, causal and not, stale and matched, with the same
  register budget, no spills, no serialized wgmmas and shared memory for two CTAs an SM (GQA is a
  run-time argument of it, as of the Triton dq: one compiled kernel for every group);
- it refuses what it does not run (debug row sums, a key tile other than 64);
- on the H200 its dQ and the matched D equal the Triton dq kernel's (``torch.equal``): the same
  operations on the same values in the same order (its TTGIR arithmetic is op for op the Triton
  kernel's, in the same wgmma accumulator layout per warp, so the row sums of P dP reduce in the
  same order); the 64-query CTA instead of the Triton kernel's 128 changes nothing a stored row
  sees (every row of dQ and D depends on its own row of P and dP alone, and the causal key tiles
  the Triton kernel visits beyond a row's diagonal add exact zeros); and ``backward_ws`` with
  both Gluon kernels is ``bwd.backward``.
"""

from __future__ import annotations

import math

import pytest
import torch

from kernel_inputs import ProblemShape, outlier_inputs, require_backend
from warp_specialized_budget import compile_and_check_budget

#: The register budget of bwd_ws's docstring: producer 24, consumer 232, 128 at launch.
_SCRIPT = """
import json
from dmref.kernels import bwd_ws
from dmref.kernels.compile_check import warp_specialized_budget
out = []
# (head dim, causal, group, host descriptors, N a multiple of 16): the launches' specializations
cases = [(d, c, g, True, True) for d in (64, 128) for c in (False, True) for g in (1, 4)]
cases += [(128, True, 4, True, False), (64, False, 1, True, False)]  # N = 1000, 777, ...
cases += [(128, True, 1, False, True), (64, False, 4, False, False)]  # descriptors built per CTA
for d, causal, group, host, n16 in cases:
    k = bwd_ws.compile_sm90(head_dim=d, causal=causal, group=group, host_descriptors=host, n_multiple_of_16=n16)
    out.append(dict(d=d, causal=causal, group=group, host=host, n16=n16, **warp_specialized_budget(k)))
print(json.dumps(out))
"""


@pytest.mark.slow
def test_bwd_ws_compiles_for_sm90_with_its_register_budget():
    compile_and_check_budget(_SCRIPT, 12)


_DQ_SCRIPT = """
import json
from dmref.kernels import bwd_ws
from dmref.kernels.compile_check import warp_specialized_budget
out = []
# (head dim, causal, recipe, N a multiple of 16, schedule): the launches' specializations
cases = [(d, c, r, True, 0) for d in (64, 128) for c in (False, True) for r in ("kernels_delta_matching", "kernels_naive_fp8")]
cases += [(128, True, "kernels_delta_matching", False, 0), (64, False, "kernels_naive_fp8", False, 0)]  # N = 1000, 777, ...
# the overlapped schedules where they fit (OVERLAP 2 spills about 60 B at D = 128)
cases += [(128, c, r, True, 1) for c in (False, True) for r in ("kernels_delta_matching", "kernels_naive_fp8")]
cases += [(64, True, "kernels_naive_fp8", True, 1)] + [(64, c, "kernels_delta_matching", True, 2) for c in (False, True)]
cases += [(128, c, r, True, 3) for c in (False, True) for r in ("kernels_delta_matching", "kernels_naive_fp8")]
cases += [(64, True, "kernels_delta_matching", True, 3), (64, False, "kernels_naive_fp8", False, 3)]
for d, causal, recipe, n16, ov in cases:
    k = bwd_ws.compile_sm90(kernel="dq", head_dim=d, causal=causal, recipe=recipe, n_multiple_of_16=n16, overlap=ov)
    out.append(dict(d=d, causal=causal, recipe=recipe, n16=n16, overlap=ov, **warp_specialized_budget(k)))
print(json.dumps(out))
"""


@pytest.mark.slow
def test_bwd_ws_dq_compiles_for_sm90_with_its_register_budget():
    for u in compile_and_check_budget(_DQ_SCRIPT, 23):
        # m64 wgmmas over queries: S and dP n64, dS K (and kbar's float16 chain, matched) n = D
        want = {"m64n64k32"} | {f"m64n{u['d']}k32"}
        assert set(u["wgmma"]) == want, u


@pytest.mark.parametrize("kernel,what", [("dq", "debug"), ("dq", "block_n2"), ("dkdv", "debug"), ("dkdv", "block_m1")])
def test_bwd_ws_refuses_what_it_does_not_run(kernel, what):
    """Each Gluon kernel refuses the debug dumps and a tile other than its 64 (``block_n2`` for
    dq, ``block_m1`` for dkdv), alone and through ``backward_ws``; ``backward_ws`` refuses an
    unknown step."""
    pytest.importorskip("triton")
    from dmref.kernels import bwd_ws
    from dmref.kernels.config import SPECS, BwdTiles

    r = SPECS["kernels_delta_matching"]
    kwargs = {}
    if what == "debug":
        kwargs["debug"] = True
    else:
        r = r.with_tiles(bwd=BwdTiles(block_m2=128, block_n2=128) if kernel == "dq" else BwdTiles(block_m1=128, block_n1=128))
    dims = dict(batch=1, heads=1, kv_heads=1, n=128, head_dim=128, causal=False, scale=1.0, recipe=r)
    with pytest.raises(ValueError, match="bwd_ws"):
        if kernel == "dq":
            bwd_ws.dq(None, None, None, **dims, **kwargs)
        else:
            bwd_ws.dkdv(None, None, None, None, **dims, **kwargs)
    with pytest.raises(ValueError, match="bwd_ws"):
        bwd_ws.backward_ws(None, None, None, None, kernels=(kernel,), **dims, **kwargs)
    with pytest.raises(ValueError, match="bwd_ws"):
        bwd_ws.backward_ws(None, None, None, None, kernels=("dq", "fwd"), **dims)


def _wide_inputs(shape: ProblemShape, device: str, seed: int = 0):
    """Outlier inputs (every 16th channel of q and k 3x) with per-head magnitudes spread over
    2**-6 .. 2**6 (q, k, v per head; dO per query head), BF16."""
    q, k, v, do = outlier_inputs(shape, "cpu", seed=seed)
    g = torch.Generator().manual_seed(seed + 1)

    def spread(x, heads):
        return x.float() * torch.exp2(torch.randint(-6, 7, (1, heads, 1, 1), generator=g).float())

    q, do = spread(q, shape.heads), spread(do, shape.heads)
    k, v = spread(k, shape.kv_heads), spread(v, shape.kv_heads)
    return [t.to(torch.bfloat16).to(device) for t in (q, k, v, do)]


_GPU_CASES = [
    (ProblemShape(2, 4, 2, 1000, 128), False, "kernels_delta_matching"),
    (ProblemShape(2, 4, 2, 1000, 128), True, "kernels_delta_matching"),
    (ProblemShape(1, 4, 4, 777, 64), True, "kernels_delta_matching"),
    (ProblemShape(1, 4, 1, 777, 64), False, "kernels_delta_matching"),
    (ProblemShape(1, 2, 1, 203, 128), True, "kernels_delta_matching"),
    (ProblemShape(1, 2, 2, 64, 64), False, "kernels_delta_matching"),
    (ProblemShape(2, 4, 2, 1000, 128), True, "kernels_naive_fp8"),
    (ProblemShape(1, 4, 4, 777, 64), False, "kernels_naive_fp8"),
    (ProblemShape(1, 4, 2, 515, 128), True, "kernels_folded_delta_matching"),
    # D = 64 with batches: at 4x32x4096x64 the dkdv's dK differed from the Triton kernel's on
    # 4e-5 of its elements on the H200 (docs/kernels_speed.md); smaller shapes of that kind
    (ProblemShape(4, 4, 4, 1024, 64), False, "kernels_delta_matching"),
    (ProblemShape(2, 4, 2, 1000, 64), True, "kernels_naive_fp8"),
]


def _id(case):
    s, c, r = case
    return f"{r}-{s.batch}x{s.heads}x{s.kv_heads}x{s.n}x{s.head_dim}{'-causal' if c else ''}"


def _problem(shape, causal, recipe, device, seed=0):
    """The forward's saved copies and dO's copies, as ``api.attention_backward`` makes them."""
    from dmref.kernels import api
    from dmref.kernels.config import SPECS
    from dmref.kernels.quantize import quantize

    r = SPECS[recipe]
    q, k, v, do = _wide_inputs(shape, device, seed)
    scale = 1.0 / math.sqrt(shape.head_dim)
    o, _, saved, _ = api.attention_forward(q, k, v, causal=causal, scale=scale, recipe=r)
    do8, delta_stale = quantize(do, r.recipe.do_dp.fmt.name, rows=True, cols=True, delta_with=o)
    dims = dict(batch=shape.batch, heads=shape.heads, kv_heads=shape.kv_heads, n=shape.n,
                head_dim=shape.head_dim, causal=causal, scale=scale)
    return saved, do8, delta_stale, r, dims


def _describe(got, want):
    d = (got.float() - want.float()).abs()
    return f"max |diff| {d.max().item():.3e}, equal fraction {(got == want).float().mean().item():.6f}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", _GPU_CASES, ids=[_id(c) for c in _GPU_CASES])
def test_bwd_ws_equals_the_triton_dkdv(case):
    device = require_backend("gpu")
    from dmref.kernels import bwd, bwd_ws

    shape, causal, recipe = case
    saved, do8, delta_stale, r, dims = _problem(shape, causal, recipe, device)
    dq, dk, dv, dbg = bwd.backward(saved, do8, do8, delta_stale, recipe=r, **dims)
    dq_ws, dk_ws, dv_ws, dbg_ws = bwd_ws.backward_ws(saved, do8, do8, delta_stale, recipe=r, **dims)
    torch.cuda.synchronize()
    assert dk_ws.shape == dk.shape and dk_ws.stride() == dk.stride() and dk_ws.dtype == dk.dtype
    assert dv_ws.shape == dv.shape and dv_ws.stride() == dv.stride() and dv_ws.dtype == dv.dtype
    assert torch.isfinite(dk).all() and torch.isfinite(dv).all()
    assert torch.equal(dk_ws, dk), f"dK: {_describe(dk_ws, dk)}"
    assert torch.equal(dv_ws, dv), f"dV: {_describe(dv_ws, dv)}"
    # the dq step is the Triton kernel in both, and so is the D the dkdv step reads
    assert torch.equal(dq_ws, dq)
    assert torch.equal(dbg_ws["delta"], dbg["delta"])
    # dkdv alone, on that D: the same
    dk1, dv1 = bwd_ws.dkdv(saved, do8, do8, dbg["delta"], recipe=r, **dims)
    assert torch.equal(dk1, dk) and torch.equal(dv1, dv)


_VARIANTS = [dict(split=True), dict(overlap=1), dict(overlap=2), dict(stages=3), dict(host_descriptors=False)]


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("variant", _VARIANTS, ids=[",".join(f"{k}={v}" for k, v in x.items()) for x in _VARIANTS])
def test_bwd_ws_variants_equal_the_triton_dkdv(variant, head_dim):
    """The kernel's other forms give the same values: ``split`` (dK and dV as two halves of the
    head dim, each its own wgmma: a wgmma's output element depends on its row of A, its column
    of B and the k order only), the overlapped schedules (the same operations, issued earlier),
    a deeper ring and the descriptors built per CTA."""
    device = require_backend("gpu")
    from dmref.kernels import bwd, bwd_ws

    shape = ProblemShape(1, 4, 2, 1000, head_dim)
    saved, do8, delta_stale, r, dims = _problem(shape, True, "kernels_delta_matching", device)
    _, dk, dv, dbg = bwd.backward(saved, do8, do8, delta_stale, recipe=r, **dims)
    dk_ws, dv_ws = bwd_ws.dkdv(saved, do8, do8, dbg["delta"], recipe=r, **variant, **dims)
    assert torch.equal(dk_ws, dk), f"dK: {_describe(dk_ws, dk)}"
    assert torch.equal(dv_ws, dv), f"dV: {_describe(dv_ws, dv)}"


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("variant", [dict(), dict(stages=3)], ids=["default", "stages=3"])
def test_bwd_ws_dkdv_gives_the_triton_bits_run_after_run(variant, causal):
    """D = 64 with batches, six runs in a row: without the proxy fence before the ring's
    releases, a third of the causal runs of the Gluon dkdv gave dK values that differ from the
    Triton kernel's in a few channels over one or two warps' key rows (docs/kernels_speed.md);
    every run must give the Triton kernel's bits."""
    device = require_backend("gpu")
    from dmref.kernels import bwd, bwd_ws

    saved, do8, delta_stale, r, dims = _problem(ProblemShape(4, 4, 4, 1024, 64), causal, "kernels_delta_matching",
                                                device)
    _, dk, dv, dbg = bwd.backward(saved, do8, do8, delta_stale, recipe=r, **dims)
    for run in range(6):
        dk_ws, dv_ws = bwd_ws.dkdv(saved, do8, do8, dbg["delta"], recipe=r, **variant, **dims)
        assert torch.equal(dk_ws, dk), f"run {run}: dK: {_describe(dk_ws, dk)}"
        assert torch.equal(dv_ws, dv), f"run {run}: dV: {_describe(dv_ws, dv)}"


@pytest.mark.gpu
def test_bwd_ws_reads_the_delta_it_is_given():
    """delta_matching: the matched D of the dq kernel is what the Gluon kernel subtracts (the
    Triton kernel's dK on it, above); on the stale D its dK is the Triton kernel's on the stale D,
    and differs from the matched one, while dV (no D in it) does not change."""
    device = require_backend("gpu")
    from dmref.kernels import bwd, bwd_ws
    from dmref.kernels.config import SPECS

    saved, do8, delta_stale, r, dims = _problem(ProblemShape(1, 4, 2, 777, 128), True, "kernels_delta_matching", device)
    _, dk, dv, dbg = bwd.backward(saved, do8, do8, delta_stale, recipe=r, **dims)
    assert not torch.equal(dbg["delta"], delta_stale)
    dk_st, dv_st = bwd_ws.dkdv(saved, do8, do8, delta_stale, recipe=r, **dims)
    _, dk_tr, _, _ = bwd.backward(saved, do8, do8, delta_stale, recipe=SPECS["kernels_naive_fp8"], **dims)
    assert torch.equal(dk_st, dk_tr), f"dK (stale D): {_describe(dk_st, dk_tr)}"
    assert not torch.equal(dk_st, dk)
    assert torch.equal(dv_st, dv)


@pytest.mark.gpu
@pytest.mark.parametrize("case", _GPU_CASES, ids=[_id(c) for c in _GPU_CASES])
def test_bwd_ws_dq_equals_the_triton_dq(case):
    """dQ and the D of the Gluon dq kernel are the Triton dq kernel's (matched: D = sum_j P dP,
    which the dkdv step reads; stale: the preprocess's D, handed on), and ``backward_ws`` with
    both Gluon kernels (dq, then dkdv on the D it made) is ``bwd.backward``."""
    device = require_backend("gpu")
    from dmref.kernels import bwd, bwd_ws

    shape, causal, recipe = case
    saved, do8, delta_stale, r, dims = _problem(shape, causal, recipe, device)
    dq, dk, dv, dbg = bwd.backward(saved, do8, do8, delta_stale, recipe=r, **dims)
    dq_ws, delta_ws = bwd_ws.dq(saved, do8, delta_stale, recipe=r, **dims)
    torch.cuda.synchronize()
    assert dq_ws.shape == dq.shape and dq_ws.stride() == dq.stride() and dq_ws.dtype == dq.dtype
    assert torch.isfinite(dq).all()
    assert torch.equal(dq_ws, dq), f"dQ: {_describe(dq_ws, dq)}"
    assert torch.equal(delta_ws, dbg["delta"]), f"D: {_describe(delta_ws, dbg['delta'])}"
    if r.matched:
        assert delta_ws.data_ptr() != delta_stale.data_ptr() and not torch.equal(delta_ws, delta_stale)
    else:
        assert delta_ws is delta_stale
    dq2, dk2, dv2, dbg2 = bwd_ws.backward_ws(saved, do8, do8, delta_stale, recipe=r, kernels=("dq", "dkdv"), **dims)
    assert torch.equal(dq2, dq) and torch.equal(dbg2["delta"], dbg["delta"])
    assert torch.equal(dk2, dk), f"dK: {_describe(dk2, dk)}"
    assert torch.equal(dv2, dv), f"dV: {_describe(dv2, dv)}"
    # the Gluon dq with the Triton dkdv (on the Gluon dq's D): the same
    dq3, dk3, dv3, _ = bwd_ws.backward_ws(saved, do8, do8, delta_stale, recipe=r, kernels=("dq",), **dims)
    assert torch.equal(dq3, dq) and torch.equal(dk3, dk) and torch.equal(dv3, dv)


_DQ_VARIANTS = [dict(stages=1), dict(stages=3), dict(overlap=1), dict(overlap=2), dict(overlap=3),
                dict(overlap=3, stages=1), dict(overlap=3, recipe="kernels_naive_fp8"),
                dict(overlap=3, recipe="kernels_naive_fp8", causal=False)]


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("variant", _DQ_VARIANTS,
                         ids=[",".join(f"{k}={v}" for k, v in x.items()) for x in _DQ_VARIANTS])
def test_bwd_ws_dq_variants_equal_the_triton_dq(variant, head_dim):
    """The dq kernel's other forms give the same values: other depths of its key-tile ring (one
    stage: the producer waits for every tile to be consumed; three) and the overlapped schedules
    (the same operations, issued earlier; OVERLAP 3 also loads one K tile past the last)."""
    device = require_backend("gpu")
    from dmref.kernels import bwd, bwd_ws

    variant = dict(variant)
    recipe, causal = variant.pop("recipe", "kernels_delta_matching"), variant.pop("causal", True)
    saved, do8, delta_stale, r, dims = _problem(ProblemShape(1, 4, 2, 1000, head_dim), causal, recipe, device)
    dq, _, _, dbg = bwd.backward(saved, do8, do8, delta_stale, recipe=r, kernels=("dq",), **dims)
    dq_ws, delta_ws = bwd_ws.dq(saved, do8, delta_stale, recipe=r, **variant, **dims)
    assert torch.equal(dq_ws, dq), f"dQ: {_describe(dq_ws, dq)}"
    assert torch.equal(delta_ws, dbg["delta"])


@pytest.mark.gpu
def test_bwd_ws_dq_large_k_keeps_kbar_finite():
    """K x 2**17, Q x 2**-17 (logits unchanged): kbar in units of the head's largest K scale stays
    finite in float16, and the Gluon dQ is the Triton one's (which test_kernels_scale_invariance
    holds to dQ x 2**17 of the unscaled problem)."""
    device = require_backend("gpu")
    import math

    from dmref.kernels import api, bwd, bwd_ws
    from dmref.kernels.config import SPECS
    from dmref.kernels.quantize import quantize

    shape = ProblemShape(1, 2, 1, 333, 128)
    r = SPECS["kernels_delta_matching"]
    q, k, v, do = _wide_inputs(shape, device)
    q, k = (q.float() * 2.0**-17).to(torch.bfloat16), (k.float() * 2.0**17).to(torch.bfloat16)
    scale = 1.0 / math.sqrt(shape.head_dim)
    o, _, saved, _ = api.attention_forward(q, k, v, causal=True, scale=scale, recipe=r)
    do8, delta_stale = quantize(do, r.recipe.do_dp.fmt.name, rows=True, cols=True, delta_with=o)
    dims = dict(batch=1, heads=2, kv_heads=1, n=shape.n, head_dim=128, causal=True, scale=scale)
    dq, _, _, dbg = bwd.backward(saved, do8, do8, delta_stale, recipe=r, kernels=("dq",), **dims)
    dq_ws, delta_ws = bwd_ws.dq(saved, do8, delta_stale, recipe=r, **dims)
    assert torch.isfinite(dq_ws).all()
    assert torch.equal(dq_ws, dq), f"dQ: {_describe(dq_ws, dq)}"
    assert torch.equal(delta_ws, dbg["delta"])


_API_CASES = [(ProblemShape(2, 4, 2, 1000, 128), True, "kernels_delta_matching"),
              (ProblemShape(1, 4, 4, 777, 64), False, "kernels_naive_fp8"),
              (ProblemShape(1, 4, 2, 515, 128), True, "kernels_folded_delta_matching"),
              (ProblemShape(1, 4, 1, 777, 64), True, "kernels_delta_matching")]


@pytest.mark.gpu
@pytest.mark.parametrize("case", _API_CASES, ids=[_id(c) for c in _API_CASES])
def test_the_api_backward_is_the_gluon_one_and_equals_the_triton_one(case, monkeypatch):
    """``api.attention_backward`` runs the Gluon dq and dkdv on a GPU (``gluon=None``), and its
    gradients and D are the Triton kernels' (``gluon=False``) bit for bit; through autograd too."""
    device = require_backend("gpu")
    from dmref.kernels import api, bwd_ws

    shape, causal, recipe = case
    q, k, v, do = _wide_inputs(shape, device)
    r = api.get_spec(recipe)
    assert api.gluon_backward_refusal(r, shape.head_dim) is None
    o, _, saved, _ = api.attention_forward(q, k, v, causal=causal, recipe=r)
    kw = dict(shape=api.Shape.of(q, k, v), causal=causal, scale=1.0 / math.sqrt(shape.head_dim), recipe=r)
    calls = []
    real_dq = bwd_ws.dq

    def counting_dq(*a, **kwa):
        calls.append(1)
        return real_dq(*a, **kwa)

    monkeypatch.setattr(bwd_ws, "dq", counting_dq)
    got = api.attention_backward(saved, o, do, **kw)
    assert calls == [1]
    monkeypatch.undo()
    want = api.attention_backward(saved, o, do, gluon=False, **kw)
    for name, g, w in zip(("dQ", "dK", "dV"), got[:3], want[:3]):
        assert torch.isfinite(w).all()
        assert torch.equal(g, w), f"{name}: {_describe(g, w)}"
    assert torch.equal(got[3]["delta"], want[3]["delta"])
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    api.attention(qg, kg, vg, causal=causal, recipe=r).backward(do)
    for g, w in zip((qg.grad, kg.grad, vg.grad), want[:3]):
        assert torch.equal(g, w)


def test_the_api_backward_says_when_the_gluon_one_does_not_run():
    """Where the Gluon backward does not run (the interpreter, the debug dumps, other tiles),
    ``gluon_backward_refusal`` says why, and ``gluon=True`` is a ValueError with that reason."""
    pytest.importorskip("triton")
    import os

    from dmref.kernels import api
    from dmref.kernels.config import BwdTiles

    r = api.get_spec("kernels_delta_matching")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        assert "interpreter" in api.gluon_backward_refusal(r, 128)
        device = require_backend("interpreter")
        shape = ProblemShape(1, 2, 1, 70, 64)
        q, k, v, do = _wide_inputs(shape, device)
        o, _, saved, _ = api.attention_forward(q, k, v, recipe=r)
        with pytest.raises(ValueError, match="Gluon backward does not run this call: Triton's interpreter"):
            api.attention_backward(saved, o, do, shape=api.Shape.of(q, k, v), causal=False, scale=0.125,
                                   recipe=r, gluon=True)
        return
    assert api.gluon_backward_refusal(r, 128) is None
    assert "debug" in api.gluon_backward_refusal(r, 64, debug=True)
    wide = r.with_tiles(bwd=BwdTiles(block_m2=128, block_n2=128))
    assert "block_n2=128" in api.gluon_backward_refusal(wide, 128)


def test_the_gluon_kernels_say_when_the_gpu_is_not_a_hopper(monkeypatch):
    """On a CUDA GPU other than Hopper (compute capability 9.x) the API's backward runs the Triton
    kernels (``gluon_backward_refusal`` names the GPU and its capability) and the folded recipes'
    forward, a Gluon kernel, refuses with the same reason; no GPU is touched (the capability and
    the name are monkeypatched)."""
    pytest.importorskip("triton")
    from dmref.kernels import api

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a Blackwell GPU")
    cuda = torch.device("cuda")
    why = api.gluon_backward_refusal(api.get_spec("kernels_delta_matching"), 128, device=cuda)
    assert why == "the Gluon kernels use Hopper's wgmma (compute capability 9.x); a Blackwell GPU has 10.0"
    assert api._not_hopper(cuda) == why
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert api._not_hopper(cuda) is None

