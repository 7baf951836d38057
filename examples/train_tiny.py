"""Train a tiny byte-level GPT whose attention runs an FP8 recipe: emulated bit for bit on the CPU
with ``dmref.attention``, or on a Hopper GPU with the Triton kernels ``dmref.kernels.attention``.

    python examples/train_tiny.py                          # CPU, delta_matching, 20 steps (< 1 min)
    python examples/train_tiny.py --recipe naive_fp8       # the same with a stale delta
    python examples/train_tiny.py --recipe kernels_delta_matching --steps 500 --context 256 \
        --batch 32                                         # on an H100/H200: the kernels

The text is this file's own bytes, so nothing is downloaded. Everything but attention is float32.
On a GPU of compute capability 9.0 the recipes the kernels run (``kernels_delta_matching``,
``kernels_naive_fp8``) run the kernels, which take BF16 q, k, v and head dims of 64 or 128;
elsewhere ``dmref.attention`` runs the recipe (the kernels' too, emulated) on the CPU.
examples/train_gpt.py is the longer study behind examples/README.md.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

# On a CPU shared with other processes, OpenMP threads that spin at every barrier make the many
# small ops of the emulation several times slower; waiting passively costs nothing when alone.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402  (after OMP_WAIT_POLICY)
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import dmref  # noqa: E402

KERNEL_RECIPES = ("kernels_delta_matching", "kernels_naive_fp8")  #: names of dmref.kernels.RECIPES


def hopper_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def make_attention(recipe: str, use_kernels: bool):
    """``attend(q, k, v)`` for (batch, heads, tokens, head_dim) float32 tensors, causal."""
    if use_kernels:
        from dmref.kernels import attention as fp8_kernels

        def attend(q, k, v):
            return fp8_kernels(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True, recipe=recipe).float()
    else:
        def attend(q, k, v):
            return dmref.attention(q, k, v, causal=True, recipe=recipe)
    return attend


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int, attend):
        super().__init__()
        self.heads, self.attend = heads, attend
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(self.attend(q, k, v).transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, d_model: int, heads: int, layers: int, context: int, attend):
        super().__init__()
        self.tok, self.pos = nn.Embedding(256, d_model), nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads, attend) for _ in range(layers))
        self.ln = nn.LayerNorm(d_model)
        nn.init.normal_(self.tok.weight, std=0.02)  # tied with the output layer: small initial logits
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.ln(x) @ self.tok.weight.T  # tied embeddings: logits over the 256 byte values


def fail(message: str):
    """Bad input: one line on stderr, exit status 2."""
    print(f"train_tiny.py: {message}", file=sys.stderr)
    raise SystemExit(2)


def main(argv=None) -> list[float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="delta_matching", help="a dmref recipe: a preset or a kernel recipe (default: %(default)s)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="auto: the kernels on a Hopper GPU, else the CPU emulation")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=32)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args(argv)
    for name in ("steps", "batch", "context", "d_model", "heads", "layers"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.d_model % args.heads:
        fail(f"--d-model {args.d_model} is not a multiple of --heads {args.heads}")
    device = ("cuda" if hopper_available() else "cpu") if args.device == "auto" else args.device
    use_kernels = device == "cuda" and hopper_available() and args.recipe in KERNEL_RECIPES
    if use_kernels and args.d_model // args.heads not in (64, 128):
        fail(f"the kernels take head dims 64 or 128, got {args.d_model // args.heads}")

    torch.manual_seed(0)
    data = torch.frombuffer(bytearray(open(__file__, "rb").read()), dtype=torch.uint8).long().to(device)
    if data.numel() <= args.context + 1:
        fail(f"--context {args.context} is longer than the text ({data.numel()} bytes)")
    model = TinyGPT(args.d_model, args.heads, args.layers, args.context,
                    make_attention(args.recipe, use_kernels)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    where = "dmref.kernels.attention on " + torch.cuda.get_device_name() if use_kernels else \
        f"dmref.attention on {device}"
    print(f"recipe {args.recipe}, {where}; uniform loss {math.log(256):.3f}")
    losses = []
    for step in range(args.steps):
        start = torch.randint(0, data.numel() - args.context - 1, (args.batch,), device=device)
        window = torch.stack([data[s:s + args.context + 1] for s in start.tolist()])
        loss = F.cross_entropy(model(window[:, :-1]).flatten(0, 1), window[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {losses[-1]:.3f}", flush=True)
    return losses


if __name__ == "__main__":
    main()
