"""Minimal attention-shaped loop (QK^T, exp2, FP8 P, PV) compiled for sm_90a by Triton, three ways of
accumulating PV: into the dot, promoted (dmref), rescaled then into the dot. Prints the wgmma
schedule (benchmarks/ptx_wgmma_schedule.py): all three wait (wait_group 0) after every matmul."""
import os, sys; sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import triton, triton.language as tl
from ptx_wgmma_schedule import schedule
from dmref.kernels.compile_check import compile_sm90

@triton.jit
def k_acc(A8, B8, S, O, N, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, MODE: tl.constexpr):
    offs_m = tl.arange(0, BM); offs_d = tl.arange(0, D); offs_n = tl.arange(0, BN)
    a = tl.load(A8 + offs_m[:, None] * D + offs_d[None, :])
    acc = tl.zeros([BM, D], tl.float32)
    for j in range(0, N, BN):
        b = tl.load(B8 + (j + offs_n)[:, None] * D + offs_d[None, :])   # (BN, D)
        s = tl.dot(a, tl.trans(b))                   # (BM, BN)
        p = tl.math.exp2(s).to(tl.float8e4nv)
        if MODE == 0:
            acc = tl.dot(p, b, acc)                  # accumulate into the dot
        elif MODE == 1:
            acc = acc * tl.load(S + j) + tl.dot(p, b) # promoted, as dmref
        else:
            acc = tl.dot(p, b, acc * tl.load(S + j))  # rescale, then accumulate into the dot
    tl.store(O + offs_m[:, None] * D + offs_d[None, :], acc)

for mode in (0, 1, 2):
    ck = compile_sm90(k_acc, dict(BM=64, BN=128, D=128, MODE=mode), num_warps=4, num_stages=3)
    print(mode, schedule(ck))
