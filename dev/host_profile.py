"""Where the host's time goes in the default recipe's forward and backward calls at
4·16·4096·128, causal: the CPU milliseconds each call, and each of the forward's launches alone,
takes to issue its work (the GPU left running behind), then cProfile over 30 calls each.
Prints (its log: dev/results/h100_host_profile.txt, ``PYTHONPATH=benchmarks python
dev/host_profile.py > ...``; the log committed there also times a cache of compiled kernels
that has left the tree: this script as committed in eaf3334, docs/kernels_speed.md, "The host's
share")."""
import cProfile
import io
import pstats

import torch
from bench_attention import host_ms  # the product benchmark's host timing

from dmref.kernels import api, fwd_ws
from dmref.kernels.config import DEFAULT_RECIPE, get_spec
from dmref.kernels.quantize import quantize, quantize_kv_folded


def profile(name, fn):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(30):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats(key).print_stats(28)
        print(f"===== {name} by {key}\n" + "\n".join(s.getvalue().splitlines()[:45]))


torch.manual_seed(0)
b, h, n, d = 4, 16, 4096, 128
q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
scale = d ** -0.5
r = get_spec(DEFAULT_RECIPE)
fwd = lambda: api.attention_forward(q, k, v, causal=True, scale=scale, recipe=DEFAULT_RECIPE, for_backward=True)  # noqa
o, lse, saved, _ = fwd()
shape = api.Shape.of(q, k, v)
bwd = lambda: api.attention_backward(saved, o, do, shape=shape, causal=True, scale=scale, recipe=DEFAULT_RECIPE)  # noqa
kv = quantize_kv_folded(k, v, for_backward=True)
parts = {
    "fwd (default, for_backward)": fwd,
    "bwd (default)": bwd,
    "quantize_kv_folded(for_backward)": lambda: quantize_kv_folded(k, v, for_backward=True),
    "fwd_ws.forward (kernel launch)": lambda: fwd_ws.forward(q, kv.k8, kv.k_scale, kv.vt8, kv.v_scale, kv_heads=h,
                                                             causal=True, scale=scale, recipe=r),
    "quantize(q, rows, cols)": lambda: quantize(q, "float8_e4m3fn", rows=True, cols=True),
    "torch.empty x2": lambda: (torch.empty(1, device="cuda"), torch.empty(1, device="cuda")),
    "torch add (one launch)": lambda: q.add_(0),
}
for name, fn in parts.items():
    print(f"host ms {name:40s} {host_ms(fn, calls=30):.4f}")
profile("fwd", fwd)
profile("bwd", bwd)
