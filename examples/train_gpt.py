"""Train a tiny GPT on the Python standard library's own source files with dmref's emulated
attention recipes, and compare BF16, naive FP8, stale-delta FP8 and Delta-Matching: the script
that produces the committed figures and tables of examples/README.md (examples/results/,
examples/results_gpu/). For a short example to copy, see examples/train_tiny.py.

    python examples/train_gpt.py                       # CPU, ~3-5 minutes on 2 cores
    python examples/train_gpt.py --steps 100 --recipes bf16 delta_matching   # quicker
    python examples/train_gpt.py --device cuda --kernels --d-model 512 --heads 8 --layers 8 \\
        --context 1024 --steps 2000 --batch 32 --eval-every 500 --diag-heads 1 \\
        --recipes exact bf16 kernels_naive_fp8 kernels_delta_matching --out examples/results_gpu  # GPU

Everything but attention is float32 (embeddings, linear layers, LayerNorm, AdamW); attention is
``dmref.attention(q, k, v, causal=True, recipe=R)``, whose forward and backward follow recipe R
bit for bit on the CPU (FP8 casts, block scales, the delta strategy). With ``--kernels`` the
recipes the kernels run (``kernels_naive_fp8``, ``kernels_delta_matching``) run
``dmref.kernels.attention`` instead (Hopper GPU, BF16 q/k/v, head dim 64 or 128) and ``bf16`` runs
torch SDPA in BF16 (examples/results_gpu/ was written when the kernels ran under the preset names
``naive_fp8`` and ``delta_matching``).

The corpus: every ``*.py`` file under ``sysconfig.get_paths()['stdlib']`` (sorted by path, no
site-packages), read as bytes; tokens are bytes (vocabulary 256). Files are split 95/5 by a hash
of their path into training and validation text, so no file is in both. Nothing is downloaded.

Every ``--eval-every`` steps, on fixed batches: the validation loss (with the recipe's own
attention, and with exact float32 attention for the same weights), and, on one fixed training
batch, the attention diagnostics of every layer from ``dmref.diagnostics.evaluate`` on the very
q, k, v and dO the model produced: the row-sum residual |sum_j dS_ij| / sum_j |P_ij dP_ij| (mean
over rows, before and after dS's FP8 rounding), its signed mean (a stale delta with a persistent
sign pushes every LSE one way), dQ's error against float64 attention, and the share of that error
along kbar_i = sum_j P_ij K_j (the stale-delta direction). Also the mean row maximum of the
logits (a spurious -sum_i delta_i LSE_i gradient shows there first).

Writes OUT/train_gpt.json (configuration, curves, final table) and OUT/train_gpt.png.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

LABELS = {
    "exact": "float32 attention (torch SDPA; diagnostics: dmref's fp32 preset)",
    "bf16": "BF16 (FlashAttention-2 numerics)",
    "naive_fp8": "naive FP8 (1x128 E4M3, stale delta from BF16 O)",
    "cudnn_fp8": "stale-delta FP8 (cuDNN-style: per-tensor E4M3/E5M2, FP8 delta)",
    "mxfp8_stale": "stale-delta MXFP8 (cuDNN MXFP8-style)",
    "delta_matching": "Delta-Matching (naive FP8 + matched delta)",
    "kernels_naive_fp8": "the kernels' naive FP8 (per-token E4M3 Q/K/dO, 1x64 dS, stale delta)",
    "kernels_delta_matching": "the kernels' Delta-Matching (per-token E4M3 Q/K/dO, 1x64 dS, deferred dQ)",
}
DEFAULT_RECIPES = ["exact", "bf16", "naive_fp8", "cudnn_fp8", "delta_matching"]


@dataclass
class Config:
    steps: int = 400
    batch: int = 16
    context: int = 128
    d_model: int = 64
    heads: int = 2
    layers: int = 2
    lr: float = 3e-3
    warmup: int = 40
    weight_decay: float = 0.1
    eval_every: int = 25
    eval_batches: int = 8
    corpus_bytes: int = 4_000_000
    diag_heads: int = 0  #: heads per layer the diagnostics look at (0: all; they run on the CPU)
    seed: int = 0
    device: str = "cpu"
    kernels: bool = False


# ----------------------------------------------------------------------------------------------
# Corpus
# ----------------------------------------------------------------------------------------------


def load_corpus(limit: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(train bytes, validation bytes, description) from the standard library's .py files."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        files.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
    train, val, total = [], [], 0
    n_files = 0
    for path in sorted(files):
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            continue
        rel = os.path.relpath(path, root)
        bucket = int(hashlib.sha256(rel.encode()).hexdigest(), 16) % 20
        (val if bucket == 0 else train).append(data)
        total += len(data)
        n_files += 1
        if total >= limit:
            break
    if not train or not val:
        raise RuntimeError(f"found too little Python source under {root}")
    t = torch.frombuffer(bytearray(b"".join(train)), dtype=torch.uint8).long()
    v = torch.frombuffer(bytearray(b"".join(val)), dtype=torch.uint8).long()
    return t, v, {"root": root, "files": n_files, "train_bytes": t.numel(), "val_bytes": v.numel()}


def batches(data: torch.Tensor, batch: int, context: int, generator: torch.Generator):
    while True:
        idx = torch.randint(0, data.numel() - context - 1, (batch,), generator=generator)
        x = torch.stack([data[i:i + context] for i in idx.tolist()])
        y = torch.stack([data[i + 1:i + context + 1] for i in idx.tolist()])
        yield x, y


# ----------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, d_model: int, heads: int, attend):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.attend = attend  # attend(q, k, v) -> out, causal
        self.capture = None  # a dict to store q, k, v, out when diagnostics are taken

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        out = self.attend(q, k, v)
        if self.capture is not None:
            self.capture.update(q=q.detach(), k=k.detach(), v=v.detach())
            out.register_hook(lambda g: self.capture.__setitem__("dout", g.detach()))
        return self.proj(out.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int, attend):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = Attention(d_model, heads, attend)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: Config, attend):
        super().__init__()
        self.tok = nn.Embedding(256, cfg.d_model)
        self.pos = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg.d_model, cfg.heads, attend) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, 256, bias=False)
        self.head.weight = self.tok.weight  # tied
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx, targets=None):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1))

    def set_attend(self, attend):
        for blk in self.blocks:
            blk.attn.attend = attend


def make_attend(recipe: str, cfg: Config):
    """attend(q, k, v) for a recipe: dmref.attention on the CPU, or dmref.kernels on a GPU."""
    if recipe == "exact":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if cfg.kernels:
        if recipe == "bf16":
            return lambda q, k, v: F.scaled_dot_product_attention(
                q.bfloat16(), k.bfloat16(), v.bfloat16(), is_causal=True).float()
        from dmref.kernels import attention as kernel_attention

        return lambda q, k, v: kernel_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True,
                                                recipe=recipe).float()
    from dmref import attention

    return lambda q, k, v: attention(q, k, v, causal=True, recipe=recipe)


# ----------------------------------------------------------------------------------------------
# Diagnostics
# ----------------------------------------------------------------------------------------------


def attention_diagnostics(model: GPT, x, y, recipe: str, heads: int = 0) -> dict:
    """Per layer, dmref.diagnostics.evaluate on the q, k, v and dO of one training batch."""
    from dmref import diagnostics

    for blk in model.blocks:
        blk.attn.capture = {}
    model.zero_grad(set_to_none=True)
    model(x, y).backward()
    model.zero_grad(set_to_none=True)
    out = {}
    for i, blk in enumerate(model.blocks):
        cap = blk.attn.capture
        blk.attn.capture = None
        q, k, v, do = (cap[n].float().cpu() for n in ("q", "k", "v", "dout"))
        if heads:
            q, k, v, do = (t[:, :heads] for t in (q, k, v, do))
        # exact: float32 SDPA trains; its diagnostics are those of float32 attention (fp32 preset)
        diag_recipe = "fp32" if recipe == "exact" else recipe
        report, rows = diagnostics.evaluate(q, k, v, do, diag_recipe, causal=True)
        active = rows.abs_pdp > 0
        signed = (rows.residual[active] / rows.abs_pdp[active]).mean().item()
        s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), -math.inf)
        out[f"layer{i}"] = {
            "rowsum_mean": report.rowsum_residual_mean,
            "rowsum_after_quant_mean": report.rowsum_residual_after_quant_mean,
            "rowsum_signed_mean": signed,
            "dq_rel_err": report.dq_rel_err,
            "dq_bias_fraction": report.dq_bias_fraction,
            "dq_err_along_kbar_rel": report.dq_err_along_kbar_rel,
            "logit_row_max_mean": s.amax(-1).mean().item(),
        }
    return out


@torch.no_grad()
def evaluate_loss(model: GPT, val_batches) -> float:
    model.eval()
    losses = [model(x, y).item() for x, y in val_batches]
    model.train()
    return sum(losses) / len(losses)


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------


def train_one(recipe: str, cfg: Config, train_data, val_batches, diag_batch, progress=None) -> dict:
    torch.manual_seed(cfg.seed)  # the same initial weights and batches for every recipe
    device = torch.device(cfg.device)
    attend = make_attend(recipe, cfg)
    exact = make_attend("exact", cfg)
    model = GPT(cfg, attend).to(device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))

    def lr_at(step):
        if step < cfg.warmup:
            return cfg.lr * (step + 1) / cfg.warmup
        frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    gen = torch.Generator().manual_seed(cfg.seed + 1)
    stream = batches(train_data, cfg.batch, cfg.context, gen)
    curve = {"step": [], "train_loss": [], "eval_step": [], "val_loss": [], "val_loss_exact_attention": [],
             "diagnostics": []}
    task = progress.add_task(f"{recipe:15s}", total=cfg.steps) if progress else None
    t0 = time.perf_counter()
    for step in range(cfg.steps + 1):
        if step % cfg.eval_every == 0 or step == cfg.steps:
            vb = [(x.to(device), y.to(device)) for x, y in val_batches]
            curve["eval_step"].append(step)
            curve["val_loss"].append(evaluate_loss(model, vb))
            model.set_attend(exact)
            curve["val_loss_exact_attention"].append(evaluate_loss(model, vb))
            model.set_attend(attend)
            curve["diagnostics"].append(attention_diagnostics(model, *(t.to(device) for t in diag_batch), recipe,
                                                              cfg.diag_heads))
        if step == cfg.steps:
            break
        x, y = next(stream)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        loss = model(x.to(device), y.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        curve["step"].append(step)
        curve["train_loss"].append(loss.item())
        if progress:
            progress.update(task, advance=1, description=f"{recipe:15s} loss {loss.item():.3f}")
    curve["seconds"] = time.perf_counter() - t0
    curve["parameters"] = sum(p.numel() for p in model.parameters())
    return curve


# ----------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------


def _smooth(values, k=20):
    out, acc = [], []
    for v in values:
        acc.append(v)
        if len(acc) > k:
            acc.pop(0)
        out.append(sum(acc) / len(acc))
    return out


def write_plot(results: dict, cfg: Config, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    (ax_loss, ax_val), (ax_rs, ax_bias) = axes
    for recipe, curve in results.items():
        label = recipe
        ax_loss.plot(curve["step"], _smooth(curve["train_loss"]), label=label, lw=1.2)
        ax_val.plot(curve["eval_step"], curve["val_loss"], marker="o", ms=3, label=label)
        rs = [sum(d[k]["rowsum_mean"] for k in d) / len(d) for d in curve["diagnostics"]]
        rsq = [sum(d[k]["rowsum_after_quant_mean"] for k in d) / len(d) for d in curve["diagnostics"]]
        bias = [sum(d[k]["dq_err_along_kbar_rel"] for k in d) / len(d) for d in curve["diagnostics"]]
        line, = ax_rs.semilogy(curve["eval_step"], [max(r, 1e-17) for r in rs], marker="o", ms=3, label=label)
        if recipe != "exact":
            ax_rs.semilogy(curve["eval_step"], [max(r, 1e-17) for r in rsq], ls="--", lw=0.8, color=line.get_color())
        ax_bias.semilogy(curve["eval_step"], [max(b, 1e-17) for b in bias], marker="o", ms=3, label=label)
    ax_loss.set(title="training loss (bytes, running mean of 20 steps)", xlabel="step", ylabel="cross-entropy (nats)")
    ax_val.set(title="validation loss (the recipe's own attention)", xlabel="step", ylabel="cross-entropy (nats)")
    ax_rs.set(title="row-sum residual of dS (solid; dashed: after dS's rounding), mean of rows, layers",
              xlabel="step", ylabel="|sum_j dS_ij| / sum_j |P_ij dP_ij|")
    ax_bias.set(title="dQ error along kbar_i (stale-delta direction), relative to |dQ|",
                xlabel="step", ylabel="||e along kbar|| / ||dQ||")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    n_params = next(iter(results.values()))["parameters"]
    fig.suptitle(f"tiny GPT on Python stdlib bytes: {cfg.layers} layers, d_model {cfg.d_model}, {cfg.heads} heads, "
                 f"context {cfg.context}, {n_params / 1e3:.0f}k parameters, {cfg.steps} steps x "
                 f"{cfg.batch * cfg.context} tokens (seed {cfg.seed})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def final_table(results: dict) -> list[dict]:
    rows = []
    for recipe, c in results.items():
        d = c["diagnostics"][-1]
        layers = list(d)
        mean = lambda key: sum(d[k][key] for k in layers) / len(layers)  # noqa: E731
        rows.append({
            "recipe": recipe,
            "val_loss": c["val_loss"][-1],
            "val_loss_exact_attention": c["val_loss_exact_attention"][-1],
            "train_loss_last50": sum(c["train_loss"][-50:]) / len(c["train_loss"][-50:]),
            "rowsum_mean": mean("rowsum_mean"),
            "rowsum_after_quant_mean": mean("rowsum_after_quant_mean"),
            "rowsum_signed_mean": mean("rowsum_signed_mean"),
            "dq_rel_err": mean("dq_rel_err"),
            "dq_bias_fraction": mean("dq_bias_fraction"),
            "logit_row_max_mean": mean("logit_row_max_mean"),
            "seconds": c["seconds"],
        })
    return rows


def print_table(rows: list[dict], console) -> None:
    from rich.table import Table

    table = Table(title="final validation loss and attention diagnostics (mean over layers)", title_justify="left")
    cols = [("recipe", "recipe", "{}"), ("val loss", "val_loss", "{:.4f}"),
            ("val loss, exact attn", "val_loss_exact_attention", "{:.4f}"), ("train (last 50)", "train_loss_last50", "{:.4f}"),
            ("rowsum", "rowsum_mean", "{:.2e}"), ("rowsum after Q(dS)", "rowsum_after_quant_mean", "{:.2e}"),
            ("signed rowsum", "rowsum_signed_mean", "{:+.1e}"), ("dQ err", "dq_rel_err", "{:.3f}"),
            ("dQ bias frac", "dq_bias_fraction", "{:.2f}"), ("max logit", "logit_row_max_mean", "{:.2f}"),
            ("s", "seconds", "{:.0f}")]
    for name, _, _ in cols:
        table.add_column(name, justify="left" if name == "recipe" else "right")
    for r in rows:
        table.add_row(*(fmt.format(r[key]) for _, key, fmt in cols))
    console.print(table)


def seed_spread(tables: dict) -> dict:
    """recipe -> validation losses per seed, their mean, and the difference to the exact (or
    first) recipe of the same seed, per seed: the comparison that removes seed-to-seed noise."""
    seeds = list(tables)
    recipes = [r["recipe"] for r in tables[seeds[0]]]
    ref = "exact" if "exact" in recipes else recipes[0]
    out = {}
    for recipe in recipes:
        vals = [next(r["val_loss"] for r in tables[s] if r["recipe"] == recipe) for s in seeds]
        refs = [next(r["val_loss"] for r in tables[s] if r["recipe"] == ref) for s in seeds]
        out[recipe] = {"val_loss": vals, "mean": sum(vals) / len(vals),
                       f"minus_{ref}": [v - r for v, r in zip(vals, refs)]}
    return out


def print_spread(spread: dict, console) -> None:
    from rich.table import Table

    ref_key = next(k for k in next(iter(spread.values())) if k.startswith("minus_"))
    table = Table(title=f"validation loss per seed, and its difference to {ref_key[6:]} on the same seed",
                  title_justify="left")
    for col in ("recipe", "val loss per seed", "mean", f"- {ref_key[6:]} per seed"):
        table.add_column(col, justify="left" if col == "recipe" else "right")
    for recipe, row in spread.items():
        table.add_row(recipe, " ".join(f"{v:.4f}" for v in row["val_loss"]), f"{row['mean']:.4f}",
                      " ".join(f"{v:+.4f}" for v in row[ref_key]))
    console.print(table)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", nargs="+", default=DEFAULT_RECIPES, help=f"recipes (default {DEFAULT_RECIPES})")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    for f in Config.__dataclass_fields__.values():
        if f.name == "kernels":
            ap.add_argument("--kernels", action="store_true", help="dmref.kernels for FP8 (GPU), SDPA BF16 for bf16")
        elif f.name != "device":
            ap.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seeds", type=int, nargs="+", default=None,
                    help="train every recipe once per seed (default: --seed only); the plot shows the first")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = ap.parse_args(argv)
    cfg = Config(**{k: getattr(args, k) for k in Config.__dataclass_fields__})
    if args.threads:
        torch.set_num_threads(args.threads)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(width=max(Console().width, 150))
    train_data, val_data, corpus = load_corpus(cfg.corpus_bytes)
    console.print(f"corpus: {corpus['files']} files under {corpus['root']}: {corpus['train_bytes']:,} training and "
                  f"{corpus['val_bytes']:,} validation bytes")
    vgen = torch.Generator().manual_seed(12345)
    vstream = batches(val_data, cfg.batch, cfg.context, vgen)
    val_batches = [next(vstream) for _ in range(cfg.eval_batches)]
    dgen = torch.Generator().manual_seed(54321)
    dx, dy = next(batches(train_data, 4, cfg.context, dgen))  # 4 fixed sequences for diagnostics
    seeds = args.seeds or [cfg.seed]
    runs = {}
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        for seed in seeds:
            scfg = Config(**{**asdict(cfg), "seed": seed})
            runs[seed] = {r: train_one(r, scfg, train_data, val_batches, (dx, dy), progress) for r in args.recipes}
    tables = {seed: final_table(results) for seed, results in runs.items()}
    for seed, rows in tables.items():
        console.print(f"seed {seed}")
        print_table(rows, console)
    spread = seed_spread(tables)
    if len(seeds) > 1:
        print_spread(spread, console)
    os.makedirs(args.out, exist_ok=True)
    png = os.path.join(args.out, "train_gpt.png")
    write_plot(runs[seeds[0]], Config(**{**asdict(cfg), "seed": seeds[0]}), png)
    with open(os.path.join(args.out, "train_gpt.json"), "w") as f:
        json.dump({"config": asdict(cfg), "seeds": seeds, "corpus": corpus,
                   "recipes": {r: LABELS.get(r, r) for r in args.recipes},
                   "final": {str(s_): rows for s_, rows in tables.items()}, "val_loss_by_recipe": spread,
                   "curves": {str(s_): res for s_, res in runs.items()}, "torch": torch.__version__}, f, indent=1)
    console.print(f"written {png} and train_gpt.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
