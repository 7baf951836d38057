"""examples/train_tiny.py runs on the CPU at a tiny size: FP8 attention emulated by
``dmref.attention`` trains (the loss falls), the recipe is really in use (its first loss differs
from exact attention's on the same weights and batch), and bad input exits with status 2."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_tiny.py"
TINY = ["--device", "cpu", "--steps", "4", "--batch", "2", "--context", "16", "--d-model", "32",
        "--heads", "2", "--layers", "1"]


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread: on a shared CPU, two threads meeting at barriers make these small ops
    several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def train_tiny():
    spec = importlib.util.spec_from_file_location("train_tiny", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_tiny_trains_with_emulated_fp8_attention(train_tiny, one_thread, capsys):
    fp8 = train_tiny.main(TINY + ["--recipe", "delta_matching"])
    exact = train_tiny.main(TINY + ["--recipe", "exact"])
    assert "dmref.attention on cpu" in capsys.readouterr().out
    assert len(fp8) == 4 and all(math.isfinite(x) for x in fp8)
    assert fp8[-1] < fp8[0]
    # same seed, weights and first batch: only the attention's rounding separates the two
    assert fp8[0] != exact[0]


@pytest.mark.parametrize("argv,named", [(["--steps", "0"], "--steps"),
                                        (["--d-model", "30", "--heads", "4"], "--d-model 30"),
                                        (["--context", "1000000"], "--context 1000000")])
def test_train_tiny_rejects_bad_input_with_status_2(train_tiny, capsys, argv, named):
    with pytest.raises(SystemExit) as exit_info:
        train_tiny.main(["--device", "cpu"] + argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and named in err
