"""Train a small transformers Llama on key-value recall once per attention backend (exact, a
stale-delta FP8 recipe, Delta-Matching); plot the loss and the row-sum residual of dS per layer.

    python examples/train_transformers.py                 # CPU: the recipes emulated, a few minutes
    python examples/train_transformers.py --device cuda   # Hopper GPU: dmref.kernels, a larger model

On the CPU the backends are the presets ``naive_fp8`` and ``delta_matching``, emulated; on the GPU
the recipes the kernels run, ``kernels_naive_fp8`` and ``kernels_delta_matching`` (the committed
examples/results/h200/train_transformers.json was written when the kernels ran under the preset
names, ``dmref:naive_fp8`` and ``dmref:delta_matching``).

``LlamaForCausalLM`` from a ``LlamaConfig`` (random weights, nothing downloaded); dmref enters only
as ``attn_implementation``. The task is made here: PAIRS (key, value) pairs, one per position (input
embedding: key's plus value's token embedding, as ``inputs_embeds``), then QUERIES of those keys (key
plus a query token); at each query the model names the key's value, which only attention over the
earlier positions can find. Every backend starts from the same weights and sees the same batches;
every --diag-every steps layer_reports reads each layer's q, k, v and dO on one fixed batch.
Writes OUT/train_transformers.json and OUT/train_transformers.png.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # many small ops on a shared CPU
os.environ.setdefault("MPLBACKEND", "Agg")  # write the PNG, open no window

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import dmref.integrations.transformers as dmt  # noqa: E402

LABELS = {"dmref": "exact attention (dmref, float64)", "sdpa": "BF16 SDPA (residual: dmref exact)",
          "dmref:naive_fp8": "FP8, stale delta (naive_fp8)", "dmref:delta_matching": "FP8, Delta-Matching",
          "dmref:kernels_naive_fp8": "FP8 kernels, stale delta (kernels_naive_fp8)",
          "dmref:kernels_delta_matching": "FP8 kernels, Delta-Matching (kernels_delta_matching)"}
SIZES = {  # the CPU size runs in a few minutes on 2 cores; the GPU size in about 3.5 minutes on an H200
    "cpu": dict(pairs=48, queries=16, keys=64, values=16, hidden=64, heads=2, layers=2, batch=32, steps=300,
                lr=3e-3, diag_every=25, backends=["dmref", "dmref:naive_fp8", "dmref:delta_matching"]),
    "cuda": dict(pairs=256, queries=64, keys=320, values=32, hidden=256, heads=4, layers=4, batch=64, steps=2000,
                 lr=3e-3, diag_every=250, backends=["sdpa", "dmref:kernels_naive_fp8",
                                                                 "dmref:kernels_delta_matching"]),
}


def make_batch(a, gen, device):
    """(key ids, value ids) of the pairs, (ids, value ids) of the queries; keys distinct per row."""
    keys = torch.rand(a.batch, a.keys, generator=gen).argsort(-1)[:, :a.pairs]
    values = torch.randint(0, a.values, (a.batch, a.pairs), generator=gen)
    pick = torch.rand(a.batch, a.pairs, generator=gen).argsort(-1)[:, :a.queries]
    return [t.to(device) for t in (keys, values, keys.gather(1, pick), values.gather(1, pick))]


def loss_and_accuracy(model, a, batch):
    keys, values, qkeys, qvalues = batch
    emb = model.get_input_embeddings()  # ids: keys 0..K-1, values K..K+V-1, the query token K+V
    x = torch.cat([emb(keys) + emb(values + a.keys), emb(qkeys) + emb.weight[a.keys + a.values]], 1)
    logits = model(inputs_embeds=x).logits[:, a.pairs:, a.keys:a.keys + a.values].float()
    loss = F.cross_entropy(logits.flatten(0, 1), qvalues.flatten())
    return loss, (logits.argmax(-1) == qvalues).float().mean().item()


def diagnose(model, a, batch, backend, autocast):
    """Per layer: dmref.diagnostics on the diagnostic batch (sdpa's weights: dmref's exact attention)."""
    model.set_attn_implementation("dmref" if backend == "sdpa" else backend)
    with dmt.record() as calls, autocast():
        loss_and_accuracy(model, a, batch)[0].backward()
    model.zero_grad(set_to_none=True)
    model.set_attn_implementation(backend)
    return [r.as_dict() for _, r in dmt.layer_reports(calls, batch=1, accumulation="fp32")]


def train(backend, a, device):
    torch.manual_seed(a.seed)
    cfg = LlamaConfig(vocab_size=a.keys + a.values + 1, hidden_size=a.hidden, intermediate_size=4 * a.hidden,
                      num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.heads,
                      max_position_embeddings=a.pairs + a.queries, attn_implementation=backend)
    model = LlamaForCausalLM(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(a.seed + 1)
    diag_batch = make_batch(argparse.Namespace(**{**vars(a), "batch": 2}), torch.Generator().manual_seed(7), device)

    def autocast():  # on the GPU: BF16 matmuls and attention (the kernels take BF16)
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    curve = dict(step=[], loss=[], accuracy=[], diag_step=[], layers=[])
    t0 = time.perf_counter()
    for step in range(a.steps + 1):
        if step % a.diag_every == 0 or step == a.steps:
            curve["diag_step"].append(step)
            curve["layers"].append(diagnose(model, a, diag_batch, backend, autocast))
        if step == a.steps:
            break
        for g in opt.param_groups:
            g["lr"] = a.lr * min(1.0, (step + 1) / 20)  # 20 warm-up steps, then constant
        with autocast():
            loss, acc = loss_and_accuracy(model, a, make_batch(a, gen, device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        for key, value in (("step", step), ("loss", loss.item()), ("accuracy", acc)):
            curve[key].append(value)
        if step % 50 == 0:
            print(f"{backend:22s} step {step:5d} loss {loss.item():.4f} accuracy {acc:.3f} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    curve["seconds"] = time.perf_counter() - t0
    curve["parameters"] = sum(p.numel() for p in model.parameters())
    return curve


def mean(xs):
    return sum(xs) / len(xs)


def smooth(xs, k=20):
    return [mean(xs[max(0, i - k + 1):i + 1]) for i in range(len(xs))]


def plot(results, a, path):
    import matplotlib.pyplot as plt  # the Agg backend: MPLBACKEND, set above
    fig, (ax_loss, ax_rs) = plt.subplots(1, 2, figsize=(13, 5.4))
    colors, widths = ("tab:gray", "tab:red", "tab:blue", "tab:green"), (3.5, 2.2, 1.0, 1.0)
    for (backend, c), color, lw in zip(results.items(), colors, widths):
        label = LABELS.get(backend, backend)
        ax_loss.semilogy(c["step"], smooth(c["loss"]), color=color, lw=lw, label=label)
        for layer in range(a.layers):
            rs = [max(d[layer]["rowsum_residual_mean"], 1e-18) for d in c["layers"]]
            ax_rs.semilogy(c["diag_step"], rs, color=color, ls=("-", "--", ":", "-.")[layer % 4], marker="o", ms=3,
                           label=f"{label}, layer {layer}")
    bound = max(d[i]["rowsum_bound_max"] for c in results.values() for d in c["layers"] for i in range(a.layers))
    ax_rs.axhline(bound, color="black", lw=0.8, ls="--", label=f"Delta-Matching's float32 bound, largest row ({bound:.0e})")
    ax_loss.set(title="training loss (running mean of 20 steps)", xlabel="step",
                ylabel="cross-entropy of the recalled value (nats)")
    ax_rs.set(title="how far the rows of dS are from summing to zero, per layer", xlabel="step", ylim=(1e-18, 1),
              ylabel="mean over rows of |sum_j dS_ij| / sum_j |P_ij dP_ij|")
    ax_loss.legend(fontsize=8)
    ax_rs.legend(fontsize=7, ncol=2, loc="center", bbox_to_anchor=(0.5, 0.45))
    for ax in (ax_loss, ax_rs):
        ax.grid(alpha=0.3)
    n = next(iter(results.values()))["parameters"]
    fig.suptitle(f"Llama ({a.layers} layers, hidden {a.hidden}, {a.heads} heads, {n / 1e3:.0f}k parameters) "
                 f"recalling values of {a.pairs} key-value pairs, {a.steps} steps of {a.batch} sequences")
    final = "; ".join(f"{LABELS.get(b, b)} {mean(c['loss'][-50:]):.2e}" for b, c in results.items())
    fig.text(0.5, 0.045, "In exact attention each row of the softmax gradient dS sums to zero. With FP8 attention "
             "a stale delta breaks this (red); Delta-Matching keeps it at float32 rounding (blue, below the dashed "
             "bound).", ha="center", fontsize=9)
    fig.text(0.5, 0.01, f"Training loss, mean of the last 50 steps: {final}.", ha="center", fontsize=9)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backends", nargs="+", help="attention implementations (default: per device, see SIZES)")
    for name, value in SIZES["cpu"].items():
        if name != "backends":
            ap.add_argument(f"--{name.replace('_', '-')}", type=type(value), help=f"CPU default {value}")
    a = ap.parse_args(argv)
    vars(a).update({name: value for name, value in SIZES[a.device].items() if getattr(a, name) is None})
    if a.pairs > a.keys or a.queries > a.pairs:
        print(f"train_transformers.py: need --queries {a.queries} <= --pairs {a.pairs} <= --keys {a.keys} "
              "(distinct keys in a sequence)", file=sys.stderr)
        raise SystemExit(2)
    device = torch.device(a.device)
    print(f"uniform guess: loss {math.log(a.values):.3f}, accuracy {1 / a.values:.3f}")
    results = {b: train(b, a, device) for b in a.backends}
    os.makedirs(a.out, exist_ok=True)
    stem = os.path.join(a.out, "train_transformers")
    final = {b: {"loss_last50": mean(c["loss"][-50:]), "accuracy_last50": mean(c["accuracy"][-50:]),
                 "layers": c["layers"][-1], "seconds": c["seconds"]} for b, c in results.items()}
    with open(stem + ".json", "w") as f:
        json.dump({"config": vars(a), "final": final, "curves": results}, f, indent=1)
    plot(results, a, stem + ".png")
    for b, r in final.items():
        rs = ", ".join(f"{d['rowsum_residual_mean']:.1e}" for d in r["layers"])
        bias = ", ".join(f"{d['dq_err_along_kbar_rel']:.1e}" for d in r["layers"])
        print(f"{b:22s} loss {r['loss_last50']:.4f} accuracy {r['accuracy_last50']:.3f} row-sum residual per layer "
              f"{rs}; dQ error along kbar {bias} ({r['seconds']:.0f} s)")
    print(f"wrote {stem}.json and {stem}.png")


if __name__ == "__main__":
    main()
