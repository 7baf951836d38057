"""Every kernel reads what it computes from its ``KernelSpec``, through one launch description per
kernel (``fwd.launch``, ``fwd_ws.launch``, ``bwd.launch``, ``bwd_ws.launch``, and for the specs with
D from a pre-pass ``bwd_prepass.launch`` and ``bwd_fused.launch``), which the launchers
and ``compile_check`` read alike; a forward tiling a kernel cannot honour is refused with the
reason. On the CPU, from the launch descriptions (Gluon kernels do not run in Triton's
interpreter); the runs of a spec with another P scale against the reference are in
``test_kernels_intermediates`` (interpreter and GPU: P codes of both passes) and
``test_kernels_vs_reference`` (GPU: the Gluon forward and backward), and below (GPU)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from dmref.kernels.config import SPECS, FwdTiles, WsBwdTiles, default_fwd_tiles, default_ws_bwd_tiles

from kernel_inputs import ProblemShape, outlier_inputs, require_backend, with_p_scale

pytest.importorskip("triton")

#: log2 of P's scale in the specs below, other than the shipped recipes' 8
P_SCALE_LOG2 = 6


def _launches(spec, head_dim: int = 128, causal: bool = True) -> dict:
    """Every kernel's launch for ``spec``: the forward of its family, both Triton backward kernels,
    and both Gluon ones; for a spec with D from a pre-pass, the pre-pass and the fused backward
    instead of the four."""
    from dmref.kernels import bwd, bwd_fused, bwd_prepass, bwd_ws, fwd, fwd_ws

    dims = dict(head_dim=head_dim, causal=causal)
    fwd_run = {"fwd": (fwd_ws if spec.folded else fwd).launch(spec, **dims)}
    if spec.prepass:
        return {**fwd_run, "prepass": bwd_prepass.launch(spec, **dims), "bwd_fused": bwd_fused.launch(spec, **dims)}
    return {**fwd_run, "dq": bwd.launch(spec, kernel="dq", **dims), "dkdv": bwd.launch(spec, kernel="dkdv", **dims),
            "dq_ws": bwd_ws.launch(spec, kernel="dq", **dims), "dkdv_ws": bwd_ws.launch(spec, kernel="dkdv", **dims)}


#: The kernels that quantize P, by whether the spec's D comes from a pre-pass
_P_KERNELS = {False: ("fwd", "dkdv", "dkdv_ws"), True: ("fwd", "bwd_fused")}


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("head_dim", [64, 128])
def test_every_kernel_scales_p_as_its_spec_says(name, head_dim):
    """P's fixed scale of every kernel that quantizes P (forward, Triton dkdv, Gluon dkdv; for a
    pre-pass spec the fused backward) is the spec's, 2**8 for the shipped recipes and 2**6 for the
    same recipe with P scaled by 2**6: no kernel reads it from anywhere else."""
    for spec, e in ((SPECS[name], 8), (with_p_scale(SPECS[name], P_SCALE_LOG2), P_SCALE_LOG2)):
        assert spec.recipe.p_fwd.offset_log2 == spec.recipe.p_bwd.offset_log2 == e
        runs = _launches(spec, head_dim)
        for kernel in _P_KERNELS[spec.prepass]:
            assert runs[kernel].constexprs["P_SCALE"] == 2.0 ** e, (spec.name, kernel)


@pytest.mark.parametrize("name", sorted(n for n, s in SPECS.items() if not s.prepass))
def test_both_dq_kernels_scale_kbars_p_as_the_spec_says(name):
    """The matched dq kernels (Triton and Gluon) quantize kbar's P times
    ``2**recipe.delta.deferred_dq.p_offset_log2``, read from the spec (the pre-pass specs run
    no dq kernel: test_bwd_prepass)."""
    spec = SPECS[name]
    runs = _launches(spec)
    deferred = spec.recipe.delta.deferred_dq
    for kernel in ("dq", "dq_ws"):
        assert runs[kernel].constexprs["MATCHED"] == (deferred is not None)
        if deferred is not None:
            assert runs[kernel].constexprs["KBAR_P_SCALE"] == 2.0 ** deferred.p_offset_log2


def test_the_gluon_forward_reads_chain_key_tile_stages_and_schedule_from_the_spec():
    from dmref.kernels import fwd_ws

    spec = SPECS["kernels_folded_naive_fp8"]
    for d in (64, 128):
        assert spec.fwd_tiles(d) == default_fwd_tiles(spec.recipe, d)
        c = fwd_ws.launch(spec, head_dim=d, causal=False).constexprs
        assert (c["BLOCK_N"], c["CHAIN"], c["STAGES"], c["OVERLAP"]) == (spec.recipe.tiles.block_k, False, 2, 1)
    other = spec.with_tiles(fwd=FwdTiles(num_stages=3, overlap=0))
    chained = fwd_ws.variant(other, chain=True)
    assert chained.recipe.pv_chain and chained.name != spec.name
    for d in (64, 128):
        c = fwd_ws.launch(chained, head_dim=d, causal=True).constexprs
        assert (c["CHAIN"], c["STAGES"], c["OVERLAP"], c["CAUSAL"]) == (True, 3, 0, True)


def test_the_gluon_backward_reads_its_schedule_from_the_spec():
    """The Gluon dq and dkdv take their ring depth and schedule from the spec's ``ws_bwd_tiles``:
    the defaults of ``default_ws_bwd_tiles`` for the shipped specs, another one where the spec says
    so, or where a launch names one (the spec with it)."""
    from dmref.kernels import bwd_ws

    def schedule(spec, d):
        runs = _launches(spec, d)
        dkdv, dq = runs["dkdv_ws"].constexprs, runs["dq_ws"].constexprs
        return WsBwdTiles(dkdv["STAGES"], dkdv["SPLIT"], dkdv["OVERLAP"], dq["STAGES"], dq["OVERLAP"])

    for name, spec in SPECS.items():
        if spec.prepass:  # no Gluon backward (test_bwd_prepass)
            continue
        for d in (64, 128):
            assert schedule(spec, d) == spec.ws_bwd_tiles(d) == default_ws_bwd_tiles(spec.recipe, d), (name, d)
    other = WsBwdTiles(dkdv_stages=3, dkdv_split=False, dkdv_overlap=2, dq_stages=3, dq_overlap=3)
    spec = SPECS["kernels_delta_matching"].with_tiles(ws_bwd=other)
    assert schedule(spec, 64) == schedule(spec, 128) == other
    given = bwd_ws.launch("kernels_delta_matching", head_dim=128, causal=False, kernel="dkdv", overlap=1, stages=3)
    assert (given.constexprs["OVERLAP"], given.constexprs["STAGES"]) == (1, 3)
    with pytest.raises(ValueError, match="split"):
        WsBwdTiles(dkdv_split=True, dkdv_overlap=2)


_NOT_HONOURED = [FwdTiles(block_m=128), FwdTiles(num_warps=8), FwdTiles(maxnreg=168), FwdTiles(tma=False),
                 FwdTiles(overlap=2), FwdTiles(num_stages=0)]


@pytest.mark.parametrize("tiles", _NOT_HONOURED,
                         ids=["block_m", "num_warps", "maxnreg", "tma", "overlap", "num_stages"])
def test_a_forward_tiling_the_gluon_forward_cannot_honour_is_refused(tiles):
    """A folded spec with a forward tiling the warp-specialized kernel does not run is refused, in
    one line naming the field, when the spec is made (not ignored at the launch)."""
    field = next(f.name for f in dataclasses.fields(FwdTiles) if getattr(tiles, f.name) != getattr(FwdTiles(), f.name))
    with pytest.raises(ValueError, match=field) as info:
        SPECS["kernels_folded_delta_matching"].with_tiles(fwd=tiles)
    assert "\n" not in str(info.value)


_NOT_HONOURED_CONSUMERS = [("block_m", FwdTiles(consumers=2)), ("consumers", FwdTiles(block_m=128, consumers=3)),
                           ("consumers", FwdTiles(consumers=0)),
                           ("num_warps", FwdTiles(block_m=128, consumers=2, num_warps=8)),
                           ("maxnreg", FwdTiles(block_m=128, consumers=2, maxnreg=168))]


@pytest.mark.parametrize("field,tiles", _NOT_HONOURED_CONSUMERS,
                         ids=["block_m", "consumers3", "consumers0", "num_warps", "maxnreg"])
def test_consumers_the_gluon_forward_cannot_honour_are_refused(field, tiles):
    """Consumer warp groups: one or two, each on 64 queries (``block_m = 64 * consumers``) of 4
    warps with setmaxnreg's registers; anything else is refused in one line naming the field."""
    from dmref.kernels.config import fwd_refusal

    spec = SPECS["kernels_folded_delta_matching"]
    why = fwd_refusal(spec.recipe, tiles)
    assert why is not None and field in why and "\n" not in why, why
    with pytest.raises(ValueError, match=field):
        spec.with_tiles(fwd=tiles)


def test_the_gluon_forward_reads_its_consumers_from_the_spec():
    """``FwdTiles(block_m=128, consumers=2)`` is honoured (not the default at either head dim):
    ``fwd_ws.launch`` gives ``CONSUMERS=2``, 128 queries a CTA (its grid), one CTA an SM's
    registers at launch; ``variant(consumers=2)`` sets both fields, and ``compile_check`` reads the
    same launch."""
    from dmref.kernels import compile_check, fwd_ws
    from dmref.kernels._gluon import LAUNCH_REGS, TWO_CONSUMER_LAUNCH_REGS
    from dmref.kernels.config import fwd_refusal

    spec = SPECS["kernels_folded_naive_fp8"]
    for d in (64, 128):
        assert spec.fwd_tiles(d).consumers == 1
        one = fwd_ws.launch(spec, head_dim=d, causal=True)
        assert (one.constexprs["CONSUMERS"], one.block_m, one.maxnreg) == (1, 64, LAUNCH_REGS)
    tiles = FwdTiles(block_m=128, consumers=2, num_stages=2, overlap=1)
    assert fwd_refusal(spec.recipe, tiles) is None
    two = spec.with_tiles(fwd=tiles)
    varied = fwd_ws.variant(spec, consumers=2)
    assert [varied.fwd_tiles(d) for d in (64, 128)] == [two.fwd_tiles(d) for d in (64, 128)] == [tiles, tiles]
    for d in (64, 128):
        for causal in (False, True):
            run = fwd_ws.launch(two, head_dim=d, causal=causal)
            assert (run.constexprs["CONSUMERS"], run.block_m, run.maxnreg, run.num_warps) == \
                (2, 128, TWO_CONSUMER_LAUNCH_REGS, 4)
            assert {k: v for k, v in run.constexprs.items() if k != "CONSUMERS"} == \
                {k: v for k, v in fwd_ws.launch(spec, head_dim=d, causal=causal).constexprs.items() if k != "CONSUMERS"}
            assert dict(compile_check.recipe_variants(two, d, causal))["fwd"] == run
    # the grid: one CTA per 128 queries, the tail CTA included (its second consumer may have no row)
    run = fwd_ws.launch(two, head_dim=128, causal=False)
    assert [run.grid(n, 6) for n in (64, 65, 128, 129, 777, 1000)] == \
        [(1, 6), (1, 6), (1, 6), (2, 6), (7, 6), (8, 6)]
    chained = fwd_ws.variant(spec, chain=True, overlap=0, stages=3, consumers=2)
    c = fwd_ws.launch(chained, head_dim=64, causal=True).constexprs
    assert (c["CHAIN"], c["OVERLAP"], c["STAGES"], c["CONSUMERS"]) == (True, 0, 3, 2)


def test_the_triton_forward_refuses_a_schedule_it_does_not_have():
    with pytest.raises(ValueError, match="overlap"):
        SPECS["kernels_delta_matching"].with_tiles(fwd=FwdTiles(overlap=1))
    with pytest.raises(ValueError, match="consumers"):
        SPECS["kernels_delta_matching"].with_tiles(fwd=FwdTiles(block_m=128, consumers=2))
    # and the Gluon forward refuses a spec of the Triton forward's family
    from dmref.kernels import fwd_ws

    with pytest.raises(ValueError, match="folded"):
        fwd_ws.launch("kernels_delta_matching", head_dim=128, causal=False)


def test_compile_check_describes_the_kernels_of_the_spec():
    """``compile_check.recipe_variants`` (what ``check`` compiles) gives the launchers' own
    descriptions: the Gluon forward's for a folded spec and the Triton forward's otherwise, both
    Triton backward kernels and both Gluon ones, or for a pre-pass spec the pre-pass and the fused
    backward (and the quantization of dO without the stale delta)."""
    from dmref.kernels import compile_check, fwd, fwd_ws

    for name, module in (("kernels_folded_naive_fp8", fwd_ws), ("kernels_naive_fp8", fwd),
                         ("kernels_folded_delta_prepass", fwd_ws), ("kernels_delta_prepass", fwd)):
        spec = with_p_scale(SPECS[name], P_SCALE_LOG2)
        runs = dict(compile_check.recipe_variants(spec, 128, False))
        want = module.launch(spec, head_dim=128, causal=False)
        assert runs["fwd"] == want and runs["fwd"].constexprs["P_SCALE"] == 2.0 ** P_SCALE_LOG2
        launches = _launches(spec, 128, causal=False)
        assert set(runs) == {"quantize", *launches}, (name, sorted(runs))
        assert {k: runs[k] for k in launches} == launches
        assert runs["quantize"].constexprs["WITH_DELTA"] == (not spec.prepass)


def test_one_format_table():
    from dmref.kernels._runtime import triton_type

    assert [triton_type(f) for f in ("float8_e4m3fn", "float8_e5m2", "bfloat16", "float32")] == \
        ["fp8e4nv", "fp8e5", "bf16", "fp32"]
    with pytest.raises(ValueError, match="float16"):
        triton_type("float16")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gluon_forward_and_backward_run_the_p_scale_of_the_spec(causal):
    """On the GPU, a folded spec with P scaled by 2**6: the Gluon forward's P codes are the
    reference's for 2**6 (on at least ``P_CODE_AGREEMENT`` of the keys) and not those for 2**8, and
    the Gluon backward's gradients are the Triton backward's bit for bit on that spec (whose P
    codes follow the spec: ``test_kernels_intermediates``, the ``p2^6`` cases)."""
    device = require_backend("gpu")
    from dmref import tiled
    from dmref.kernels import api, fwd_ws

    from test_fwd_ws import P_CODE_AGREEMENT

    shape = ProblemShape(1, 4, 2, 777, 128)
    q, k, v, do = outlier_inputs(shape, device)
    scale = 1.0 / math.sqrt(shape.head_dim)
    spec = with_p_scale(SPECS["kernels_folded_delta_matching"], P_SCALE_LOG2)
    _, _, _, codes = fwd_ws.attention_forward(q, k, v, causal=causal, scale=scale, recipe=spec, debug=True)
    n = shape.n
    got = codes.view(shape.batch, shape.heads, n, -1)[..., :n].cpu()
    seen = torch.ones(n, n, dtype=torch.bool).tril() if causal else torch.ones(n, n, dtype=torch.bool)
    agree = {}
    for e in (P_SCALE_LOG2, 8):
        recipe = with_p_scale(spec, e).recipe
        ref = tiled.forward(q.float(), k.float(), v.float(), recipe=recipe, causal=causal, scale=scale, p_codes=True)
        agree[e] = (got == ref.p_codes.cpu())[..., seen].float().mean().item()
    assert agree[P_SCALE_LOG2] >= P_CODE_AGREEMENT and agree[8] < P_CODE_AGREEMENT, agree
    o, _, saved, _ = api.attention_forward(q, k, v, causal=causal, scale=scale, recipe=spec)
    shp = api.Shape.of(q, k, v)
    gluon = api.attention_backward(saved, o, do, shape=shp, causal=causal, scale=scale, recipe=spec, gluon=True)
    triton_ = api.attention_backward(saved, o, do, shape=shp, causal=causal, scale=scale, recipe=spec, gluon=False)
    for name, a, b in zip(("dq", "dk", "dv"), gluon[:3], triton_[:3]):
        assert torch.equal(a, b), name
