"""dmref.attention: a torch.autograd.Function whose backward is the recipe's."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from dmref_problems import make_inputs

import dmref
from dmref import reference, tiled
from dmref.diagnostics import U_FP64, attention_error_bound

_SHAPE = dict(batch=2, heads=2, kv_heads=1, seqlen_q=140, seqlen_k=140, head_dim=32, head_dim_v=32)


@pytest.mark.parametrize("recipe, dtype", [("naive_fp8", torch.float32), ("delta_matching", torch.bfloat16),
                                           ("consistent_p", torch.float32), ("mxfp8_stale", torch.bfloat16)])
def test_attention_gradients_are_the_recipes_backward(recipe, dtype):
    q, k, v, dout = (t.to(dtype) for t in make_inputs(_SHAPE, 0, dtype=torch.float32))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = dmref.attention(*leaves, causal=True, recipe=recipe)
    out.backward(dout)
    fwd, bwd = tiled.attention(q, k, v, dout, recipe=recipe, causal=True)
    assert out.dtype == dtype and all(t.grad.dtype == dtype for t in leaves)
    assert torch.equal(out, fwd.out.to(dtype))
    for leaf, grad in zip(leaves, (bwd.dq, bwd.dk, bwd.dv)):
        assert torch.equal(leaf.grad, grad.to(dtype))


def test_autocast_does_not_change_the_recipes_numbers():
    """Under torch.autocast the recipe's float32 matmuls would run in BF16; dmref.attention
    switches autocast off inside, forward and backward, so the numbers are the same codes."""
    q, k, v, dout = make_inputs(_SHAPE, 2, dtype=torch.float32)
    runs = []
    for autocast in (False, True):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = dmref.attention(*leaves, causal=True, recipe="delta_matching")
            out.backward(dout)
        runs.append([out, *(t.grad for t in leaves)])
    for plain, autocast in zip(*runs):
        assert plain.dtype == autocast.dtype == torch.float32 and torch.equal(plain, autocast)


def test_exact_recipe_matches_the_reference_within_float64_bound():
    q, k, v, dout = make_inputs(_SHAPE, 1)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    mask = torch.rand(140, 140, generator=torch.Generator().manual_seed(0)) < 0.8
    out = dmref.attention(*leaves, mask=mask, recipe="exact")
    out.backward(dout)
    want = reference.attention_ref(q, k, v, dout, mask=mask)
    n_tiles = 2
    bound = attention_error_bound(q, k, v, dout, u=U_FP64, n_tiles=n_tiles, mask=mask)
    b_ref = attention_error_bound(q, k, v, dout, u=U_FP64, mask=mask)
    for name, got, ref in zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in leaves)), (want[0], *want[2:])):
        assert bool(((got.detach() - ref).abs() <= bound[name] + b_ref[name]).all()), name


def test_a_small_model_trains_with_emulated_fp8_attention():
    torch.manual_seed(0)
    vocab, dim, heads, seqlen = 17, 32, 2, 32

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(vocab, dim)
            self.qkv = torch.nn.Linear(dim, 3 * dim)
            self.out = torch.nn.Linear(dim, vocab)

        def forward(self, tokens):
            b, n = tokens.shape
            x = self.emb(tokens)
            q, k, v = self.qkv(x).view(b, n, 3, heads, dim // heads).permute(2, 0, 3, 1, 4)
            y = dmref.attention(q, k, v, causal=True, recipe="delta_matching")
            return self.out(y.transpose(1, 2).reshape(b, n, dim) + x)

    model = Tiny()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, vocab, (4, seqlen + 1))
    losses = []
    for _ in range(15):
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


def test_unknown_recipe_and_bad_input_are_clear_errors():
    q, k, v, _ = make_inputs(_SHAPE, 2, dtype=torch.float32)
    with pytest.raises(ValueError, match="unknown recipe 'fp6'"):
        dmref.attention(q, k, v, recipe="fp6")
    with pytest.raises(TypeError, match="recipe must be a Recipe"):
        dmref.attention(q, k, v, recipe=3)
    with pytest.raises(TypeError, match="float16, bfloat16, float32 or float64"):
        dmref.attention(q.to(torch.int32), k, v)
    with pytest.raises(ValueError, match="head_dim of q"):
        dmref.attention(q[..., :16], k, v, recipe="naive_fp8")


_TINY = dict(batch=1, heads=2, kv_heads=1, seqlen_q=9, seqlen_k=7, head_dim=8, head_dim_v=8)


@pytest.mark.parametrize("causal", ["yes", "False", 1, 0, None, 1.0, torch.tensor(True), np.array([True])])
def test_causal_that_is_not_a_bool_is_a_type_error(causal):
    """A truthy string ("False" included) or number would otherwise be taken as True."""
    q, k, v, dout = make_inputs(_TINY, 4, dtype=torch.float32)
    calls = {
        "dmref.attention": lambda: dmref.attention(q, k, v, causal=causal, recipe="naive_fp8"),
        "dmref.evaluate": lambda: dmref.evaluate(q, k, v, dout, "naive_fp8", causal=causal),
        "attention_ref": lambda: reference.attention_ref(q, k, v, dout, causal=causal),
        "attention_forward": lambda: reference.attention_forward(q, k, v, causal=causal),
        "keep_mask": lambda: reference.keep_mask(9, 7, causal=causal),
    }
    for name, call in calls.items():
        with pytest.raises(TypeError, match="causal must be True or False") as info:
            call()
        assert type(causal).__name__ in str(info.value) or repr(causal) in str(info.value), name


@pytest.mark.parametrize("flag", [True, False])
def test_numpy_bool_causal_is_the_bool(flag):
    q, k, v, dout = make_inputs(_TINY, 5, dtype=torch.float32)
    want = dmref.attention(q, k, v, causal=flag, recipe="naive_fp8")
    assert torch.equal(dmref.attention(q, k, v, causal=np.bool_(flag), recipe="naive_fp8"), want)
    report, _ = dmref.evaluate(q, k, v, dout, "naive_fp8", causal=np.bool_(flag))
    assert report.as_dict() == dmref.evaluate(q, k, v, dout, "naive_fp8", causal=flag)[0].as_dict()


def test_evaluate_names_a_missing_dout_and_a_bad_exact():
    q, k, v, dout = make_inputs(_TINY, 6, dtype=torch.float32)
    with pytest.raises(TypeError, match="dout must be a torch.Tensor.*got NoneType"):
        dmref.evaluate(q, k, v, None, "naive_fp8")
    with pytest.raises(TypeError, match="exact must be None or .*got tuple"):
        dmref.evaluate(q, k, v, dout, "naive_fp8", exact=reference.attention_ref(q, k, v, dout))
    with pytest.raises(ValueError, match=r"dout must have the output's shape \(1, 2, 9, 8\)"):
        dmref.evaluate(q, k, v, dout[..., :3], "naive_fp8")


@pytest.mark.parametrize("name, named", [
    ("naive_fp8@volta", ["'volta'", "'fp32'", "'hopper-p<N>'"]),
    ("naive_fp8@", ["''", "hopper"]),
    ("naive_fp8@hopper-p48", ["48", "multiple of the k-step 32"]),
    ("naive_fp8@hopper-p0", ["0", "positive multiple"]),
    ("bf16@hopper", ["'bf16'", "FP8", "q, k"]),
    ("cudnn_fp8@hopper", ["'cudnn_fp8'", "power-of-two", "amax"]),
])
def test_get_recipe_rejects_an_accumulation_model_it_cannot_run(name, named):
    with pytest.raises(ValueError) as info:
        dmref.get_recipe(name)
    for text in named:
        assert text in str(info.value), (text, str(info.value))


@pytest.mark.parametrize("name", ["naive_fp8@hopper", "delta_matching@hopper-p128", "mxfp8_stale@hopper",
                                  "consistent_p@hopper-p32", "bf16@fp32", "exact@float64", "naive_fp8@exact"])
def test_get_recipe_accepts_the_accumulation_models_it_can_run(name):
    recipe = dmref.get_recipe(name)
    model = name.partition("@")[2]
    assert recipe.name == name and {m.name for m in recipe.accumulation.models()} == {model}
    q, k, v, dout = make_inputs(_TINY, 7, dtype=torch.float32)
    fwd, bwd = tiled.attention(q, k, v, dout, recipe=recipe, causal=True)
    assert all(bool(torch.isfinite(t).all()) for t in (fwd.out, bwd.dq, bwd.dk, bwd.dv))


def test_import_dmref_does_not_import_torch():
    code = "import sys, dmref; assert 'torch' not in sys.modules; dmref.attention; assert 'torch' in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.gpu
def test_attention_on_cuda_is_as_accurate_as_on_the_cpu():
    """The casts are bit-exact on both devices; the float32 matmuls sum in other orders, which
    can move a value across an FP8 rounding boundary. So: the GPU's error against the exact
    reference is at most twice the CPU's (a bound relative to a baseline's own error)."""
    q, k, v, dout = make_inputs(_SHAPE, 3, dtype=torch.float32)
    exact = reference.attention_ref(q, k, v, dout, causal=True)
    exact = (exact[0], *exact[2:])
    errors = {}
    for device in ("cpu", "cuda"):
        leaves = [t.detach().to(device).requires_grad_() for t in (q, k, v)]
        out = dmref.attention(*leaves, causal=True, recipe="delta_matching")
        out.backward(dout.to(device))
        got = [out.detach().cpu()] + [t.grad.cpu() for t in leaves]
        errors[device] = [(g.double() - e).norm().item() for g, e in zip(got, exact)]
    for cpu, gpu in zip(errors["cpu"], errors["cuda"]):
        assert gpu <= 2 * cpu
