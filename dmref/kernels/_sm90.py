"""Compiling a kernel launch for Hopper (sm_90a) without a GPU, and reading its resource usage
from ptxas and the SASS: the machinery under :mod:`dmref.kernels.compile_check`, which the kernel
modules' own compile helpers call too (this module imports no kernel, so no import circle)."""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

from ._runtime import Launch, register_cap, triton_type

_INT_ARGS = ("H", "HKV", "GROUP", "N", "NPAD")


@dataclass
class Usage:
    kernel: str
    registers: int
    spill_bytes: int  #: local-memory stores + loads per thread reported by ptxas
    shared_bytes: int
    variant: str


def _pointer_type(name: str, do_format: str) -> str:
    if name in ("O", "DQ", "DK", "DV", "X", "Y"):
        return "*bf16"
    if name.startswith("SEM"):
        return "*i32"  # the fused backward's counters (bwd_fused)
    if name.startswith(("DO8", "DOT8")):
        return "*" + triton_type(do_format)
    if name.endswith("8"):
        return "*" + triton_type("float8_e4m3fn")
    return "*fp32"  # scales, LSE2, deltas, row sums, debug dumps


def compile_sm90(kernel, constexprs: dict, *, num_warps: int, num_stages: int,
                 do_format: str = "float8_e4m3fn", descriptors: dict | None = None,
                 maxnreg: int | None = None):
    """``triton.compile`` one variant of a jitted kernel for sm_90 (no GPU needed).
    ``descriptors``: argument name -> block shape of the arguments passed as TMA tensor
    descriptors (FP8, of the format the pointer would have)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = kernel
    if not hasattr(fn, "arg_names") or type(fn).__name__ == "InterpretedFunction":
        raise RuntimeError("kernels are interpreted (TRITON_INTERPRET=1): nothing to compile")
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif descriptors and name in descriptors:
            elem = _pointer_type(name, do_format)[1:]
            sig[name] = f"tensordesc<{elem}[" + ", ".join(str(b) for b in descriptors[name]) + "]>"
        elif name[0].isupper() and name not in _INT_ARGS:
            sig[name] = _pointer_type(name, do_format)
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("qk_scale", "sm_scale"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name in ("N", "NPAD") or name.startswith("stride"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, sig, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages, **register_cap(maxnreg)))


def ptxas_report(compiled) -> str:
    """ptxas's verbose report (``-v``, sm_90a) on a compiled kernel's PTX: its resource lines
    and warnings such as C7514 (wgmma serialized)."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90).path
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        return subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", ptx, "-o", os.path.join(tmp, "k.o")],
                              capture_output=True, text=True, check=True).stderr


def resource_usage(compiled, report: str | None = None) -> tuple[int, int, int]:
    """(registers, spill bytes, shared bytes) of a compiled kernel, from ptxas's own report
    (``report``: :func:`ptxas_report`'s, when already made)."""
    out = ptxas_report(compiled) if report is None else report
    regs = int(re.search(r"Used (\d+) registers", out).group(1))
    spills = sum(int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", out))
    return regs, spills, int(compiled.metadata.shared)


def added_wgmma_waits(compiled) -> int:
    """How many wgmma waits ptxas added to the kernel's own: ``WARPGROUP.DEPBAR`` in the sm_90a
    SASS less ``wgmma.wait_group`` in the PTX. Positive when ptxas serialized wgmmas without
    saying so (no C7514): a wait after every instruction of a chain."""
    sass = compiled.asm["sass"]
    return len(re.findall(r"WARPGROUP\.DEPBAR", sass)) - len(re.findall(r"wgmma\.wait_group", compiled.asm["ptx"]))


def sass_loop(compiled) -> collections.Counter:
    """Opcodes of the innermost loop of ``compiled``'s SASS that holds a wgmma (``GMMA``) and an
    exp2 (``MUFU``): the span from a label to a conditional branch back to it (the unconditional
    branches back are the mbarrier waits' retries, placed after the kernel's end)."""
    text = compiled.asm["sass"].splitlines()
    labels = {m.group(1): i for i, line in enumerate(text) if (m := re.match(r"(LBB\d+):", line.strip()))}
    spans = []
    for i, line in enumerate(text):
        m = re.search(r"@!?P\d+ BRA (LBB\d+);", line)
        if m and labels.get(m.group(1), i) < i:
            body = text[labels[m.group(1)]:i + 1]
            if any("GMMA" in b for b in body) and any("MUFU" in b for b in body):
                spans.append(body)
    if not spans:
        raise ValueError("no loop with a wgmma and an exp2 in the SASS")
    ops = collections.Counter()
    for line in min(spans, key=len):
        m = re.match(r"\S+\t(?:@!?U?P\w+ )?([A-Z][A-Z0-9_]*)", line)
        if m:
            ops[m.group(1)] += 1
    return ops


def warp_specialized_budget(compiled) -> dict:
    """What the warp-specialized Gluon kernels' budget is checked on (one ptxas run): registers
    at launch, spill bytes, shared bytes, the ``setmaxnreg`` values, threads per CTA, whether
    ptxas serialized the wgmmas (C7514, or waits it added: :func:`added_wgmma_waits`) and the
    wgmma shapes issued."""
    ptx = compiled.asm["ptx"]
    report = ptxas_report(compiled)
    regs, spills, shared = resource_usage(compiled, report)
    return dict(regs=regs, spills=spills, shared=shared,
                serialized="C7514" in report or added_wgmma_waits(compiled) > 0,
                setmaxnreg=sorted({int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}),
                threads=int(re.search(r"\.reqntid (\d+)", ptx).group(1)),
                wgmma=sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\w+)\.", ptx))))


def compile_launch(run: Launch, *, do_format: str = "float8_e4m3fn", n_multiple_of_16: bool = True):
    """Compile ``run.kernel`` for sm_90a as ``run`` launches it (no GPU needed), Triton and Gluon
    kernels alike: a Triton kernel through :func:`compile_sm90` (its argument types from their
    names, dO's of ``do_format``), a Gluon one with the types its launch gives
    (``run.signature``; N divisible by 16 with ``n_multiple_of_16``, as a launch at such an N
    specializes it)."""
    if run.signature is None:
        return compile_sm90(run.kernel, run.constexprs, num_warps=run.num_warps, num_stages=run.num_stages,
                            do_format=do_format, descriptors=run.descriptors or None, maxnreg=run.maxnreg)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig, attrs = run.signature(run, n_multiple_of_16, do_format)
    sig = {**sig, **{name: "constexpr" for name in run.constexprs}}
    names = list(run.kernel.arg_names)
    src = GluonASTSource(run.kernel, {k: sig[k] for k in names}, constexprs=run.constexprs,
                         attrs={(names.index(k),): v for k, v in attrs.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=run.options())
