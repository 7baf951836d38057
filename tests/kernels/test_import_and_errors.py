"""dmref.kernels imports without triton or a GPU; calling it without a GPU fails clearly."""

from __future__ import annotations

import dataclasses

import os
import subprocess
import sys

import pytest

from dmref.kernels.config import SPECS, BwdTiles, FwdTiles, KernelSpec, get_spec, kernel_recipe

_SCRIPT = """
import sys
import torch
import dmref
import dmref.kernels as K
for name in K.SPECS:
    assert dmref.get_recipe(name) is K.get_spec(name).recipe, name
assert "triton" not in sys.modules, "importing dmref.kernels or resolving its recipe names imported triton"
try:
    K.attention(torch.zeros(1, 1, 16, 64, dtype=torch.bfloat16), *[torch.zeros(1, 1, 16, 64, dtype=torch.bfloat16)] * 2,
                recipe="delta_matching")
except ValueError as exc:
    print("PRESET:", exc)
q = torch.zeros(1, 1, 16, 64, dtype=torch.bfloat16)
try:
    K.attention(q, q, q)
except RuntimeError as exc:
    print("ERROR:", exc)
"""


def test_import_does_not_load_triton_and_cpu_call_fails_with_a_clear_message():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ERROR:" in proc.stdout
    assert "CUDA GPU" in proc.stdout or "needs triton" in proc.stdout
    # a preset name: the recipe's error, before any device check, naming the kernel recipe to use
    assert "PRESET: the kernels do not run recipe 'delta_matching'; use 'kernels_delta_matching'" in proc.stdout


def test_specs_are_built_from_the_kernel_recipes_and_the_old_names_still_resolve():
    import dmref.kernels
    from dmref.kernels import config
    from dmref.recipes import KERNEL_RECIPES

    assert {name: spec.recipe for name, spec in SPECS.items()} == KERNEL_RECIPES
    assert config.RECIPES is SPECS and dmref.kernels.RECIPES is SPECS
    assert config.get_recipe("kernels_naive_fp8") is get_spec("kernels_naive_fp8") is SPECS["kernels_naive_fp8"]
    # a tiling other than the default refits the recipes' Recipe to its tile extents
    tiles = BwdTiles(128, 64, 64, 128, 8, 1, 8, 1)
    assert kernel_recipe("matched", tiles).ds_dk != KERNEL_RECIPES["kernels_delta_matching"].ds_dk


def test_recipes_are_named_by_their_recipes_and_validate_tiles():
    for name, spec in SPECS.items():
        assert spec.name == name and name.startswith("kernels_"), name
        assert spec.matched == name.endswith("delta_matching"), name
        assert spec.prepass == ("delta_prepass" in name), name
        assert spec.dsq_row == name.endswith("_dsq_row"), name
        assert spec.folded == name.startswith("kernels_folded_"), name
    # a folded K without the folded V is no forward the kernels have
    half = dataclasses.replace(kernel_recipe("stale"), k=SPECS["kernels_folded_naive_fp8"].recipe.k)
    with pytest.raises(ValueError, match="v: "):
        KernelSpec(half)
    with pytest.raises(ValueError, match="block_m"):
        FwdTiles(block_m=48)
    with pytest.raises(ValueError, match="block_m1"):
        BwdTiles(block_m1=256)
    with pytest.raises(ValueError, match="do_dp"):
        KernelSpec(kernel_recipe("matched", do_format="float16"))
    described = get_spec("kernels_delta_matching").recipe.describe()
    assert "delta  matched_deferred" in described and "ds_dq  E4M3, 1x64, pow2_down" in described


def test_a_recipe_object_builds_its_spec_and_a_preset_name_says_which_to_use():
    import dmref

    spec = get_spec(dmref.get_recipe("kernels_delta_matching"))
    assert spec is SPECS["kernels_delta_matching"]
    # a Recipe of the kernels' numerics that is not shipped builds its own spec
    e5m2 = kernel_recipe("stale", do_format="float8_e5m2")
    assert get_spec(e5m2).recipe == e5m2
    with pytest.raises(ValueError, match=r"use 'kernels_delta_matching'.*q: the kernels quantize it as E4M3, row"):
        get_spec("delta_matching")
    with pytest.raises(ValueError, match="use 'kernels_naive_fp8'"):
        get_spec(dmref.get_recipe("naive_fp8"))
    with pytest.raises(ValueError, match="not one of the kernels' recipes"):
        get_spec("no_such_recipe")
    # a retiled spec whose dS blocks differ has a name of its own
    retiled = SPECS["kernels_naive_fp8"].with_tiles(bwd=BwdTiles(128, 64, 64, 128, 8, 1, 8, 1))
    assert retiled.name == "kernels_naive_fp8_tiles128x128" and retiled.recipe != SPECS["kernels_naive_fp8"].recipe
    same = SPECS["kernels_naive_fp8"].with_tiles(bwd=dataclasses.replace(BwdTiles(), tma=False))
    assert same.recipe is SPECS["kernels_naive_fp8"].recipe


def test_backward_runs_kernels_by_name_and_rejects_unknown_names():
    pytest.importorskip("triton")
    from dmref.kernels import bwd

    with pytest.raises(ValueError, match=r"\['dkv'\] not among \('dq', 'dkdv'\)"):
        bwd.backward(None, None, None, None, batch=1, heads=1, kv_heads=1, n=16, head_dim=64, causal=False,
                     scale=0.125, recipe=get_spec("kernels_delta_matching"), kernels=("dq", "dkv"))
