"""dmref.integrations.transformers: dmref's attention inside transformers models built from
configurations (random weights, nothing downloaded).

Two model families: Llama (multi-head attention, a left-padded batch, so that the mask carries
padding and fully masked rows) and Qwen2 (grouped-query attention, 4 query heads per key/value
head, a sliding window of 8 tokens on its second layer, shorter than the 37-token sequence, so
that layer's mask carries the window, and a softmax scale of 0.3 instead of 1/sqrt(head_dim),
so that ``scaling`` matters).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs the extra: pip install 'dmref[transformers]'")

from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

from dmref import tiled  # noqa: E402
from dmref.diagnostics import U_FP32, U_FP64, attention_error_bound  # noqa: E402
from dmref.testing import assert_within_bound  # noqa: E402

SEQ, BATCH, VOCAB, PAD = 37, 2, 96, 5  # PAD: left padding of the first sequence
STALE = ("bf16", "naive_fp8", "cudnn_fp8", "mxfp8_stale")  # presets with a stale delta
MATCHED = ("delta_matching",)


def llama():
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)


def qwen2():
    cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=1, use_sliding_window=True,
                                   sliding_window=8, max_window_layers=1, max_position_embeddings=64)
    assert cfg.layer_types == ["full_attention", "sliding_attention"]
    return transformers.Qwen2ForCausalLM(cfg)


MODELS = {"llama": llama, "qwen2": qwen2}

dmt = None  #: dmref.integrations.transformers, imported by the fixture below


@pytest.fixture(autouse=True, scope="module")
def integration():
    """Import (and so register) the integration when the tests run, not when pytest collects this
    file: it imports triton (through transformers' modeling_utils), and tests/kernels' conftest,
    collected after this file, has to switch Triton's interpreter on before triton is imported."""
    global dmt
    import dmref.integrations.transformers as module

    dmt = module
    return module


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One torch thread: on a shared CPU, two threads meeting at barriers make these small ops
    several times slower (as in tests/test_examples.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def build(family: str, dtype=torch.float32):
    torch.manual_seed(0)
    model = MODELS[family]().to(dtype)
    if family == "qwen2":
        for layer in model.model.layers:
            layer.self_attn.scaling = 0.3
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    if family == "llama":
        mask[0, :PAD] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return model, dict(input_ids=ids, attention_mask=mask, labels=labels)


def run(model, batch, implementation):
    """Logits (real tokens only) and every parameter's gradient, with attention ``implementation``."""
    model.set_attn_implementation(implementation)
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    keep = batch["attention_mask"].bool()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    return out.logits[keep].detach(), grads


def baseline_relative_bound(baseline_error: float) -> float:
    """FlashAttention's test criterion: an implementation's error against a float64
    run is at most twice the error of torch's own implementation in the same precision. Here
    dmref's exact recipe computes attention in float64 and rounds once, so the only float32
    errors of its model are the model's other layers, which sdpa's float32 model has as well."""
    return 2 * baseline_error


def test_import_dmref_does_not_import_transformers():
    code = "import dmref, dmref.integrations, sys; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_name_is_registered_with_attention_and_mask_interfaces():
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    assert dmt.NAMES["dmref"] == "exact" and dmt.NAMES["dmref:delta_matching"] == "delta_matching"
    assert {"dmref:naive_fp8", "dmref:cudnn_fp8", "dmref:mxfp8_stale", "dmref:kernels_delta_matching",
            "dmref:kernels_naive_fp8"} <= set(dmt.NAMES)
    # one name, one numerics: every registered name runs dmref.get_recipe of its recipe name
    import dmref

    assert all(dmref.get_recipe(r).name == r for r in dmt.NAMES.values())
    for name in dmt.NAMES:
        assert name in transformers.AttentionInterface._global_mapping
        assert name in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping


@pytest.mark.parametrize("family", list(MODELS))
def test_exact_backend_gives_sdpas_logits_and_gradients(family):
    """Logits and all parameter gradients of the "dmref" model against a float64 sdpa model,
    within twice the error of the float32 sdpa model (baseline_relative_bound)."""
    model, batch = build(family)
    ref_logits, ref_grads = run(build(family, torch.float64)[0], batch, "sdpa")
    sdpa_logits, sdpa_grads = run(model, batch, "sdpa")
    dmref_logits, dmref_grads = run(model, batch, "dmref")
    for what, got, base, ref in (("logits", dmref_logits, sdpa_logits, ref_logits),
                                 ("gradients", dmref_grads, sdpa_grads, ref_grads)):
        err = (got.double() - ref).norm().item()
        base_err = (base.double() - ref).norm().item()
        assert 0 < base_err and err <= baseline_relative_bound(base_err), (what, err, base_err)


@pytest.mark.parametrize("family", list(MODELS))
def test_exact_backend_equals_sdpa_per_layer_within_float32_bound(family):
    """Each layer's attention call, as the model made it (layout, grouped heads, mask with
    padding or window, scaling): dmref's output and q, k, v gradients against sdpa's on the same
    inputs and output gradient, within the sum of both rounding-error bounds
    (attention_error_bound at float32 for sdpa, at float64 plus one rounding to float32 for
    dmref's exact recipe)."""
    model, batch = build(family)
    model.set_attn_implementation("dmref")
    with dmt.record() as calls:
        model(**batch).loss.backward()
    assert [c.layer for c in calls] == [0, 1] and all(c.dout is not None for c in calls)
    if family == "qwen2":
        assert calls[0].mask is None and calls[0].causal and calls[1].mask is not None  # the window
    else:
        assert all(c.mask is not None and not bool(c.mask[0, 0, :PAD].any()) for c in calls)  # padding
    for c in calls:
        groups = c.q.shape[1] // c.k.shape[1]
        module = SimpleNamespace(num_key_value_groups=groups, is_causal=True)
        mask = None if c.causal else c.mask
        runs = []
        for fn in (sdpa_attention_forward, dmt.attention_forward):
            leaves = [t.clone().requires_grad_() for t in (c.q, c.k, c.v)]
            out, weights = fn(module, *leaves, mask, scaling=c.scale)
            assert weights is None and out.shape == (BATCH, SEQ, c.q.shape[1], c.q.shape[-1])
            out = out.transpose(1, 2)
            runs.append([out.detach(), *torch.autograd.grad(out, leaves, c.dout)])
        bounds = [attention_error_bound(c.q, c.k, c.v, c.dout, u=u, causal=c.causal, scale=c.scale, mask=mask)
                  for u in (U_FP32, U_FP64)]
        for i, name in enumerate(("out", "dq", "dk", "dv")):
            sdpa, ours = runs[0][i], runs[1][i]
            bound = bounds[0][name] + bounds[1][name] + U_FP32 * (ours.double().abs() + bounds[1][name])
            assert_within_bound(ours, sdpa, bound, what=f"{family} layer {c.layer} {name}")


@pytest.mark.parametrize("recipe", STALE + MATCHED)
def test_fp8_recipe_row_sum_residual_per_layer(recipe):
    """Each layer of the Llama and Qwen2 models under "dmref:<recipe>": the output is the
    recipe's (dmref.tiled, the same codes), and the row-sum residual of dS (dmref.diagnostics,
    on the very q, k, v, dO of that layer) is what the docs state: a stale delta leaves every
    layer's mean residual above the largest Delta-Matching bound of any row, Delta-Matching stays
    within that float32 bound in every row."""
    for family in MODELS:
        model, batch = build(family)
        model.set_attn_implementation(f"dmref:{recipe}")
        with dmt.record() as calls:
            model(**batch).loss.backward()
        for c in calls:
            want = tiled.forward(c.q, c.k, c.v, recipe=recipe, causal=c.causal, scale=c.scale, mask=c.mask).out
            assert c.recipe.name == recipe and torch.equal(c.out, want.to(c.out.dtype))
        reports = dmt.layer_reports(calls)
        assert [layer for layer, _ in reports] == [0, 1]
        for layer, r in reports:
            where = (family, layer, r.rowsum_residual_mean, r.rowsum_bound_max, r.rowsum_over_bound_max)
            if recipe in STALE:
                assert r.rowsum_residual_mean > r.rowsum_bound_max, where
            else:
                assert r.rowsum_over_bound_max <= 1, where


@pytest.mark.parametrize("name", ["kernels_delta_matching", "kernels_naive_fp8"])
def test_kernels_recipe_name_emulates_the_kernels_recipe_off_hopper(name):
    from dmref.kernels import SPECS

    model, batch = build("llama")
    model.set_attn_implementation(f"dmref:{name}")
    with pytest.raises(ValueError, match="head_dim=16"):
        model(**batch)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                   attn_implementation=f"dmref:{name}")
    with dmt.record() as calls:
        transformers.LlamaForCausalLM(cfg)(**batch).loss.backward()
    assert all(c.recipe is SPECS[name].recipe and not c.kernels for c in calls)
    for layer, r in dmt.layer_reports(calls):
        within = r.rowsum_over_bound_max <= 1
        assert within if name == "kernels_delta_matching" else not within, (layer, r.rowsum_over_bound_max)


def test_bfloat16_model_gets_bfloat16_from_the_float32_emulation():
    model, batch = build("qwen2", torch.bfloat16)
    model.set_attn_implementation("dmref:delta_matching")
    with dmt.record() as calls:
        logits = model(**batch).logits
    assert logits.dtype == torch.bfloat16 and all(c.q.dtype == c.out.dtype == torch.bfloat16 for c in calls)
    assert calls[0].recipe.precision == "float32"


def _call(**kwargs):
    q = torch.zeros(1, 4, 3, 8)
    kv = torch.zeros(1, 2, 3, 8)
    module = SimpleNamespace(num_key_value_groups=kwargs.pop("groups", 2), layer_idx=0, is_causal=True)
    return dmt.attention_forward(module, q, kv, kv, None, name="dmref", **kwargs)


@pytest.mark.parametrize("kwargs, named", [
    (dict(dropout=0.1), "dropout=0.1"),
    (dict(softcap=50.0), "softcap=50.0"),
    (dict(s_aux=torch.zeros(4)), "s_aux"),
    (dict(position_bias=torch.zeros(1, 4, 3, 3)), "position_bias"),
    (dict(groups=4), "num_key_value_groups=4"),
])
def test_what_is_not_implemented_is_refused_in_one_line(kwargs, named):
    with pytest.raises(ValueError) as info:
        _call(**kwargs)
    message = str(info.value)
    assert named in message and "\n" not in message


def test_dropout_in_training_names_the_models_setting():
    model, batch = build("llama")
    model.config.attention_dropout = 0.25
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.25
    model.set_attn_implementation("dmref:naive_fp8")
    model.train()
    with pytest.raises(ValueError, match="dropout=0.25.*attention_dropout"):
        model(**batch)


@pytest.mark.parametrize("dtype, mask, window, named", [
    (torch.float32, None, None, "torch.float32"),
    (torch.bfloat16, torch.ones(1, 1, 3, 3, dtype=torch.bool).triu(), 2, "sliding_window=2"),
    (torch.bfloat16, torch.tensor([False, True, True]).expand(1, 1, 3, 3), None, "padding"),
])
def test_kernels_refuse_what_they_do_not_implement_before_they_run(dtype, mask, window, named):
    q = torch.zeros(1, 2, 3, 64, dtype=dtype)
    module = SimpleNamespace(sliding_window=window, layer_idx=0)
    with pytest.raises((TypeError, ValueError), match=named):
        dmt._kernels("dmref:kernels_delta_matching", module, q, q, q, mask, False, 0.125, "kernels_delta_matching",
                     {"sliding_window": window})


def _example():
    path = Path(__file__).resolve().parents[2] / "examples" / "train_transformers.py"
    spec = importlib.util.spec_from_file_location("train_transformers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TINY = ["--steps", "2", "--diag-every", "2", "--pairs", "8", "--queries", "4", "--keys", "8", "--hidden", "16",
        "--batch", "2"]


def test_example_trains_each_backend_and_writes_the_residual_per_layer(tmp_path):
    _example().main(TINY + ["--out", str(tmp_path)])
    data = json.loads((tmp_path / "train_transformers.json").read_text())
    assert (tmp_path / "train_transformers.png").stat().st_size > 0
    curves, final = data["curves"], data["final"]
    assert list(final) == ["dmref", "dmref:naive_fp8", "dmref:delta_matching"]
    # the same weights and first batch: only attention's rounding separates the first losses
    assert curves["dmref"]["loss"][0] != curves["dmref:naive_fp8"]["loss"][0]
    for d in curves["dmref:naive_fp8"]["layers"][-1]:
        assert d["rowsum_residual_mean"] > d["rowsum_bound_max"]
    for d in curves["dmref:delta_matching"]["layers"][-1]:
        assert d["rowsum_over_bound_max"] <= 1


def test_example_rejects_more_pairs_than_keys_in_one_line(capsys):
    with pytest.raises(SystemExit) as info:
        _example().main(["--pairs", "9", "--keys", "8"])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and len(err.splitlines()) == 1 and "--pairs 9" in err


@pytest.mark.parametrize("mask, causal", [(torch.ones(4, 4, dtype=torch.bool).tril().expand(1, 1, 4, 4), True),
                                          (torch.ones(1, 1, 4, 4, dtype=torch.bool), False)])
def test_kernels_take_a_causal_or_full_boolean_mask_as_their_causal_flag(monkeypatch, mask, causal):
    """Such a mask reaches the kernel as its causal flag (the launch replaced by a stand-in: no
    kernel runs here, not even in Triton's interpreter)."""
    import dmref.kernels

    launched = {}
    monkeypatch.setattr(dmref.kernels, "attention", lambda q, k, v, **kw: launched.update(kw) or q)
    q = torch.zeros(1, 2, 4, 64, dtype=torch.bfloat16)
    dmt._kernels("dmref:kernels_delta_matching", SimpleNamespace(layer_idx=0), q, q, q, mask, False, 0.125,
                 "kernels_delta_matching", {})
    assert launched == dict(causal=causal, scale=0.125, recipe="kernels_delta_matching")


def test_kernel_path_in_a_bfloat16_llama_with_a_stand_in_kernel(monkeypatch):
    """The Hopper path through a whole model, with the launch replaced by the emulated reference of
    the kernel's recipe: the causal mask arrives as None and becomes the causal flag, the calls are
    recorded as the kernels', and layer_reports reads them under float32 accumulation."""
    import dmref.kernels
    from dmref import attention as emulated

    launched = []

    def stand_in(q, k, v, *, causal, scale, recipe):
        launched.append(causal)
        reference = dmref.kernels.SPECS[recipe].reference_recipe(accumulation="fp32")
        return emulated(q, k, v, causal=causal, scale=scale, recipe=reference)

    monkeypatch.setattr(dmt, "_hopper", lambda t: True)
    monkeypatch.setattr(dmref.kernels, "attention", stand_in)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                   attn_implementation="dmref:kernels_delta_matching")
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    ids = build("qwen2")[1]["input_ids"]
    with dmt.record() as calls:
        model(input_ids=ids, labels=ids).loss.backward()
    assert launched == [True, True] and all(c.kernels and c.out.dtype == torch.bfloat16 for c in calls)
    for layer, r in dmt.layer_reports(calls, accumulation="fp32"):
        assert r.recipe.endswith("@fp32") and r.rowsum_over_bound_max <= 1, (layer, r)


@pytest.mark.gpu
def test_kernels_run_a_llama_under_bfloat16_autocast_with_delta_matching_within_the_bound():
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to("cuda")
    model.set_attn_implementation("dmref:kernels_delta_matching")
    ids = torch.randint(0, VOCAB, (2, 300), device="cuda")
    with dmt.record() as calls, torch.autocast("cuda", dtype=torch.bfloat16):
        model(input_ids=ids, labels=ids).loss.backward()
    assert all(c.kernels and c.out.dtype == torch.bfloat16 for c in calls) and len(calls) == 2
    for layer, r in dmt.layer_reports(calls, batch=1, heads=1, accumulation="fp32"):
        assert r.rowsum_over_bound_max <= 1, (layer, r)
