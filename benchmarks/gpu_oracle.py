"""The oracle on the GPU targets of docs/oracle.md (an H200, torch >= 2.5, under 3 minutes):

- torch SDPA in BF16 with the flash, cuDNN and math backends (exact attention at BF16 bounds;
  ``enable_gqa`` on the gqa case, which a backend without a GQA kernel skips; the masked cases
  only for math, the others take no mask);
- dmref.kernels.attention with stale delta (``kernels_naive_fp8``) and with Delta-Matching
  (``kernels_delta_matching``), each at BF16 bounds, as a claim of the recipe it runs (its own
  name: ``dmref.get_recipe("kernels_...")``, the Hopper model) and of the dmref preset whose
  quantization it shares (``naive_fp8``, ``delta_matching``); the stale kernel also as a claim of
  the matched kernel's recipe (the probe must see its stale delta from outside). Result files
  written before the kernels' recipes had names of their own call them ``kernels naive_fp8`` /
  ``kernels delta_matching`` and their recipes ``kernels_<name>_d<head dim>``;
- ``dmref.targets.cudnn_fp8`` (cuDNN's FP8 attention, head dim 128 only) at head dim 128: at BF16
  bounds, as a claim of the ``cudnn_fp8`` recipe and as a claim of ``delta_matching``; skipped
  with a message when dmref.targets or cuDNN's FP8 attention is not available.

    python benchmarks/gpu_oracle.py --out DIR [--cases quick|standard] [--skip-kernels | --only-cudnn | --only-folded
                                                                         | --only-prepass]

The reference, the baselines and the emulated recipes run on the CPU in float64 / float32; the
targets run on the GPU. Writes DIR/gpu_oracle.json (DIR/gpu_oracle_sdpa.json with --skip-kernels,
DIR/gpu_oracle_cudnn.json with --only-cudnn, DIR/gpu_oracle_folded.json with --only-folded: the
folded recipes' kernels, whose forward is the warp-specialized Gluon one, as claims of the
recipes they run, and the stale one as a claim of the matched one; DIR/gpu_oracle_prepass.json
with --only-prepass: the seven-GEMM recipes, pre-pass and the Gluon five-GEMM backward, likewise)
and prints the tables. A target that cannot
run (no backend, no Triton) is recorded as an error and the others still run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

from oracle_runs import Target, run  # this folder's module (a script's folder is first on sys.path)

# dmref.kernels: head dim 64 or 128, seqlen_q == seqlen_k, GQA, no mask
KERNEL_CASES = ["realistic", "realistic_causal", "outlier_channels", "peaked_rows", "flat_rows", "long_sequence",
                "tail_lengths", "large_values", "small_values", "gqa"]


#: torch's messages when the selected SDPA backend has no kernel for the inputs (older, newer)
_NO_KERNEL = ("No available kernel", "No viable backend")


def _sdpa(backend_name: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    from dmref import oracle

    backend = getattr(SDPBackend, backend_name)

    def fn(q, k, v, *, causal=False, scale=None):  # no mask: flash takes none; masked cases skipped
        gqa = oracle.gqa_kwargs(q, k)  # enable_gqa when k, v have fewer heads (the gqa case)
        try:
            with sdpa_kernel(backend):
                return scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, **gqa)
        except RuntimeError as e:
            # a backend without a GQA kernel cannot do the case: a skip, not a numerical failure;
            # any other error stays a failed run
            if gqa and any(m in str(e) for m in _NO_KERNEL):
                raise NotImplementedError(f"{backend_name} has no GQA kernel here: {e}") from e
            raise

    fn.__name__ = fn.__qualname__ = f"sdpa_{backend_name.lower()}"
    return fn


def _kernel(recipe: str):
    def fn(q, k, v, *, causal=False, scale=None):
        from dmref.kernels import attention

        return attention(q, k, v, causal=causal, scale=scale, recipe=recipe)

    fn.__name__ = fn.__qualname__ = recipe
    return fn


def _cudnn_fp8_targets(cases: str) -> list[Target]:
    """dmref.targets.cudnn_fp8 at head dim 128 (its only head dim), imported lazily."""
    try:
        from dmref.targets import cudnn_fp8
    except Exception as e:  # noqa: BLE001 - the target is optional: say why and go on
        print(f"skipping dmref.targets.cudnn_fp8: {type(e).__name__}: {e}", file=sys.stderr)
        return []
    from dmref import oracle

    fcases = oracle.make_cases(cases, dtype=torch.bfloat16, head_dim=128)
    return [
        Target("cudnn_fp8", cudnn_fp8, cases=fcases, device="cuda",
               note="exact attention at BF16 bounds (an FP8 kernel is expected to fail these)"),
        Target("cudnn_fp8 claims cudnn_fp8", cudnn_fp8, recipe="cudnn_fp8", cases=fcases, device="cuda",
               note="held to the dmref preset it names"),
        Target("cudnn_fp8 claims delta_matching", cudnn_fp8, recipe="delta_matching", cases=fcases, device="cuda",
               note="held to Delta-Matching: the probe must see cuDNN's stale delta from outside"),
    ]


def _folded_targets(cases: str) -> list[Target]:
    """The folded recipes' kernels (``kernels_folded_*``) held to the recipes they run."""
    from dmref import oracle
    from dmref.kernels.config import SPECS

    kcases = oracle.make_cases(cases, dtype=torch.bfloat16, names=KERNEL_CASES)
    out = [Target(f"{r} claims its recipe", _kernel(r), recipe=SPECS[r].recipe, cases=kcases, device="cuda",
                  note=f"held to the recipe it runs: {r}")
           for r in ("kernels_folded_naive_fp8", "kernels_folded_delta_matching")]
    out.append(Target("kernels_folded_naive_fp8 claims kernels_folded_delta_matching",
                      _kernel("kernels_folded_naive_fp8"), recipe=SPECS["kernels_folded_delta_matching"].recipe,
                      cases=kcases, device="cuda", note="the stale kernel held to the matched kernel's recipe"))
    return out


def _prepass_targets(cases: str) -> list[Target]:
    """The seven-GEMM recipes (``kernels_delta_prepass``, its folded form and the folded form with
    dS for dQ scaled from the pre-pass's bound, ``kernels_folded_delta_prepass_dsq_row``: a
    pre-pass's matched D, then the Gluon five-GEMM backward) held to the recipes they run, and the
    stale kernel held to the folded one's (its rows must fail ``rowsum``)."""
    from dmref import oracle
    from dmref.kernels.config import SPECS

    kcases = oracle.make_cases(cases, dtype=torch.bfloat16, names=KERNEL_CASES)
    out = [Target(f"{r} claims its recipe", _kernel(r), recipe=SPECS[r].recipe, cases=kcases, device="cuda",
                  note=f"held to the recipe it runs: {r}")
           for r in ("kernels_delta_prepass", "kernels_folded_delta_prepass", "kernels_folded_delta_prepass_dsq_row")]
    out.append(Target("kernels_folded_naive_fp8 claims kernels_folded_delta_prepass", _kernel("kernels_folded_naive_fp8"),
                      recipe=SPECS["kernels_folded_delta_prepass"].recipe, cases=kcases, device="cuda",
                      note="the stale kernel held to the seven-GEMM recipe"))
    return out


def targets(cases: str, skip_kernels: bool, only_cudnn: bool = False, only_folded: bool = False,
            only_prepass: bool = False) -> list[Target]:
    from dmref import oracle

    if only_prepass:
        return _prepass_targets(cases)
    if only_cudnn:
        return _cudnn_fp8_targets(cases)
    if only_folded:
        return _folded_targets(cases)
    out = [
        Target("sdpa flash bf16", _sdpa("FLASH_ATTENTION"), cases=cases, device="cuda"),
        Target("sdpa cudnn bf16", _sdpa("CUDNN_ATTENTION"), cases=cases, device="cuda"),
        Target("sdpa math bf16 (cuda)", oracle.sdpa_math, cases=cases, device="cuda"),
    ]
    if not skip_kernels:
        kcases = oracle.make_cases(cases, dtype=torch.bfloat16, names=KERNEL_CASES)
        from dmref.kernels.config import SPECS

        for r, preset in (("kernels_naive_fp8", "naive_fp8"), ("kernels_delta_matching", "delta_matching")):
            out.append(Target(r, _kernel(r), cases=kcases, device="cuda",
                              note="exact attention at BF16 bounds (an FP8 kernel is expected to fail these)"))
            out.append(Target(f"{r} claims its recipe", _kernel(r), recipe=SPECS[r].recipe,
                              cases=kcases, device="cuda", note=f"held to the recipe it runs: {r}"))
            out.append(Target(f"{r} claims preset {preset}", _kernel(r), recipe=preset, cases=kcases, device="cuda",
                              note="held to the dmref preset of its quantization (dS blocks 1x64 vs the preset's 1x128)"))
        out.append(Target("kernels_naive_fp8 claims kernels_delta_matching", _kernel("kernels_naive_fp8"),
                          recipe=SPECS["kernels_delta_matching"].recipe, cases=kcases, device="cuda",
                          note="the stale kernel held to the matched kernel's recipe"))
    return out + _cudnn_fp8_targets(cases)


def _run_target(args, i: int, t: Target, name: str, case_names: list[str] | None) -> dict:
    """Target i (only ``case_names`` of its cases, when given) in a process of its own."""
    with tempfile.TemporaryDirectory() as tmp:
        argv_i = [sys.executable, os.path.abspath(__file__), "--out", tmp, "--cases", args.cases,
                  "--seed", str(args.seed), "--target-index", str(i)]
        argv_i += (["--skip-kernels"] * args.skip_kernels + ["--only-cudnn"] * args.only_cudnn
                   + ["--only-folded"] * args.only_folded + ["--only-prepass"] * args.only_prepass)
        argv_i += ["--case-names", ",".join(case_names)] if case_names else []
        proc = subprocess.run(argv_i)
        try:
            with open(os.path.join(tmp, name)) as f:
                return json.load(f)
        except OSError:
            return {"meta": None, "reports": [],
                    "summary": [{"target": t.label, "error": f"its process ended with status {proc.returncode}"}]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for gpu_oracle.json")
    ap.add_argument("--cases", default="standard", choices=("quick", "standard"))
    ap.add_argument("--skip-kernels", action="store_true", help="only the SDPA backends")
    ap.add_argument("--only-cudnn", action="store_true", help="only dmref.targets.cudnn_fp8")
    ap.add_argument("--only-folded", action="store_true", help="only the folded recipes' kernels")
    ap.add_argument("--only-prepass", action="store_true",
                    help="only the seven-GEMM recipes (pre-pass + the five-GEMM backward)")
    ap.add_argument("--target-index", type=int, help=argparse.SUPPRESS)  # one target, in this process
    ap.add_argument("--case-names", help=argparse.SUPPRESS)  # only these of its cases (comma-separated)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_oracle.py needs a CUDA device", file=sys.stderr)
        return 2
    torch.set_num_threads(max(1, min(16, os.cpu_count() or 1)))
    os.makedirs(args.out, exist_ok=True)
    name = ("gpu_oracle_cudnn.json" if args.only_cudnn else "gpu_oracle_folded.json" if args.only_folded
            else "gpu_oracle_prepass.json" if args.only_prepass
            else "gpu_oracle_sdpa.json" if args.skip_kernels else "gpu_oracle.json")
    all_targets = targets(args.cases, args.skip_kernels, args.only_cudnn, args.only_folded, args.only_prepass)
    title = f"dmref oracle, {torch.cuda.get_device_name()} ({args.cases})"
    if args.target_index is not None:
        t = all_targets[args.target_index]
        if args.case_names:
            keep = args.case_names.split(",")
            t.cases = [c for c in t.cases if c.name in keep] if isinstance(t.cases, list) else keep
            t.label += " (the cases after a device fault, in a new process)"
        run([t], os.path.join(args.out, name), title=title, seed=args.seed)
        return 0
    # Each target runs in a process of its own: a device-side fault (an illegal or misaligned
    # access) leaves the CUDA context unusable, so the oracle stops that target's remaining cases
    # ("not run: ..."); they run in a new process, reported as a row of their own.
    merged = {"meta": None, "summary": [], "reports": []}
    for i, t in enumerate(all_targets):
        case_names = None
        for _ in range(8):  # at most as many device faults per target
            part = _run_target(args, i, t, name, case_names)
            merged["meta"] = merged["meta"] or part["meta"]
            merged["summary"] += part["summary"]
            merged["reports"] += part["reports"]
            case_names = list(dict.fromkeys(c["case"] for r in part["reports"] for c in r["checks"]
                                            if c["passed"] is None and c["detail"].startswith("not run: case")))
            if not case_names:
                break
    path = os.path.join(args.out, name)
    with open(path, "w") as f:
        json.dump(merged, f, indent=1)
    print(f"{title}: written {path}")
    for r in merged["summary"]:
        verdict = r.get("error") or ("pass" if r["passed"] else "FAIL " + ", ".join(r["failed_checks"]))
        checks = "" if "error" in r else f"{r['checks_passed']}/{r['checks_run']}"
        print(f"  {r['target']:55s} {checks:>9s}  {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
