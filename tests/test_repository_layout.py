"""The clone on sys.path. A clone named dmref in the current directory: ``import dmref`` run from
its parent finds the repository folder before the installed package; it stops with a message
saying so, instead of an empty namespace package whose ``dmref.attention`` is an AttributeError.
Run from the clone's root: its folders are importable names, and none of them may shadow another
package."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env=env)


@pytest.fixture
def parent_of_a_clone(tmp_path) -> Path:
    """A folder holding this repository under the name dmref (a symbolic link to it)."""
    try:
        (tmp_path / "dmref").symlink_to(ROOT, target_is_directory=True)
    except OSError as e:
        pytest.skip(f"cannot make a symbolic link here: {e}")
    return tmp_path


def test_import_from_the_parent_of_a_clone_says_what_it_found(parent_of_a_clone):
    proc = _python("import dmref", parent_of_a_clone)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: 'import dmref' found ") and "a clone of the dmref repository" in last
    assert "Run Python from another directory" in last


def test_import_from_inside_the_clone_is_the_package():
    proc = _python("import dmref; print(dmref.attention.__module__)", ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "dmref.api"


def test_the_clone_root_shadows_no_other_package():
    """Python run at the root of the clone (as the README says to) has the root first on sys.path,
    so a folder there is an importable name: a root-level ``kernels/`` once shadowed Hugging
    Face's ``kernels`` package, which transformers imports, and no transformers model could be
    built from the clone's root. dmref's subpackages live under ``dmref/``."""
    # whether the name resolves to a folder or module at the root itself (a virtual environment
    # inside the clone, as .ci/run makes, may hold the real package further down)
    code = ("import importlib.util as u, os\n"
            "for name in ('kernels', 'emulation', 'proofs'):\n"
            "    spec = u.find_spec(name)\n"
            "    places = (spec.submodule_search_locations or [spec.origin or '']) if spec else []\n"
            "    print(name, any(os.path.dirname(os.path.abspath(p)) == os.getcwd() or "
            "os.path.dirname(os.path.dirname(os.path.abspath(p))) == os.getcwd() and p.endswith('__init__.py') "
            "for p in places))\n")
    proc = _python(code, ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["kernels", "False", "emulation", "False", "proofs", "False"]


@pytest.mark.slow
def test_a_transformers_model_builds_at_the_clone_root():
    pytest.importorskip("transformers")
    code = ("from transformers import LlamaConfig, LlamaForCausalLM\n"
            "LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, "
            "num_attention_heads=2, num_key_value_heads=2, vocab_size=16))\n"
            "import dmref.integrations.transformers\n"
            "print('built')\n")
    proc = _python(code, ROOT)
    assert proc.returncode == 0, proc.stderr.strip().splitlines()[-1:]
    assert proc.stdout.strip() == "built"
