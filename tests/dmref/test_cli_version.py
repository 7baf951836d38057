"""``dmref --version``: one line, ``dmref <version>``, the version pip installed (the one
pyproject.toml sets), status 0; the same from ``python -m dmref --version``."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dmref.cli import main, version

ROOT = Path(__file__).resolve().parents[2]


def test_version_is_the_installed_distributions():
    installed = importlib.metadata.version("dmref")
    assert version() == f"dmref {installed}"
    # the editable install of this tree: the version its pyproject.toml declares
    declared = re.search(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert declared is not None and installed == declared[1]


def test_version_option_prints_one_line_and_exits_0(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    out, err = capsys.readouterr()
    assert out == version() + "\n" and err == ""


def test_version_in_a_process():
    proc = subprocess.run([sys.executable, "-m", "dmref", "--version"], capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, version() + "\n", "")
