"""SHA-256 digests of the FP8 kernels' outputs and gradients at the benchmark shapes, on a GPU.

    python benchmarks/kernel_digests.py --out DIR [--compare FILE]

For every shape of ``bench_attention.SHAPES`` (plus a GQA shape with a tail tile), causal or not,
and every recipe in ``dmref.kernels.SPECS``, it draws seeded BF16 inputs (outlier channels and
a wide exponent range, not plain randn), runs ``dmref.kernels.attention`` forward and backward
through torch.autograd, and records the SHA-256 of the bytes of O, dQ, dK and dV. Each problem runs
twice; the two runs must agree (the kernels are deterministic). Two trees whose digests agree
compute bit-identical outputs and gradients on these problems: ``--compare FILE`` checks this
tree against a digest file written by another tree and exits 1 on any difference (a file written
before the kernels' recipes had names of their own, ``delta_matching``, ``folded_naive_fp8``, ...,
is read under the names ``kernels_delta_matching``, ``kernels_folded_naive_fp8``, ...).

Writes ``<device>_kernel_digests.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import torch

from bench_attention import SHAPES  # this folder's benchmark (a script's folder is first on sys.path)

#: B, H, HKV, N, D: the benchmark shapes (H = HKV) and one GQA shape with a tail tile
PROBLEMS = [(b, h, h, n, d) for b, h, n, d in SHAPES] + [(2, 8, 2, 1000, 128), (1, 8, 4, 777, 64)]


def _inputs(b, h, hkv, n, d, seed):
    """BF16 q, k, v, dO on the GPU: normal rows times log-uniform magnitudes over 2^-6..2^6 per
    token, with 4 outlier channels 2^5 larger."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def draw(heads):
        x = torch.randn(b, heads, n, d, device="cuda", generator=g)
        x *= torch.exp2(torch.empty(b, heads, n, 1, device="cuda").uniform_(-6, 6, generator=g))
        x[..., :4] *= 32.0
        return x.to(torch.bfloat16)

    return draw(h), draw(hkv), draw(hkv), draw(h)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def run_problem(shape, causal, recipe, seed=0):
    from dmref.kernels import attention

    q, k, v, do = _inputs(*shape, seed)
    digests = []
    for _ in range(2):
        qs, ks, vs = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        o = attention(qs, ks, vs, causal=causal, recipe=recipe)
        o.backward(do)
        digests.append({"o": _digest(o), "dq": _digest(qs.grad), "dk": _digest(ks.grad),
                        "dv": _digest(vs.grad)})
        del o, qs, ks, vs
    if digests[0] != digests[1]:
        raise RuntimeError(f"{shape} causal={causal} {recipe}: two runs differ {digests}")
    return digests[0]


def _current_name(recipe: str) -> str:
    """A recipe name of a digest file: the kernels' recipes were once named without ``kernels_``."""
    return recipe if recipe.startswith("kernels_") else f"kernels_{recipe}"


def main(argv=None):
    from dmref.kernels import SPECS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--compare", help="digest file of another tree; exit 1 on any difference")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for shape in PROBLEMS:
        for causal in (False, True):
            for recipe in sorted(SPECS):
                row = dict(shape=list(shape), causal=causal, recipe=recipe,
                           digests=run_problem(shape, causal, recipe))
                rows.append(row)
                print(shape, causal, recipe, row["digests"]["dq"][:16], flush=True)
                torch.cuda.empty_cache()
    device = torch.cuda.get_device_name().replace(" ", "-").lower()
    path = os.path.join(args.out, f"{device}_kernel_digests.json")
    with open(path, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f,
                  indent=1)
    print("wrote", path)
    if args.compare:
        with open(args.compare) as f:
            other = {(tuple(r["shape"]), r["causal"], _current_name(r["recipe"])): r["digests"]
                     for r in json.load(f)["rows"]}
        key = lambda r: (tuple(r["shape"]), r["causal"], r["recipe"])  # noqa: E731
        new = sorted({r["recipe"] for r in rows if key(r) not in other})
        diff = [(*key(r), name) for r in rows if key(r) in other for name, h in r["digests"].items()
                if other[key(r)].get(name) != h]
        print(f"compared {len(rows) - sum(key(r) not in other for r in rows)} problems x 4 tensors with "
              f"{args.compare}: {len(diff)} differ" + (f": {diff}" if diff else "")
              + (f"; recipes not in it (not compared): {new}" if new else ""))
        return 1 if diff else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
