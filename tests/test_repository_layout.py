"""A clone named dmref in the current directory: ``import dmref`` run from its parent finds the
repository folder before the installed package. It stops with a message saying so, instead of
an empty namespace package whose ``dmref.attention`` is an AttributeError."""

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
