"""Train examples/train_tiny.py's model with PyTorch's own distributed engines, unchanged:
DistributedDataParallel (``--mode ddp``), FSDP2 ``fully_shard`` (``--mode fsdp2``), or one process
(``--mode single``, optionally accumulating gradients over ``--accumulate`` micro-batches).

    torchrun --standalone --nproc-per-node 2 examples/train_distributed.py --mode ddp --out ddp.json
    torchrun --standalone --nproc-per-node 2 examples/train_distributed.py --mode fsdp2 --out fsdp2.json
    python examples/train_distributed.py --mode single --out single.json           # the same global batch
    python examples/train_distributed.py --mode single --accumulate 2 --out acc.json  # DDP's sums

With GPUs each rank takes ``cuda:LOCAL_RANK`` and NCCL, and the FP8 recipes run the Triton kernels
``dmref.kernels.attention`` on compute capability 9.0; without GPUs each rank runs on the CPU with
gloo and ``dmref.attention`` emulates the recipe. NVLink multicast is switched off for NCCL
(NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1).

``--batch`` is the global batch: every step draws it from a generator seeded with (seed, step),
so the data order depends on nothing but the step, and rank r trains on rows
[r * batch / world, (r + 1) * batch / world). The reported loss of a step is the mean over ranks
of the per-rank mean losses (for equal shards: the mean over the global batch).

Checkpoints (``--save-at S --ckpt DIR``: the state after S steps) hold the model, the optimizer
and the step, written with torch.distributed.checkpoint (DCP) from
``torch.distributed.checkpoint.state_dict.get_state_dict``: every rank writes its own shards (no
gather of FSDP2's parameters onto one rank), the keys are the plain module's names in every mode,
and loading reshards, so a checkpoint written by one mode or world size loads in another (tested:
a 2-rank FSDP2 checkpoint resumed by one process).
``--resume --ckpt DIR`` continues from it to ``--steps``. ``--out`` writes the loss curve as JSON;
``python examples/train_distributed.py --compare ref.json a.json ...`` compares curves (see
docs/distributed.md).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import warnings
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see train_tiny.py
# NVLink multicast stays off for every process this script starts (project rule).
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_tiny  # noqa: E402  (the model, the text and make_attention)
from dmref.recipes import get_recipe  # noqa: E402

MODES = ("single", "ddp", "fsdp2")


def fail(message: str):
    """Bad input: one line on stderr, exit status 2."""
    print(f"train_distributed.py: {message}", file=sys.stderr)
    raise SystemExit(2)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=MODES, default="ddp")
    ap.add_argument("--recipe", default="delta_matching", help="a dmref recipe: a preset or a kernel recipe (default: %(default)s)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="auto: cuda when GPUs are present, else cpu")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8, help="global batch (split across ranks)")
    ap.add_argument("--accumulate", type=int, default=1,
                    help="single mode: micro-batches per step, gradients summed as DDP sums ranks")
    ap.add_argument("--context", type=int, default=32)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-grad-norm", type=float, default=1.0,
                    help="clip the gradient norm to this (0: no clipping; default: %(default)s)")
    ap.add_argument("--ckpt", default=None, help="checkpoint directory (DCP)")
    ap.add_argument("--save-at", type=int, default=None, help="save the state after this many steps")
    ap.add_argument("--resume", action="store_true", help="continue from --ckpt")
    ap.add_argument("--out", default=None, help="JSON file for the loss curve (written by rank 0)")
    args = ap.parse_args(argv)
    for name in ("steps", "batch", "accumulate", "context", "d_model", "heads", "layers"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.d_model % args.heads:
        fail(f"--d-model {args.d_model} is not a multiple of --heads {args.heads}")
    try:
        get_recipe(args.recipe)
    except ValueError as err:
        fail(f"--recipe: {err}")
    if not args.max_grad_norm >= 0:
        fail(f"--max-grad-norm must be >= 0, got {args.max_grad_norm}")
    if args.accumulate > 1 and args.mode != "single":
        fail(f"--accumulate {args.accumulate} is for --mode single; --mode {args.mode} splits over ranks")
    if args.save_at is not None and not 1 <= args.save_at <= args.steps:
        fail(f"--save-at {args.save_at} must be in [1, --steps {args.steps}]")
    if (args.save_at is not None or args.resume) and not args.ckpt:
        fail("--save-at and --resume need --ckpt DIR")
    if args.resume and not Path(args.ckpt).is_dir():
        fail(f"--resume: checkpoint directory {args.ckpt!r} does not exist")
    return args


def gamma(n: int, u: float) -> float:
    """Higham's gamma_n = n u / (1 - n u): the relative error bound of n roundings."""
    if not n * u < 1:
        raise ValueError(f"{n=} roundings of unit roundoff {u=} have no bound (n u >= 1)")
    return n * u / (1 - n * u)


def first_step_loss_bound(loss: float, tokens: int, parts: int, u: float = 2.0 ** -24) -> float:
    """Bound on |L_parts - L_one| for the first step's loss (identical weights), where L_one is the
    float32 mean of ``tokens`` per-token losses l_i >= 0 in one reduction and L_parts the mean of
    ``parts`` equal shards' float32 means (ranks x micro-batches: summed, then divided by parts).

    Any order of summing m non-negative terms errs by at most gamma_(m-1) times their exact sum,
    and each division adds one rounding, so with L the exact mean
    |L_one - L| <= gamma_tokens L and |L_parts - L| <= gamma_(tokens / parts + parts) L; with
    L <= L_one / (1 - gamma_tokens) (``loss`` = L_one) the two add up to the bound returned.

    Precondition: every l_i is the same float32 number whether the forward sees the whole batch
    or a shard (checked by tests/test_distributed.py): batch rows are independent in the model,
    and the recipes' scales are per row or block (not per tensor, as cudnn_fp8's are). From the
    second step on the weights differ by the gradients' other summation order, amplified by the
    optimizer; that part is measured, not bounded.
    """
    if tokens % parts:
        raise ValueError(f"{tokens=} is not a multiple of {parts=}")
    g_one = gamma(tokens, u)
    return (g_one + gamma(tokens // parts + parts, u)) * loss / (1 - g_one)


def setup(args):
    """(rank, world, device): a process group for ddp / fsdp2 (NCCL on cuda, gloo on cpu)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if args.mode == "single" and world != 1:
        fail(f"--mode single runs one process, got WORLD_SIZE={world}")
    cuda = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        fail("--device cuda: no CUDA device")
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        # bit-identical reruns (resume) need deterministic kernels, e.g. the embedding backward
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    else:
        device = torch.device("cpu")
        # one thread in every process: the same summation order in every mode, and a fair share
        # of a shared CPU
        torch.set_num_threads(1)
    if args.mode != "single":
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    if args.batch % (world * args.accumulate):
        fail(f"--batch {args.batch} is not a multiple of world size x --accumulate = "
             f"{world * args.accumulate}")
    return rank, world, device


def text_bytes(device) -> torch.Tensor:
    """The training text: train_tiny.py's own bytes, as int64 token ids."""
    raw = bytearray(Path(train_tiny.__file__).read_bytes())
    return torch.frombuffer(raw, dtype=torch.uint8).long().to(device)


def global_batch(data: torch.Tensor, step: int, batch: int, context: int, seed: int) -> torch.Tensor:
    """The (batch, context + 1) windows of ``step``: a function of (seed, step) only."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    start = torch.randint(0, data.numel() - context - 1, (batch,), generator=gen)
    return torch.stack([data[s:s + context + 1] for s in start.tolist()])


def build_model(args, device, use_kernels: bool):
    """train_tiny.TinyGPT, initialised from ``--seed`` on the CPU (the same weights everywhere)."""
    torch.manual_seed(args.seed)
    attend = train_tiny.make_attention(args.recipe, use_kernels)
    model = train_tiny.TinyGPT(args.d_model, args.heads, args.layers, args.context, attend)
    return model.to(device)


def wrap(model, mode: str, device):
    """DDP or FSDP2 around ``model``; the plain module for single."""
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        device_ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)
    if mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)  # the root: embeddings (tied with the output layer) and the last norm
    return model


def save_checkpoint(path: str, model, opt, step: int):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model_sd, opt_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": opt_sd, "step": step}, checkpoint_id=path,
             no_dist=not dist.is_initialized())


def load_checkpoint(path: str, model, opt) -> int:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model_sd, opt_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": opt_sd, "step": -1}
    with warnings.catch_warnings():  # dcp.load warns whenever it loads in one process, as meant here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, checkpoint_id=path, no_dist=not dist.is_initialized())
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["step"])


def train_step(model, opt, windows, world: int, accumulate: int, max_grad_norm: float) -> torch.Tensor:
    """One optimizer step on this rank's windows; returns the global mean loss (float32)."""
    opt.zero_grad(set_to_none=True)
    total = None
    for micro in windows.chunk(accumulate):
        loss = F.cross_entropy(model(micro[:, :-1]).flatten(0, 1), micro[:, 1:].flatten())
        loss.backward()  # ddp / fsdp2: gradients / world, summed over ranks (all-reduce / reduce-scatter)
        total = loss.detach() if total is None else total + loss.detach()
    if accumulate > 1:  # the sum of micro-batch gradients, each / accumulate: DDP's arithmetic
        for p in model.parameters():
            p.grad.div_(accumulate)
    if max_grad_norm > 0:  # fsdp2: the norm sums squares per shard, then over ranks
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    opt.step()
    if world > 1:
        dist.all_reduce(total)
    return total / (world * accumulate)


def float32_ulp(x: float) -> float:
    """The spacing of float32 numbers at |x| (normal range)."""
    return 2.0 ** (math.frexp(abs(x))[1] - 24)


def compare(paths: list[str]) -> dict:
    """Loss curves of ``paths`` against the first (one process, whole batch): per step |difference|
    in float32 ulps of the reference loss, the first step's bound, and which curves are
    bit-identical."""
    runs = {Path(p).stem: json.loads(Path(p).read_text()) for p in paths}
    names = list(runs)
    ref = runs[names[0]]
    same = ("recipe", "global_batch", "context", "d_model", "heads", "layers", "lr", "seed")
    for name, run in runs.items():
        differ = [key for key in same if run.get(key) != ref.get(key)]
        if differ or run.get("first_step") != 0 or len(run["losses"]) != len(ref["losses"]):
            fail(f"--compare: {name} is not the same training from step 0 as {names[0]} "
                 f"(differs in {differ or ['first_step or the number of steps']})")
    tokens = ref["global_batch"] * ref["context"]
    summary = {"reference": names[0], "runs": {}}
    for name in names[1:]:
        run = runs[name]
        parts = run["world_size"] * run["accumulate"]
        pairs = list(zip(ref["losses"], run["losses"]))
        summary["runs"][name] = {
            "mode": run["mode"], "world_size": run["world_size"], "accumulate": run["accumulate"],
            "max_grad_norm": run["max_grad_norm"],
            "first_step_diff": abs(pairs[0][1] - pairs[0][0]),
            "first_step_bound": first_step_loss_bound(pairs[0][0], tokens, parts),
            "diff_ulps": [abs(b - a) / float32_ulp(a) for a, b in pairs],
            "bit_identical_to": [other for other in names if other != name
                                 and runs[other]["losses"] == run["losses"]],
        }
    return summary


def main(argv=None) -> list[float]:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--compare"]:
        if len(argv) < 3 or not all(Path(p).is_file() for p in argv[1:]):
            fail(f"--compare takes two or more loss-curve JSON files (reference first), got {argv[1:]}")
        print(json.dumps(compare(argv[1:]), indent=1))
        return []
    args = parse_args(argv)
    rank, world, device = setup(args)
    use_kernels = device.type == "cuda" and train_tiny.hopper_available() and \
        args.recipe in train_tiny.KERNEL_RECIPES
    if use_kernels and args.d_model // args.heads not in (64, 128):
        fail(f"the kernels take head dims 64 or 128, got {args.d_model // args.heads}")
    data = text_bytes(device)
    if data.numel() <= args.context + 1:
        fail(f"--context {args.context} is longer than the text ({data.numel()} bytes)")
    model = wrap(build_model(args, device, use_kernels), args.mode, device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    first = load_checkpoint(args.ckpt, model, opt) if args.resume else 0
    where = "dmref.kernels.attention" if use_kernels else "dmref.attention (emulated)"
    if rank == 0:
        print(f"{args.mode}, world {world}, {device.type}, recipe {args.recipe} via {where}; "
              f"steps {first}..{args.steps - 1}", flush=True)
    shard = args.batch // world
    losses = []
    for step in range(first, args.steps):
        windows = global_batch(data, step, args.batch, args.context, args.seed)
        windows = windows[rank * shard:(rank + 1) * shard]
        losses.append(train_step(model, opt, windows, world, args.accumulate, args.max_grad_norm).item())
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {losses[-1]:.6f}", flush=True)
        if args.save_at == step + 1:
            save_checkpoint(args.ckpt, model, opt, step + 1)
    if rank == 0 and args.out:
        record = {"mode": args.mode, "world_size": world, "accumulate": args.accumulate,
                  "device": device.type, "backend": dist.get_backend() if dist.is_initialized() else None,
                  "attention": where, "recipe": args.recipe, "global_batch": args.batch,
                  "context": args.context, "d_model": args.d_model, "heads": args.heads,
                  "layers": args.layers, "lr": args.lr, "max_grad_norm": args.max_grad_norm,
                  "seed": args.seed, "first_step": first, "losses": losses}
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    if dist.is_initialized():
        del model, opt  # they hold the process group: freed before it ends (see shutdown)
        shutdown()
    return losses


def shutdown():
    """Ends the process group so that no gloo thread outlives it: every rank waits for the others
    (none tears its connections down while another still talks), and what still holds the group
    (the caller has dropped the wrapped model and the optimizer) is collected while the interpreter
    is alive. Without this, a rank that finished first aborted now and then at interpreter exit
    ("terminate called without an active exception", no Python frame): a gloo object destroyed
    during finalization."""
    dist.barrier()
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
