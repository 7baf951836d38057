"""examples/train_distributed.py under PyTorch's own distributed engines, on the CPU with gloo
(two processes started by torchrun) and, marked ``gpu``, on two GPUs with NCCL.

What is checked:

- the per-token losses do not depend on how the global batch is split (the precondition of the
  first-step bound);
- DDP and FSDP2 compute the arithmetic of one process that accumulates the same micro-batches
  (bit for bit: with two ranks the gradient all-reduce / reduce-scatter adds the same two
  numbers); FSDP2 with clipping is left out of that claim, because its gradient norm sums the
  squares per shard and then over ranks, another order than the whole tensors' norm;
- against one process on the whole global batch, the first step's loss is within
  ``first_step_loss_bound`` (reduction order only); the later steps are recorded, not bounded;
- a run resumed from a torch.distributed.checkpoint checkpoint gives the same losses, bit for
  bit, as the uninterrupted run, for DDP and for FSDP2, and FSDP2's sharded checkpoint resumes
  in one process;
- the attention (dmref.kernels.attention on two GPUs with NCCL, ``gpu``; dmref.attention on two
  gloo CPU processes here) gives the same bytes on both ranks for the same inputs (SHA-256 of
  the outputs and gradients, gathered with all_gather_object).

The training tests share one fixture of four torchrun launches (about 2 minutes on a loaded 2-core CPU,
most of it starting processes), so they are marked ``slow``:
``python -m pytest tests/test_distributed.py -m "slow and not gpu"``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_distributed.py"
TINY = ["--device", "cpu", "--steps", "4", "--batch", "4", "--context", "16", "--d-model", "32",
        "--heads", "2", "--layers", "1"]
SAVE_AT = 2
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@pytest.fixture(scope="module")
def td():
    spec = importlib.util.spec_from_file_location("train_distributed", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def torchrun_cmd(argv, out: Path, nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            str(SCRIPT), *argv, "--out", str(out)]


def finish(proc: subprocess.Popen, out: Path, nproc: int = 2) -> list[float]:
    """Waits for a torchrun started by ``start``; returns rank 0's loss curve."""
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-4000:]
    record = json.loads(out.read_text())
    assert record["world_size"] == nproc
    return record["losses"]


def start(argv, out: Path, nproc: int = 2) -> subprocess.Popen:
    """The script under torchrun (nproc processes), NVLink multicast off."""
    return subprocess.Popen(torchrun_cmd(argv, out, nproc), env={**os.environ, **NO_MULTICAST},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def torchrun(argv, out: Path, nproc: int = 2) -> list[float]:
    return finish(start(argv, out, nproc), out, nproc)


@pytest.fixture(scope="module")
def runs(td, one_thread, tmp_path_factory):
    """Loss curves. DDP (clipping) and FSDP2 (no clipping) under torchrun, each saving a
    checkpoint after SAVE_AT steps, then each resumed from it (the two launches of a stage run
    side by side: most of a launch is waiting for imports); meanwhile, in this process, one
    process on the whole batch and on 2 accumulated micro-batches, with and without clipping."""
    tmp = tmp_path_factory.mktemp("dist")
    noclip = ["--max-grad-norm", "0"]
    extra = {"ddp": [], "fsdp2": noclip}
    first = {mode: start(TINY + ["--mode", mode, "--ckpt", str(tmp / mode), "--save-at", str(SAVE_AT)]
                         + extra[mode], tmp / f"{mode}.json") for mode in extra}
    curves = {
        "single": td.main(TINY + ["--mode", "single"]),
        "accumulate": td.main(TINY + ["--mode", "single", "--accumulate", "2"]),
        "single_noclip": td.main(TINY + ["--mode", "single"] + noclip),
        "accumulate_noclip": td.main(TINY + ["--mode", "single", "--accumulate", "2"] + noclip),
    }
    curves.update({mode: finish(proc, tmp / f"{mode}.json") for mode, proc in first.items()})
    second = {mode: start(TINY + ["--mode", mode, "--ckpt", str(tmp / mode), "--resume"] + extra[mode],
                          tmp / f"{mode}_resumed.json") for mode in extra}
    # FSDP2's sharded checkpoint, loaded into one process (resharded by DCP)
    curves["fsdp2_into_accumulate"] = td.main(TINY + ["--mode", "single", "--accumulate", "2", "--ckpt",
                                                      str(tmp / "fsdp2"), "--resume"] + noclip)
    curves.update({f"{mode}_resumed": finish(proc, tmp / f"{mode}_resumed.json")
                   for mode, proc in second.items()})
    return curves


def check_first_step(td, distributed: list[float], single: list[float]):
    tokens = 4 * 16  # TINY's --batch x --context
    bound = td.first_step_loss_bound(single[0], tokens, parts=2)
    assert bound > 0
    assert abs(distributed[0] - single[0]) <= bound, (distributed[0], single[0], bound)
    assert all(math.isfinite(x) for x in distributed) and len(distributed) == len(single)


def test_per_token_losses_do_not_depend_on_the_batch_split(td, one_thread):
    args = td.parse_args(TINY + ["--mode", "single"])
    model = td.build_model(args, torch.device("cpu"), use_kernels=False)
    data = td.text_bytes(torch.device("cpu"))
    windows = td.global_batch(data, 0, args.batch, args.context, args.seed)

    def per_token(w):
        return torch.nn.functional.cross_entropy(model(w[:, :-1]).flatten(0, 1), w[:, 1:].flatten(),
                                                 reduction="none")
    with torch.no_grad():
        whole = per_token(windows)
        split = torch.cat([per_token(half) for half in windows.chunk(2)])
    assert whole.dtype == torch.float32 and torch.equal(whole, split)


@pytest.mark.slow
def test_ddp_is_accumulation_and_within_the_bound_of_one_process(td, runs):
    curves = runs
    assert curves["ddp"] == curves["accumulate"]  # bit for bit, every step
    check_first_step(td, curves["ddp"], curves["single"])


@pytest.mark.slow
def test_fsdp2_is_accumulation_and_within_the_bound_of_one_process(td, runs):
    curves = runs
    assert curves["fsdp2"] == curves["accumulate_noclip"]  # bit for bit, every step
    check_first_step(td, curves["fsdp2"], curves["single_noclip"])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_resume_from_checkpoint_continues_exactly(runs, mode):
    resumed, uninterrupted = runs[f"{mode}_resumed"], runs[mode]
    assert len(resumed) == len(uninterrupted) - SAVE_AT
    assert resumed == uninterrupted[SAVE_AT:]


@pytest.mark.slow
def test_fsdp2_checkpoint_resumes_in_one_process(runs):
    """Resharding: the 2-rank FSDP2 checkpoint, loaded by one process that accumulates the same 2
    micro-batches, continues the FSDP2 run bit for bit."""
    assert runs["fsdp2_into_accumulate"] == runs["fsdp2"][SAVE_AT:]


@pytest.mark.parametrize("argv,named", [
    (["--mode", "ddp", "--accumulate", "2"], "--accumulate 2"),
    (["--mode", "single", "--accumulate", "3"], "--batch 4"),
    (["--mode", "single", "--save-at", "9", "--ckpt", "x"], "--save-at 9"),
    (["--mode", "single", "--resume", "--ckpt", "/nonexistent/ckpt"], "/nonexistent/ckpt"),
    (["--mode", "single", "--max-grad-norm", "-1"], "--max-grad-norm"),
    (["--mode", "single", "--recipe", "fp9"], "'fp9'"),
])
def test_bad_input_exits_with_status_2(td, one_thread, capsys, argv, named):
    with pytest.raises(SystemExit) as exit_info:
        td.main(TINY + argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and named in err


def test_compare_reports_ulps_bound_and_identical_curves(td, tmp_path, capsys):
    base = {"mode": "single", "world_size": 1, "accumulate": 1, "max_grad_norm": 1.0, "recipe": "exact",
            "global_batch": 4, "context": 16, "d_model": 32, "heads": 2, "layers": 1, "lr": 3e-3,
            "seed": 0, "first_step": 0, "losses": [5.0, 4.0]}
    ulp = td.float32_ulp(5.0)
    assert ulp == 2.0 ** -21
    curves = {"one": base, "acc": {**base, "accumulate": 2, "losses": [5.0 + ulp, 4.0]},
              "ddp": {**base, "mode": "ddp", "world_size": 2, "losses": [5.0 + ulp, 4.0]}}
    paths = []
    for name, record in curves.items():
        paths.append(str(tmp_path / f"{name}.json"))
        Path(paths[-1]).write_text(json.dumps(record))
    td.main(["--compare"] + paths)
    summary = json.loads(capsys.readouterr().out)
    ddp = summary["runs"]["ddp"]
    assert summary["reference"] == "one" and ddp["bit_identical_to"] == ["acc"]
    assert ddp["diff_ulps"] == [1.0, 0.0] and ddp["first_step_diff"] == ulp
    assert ddp["first_step_bound"] == td.first_step_loss_bound(5.0, 64, 2)
    with pytest.raises(SystemExit) as exit_info:
        td.main(["--compare", paths[0], str(tmp_path / "missing.json")])
    assert exit_info.value.code == 2 and "missing.json" in capsys.readouterr().err
    Path(paths[2]).write_text(json.dumps({**curves["ddp"], "seed": 1}))
    with pytest.raises(SystemExit) as exit_info:
        td.main(["--compare"] + paths)
    assert exit_info.value.code == 2 and "['seed']" in capsys.readouterr().err


# ---- the same inputs on two ranks give the same bits ----------------------------------------

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()


def _attention_digests_worker(kind: str, out: str):
    """One rank under torchrun: attention forward and backward on the same seeded inputs, the
    SHA-256 of the bytes of q, out, dq, dk, dv gathered with all_gather_object; rank 0 writes
    them. ``kind``: "kernels" (NCCL, dmref.kernels.attention on cuda:LOCAL_RANK, BF16) or
    "emulated" (gloo, dmref.attention on the CPU, float32, small)."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if kind == "kernels":
        from dmref.kernels import attention
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        shape, dtype, where = (2, 4, 384, 64), torch.bfloat16, f"cuda:{torch.cuda.current_device()}"
    else:
        from dmref import attention
        torch.set_num_threads(1)
        device = torch.device("cpu")
        dist.init_process_group("gloo")
        shape, dtype, where = (1, 2, 32, 16), torch.float32, f"cpu pid {os.getpid()}"
    digests = {"where": where}
    # the kernels run their own recipes; the CPU emulates the presets
    recipes = ("kernels_delta_matching", "kernels_naive_fp8") if kind == "kernels" else ("delta_matching", "naive_fp8")
    for recipe in recipes:
        for causal in (False, True):
            gen = torch.Generator().manual_seed(1234)
            q, k, v, dout = (torch.randn(*shape, generator=gen).to(device, dtype) for _ in range(4))
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            o = attention(q, k, v, causal=causal, recipe=recipe)
            dq, dk, dv = torch.autograd.grad(o, (q, k, v), dout)
            assert all(torch.isfinite(t).all() for t in (o, dq, dk, dv))
            digests[f"{recipe} causal={causal}"] = {name: _digest(t) for name, t in
                                                    (("q", q), ("out", o), ("dq", dq), ("dk", dk), ("dv", dv))}
    gathered = [None] * world
    dist.all_gather_object(gathered, digests)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered, indent=1))
    dist.destroy_process_group()


def check_digests(kind: str, tmp_path: Path):
    out = tmp_path / f"{kind}_digests.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           __file__, kind, str(out)]
    done = subprocess.run(cmd, env={**os.environ, **NO_MULTICAST}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = json.loads(out.read_text())
    where = [r.pop("where") for r in ranks]
    assert len(set(where)) == 2, where  # two processes (two GPUs for the kernels)
    assert ranks[0] == ranks[1]
    assert len(ranks[0]) == 4
    return where


@pytest.mark.slow
def test_emulated_attention_gives_bit_identical_results_on_two_gloo_ranks(tmp_path):
    """The harness of the two-GPU test, run here: two gloo processes, dmref.attention."""
    check_digests("emulated", tmp_path)


@pytest.mark.gpu
@two_gpus
def test_kernels_give_bit_identical_results_on_two_gpus(tmp_path):
    """Two NCCL processes on two GPUs, dmref.kernels.attention on the same inputs."""
    assert check_digests("kernels", tmp_path) == ["cuda:0", "cuda:1"]


@pytest.mark.gpu
@pytest.mark.slow
@two_gpus
def test_training_on_two_gpus_is_accumulation(td, tmp_path):
    """DDP and FSDP2 (no clipping) with the kernels, on two GPUs: bit for bit the curve of one GPU
    accumulating the same two micro-batches, and within the first-step bound of one GPU on the
    whole batch."""
    gpu = ["--device", "cuda", "--recipe", "kernels_delta_matching", "--steps", "6", "--batch", "8", "--context",
           "64", "--d-model", "128", "--heads", "2", "--layers", "2", "--max-grad-norm", "0"]
    single = torchrun(gpu + ["--mode", "single"], tmp_path / "single.json", nproc=1)
    accumulate = torchrun(gpu + ["--mode", "single", "--accumulate", "2"], tmp_path / "acc.json", nproc=1)
    for mode in ("ddp", "fsdp2"):
        curve = torchrun(gpu + ["--mode", mode, "--ckpt", str(tmp_path / mode), "--save-at", "3"],
                         tmp_path / f"{mode}.json")
        assert curve == accumulate, mode
        tokens = 8 * 64
        assert abs(curve[0] - single[0]) <= td.first_step_loss_bound(single[0], tokens, parts=2)
        resumed = torchrun(gpu + ["--mode", mode, "--ckpt", str(tmp_path / mode), "--resume"],
                           tmp_path / f"{mode}_resumed.json")
        assert resumed == curve[3:], mode


if __name__ == "__main__":  # a rank of check_digests, started by torchrun
    # run as a script, tests/ leads sys.path, and tests/dmref would shadow the dmref package
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    _attention_digests_worker(sys.argv[1], sys.argv[2])
