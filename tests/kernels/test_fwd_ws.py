"""The warp-specialized Gluon forward (``dmref.kernels.fwd_ws``) and its folded quantization.

- its K/V quantization (a Triton kernel: interpreter and GPU) gives the codes and scales of
  ``dmref.emulation.quantize_blocked`` with one block per head (K) and per head and channel (V);
- it compiles for sm_90a on a machine without a GPU, with the register budget its docstring
  states, no spills and its overlapped wgmmas not serialized by ptxas (Gluon kernels do not run
  in Triton's interpreter);
- on the H200 its O and LSE equal the emulated reference ``dmref.tiled`` on its recipe
  (``config.SPECS["kernels_folded_naive_fp8"]``), with the Hopper wgmma model, up to the bounds of the other kernels'
  differential tests;
- its two-consumer form (``consumers=2``: two consumer warp groups a CTA sharing the K/V ring)
  compiles within one CTA an SM's register budget without spills, and on a GPU gives the
  one-consumer kernel's O and LSE bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch

from kernel_bounds import code_flip_rel_bound, lse2_tolerance, rel_err
from kernel_inputs import ProblemShape, outlier_inputs, require_backend
from warp_specialized_budget import compile_and_check_budget


def _wide_inputs(shape: ProblemShape, device: str):
    """Outlier inputs with per-head magnitudes spread over 2**-6 .. 2**5 (K, Q) and per-channel
    magnitudes of V over 2**-9 .. 2**9, plus one all-zero V channel (a zero-amax block)."""
    q, k, v, _ = outlier_inputs(shape, "cpu")
    g = torch.Generator().manual_seed(1)
    q = q.float() * torch.exp2(torch.randint(-6, 6, (1, shape.heads, 1, 1), generator=g).float())
    k = k.float() * torch.exp2(torch.randint(-6, 6, (1, shape.kv_heads, 1, 1), generator=g).float())
    v = v.float() * torch.exp2(torch.randint(-9, 10, (1, 1, 1, shape.head_dim), generator=g).float())
    v[..., 3] = 0
    return [t.to(torch.bfloat16).to(device) for t in (q, k, v)]


@pytest.mark.parametrize("backend", ["interpreter", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_folded_quantization_equals_the_emulation(backend):
    device = require_backend(backend)  # before importing the kernels: it skips without triton
    from dmref.emulation import Block, quantize_blocked
    from dmref.kernels.quantize import quantize_kv_folded

    shape = ProblemShape(2, 3, 3, 203, 64)
    _, k, v = _wide_inputs(shape, device)
    got = quantize_kv_folded(k, v)
    bh = shape.batch * shape.kv_heads
    k_codes, k_scales = quantize_blocked(k.cpu().float().reshape(bh, shape.n, -1), "float8_e4m3fn",
                                         block=Block.matrix(), scale_rule="pow2_down")
    v_codes, v_scales = quantize_blocked(v.cpu().float().reshape(bh, shape.n, -1), "float8_e4m3fn",
                                         block=Block.cols(), scale_rule="pow2_down")
    vt = got.vt8.cpu().view(torch.uint8)
    assert torch.equal(got.k8.cpu().view(torch.uint8), torch.as_tensor(k_codes).to(torch.uint8))
    assert torch.equal(vt[..., :shape.n].transpose(1, 2), torch.as_tensor(v_codes).to(torch.uint8))
    assert int(vt[..., shape.n:].max()) == 0  # padding tokens: code 0
    # dequantization factors: the emulation's scales (x ~= scale * decode(code))
    assert torch.equal(got.k_scale.cpu(), torch.as_tensor(k_scales).reshape(bh).float())
    assert torch.equal(got.v_scale.cpu(), torch.as_tensor(v_scales).reshape(bh, -1).float())
    assert got.k_cols is None and got.v_rows is None


@pytest.mark.parametrize("backend", ["interpreter", pytest.param("gpu", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("n", [203, 256])
def test_folded_quantization_for_backward_writes_quantizes_copies(backend, n):
    """``for_backward``: the folded quantization's second launch also writes K's transposed copy
    and V's row copy, the codes and factors ``quantize`` writes for them bit for bit (padding
    included), and the folded copies are those without it; on tails (203) and whole blocks (256),
    GQA's key/value heads, wide exponent ranges and zero channels (``_wide_inputs``)."""
    device = require_backend(backend)
    from dmref.kernels.quantize import quantize, quantize_kv_folded

    _, k, v = _wide_inputs(ProblemShape(2, 3, 3, n, 64), device)
    plain = quantize_kv_folded(k, v)
    got = quantize_kv_folded(k, v, for_backward=True)
    k_cols, _ = quantize(k, "float8_e4m3fn", rows=False, cols=True)
    v_rows, _ = quantize(v, "float8_e4m3fn", rows=True, cols=False)

    def bits(t):
        return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t.contiguous().view(torch.int32)

    for a, b in ((got.k_cols.cols, k_cols.cols), (got.k_cols.col_scale, k_cols.col_scale),
                 (got.v_rows.rows, v_rows.rows), (got.v_rows.row_scale, v_rows.row_scale),
                 (got.k8, plain.k8), (got.k_scale, plain.k_scale), (got.vt8, plain.vt8), (got.v_scale, plain.v_scale)):
        assert a.shape == b.shape and torch.equal(bits(a), bits(b))


#: The register budget of fwd_ws's docstring: producer 24, consumer 232, 128 at launch, for the
#: schedule the folded specs run (their tiling's ``overlap`` with the folded recipes' promoted PV: QK^T
#: of the next tile in flight during the softmax; at D = 128 PV's tile in the dead S tile's registers),
#: for the serial schedule at D = 128, and for the chained one. ptxas reports C7514 ("wgmma.mma_async
#: instructions are serialized") when a non-wgmma instruction reads an accumulator in flight,
#: which would undo the overlap, and can also serialize them without saying so (a wait after every
#: wgmma, ``compile_check.added_wgmma_waits``); the budget check requires the absence of both.
_SCRIPT = """
import json
from dmref.kernels import fwd_ws
from dmref.kernels.compile_check import warp_specialized_budget
configs = [(d, causal, {}) for d in (64, 128) for causal in (False, True)] + [
    (128, False, dict(overlap=False)), (128, True, dict(overlap=False)), (128, False, dict(chain=True))]
print(json.dumps([dict(d=d, causal=causal, **kw, **warp_specialized_budget(
                      fwd_ws.compile_sm90(head_dim=d, causal=causal, **kw))) for d, causal, kw in configs]))
"""


@pytest.mark.slow
def test_fwd_ws_compiles_for_sm90_with_its_register_budget_and_overlap():
    from dmref.kernels import fwd_ws
    from dmref.kernels.config import SPECS

    # the configurations ``{}`` below compile what the folded specs launch: promoted PV, the
    # overlapped schedule, two stages
    for name in ("kernels_folded_delta_matching", "kernels_folded_naive_fp8"):
        assert not SPECS[name].recipe.pv_chain
        for d in (64, 128):
            consts = fwd_ws.launch(name, head_dim=d, causal=False).constexprs
            assert (consts["CHAIN"], consts["OVERLAP"], consts["STAGES"]) == (False, 1, 2), (name, d, consts)
    compile_and_check_budget(_SCRIPT, 7)


#: The two-consumer kernel (``FwdTiles(consumers=2)``, 128 queries a CTA on two consumer warp groups
#: sharing the ring) in every schedule at both head dims, causal and not, and chained: the budget of
#: one CTA an SM (168 registers at launch, 240 for each consumer, 24 for the producer), no spills,
#: no serialized wgmma.
_SCRIPT_TWO_CONSUMERS = """
import json
from dmref.kernels import fwd_ws
from dmref.kernels.compile_check import warp_specialized_budget
configs = [(d, causal, dict(overlap=overlap)) for d in (64, 128) for causal in (False, True) for overlap in (0, 1)]
configs += [(128, True, dict(chain=True))]
print(json.dumps([dict(d=d, causal=causal, **kw, **warp_specialized_budget(
                      fwd_ws.compile_sm90(head_dim=d, causal=causal, consumers=2, **kw)))
                  for d, causal, kw in configs]))
"""


@pytest.mark.slow
def test_two_consumer_fwd_ws_compiles_for_sm90_with_its_register_budget():
    compile_and_check_budget(_SCRIPT_TWO_CONSUMERS, 9, consumers=2)


_GPU_CASES = [
    (ProblemShape(2, 4, 2, 1000, 128), False),
    (ProblemShape(2, 4, 2, 1000, 128), True),
    (ProblemShape(1, 4, 4, 777, 64), True),
    (ProblemShape(1, 4, 1, 777, 64), False),
    (ProblemShape(1, 2, 1, 203, 128), True),
    (ProblemShape(1, 2, 2, 64, 64), False),
]
_CASE_IDS = [f"{s.batch}x{s.heads}x{s.kv_heads}x{s.n}x{s.head_dim}{'-causal' if c else ''}" for s, c in _GPU_CASES]


def _assert_within_the_reference(o, lse2, ref, n: int) -> float:
    """O within one P code flip's relative bound of ``ref`` (``tiled.forward``'s result: one FP8
    operand, P, that each side quantizes from float32 it computed itself) and LSE2 within
    ``lse2_tolerance`` where the reference's is finite; returns O's relative error."""
    diff = rel_err(o.float(), ref.out)
    assert diff <= code_flip_rel_bound(1), f"O: kernel vs reference {diff:.3e}"
    want = ref.stats.lse2.double()
    finite = torch.isfinite(want)
    got = lse2.view_as(want).double()
    assert (got - want)[finite].abs().max().item() <= lse2_tolerance(want, n)
    return diff


def _p_code_agreement(codes, ref, shape: ProblemShape, causal: bool) -> tuple[float, int]:
    """The kernel's debug P codes against ``ref.p_codes`` (``tiled.forward(..., p_codes=True)``):
    code 0 wherever a key is masked, and (the share of equal codes, how many were compared) on
    every key a query sees."""
    n = shape.n
    got = codes.view(shape.batch, shape.heads, n, -1)[..., :n].cpu()
    seen = torch.ones(n, n, dtype=torch.bool).tril() if causal else torch.ones(n, n, dtype=torch.bool)
    assert bool((got[..., ~seen] == 0).all()), "codes where a key is masked"
    agree = (got == ref.p_codes.cpu())[..., seen].float().mean().item()
    return agree, int(seen.sum()) * shape.batch * shape.heads


@pytest.mark.gpu
@pytest.mark.parametrize("shape,causal", _GPU_CASES, ids=_CASE_IDS)
def test_fwd_ws_equals_the_reference_on_its_recipe(shape, causal):
    device = require_backend("gpu")
    from dmref import tiled
    from dmref.kernels import fwd_ws
    from dmref.kernels.config import SPECS

    q, k, v = _wide_inputs(shape, device)
    scale = 1.0 / math.sqrt(shape.head_dim)
    o, lse2, _ = fwd_ws.attention_forward(q, k, v, causal=causal, scale=scale)
    ref = tiled.forward(q.float(), k.float(), v.float(), recipe=SPECS["kernels_folded_naive_fp8"].recipe, causal=causal, scale=scale)
    _assert_within_the_reference(o, lse2, ref, shape.n)


_SCHEDULES = [(True, True), (True, False), (False, False), (False, True)]
_SCHEDULE_IDS = ["chained-overlapped", "chained-serial", "promoted-serial", "promoted-overlapped"]


@pytest.mark.gpu
@pytest.mark.parametrize("chain,overlap", _SCHEDULES, ids=_SCHEDULE_IDS)
@pytest.mark.parametrize("shape,causal", _GPU_CASES, ids=_CASE_IDS)
def test_every_schedule_equals_the_reference_of_its_pv_accumulation(shape, causal, chain, overlap):
    """Each schedule of the kernel (``chain``: PV in one wgmma chain over all keys, a recipe with
    ``pv_chain``, or promoted once per tile, the folded recipes'; ``overlap``: QK^T of the next tile during
    the softmax) against the folded recipe with ``pv_chain = chain``, within the bounds of the
    shipped one. The two recipes differ by less than that bound (7.6e-4 against 7.9e-3 on the
    777-token case), so each schedule must also be closer to its own recipe than to the other."""
    from dataclasses import replace

    device = require_backend("gpu")
    from dmref import tiled
    from dmref.kernels import fwd_ws
    from dmref.kernels.config import SPECS

    q, k, v = _wide_inputs(shape, device)
    scale = 1.0 / math.sqrt(shape.head_dim)
    folded = SPECS["kernels_folded_naive_fp8"].recipe
    refs = {c: tiled.forward(q.float(), k.float(), v.float(), recipe=replace(folded, pv_chain=c), causal=causal,
                             scale=scale) for c in (False, True)}
    o, lse2, _ = fwd_ws.attention_forward(q, k, v, causal=causal, scale=scale, chain=chain, overlap=overlap)
    diff = _assert_within_the_reference(o, lse2, refs[chain], shape.n)
    if not torch.equal(refs[True].out, refs[False].out):  # one key tile: the two recipes agree
        assert diff < rel_err(o.float(), refs[not chain].out), "closer to the other recipe"


@pytest.mark.gpu
@pytest.mark.parametrize("shape,causal", _GPU_CASES, ids=_CASE_IDS)
def test_overlap_and_host_descriptors_give_the_serial_schedule_bits(shape, causal):
    """The overlapped schedule (QK^T of tile i + 1 in flight during the softmax of tile i) runs
    the serial schedule's operations on the same values, and device-side TMA descriptors (written
    by every CTA) load the tiles the host-side ones (built once a launch, the default) do, and so does a
    ring of three stages: O and LSE are the serial schedule's bits with the same PV accumulation,
    chained and promoted (the shipped schedule), on the recipes' 128-key tiles. The cases cover one key tile
    (64 tokens), two (203), and odd and even counts of middle tiles (777, 1000)."""
    device = require_backend("gpu")
    from dmref.kernels import fwd_ws

    q, k, v = _wide_inputs(shape, device)
    scale = 1.0 / math.sqrt(shape.head_dim)
    for chain in (True, False):
        o1, lse1, _ = fwd_ws.attention_forward(q, k, v, causal=causal, scale=scale, chain=chain, overlap=False)
        for tiles in (dict(overlap=True), dict(overlap=False, host_descriptors=False),
                      dict(overlap=True, host_descriptors=False), dict(overlap=True, stages=3)):
            o2, lse2, _ = fwd_ws.attention_forward(q, k, v, causal=causal, scale=scale, chain=chain, **tiles)
            assert torch.equal(o2, o1) and torch.equal(lse2, lse1), (chain, tiles)


#: The cases of the bit-for-bit test of two consumers: the last 128-query CTA has rows for both
#: consumers (1000: 104 rows, 203: 75, 65: 64 and 1), or for the first alone (777: 9, 64: 64, 129: 1);
#: GQA among them, both head dims, causal and not.
_TWO_CONSUMER_CASES = _GPU_CASES + [
    (ProblemShape(1, 2, 1, 65, 128), True),
    (ProblemShape(1, 2, 1, 65, 64), False),
    (ProblemShape(1, 2, 2, 129, 64), True),
    (ProblemShape(2, 4, 2, 1000, 64), True),
]
_TWO_CONSUMER_IDS = [f"{s.batch}x{s.heads}x{s.kv_heads}x{s.n}x{s.head_dim}{'-causal' if c else ''}"
                     for s, c in _TWO_CONSUMER_CASES]


@pytest.mark.gpu
@pytest.mark.parametrize("shape,causal", _TWO_CONSUMER_CASES, ids=_TWO_CONSUMER_IDS)
def test_two_consumers_give_the_one_consumer_bits(shape, causal):
    """Two consumer warp groups a CTA sharing the ring (``consumers=2``: 128 queries a CTA) run,
    for every query row, the operations of the one-consumer kernel on the same row of Q and the
    same key tiles (a row's result depends on nothing else), so O and LSE are its bits in every
    schedule, chained and promoted, with device-side descriptors and a ring of three stages, and
    the debug build's P codes are its codes. Where the second consumer's rows all lie past N (777,
    64, 129) it still releases every stage, or the launch would not return."""
    device = require_backend("gpu")
    from dmref.kernels import fwd_ws

    q, k, v = _wide_inputs(shape, device)
    scale = 1.0 / math.sqrt(shape.head_dim)
    runs = [dict(chain=chain, overlap=overlap) for chain, overlap in _SCHEDULES]
    runs += [dict(host_descriptors=False), dict(stages=3), dict(debug=True)]
    for kw in runs:
        o1, lse1, _, *codes1 = fwd_ws.attention_forward(q, k, v, causal=causal, scale=scale, **kw)
        o2, lse2, _, *codes2 = fwd_ws.attention_forward(q, k, v, causal=causal, scale=scale, consumers=2, **kw)
        assert torch.equal(o2, o1) and torch.equal(lse2, lse1), kw
        assert all(torch.equal(a, b) for a, b in zip(codes2, codes1)), kw


#: The share of P codes the kernel must agree on with the reference (issue: at least 99.9%): both
#: quantize P * 2**8 from float32 each computed itself (ex2.approx and a fused argument against
#: torch's exp2 of fl(fl(S c) - m)), so a code may differ where P * 2**8 lies within a few
#: float32 ulps of a rounding boundary of E4M3.
P_CODE_AGREEMENT = 0.999


@pytest.mark.gpu
@pytest.mark.parametrize("shape,causal", _GPU_CASES, ids=_CASE_IDS)
def test_p_codes_equal_the_reference(shape, causal, record_property):
    """The kernel's P codes (``debug=True``: every tile's E4M3 codes of P * 2**8 against the
    running max) against ``dmref.tiled``'s (``p_codes=True``) on every key a query sees, and the
    debug build's O and LSE are the shipped build's."""
    device = require_backend("gpu")
    from dmref import tiled
    from dmref.kernels import fwd_ws
    from dmref.kernels.config import SPECS

    q, k, v = _wide_inputs(shape, device)
    scale = 1.0 / math.sqrt(shape.head_dim)
    o, lse2, _, codes = fwd_ws.attention_forward(q, k, v, causal=causal, scale=scale, debug=True)
    o_plain, lse2_plain, _ = fwd_ws.attention_forward(q, k, v, causal=causal, scale=scale)
    assert torch.equal(o, o_plain) and torch.equal(lse2, lse2_plain)
    ref = tiled.forward(q.float(), k.float(), v.float(), recipe=SPECS["kernels_folded_naive_fp8"].recipe, causal=causal,
                        scale=scale, p_codes=True)
    agree, compared = _p_code_agreement(codes, ref, shape, causal)
    record_property("p_code_agreement", agree)  # in the --junitxml report
    record_property("p_codes_compared", compared)
    assert agree >= P_CODE_AGREEMENT, f"P codes agree on {agree:.6f} < {P_CODE_AGREEMENT}"


def test_host_descriptors_take_the_layouts_the_kernels_allocate():
    """The host-side TMA descriptors' shared layouts come from a cache (``_gluon.shared_layout``,
    built once instead of at every launch): each equals what ``get_default_for`` builds for its
    block and element type, the layout the kernels allocate on the device side, for every block
    the forward's and the backward's descriptors use, and a descriptor made twice is the same."""
    pytest.importorskip("triton")
    from triton.experimental.gluon import language as gl

    from dmref.kernels import bwd_ws, fwd_ws
    from dmref.kernels._gluon import shared_layout, unswizzled_layout

    for block in [(128, 128), (128, 64), (64, 128), (64, 64)]:
        for dtype in (gl.float8e4nv, gl.float8e5, gl.float32):
            assert shared_layout(block, dtype) == gl.NVMMASharedLayout.get_default_for(list(block), dtype)
    assert unswizzled_layout(32) == gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    k8 = torch.zeros(2, 256, 128, dtype=torch.float8_e4m3fn)
    vt8 = torch.zeros(2, 128, 256, dtype=torch.float8_e4m3fn)
    k_desc, v_desc = fwd_ws._descriptors(k8, vt8, 128)
    assert k_desc.layout == gl.NVMMASharedLayout.get_default_for([128, 128], gl.float8e4nv)
    assert (k_desc.block_shape, v_desc.block_shape) == ([128, 128], [128, 128])
    for a, b in zip(fwd_ws._descriptors(k8, vt8, 128), (k_desc, v_desc)):
        assert (a.base.data_ptr(), a.shape, a.strides, a.block_shape, a.layout) == \
            (b.base.data_ptr(), b.shape, b.strides, b.block_shape, b.layout)
    row = bwd_ws._row_desc(k8, 64)
    assert row.layout == gl.NVMMASharedLayout.get_default_for([64, 128], gl.float8e4nv)
    assert bwd_ws._col_desc(vt8, 128, 64).layout == gl.NVMMASharedLayout.get_default_for([128, 64], gl.float8e4nv)
