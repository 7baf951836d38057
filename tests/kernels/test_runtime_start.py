"""``_runtime.start``, the launch path of every kernel: the first launch of an argument key goes
through Triton's ``JITFunction.run``, later ones straight to the compiled kernel it returned, with
the bound arguments in the kernel's signature order (the positional ones, then each constexpr's
keyword or default). Checked here on the CPU with a recording stand-in for the compiled kernel;
on the GPU every kernel test launches through it, and
``test_fast_and_triton_launches_give_the_same_bits`` compares the two paths."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
tl = triton.language


def _toy(X, Y, n, scale, BLOCK: tl.constexpr, FLAG: tl.constexpr = False):  # pragma: no cover - never run
    pass


class _Recorder(triton.runtime.jit.JITFunction):
    """A JITFunction whose run records its call and returns a compiled stand-in that records the
    launches it is given."""

    def __init__(self, fn):
        super().__init__(fn)
        self.runs, self.fast = [], []
        recorder = self

        class Compiled:
            def __getitem__(self, grid):
                return lambda *args: recorder.fast.append((grid, args))

        self.compiled = Compiled()

    def run(self, *args, grid, warmup, **kwargs):
        self.runs.append((grid, args, kwargs))
        return self.compiled


@pytest.fixture
def compiled_path(monkeypatch):
    from dmref.kernels import _runtime

    monkeypatch.setattr(_runtime, "interpreting", lambda: False)
    monkeypatch.setattr(_runtime, "FAST_LAUNCH", True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(_runtime, "_COMPILED", {})
    return _runtime


def test_a_seen_key_launches_the_compiled_kernel_with_the_bound_arguments_in_order(compiled_path):
    start = compiled_path.start
    kernel = _Recorder(_toy)
    x, y = torch.zeros(8), torch.zeros(8, dtype=torch.bfloat16)
    start(kernel, (4,), x, y, 7, 0.5, BLOCK=16, num_warps=4)
    assert len(kernel.runs) == 1 and not kernel.fast
    start(kernel, (3, 2), x, y, 7, 0.25, BLOCK=16, num_warps=4)
    assert len(kernel.runs) == 1
    assert kernel.fast == [((3, 2, 1), (x, y, 7, 0.25, 16, False))]  # FLAG's default last, no launch option
    # what Triton specializes on, or more, is a new key: another int, alignment, dtype, constexpr, option
    for args, kwargs in (((x, y, 8, 0.5), dict(BLOCK=16, num_warps=4)),
                         ((x[1:], y, 7, 0.5), dict(BLOCK=16, num_warps=4)),
                         ((x.double(), y, 7, 0.5), dict(BLOCK=16, num_warps=4)),
                         ((x, y, 7, 0.5), dict(BLOCK=32, num_warps=4)),
                         ((x, y, 7, 0.5), dict(BLOCK=16, FLAG=True, num_warps=4)),
                         ((x, y, 7, 0.5), dict(BLOCK=16, num_warps=8))):
        before = len(kernel.runs)
        start(kernel, (1,), *args, **kwargs)
        assert len(kernel.runs) == before + 1, (args[2], kwargs)
    # a float's value is not specialized: the same key
    start(kernel, (1,), x, y, 7, 3.0, BLOCK=16, num_warps=4)
    assert kernel.fast[-1] == ((1, 1, 1), (x, y, 7, 3.0, 16, False))


def test_what_it_cannot_key_goes_through_triton_every_time(compiled_path):
    kernel = _Recorder(_toy)
    x = torch.zeros(8)
    for _ in range(2):
        compiled_path.start(kernel, (1,), x, x, [7], 0.5, BLOCK=16)
    assert len(kernel.runs) == 2 and not kernel.fast


def test_under_the_interpreter_or_switched_off_every_launch_is_tritons(compiled_path, monkeypatch):
    kernel = _Recorder(_toy)
    x = torch.zeros(8)
    monkeypatch.setattr(compiled_path, "FAST_LAUNCH", False)
    for _ in range(2):
        compiled_path.start(kernel, (1,), x, x, 7, 0.5, BLOCK=16)
    monkeypatch.setattr(compiled_path, "FAST_LAUNCH", True)
    monkeypatch.setattr(compiled_path, "interpreting", lambda: True)
    for _ in range(2):
        compiled_path.start(kernel, (1,), x, x, 7, 0.5, BLOCK=16)
    assert len(kernel.runs) == 4 and not kernel.fast


def test_descriptor_keys_hold_what_triton_specializes_on():
    from dmref.kernels._runtime import _arg_key

    gluon = pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from dmref.kernels._gluon import shared_layout

    x = torch.zeros(256, 128, dtype=torch.float8_e4m3fn)
    import triton.experimental.gluon.language as gl

    def desc(t, block):
        return gluon.TensorDescriptor.from_tensor(t, block, shared_layout(tuple(block), gl.float8e4nv))

    a, b = desc(x, [64, 128]), desc(x, [128, 128])
    assert _arg_key(a) == _arg_key(desc(x, [64, 128]))
    assert _arg_key(a) != _arg_key(b) and _arg_key(a) != _arg_key(desc(x[:128], [64, 128]))
    # Triton's own host descriptors (the Triton forward's) have no layout
    from triton.tools.tensor_descriptor import TensorDescriptor

    t = TensorDescriptor.from_tensor(x, [64, 128])
    assert _arg_key(t) == _arg_key(TensorDescriptor.from_tensor(x, [64, 128])) != _arg_key(a)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["kernels_folded_delta_matching", "kernels_folded_delta_prepass",
                                    "kernels_delta_matching"])
def test_fast_and_triton_launches_give_the_same_bits(recipe, monkeypatch):
    """O, dQ, dK, dV through autograd with every launch Triton's, then twice through
    ``start``'s cache (the second call launches only compiled kernels): the same bits."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from kernel_inputs import Case, outlier_inputs, require_backend

    require_backend("gpu")
    from dmref.kernels import _runtime, attention

    case = Case(2, 8, 2, 1000, 128, True, recipe)
    q, k, v, do = outlier_inputs(case, "cuda")
    runs = []
    for fast in (False, True, True):
        monkeypatch.setattr(_runtime, "FAST_LAUNCH", fast)
        qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
        o = attention(qg, kg, vg, causal=True, recipe=recipe)
        o.backward(do)
        runs.append([t.detach().view(torch.int16) for t in (o, qg.grad, kg.grad, vg.grad)])
    assert _runtime._COMPILED, "no launch went through the compiled kernels"
    for name, *bits in zip(("O", "dQ", "dK", "dV"), *runs):
        assert all(torch.equal(bits[0], b) for b in bits[1:]), f"{name}: the compiled-kernel launch differs"
