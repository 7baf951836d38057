"""dmref.kernels imports without triton or a GPU; calling it without a GPU fails clearly."""

from __future__ import annotations

import dataclasses

import os
import subprocess
import sys

import pytest

from dmref.kernels.config import RECIPES, BwdTiles, FwdTiles, KernelRecipe, get_recipe, kernel_recipe

_SCRIPT = """
import sys
import torch
import dmref.kernels as K
assert "triton" not in sys.modules, "importing dmref.kernels imported triton"
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


def test_recipes_name_their_reference_presets_and_validate_tiles():
    for name, r in RECIPES.items():
        assert r.delta == ("matched" if name.endswith("delta_matching") else "stale"), name
        assert r.folded == name.startswith("folded_"), name
    # a folded K without the folded V is no forward the kernels have
    half = dataclasses.replace(kernel_recipe("stale"), k=RECIPES["folded_naive_fp8"].recipe.k)
    with pytest.raises(ValueError, match="v: "):
        KernelRecipe(name="x", recipe=half)
    with pytest.raises(ValueError, match="block_n"):
        FwdTiles(block_n=48)
    with pytest.raises(ValueError, match="block_m1"):
        BwdTiles(block_m1=256)
    with pytest.raises(ValueError, match="do_dp"):
        KernelRecipe(name="x", recipe=kernel_recipe("matched", do_format="float16"))
    described = get_recipe("delta_matching").recipe.describe()
    assert "delta  matched_deferred" in described and "ds_dq  E4M3, 1x64, pow2_down" in described


def test_backward_runs_kernels_by_name_and_rejects_unknown_names():
    pytest.importorskip("triton")
    from dmref.kernels import bwd

    with pytest.raises(ValueError, match=r"\['dkv'\] not among \('dq', 'dkdv'\)"):
        bwd.backward(None, None, None, None, batch=1, heads=1, kv_heads=1, n=16, head_dim=64, causal=False,
                     scale=0.125, recipe=get_recipe("delta_matching"), kernels=("dq", "dkv"))
