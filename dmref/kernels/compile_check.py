"""Compile the kernels for Hopper (sm_90a) without a GPU, and read their resource usage.

Triton's front end, its MLIR passes and the ptxas it ships run on any machine, so CI can catch
what the interpreter cannot (Triton language rules, layouts, wgmma lowering) and a developer can
read registers, spills and shared memory of a tiling before spending GPU time on it.

    python -m dmref.kernels.compile_check            # kernels_delta_matching, both head dims
    python -m dmref.kernels.bwd_prepass              # the pre-pass of kernels_delta_prepass

Must run with ``TRITON_INTERPRET`` unset (under the interpreter kernels are not compiled).
"""

from __future__ import annotations

from ._sm90 import (Usage, added_wgmma_waits, compile_launch, compile_sm90, ptxas_report, resource_usage,
                    sass_loop, warp_specialized_budget)
from .config import KernelSpec, get_spec

__all__ = ["Usage", "added_wgmma_waits", "check", "compile_launch", "compile_sm90", "jitted_kernels",
           "ptxas_report", "recipe_variants", "resource_usage", "sass_loop", "warp_specialized_budget"]


def jitted_kernels() -> dict:
    """The jitted kernels a training step can launch, by name (``quantize``, ``fwd``, ``dq``, ``dkdv``,
    the Gluon backward's ``dq_ws``, ``dkdv_ws``, and the five-GEMM backward's ``bwd_fused`` and
    ``prepass``): what a benchmark reads the compiled variants' registers, spills and shared memory
    from after it ran them."""
    from . import bwd, bwd_fused, bwd_prepass, bwd_ws, fwd, quantize

    return {"fwd": fwd._fwd_kernel, "dq": bwd._bwd_dq_kernel, "dkdv": bwd._bwd_dkdv_kernel,
            "quantize": quantize._quantize_kernel, "dq_ws": bwd_ws._bwd_dq_ws_kernel,
            "dkdv_ws": bwd_ws._bwd_dkdv_ws_kernel, "bwd_fused": bwd_fused._bwd_fused_kernel,
            "prepass": bwd_prepass._bwd_prepass_kernel}


def recipe_variants(spec: KernelSpec, head_dim: int, causal: bool, group: int = 1, gluon: bool = True):
    """(name, launch) of the kernels a training step of ``spec`` runs, from the launchers' own
    descriptions (``quantize.launch``, ``fwd.launch`` or ``fwd_ws.launch`` for a folded spec,
    ``bwd.launch``, and with ``gluon`` ``bwd_ws.launch`` as ``dq_ws`` and ``dkdv_ws`` where the Gluon
    backward runs the spec; for a spec with D from a pre-pass, ``bwd_prepass.launch`` as ``prepass``
    and ``bwd_fused.launch`` as ``bwd_fused`` instead of the dq and dkdv kernels)."""
    from . import bwd, bwd_fused, bwd_prepass, bwd_ws, fwd, fwd_ws, quantize

    # the backward's preprocess: dO's copies (and the stale delta), with Q's where the
    # warp-specialized forward leaves them to it (the folded specs)
    yield "quantize", quantize.launch(head_dim, spec.recipe.do_dp.fmt.name, rows=True, cols=True,
                                      with_delta=not spec.prepass,
                                      second_fmt=spec.recipe.q.fmt.name if spec.folded else None)
    yield "fwd", (fwd_ws if spec.folded else fwd).launch(spec, head_dim=head_dim, causal=causal)
    if spec.prepass:
        yield "prepass", bwd_prepass.launch(spec, head_dim=head_dim, causal=causal)
        yield "bwd_fused", bwd_fused.launch(spec, head_dim=head_dim, causal=causal, group=group)
        return
    yield "dq", bwd.launch(spec, head_dim=head_dim, causal=causal, kernel="dq")
    yield "dkdv", bwd.launch(spec, head_dim=head_dim, causal=causal, kernel="dkdv", group=group)
    for kernel in ("dq", "dkdv") if gluon else ():
        try:
            yield f"{kernel}_ws", bwd_ws.launch(spec, head_dim=head_dim, causal=causal, kernel=kernel, group=group)
        except ValueError:  # a backward tiling the Gluon kernels do not run: the Triton ones run it
            continue


def check(recipe: str | KernelSpec = "kernels_delta_matching", head_dims=(64, 128), causal=(False, True),
          only: tuple[str, ...] | None = None) -> list[Usage]:
    spec = get_spec(recipe)
    out = []
    for d in head_dims:
        for c in causal:
            for name, run in recipe_variants(spec, d, c):
                if only is not None and name not in only:
                    continue
                ck = compile_launch(run, do_format=spec.recipe.do_dp.fmt.name)
                regs, spills, shared = resource_usage(ck)
                cap = "" if run.maxnreg is None else f" maxnreg={run.maxnreg}"
                stages = run.constexprs.get("STAGES") if run.num_stages is None else run.num_stages
                out.append(Usage(name, regs, spills, shared,
                                 f"{spec.name} d={d} causal={c} warps={run.num_warps} stages={stages}{cap}"))
    return out


if __name__ == "__main__":  # pragma: no cover
    # both recipes: they differ in the dq kernel only (kbar and the matched delta)
    usage = check("kernels_delta_matching") + check("kernels_naive_fp8", only=("dq",))
    for u in usage:
        print(f"{u.kernel:9s} regs {u.registers:4d} spill {u.spill_bytes:6d} B  smem {u.shared_bytes:7d} B  {u.variant}")
