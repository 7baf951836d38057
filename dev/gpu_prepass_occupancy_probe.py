"""The Gluon pre-pass (``bwd_ws.prepass``: S, dP, D and, for the dsq-row recipe, the bound U) at
more CTAs an SM: its consumer needs few registers (no spills at a launch cap of 64 registers a
thread, 104 for the consumer after the producer's drop, where the kernels' ``LAUNCH_REGS`` is 128:
two CTAs an SM), so a lower cap lets three (80) or four (64) CTAs share an SM, more warps to hide
its wgmmas' and exp2s' latency; and a deeper K/V ring (``WsBwdTiles.dq_stages``). At the bench's
shapes (``bench_attention.SHAPES``), causal and not, beside cuDNN BF16's backward timed in the same
process: the pre-pass of ``kernels_folded_delta_prepass_dsq_row`` alone under each variant
(``prepass_<regs>_<stages>``) and that recipe's whole backward (``api.attention_backward``) with
its pre-pass under the first and the lowest cap (``bwd_<regs>_<stages>``), each a spec with
``WsBwdTiles.prepass_regs`` and ``dq_stages``. Prints one JSON line a
shape (``ratio``: cuDNN BF16's backward time over ours) and writes them to
``$OUT/<device>_prepass_occupancy_probe.json`` (its log: dev/results/; ``PYTHONPATH=benchmarks python
dev/gpu_prepass_occupancy_probe.py``)."""
import dataclasses
import json
import os

import torch
from bench_attention import SHAPES, bench, device_tag  # the product benchmark's shapes, timing, file prefix
from gpu_dsq_row_probe import R, problem  # the dsq-row recipe's inputs, anchor and operands at one shape

from dmref.kernels import bwd_ws
from dmref.kernels.config import get_spec

#: (launch register cap, K/V ring depth) of the pre-pass
VARIANTS = [(128, 2), (80, 2), (64, 2), (64, 3)]
WHOLE = [(128, 2), (64, 2)]


def spec_with(regs: int, stages: int, head_dim: int):
    """The dsq-row spec with the pre-pass at ``regs`` registers a thread at launch
    (``WsBwdTiles.prepass_regs``) and a K/V ring of ``stages`` (``dq_stages``)."""
    spec = get_spec(R)
    tiles = dataclasses.replace(spec.ws_bwd_tiles(head_dim), prepass_regs=regs, dq_stages=stages)
    return spec.with_tiles(ws_bwd=tiles)


def main() -> None:
    out = []
    for b, h, n, d in SHAPES:
        for causal in (False, True):
            ms, backward, sv, do8, kw = problem(b, h, n, d, causal)
            want = bwd_ws.prepass(sv, do8, recipe=R, bound=True, **kw)
            same = True
            for regs, stages in VARIANTS:
                spec = spec_with(regs, stages, d)
                got = bwd_ws.prepass(sv, do8, recipe=spec, bound=True, **kw)
                same &= all(torch.equal(a, b_) for a, b_ in zip(got, want))
                ms[f"prepass_{regs}_{stages}"] = bench(lambda spec=spec: bwd_ws.prepass(sv, do8, recipe=spec,
                                                                                         bound=True, **kw))
                if (regs, stages) in WHOLE:
                    # the recipe's whole backward as the API runs it, this pre-pass within it
                    ms[f"bwd_{regs}_{stages}"] = bench(lambda spec=spec: backward(spec))
            ratio = {key: round(ms["cudnn_bwd"] / t, 3) for key, t in ms.items() if key != "cudnn_bwd"}
            row = dict(shape=[b, h, n, d], causal=causal, same_bits=bool(same), ms=ms, ratio=ratio)
            print(json.dumps(row), flush=True)
            out.append(row)
            # written after every shape: a run cut short keeps its rows
            meta = dict(device=torch.cuda.get_device_name(),
                        method="triton.testing.do_bench medians (bench_attention.bench); ratio = cuDNN BF16's backward "
                               "time / ours; same_bits: D and U of every variant equal the default launch's")
            with open(os.path.join(os.environ.get("OUT", "."), f"{device_tag()}_prepass_occupancy_probe.json"), "w") as f:
                json.dump(dict(meta=meta, rows=out), f, indent=1)


if __name__ == "__main__":
    main()
