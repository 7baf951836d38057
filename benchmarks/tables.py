"""The results tables of the docs, generated from ``benchmarks/results/<device>_<bench>.json``.

A generated table sits in a doc between ``<!-- table:NAME:DEVICE -->`` and ``<!-- /table -->``;
``python benchmarks/tables.py`` rewrites every such block from its file, ``--check`` rewrites
nothing and exits 1 naming each block that differs from what the file gives. Tables (NAME):

- ``bench_attention``: ``speedup_vs_cudnn`` of ``<device>_bench_attention.json``, one column per
  key present (:data:`LABELS`; a key without a label is shown by its name), and matched over stale;
- ``bench_attention_fp8``: cuDNN's TFLOP/s and ``speedup_vs_cudnn_fp8`` (ours against cuDNN FP8)
  of the same file;
- ``bench_attention_ranges``: each ratio's range over the file's shapes, per head dim, with the
  Gluon backward over the Triton one (``ours_bwd_matched_triton`` / ``ours_bwd_matched`` times);
- ``accuracy``: ``<device>_accuracy.json``, normwise errors against float64 in %.

Prose that quotes these figures sits between ``<!-- prose:DEVICE -->`` and ``<!-- /prose -->``:
every ratio in it (``1.23x``, ``1.05-1.31x``) is a cell of a generated table of that device
(:func:`unquoted_ratios`, checked by ``tests/test_doc_references.py``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ("README.md", "docs/*.md")

#: ``speedup_vs_cudnn`` key -> column label; keys not listed are shown by their name.
LABELS = {
    "fwd_kernel": "fwd kernel",
    "fwd_incl_quant": "fwd + quant",
    "default_fwd_incl_quant": "default fwd + quant",
    "default_fwd_incl_quant_graph": "default fwd + quant, CUDA graph (no host)",
    "default_fwd_given_kv": "default fwd, K/V given",
    "fwd_ws_kernel": "WS fwd kernel",
    "fwd_ws_incl_quant": "WS fwd + quant",
    "fwd_ws_kernel_host": "WS fwd kernel, host descriptors",
    "fwd_ws_incl_quant_host": "WS fwd + quant, host descriptors",
    "fwd_ws_kernel_dev": "WS fwd kernel, device descriptors",
    "fwd_ws_incl_quant_dev": "WS fwd + quant, device descriptors",
    "fwd_ws_2cons_kernel": "WS fwd kernel, two consumers",
    "fwd_ws_2cons_incl_quant": "WS fwd + quant, two consumers",
    "fwd_ws_3cons_kernel": "WS fwd kernel, three consumers (left the tree)",
    "fwd_ws_3cons_incl_quant": "WS fwd + quant, three consumers (left the tree)",
    "bwd_matched": "bwd matched",
    "bwd_stale": "bwd stale",
    "bwd_matched_triton": "bwd matched, Triton",
    "bwd_prepass_gluon_fused": "Gluon five-GEMM kernel",
    "bwd_fused_2cons": "Gluon five-GEMM kernel, two consumers",
    "bwd_fused_tma": "Gluon five-GEMM kernel, TMA dQ adds",
    "bwd_fused_t": "Gluon five-GEMM kernel, dQ^T",
    "bwd_fused_pair": "Gluon five-GEMM kernel, dQ summed on chip (dq_pair; left the tree)",
    "bwd_fused_t_prefetch": "Gluon five-GEMM kernel, dQ^T, vectors a tile ahead (prefetch; left the tree)",
    "bwd_fused_pair_t": "Gluon five-GEMM kernel, dQ^T summed on chip (dq_pair; left the tree)",
    "fwd_ws_poly2_kernel": "WS fwd kernel, 1 in 2 exp2 on the FMA pipe (left the tree)",
    "fwd_ws_poly4_kernel": "WS fwd kernel, 1 in 4 exp2 on the FMA pipe (left the tree)",
    "default_bwd": "default bwd",
    "e2e_matched": "e2e matched",
    "e2e_matched_folded": "e2e matched, WS fwd",
    "default_e2e": "default e2e",
    "bwd_fused_stale": "5-GEMM bwd stale",
    "bwd_fused_stale_det": "5-GEMM bwd stale, deterministic",
    "bwd_fused_stale_triton": "5-GEMM bwd stale, Triton",
    "bwd_prepass_gluon": "7-GEMM bwd matched (pre-pass)",
    "e2e_prepass_gluon": "e2e 7-GEMM matched",
    "e2e_prepass_gluon_folded": "e2e 7-GEMM matched, WS fwd",
    "dsq_row_bwd": "7-GEMM bwd matched, dS for dQ per query (`kernels_folded_delta_prepass_dsq_row`)",
    "dsq_row_bwd_det": "7-GEMM bwd matched, dS for dQ per query, deterministic",
    "dsq_row_e2e": "e2e 7-GEMM matched, dS for dQ per query",
    "dsq_row_bwd_fused": "Gluon five-GEMM kernel, dS for dQ per query",
    "dsq_row_bwd_fused_2cons": "Gluon five-GEMM kernel, dS for dQ per query, two consumers",
}
GLUON_OVER_TRITON = "Gluon bwd over Triton bwd (matched)"

_BLOCK = re.compile(r"(<!-- table:(\w+):(\w+) -->\n)(.*?)(<!-- /table -->)", re.DOTALL)
_PROSE = re.compile(r"<!-- prose:(\w+) -->\n(.*?)<!-- /prose -->", re.DOTALL)
_RATIO = re.compile(r"(?<![\w.])\d+\.\d+(?:-\d+\.\d+)?x(?!\w)")


def _load(device: str, bench: str):
    return json.loads((RESULTS / f"{device}_{bench}.json").read_text())


def _ratio(x: float) -> str:
    return f"{x:.2f}x"


def _range(values: list[float]) -> str:
    lo, hi = f"{min(values):.2f}", f"{max(values):.2f}"
    return f"{lo}x" if lo == hi else f"{lo}-{hi}x"


def _percent(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 1 else f"{x:.2f}"


def _markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def _keys(cases: list[dict], field: str) -> list[str]:
    present = {k for c in cases for k in c.get(field, {})}
    ordered = [k for k in LABELS if k in present]
    return ordered + sorted(present - set(ordered))


def _shape(case: dict) -> list[str]:
    """B·H·N·D, grouped-query rows B·H/HKV·N·D; and causal."""
    b, h, n, d = case["shape"]
    heads = f"{h}/{case['kv_heads']}" if "kv_heads" in case else str(h)
    return ["·".join((str(b), heads, str(n), str(d))), "yes" if case["causal"] else "no"]


def bench_attention(device: str) -> str:
    cases = _load(device, "bench_attention")["cases"]
    keys = _keys(cases, "speedup_vs_cudnn")
    rows = [_shape(c) + [_ratio(c["speedup_vs_cudnn"][k]) if k in c["speedup_vs_cudnn"] else "—" for k in keys]
            + [f"+{100 * c['matched_over_stale']:.1f}%" if "matched_over_stale" in c else "—"] for c in cases]
    return _markdown(["B·H·N·D", "causal", *(LABELS.get(k, k) for k in keys), "matched over stale"], rows)


def bench_attention_fp8(device: str) -> str:
    cases = _load(device, "bench_attention")["cases"]
    keys = _keys(cases, "speedup_vs_cudnn_fp8")

    def tflops(c, name):
        t = c["tflops"]
        return f"{t[name + '_fwd']:.0f} / {t[name + '_bwd']:.0f}" if name + "_fwd" in t else "—"

    rows = [_shape(c) + [tflops(c, "cudnn"), tflops(c, "cudnn_fp8")]
            + [_ratio(c["speedup_vs_cudnn_fp8"][k]) if k in c.get("speedup_vs_cudnn_fp8", {}) else "—" for k in keys]
            for c in cases]
    return _markdown(["B·H·N·D", "causal", "cuDNN BF16 fwd / bwd TFLOP/s", "cuDNN FP8 fwd / bwd TFLOP/s",
                      *(LABELS.get(k, k) for k in keys)], rows)


def bench_attention_ranges(device: str) -> str:
    cases = _load(device, "bench_attention")["cases"]
    dims = sorted({c["shape"][-1] for c in cases}, reverse=True)
    by_dim = {d: [c for c in cases if c["shape"][-1] == d] for d in dims}
    rows = []
    for field, prefix in (("speedup_vs_cudnn", "vs cuDNN BF16"), ("speedup_vs_cudnn_fp8", "vs cuDNN FP8")):
        for k in _keys(cases, field):
            cells = [_range([c[field][k] for c in by_dim[d] if k in c.get(field, {})]) if any(
                k in c.get(field, {}) for c in by_dim[d]) else "—" for d in dims]
            rows.append([f"{prefix}: {LABELS.get(k, k)}", *cells])
    both = [c for c in cases if "ours_bwd_matched_triton" in c["ms"]]
    if both:
        rows.append([GLUON_OVER_TRITON, *(_range([c["ms"]["ours_bwd_matched_triton"] / c["ms"]["ours_bwd_matched"]
                                                  for c in both if c["shape"][-1] == d]) for d in dims)])
    return _markdown(["ratio (min-max over the shapes)", *(f"D = {d}" for d in dims)], rows)


def accuracy(device: str) -> str:
    results = _load(device, "accuracy")
    rows = []
    for i, case in enumerate(results["rows"] if isinstance(results, dict) else results):
        where = "·".join(map(str, case["shape"])) + (" causal" if case["causal"] else "")
        # a named problem (``dc``), or the file's problem by number (its draw described in the doc)
        where += f", `{case['inputs']}`" if " " not in case["inputs"] else f", problem {i + 1}"
        for name, err in case.items():
            if isinstance(err, dict):
                rows.append([where, name.removeprefix("ours_"),
                             " / ".join(_percent(100 * err[k]) for k in ("o", "dq", "dk", "dv"))])
                where = ""
    return _markdown(["shape, inputs", "implementation", "O / dQ / dK / dV (%)"], rows)


#: the backwards side by side (``backward_side_by_side``): label, the speed-up key (None: cuDNN
#: BF16 itself; "cudnn_fp8": its time over cuDNN FP8's), the accuracy file's implementation
BACKWARDS = [
    ("eight GEMMs, matched (`kernels_delta_matching`, the default's)", "bwd_matched", "ours_kernels_delta_matching"),
    ("seven GEMMs, stale (`kernels_naive_fp8`)", "bwd_stale", "ours_kernels_naive_fp8"),
    ("seven GEMMs, matched: pre-pass + five-GEMM (`kernels_delta_prepass`)", "bwd_prepass_gluon",
     "ours_kernels_delta_prepass"),
    ("seven GEMMs, matched, dS for dQ per query from the pre-pass's bound (`kernels_folded_delta_prepass_dsq_row`; "
     "its errors: docs/delta_study.md)", "dsq_row_bwd", None),
    ("five GEMMs, stale (`fused=True`; its errors are not in the accuracy file)", "bwd_fused_stale", None),
    ("cuDNN FP8 (stale, per-tensor scales)", "cudnn_fp8", "cudnn_fp8"),
    ("cuDNN BF16", None, "cudnn_bf16"),
]


def backward_side_by_side(device: str) -> str:
    """Each backward's speed against cuDNN BF16's (min-max over the bench's shapes, per head dim)
    beside its errors against float64 (dQ / dK / dV, %, on each problem of the accuracy file),
    both from ``device``'s files of one run."""
    cases = _load(device, "bench_attention")["cases"]
    acc = _load(device, "accuracy")
    acc = acc["rows"] if isinstance(acc, dict) else acc
    dims = sorted({c["shape"][-1] for c in cases}, reverse=True)

    def speed(key, d):
        if key is None:
            return "1.00x"
        if key == "cudnn_fp8":
            vals = [c["ms"]["cudnn_bwd"] / c["ms"]["cudnn_fp8_bwd"] for c in cases
                    if c["shape"][-1] == d and "cudnn_fp8_bwd" in c.get("ms", {})]
        else:
            vals = [c["speedup_vs_cudnn"][key] for c in cases
                    if c["shape"][-1] == d and key in c.get("speedup_vs_cudnn", {})]
        return _range(vals) if vals else "—"

    def errors(name, case):
        err = case.get(name) if name else None
        return " / ".join(_percent(100 * err[k]) for k in ("dq", "dk", "dv")) if err else "—"

    problems = [f"{'·'.join(map(str, c['shape']))}{' causal' if c['causal'] else ''}, `{c['inputs']}`" for c in acc]
    rows = [[label, *(speed(key, d) for d in dims), *(errors(name, c) for c in acc)] for label, key, name in BACKWARDS]
    return _markdown(["backward", *(f"speed, D = {d}" for d in dims),
                      *(f"dQ / dK / dV error (%), {p}" for p in problems)], rows)


TABLES = {"bench_attention": bench_attention, "bench_attention_fp8": bench_attention_fp8,
          "bench_attention_ranges": bench_attention_ranges, "accuracy": accuracy,
          "backward_side_by_side": backward_side_by_side}


def doc_files() -> list[Path]:
    return sorted({p for pattern in DOCS for p in ROOT.glob(pattern)})


def regenerate(text: str) -> str:
    """``text`` with every generated block rewritten from its results file."""
    def block(m):
        if m[2] not in TABLES:
            raise SystemExit(f"unknown table {m[2]!r}: one of {', '.join(TABLES)}")
        return m[1] + TABLES[m[2]](m[3]) + m[5]
    return _BLOCK.sub(block, text)


def generated_ratios(device: str) -> set[str]:
    """Every ratio cell of the generated tables of ``device`` in the docs."""
    return {r for doc in doc_files() for m in _BLOCK.finditer(doc.read_text()) if m[3] == device
            for r in _RATIO.findall(m[4])}


def unquoted_ratios() -> list[tuple[str, str, str]]:
    """(doc, device, ratio) for every ratio of a prose block that no generated table of its device holds."""
    out = []
    for doc in doc_files():
        for m in _PROSE.finditer(doc.read_text()):
            known = generated_ratios(m[1])
            out += [(str(doc.relative_to(ROOT)), m[1], r) for r in _RATIO.findall(m[2]) if r not in known]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table is stale")
    args = parser.parse_args(argv)
    stale = []
    for doc in doc_files():
        text = doc.read_text()
        new = regenerate(text)
        if new != text:
            stale.append(str(doc.relative_to(ROOT)))
            if not args.check:
                doc.write_text(new)
    if args.check and stale:
        print("generated tables differ from benchmarks/results: " + ", ".join(stale)
              + " (python benchmarks/tables.py)", file=sys.stderr)
        return 1
    for doc in stale:
        print(f"rewrote {doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
