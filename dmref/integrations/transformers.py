"""dmref's attention as a Hugging Face transformers attention backend.

Importing this module registers, with ``transformers.AttentionInterface`` (and, for the masks,
``transformers.masking_utils.AttentionMaskInterface``), one attention function per name:

==============================  ===============================================================
``"dmref"``                     the ``exact`` recipe: float64 attention, rounded once to the
                                query's dtype (forward and backward)
``"dmref:<preset>"``            a preset of :data:`dmref.PRESETS` (``bf16``, ``naive_fp8``,
                                ``cudnn_fp8``, ``mxfp8_stale``, ``delta_matching``,
                                ``consistent_p``, ``fp32``, ``exact``) or of
                                :data:`dmref.recipes.DELTA_STUDY`: ``dmref.attention`` with that
                                recipe, emulated on the tensors' device
``"dmref:kernels_<name>"``      a recipe the kernels run (``kernels_delta_matching``,
                                ``kernels_naive_fp8``, ``kernels_folded_*``: the names of
                                ``dmref.recipes.KERNEL_RECIPES``): the kernel on a Hopper GPU (compute
                                capability 9.0), and elsewhere ``dmref.attention`` on the very
                                same Recipe (``dmref.get_recipe(name)``: the same scales, dS
                                blocks, deferred dQ and Hopper accumulation)
==============================  ===============================================================

Usage (three lines)::

    import dmref.integrations.transformers  # registers the names
    model = AutoModelForCausalLM.from_config(config, attn_implementation="dmref:delta_matching")
    # or attn_implementation="dmref:kernels_delta_matching": dmref.kernels on a Hopper GPU
    # train as usual; record(...) and layer_reports(...) read the row-sum residual per layer

The calling convention is transformers' own (``integrations/sdpa_attention.py``): ``query``
``(batch, heads, q_len, head_dim)``, ``key``/``value`` ``(batch, kv_heads, kv_len, head_dim)``
with ``heads = module.num_key_value_groups * kv_heads`` (dmref reads the grouped heads
directly, nothing is repeated), ``scaling`` the softmax scale, the mask as ``sdpa`` receives it
(boolean ``(batch, 1, q_len, kv_len)``, True = attend, with padding and sliding windows in it, or
None for a plain causal mask: then ``is_causal`` / ``module.is_causal`` decides, for more than
one query), and the output transposed to ``(batch, q_len, heads, head_dim)``; no attention
weights are returned (None, as ``sdpa``). A floating 4-D mask a user passes is an additive mask
and is passed on as one (it gets no gradient, as in ``sdpa``).

Dtypes: the emulation computes ``exact`` in float64 and every other recipe in float32 with the
recipe's FP8/BF16 roundings (whatever the model's dtype, autocast switched off inside), and
returns the query's dtype; the kernels take and return bfloat16: under
``torch.autocast("cuda", dtype=torch.bfloat16)`` q, k and v are cast to it, as autocast casts them
for torch's SDPA, and the output is bfloat16, as SDPA's is; other dtypes are refused (run the
model in bfloat16 or under that autocast).

Refused, with one line naming the model's setting: dropout > 0 (``config.attention_dropout`` in
training), attention-logit softcapping, attention sinks, a learned position bias (it would get
no gradient), and on the kernels everything they do not implement: a mask other than the
causal one (padding, sliding windows), a KV cache (fewer queries than keys), head dims other
than 64 and 128, dtypes other than bfloat16.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import transformers
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .. import diagnostics
from ..api import attention as emulated_attention
from ..recipes import DELTA_STUDY, PRESETS, Recipe, get_recipe

__all__ = ["AttentionCall", "NAMES", "attention_forward", "layer_reports", "record", "register"]

def _kernel_recipes() -> tuple[str, ...]:
    """The recipes the kernels run, by name (:data:`dmref.recipes.KERNEL_RECIPES`)."""
    from ..recipes import KERNEL_RECIPES

    return tuple(KERNEL_RECIPES)


_KERNEL_RECIPES = _kernel_recipes()


def _names() -> dict[str, tuple[str, bool]]:
    """Registered name -> (recipe name, whether the kernels run it on a Hopper GPU)."""
    names = {"dmref": ("exact", False)}
    names.update({f"dmref:{p}": (p, False) for p in (*PRESETS, *DELTA_STUDY)})
    names.update({f"dmref:{k}": (k, True) for k in _KERNEL_RECIPES})
    return names


#: Every name this module registers, with the recipe it runs (``dmref.get_recipe`` of it).
NAMES: dict[str, str] = {name: r for name, (r, _) in _names().items()}


# ----------------------------------------------------------------------------------------------
# Recording, for the diagnostics
# ----------------------------------------------------------------------------------------------


@dataclass
class AttentionCall:
    """One attention call as dmref ran it: the tensors dmref saw (``(batch, heads, len, dim)``,
    detached), the mask and causal flag it was given, and ``dout``, the gradient of the output,
    filled in by the backward."""

    layer: int | None  #: ``module.layer_idx``
    name: str  #: the registered name
    recipe: Recipe  #: the recipe the numbers follow (a kernel's: the Recipe it runs)
    kernels: bool  #: True when dmref.kernels ran it
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None
    causal: bool
    scale: float
    out: torch.Tensor
    dout: torch.Tensor | None = None


_RECORDERS: list[list[AttentionCall]] = []


@contextmanager
def record():
    """Record every dmref attention call made inside the block (and the gradients of their
    outputs, if the backward runs inside it too); yields the list of :class:`AttentionCall`."""
    calls: list[AttentionCall] = []
    _RECORDERS.append(calls)
    try:
        yield calls
    finally:
        _RECORDERS.remove(calls)


def _record(call: AttentionCall, out: torch.Tensor) -> None:
    for calls in _RECORDERS:
        calls.append(call)
    if out.requires_grad:
        def keep(grad):
            call.dout = grad.detach()
        out.register_hook(keep)


def layer_reports(calls: list[AttentionCall], *, batch: int | None = None, heads: int | None = None,
                  accumulation: str | None = None) -> list[tuple[int | None, diagnostics.Report]]:
    """``dmref.diagnostics.evaluate`` on each recorded call that has its gradient: the row-sum
    residual of dS relative to sum_j |P_ij dP_ij| (and the Delta-Matching bound it is held to),
    dQ's error against float64 and its share along kbar, for the very q, k, v and dO of that
    layer. ``batch`` / ``heads``: look at the first so many sequences / key-value head groups
    only (the diagnostics run the float64 reference). ``accumulation``: evaluate the calls
    dmref.kernels ran with their recipe's matmuls under this model (``"fp32"``: the emulated
    Hopper accumulation is slow at long sequences; the quantization and the delta stay the
    kernel's). Returns ``[(layer, report), ...]``."""
    out = []
    for c in calls:
        if c.dout is None:
            continue
        q, k, v, do, mask = c.q, c.k, c.v, c.dout, c.mask
        if batch is not None:
            q, k, v, do = q[:batch], k[:batch], v[:batch], do[:batch]
            mask = mask if mask is None or mask.shape[0] == 1 else mask[:batch]
        if heads is not None and heads < k.shape[1]:
            groups = q.shape[1] // k.shape[1]
            q, do, k, v = q[:, :heads * groups], do[:, :heads * groups], k[:, :heads], v[:, :heads]
            mask = mask if mask is None or mask.dim() < 4 or mask.shape[1] == 1 else mask[:, :heads * groups]
        recipe = c.recipe.with_accumulation(accumulation) if accumulation and c.kernels else c.recipe
        report, _ = diagnostics.evaluate(q, k, v, do, recipe, causal=c.causal, scale=c.scale, mask=mask)
        out.append((c.layer, report))
    return out


# ----------------------------------------------------------------------------------------------
# The attention function
# ----------------------------------------------------------------------------------------------


def _hopper(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.get_device_capability(t.device) == (9, 0)


def _refuse_unsupported(name: str, module, dropout: float, kwargs: dict) -> None:
    where = f"{name} ({type(module).__name__}, layer {getattr(module, 'layer_idx', '?')})"
    if dropout:
        raise ValueError(f"{where}: attention dropout={dropout} is not implemented (the model's "
                         f"config.attention_dropout in training); set it to 0.0 or call model.eval()")
    if kwargs.get("softcap") is not None:
        raise ValueError(f"{where}: softcap={kwargs['softcap']} (config.attn_logit_softcapping) is not "
                         "implemented: dmref's softmax takes the logits as they are")
    for sink in ("s_aux", "sinks"):
        if kwargs.get(sink) is not None:
            raise ValueError(f"{where}: attention sinks ({sink}) are not implemented")
    if kwargs.get("position_bias") is not None:
        raise ValueError(f"{where}: a position_bias is not implemented: dmref's additive mask gets no "
                         "gradient, and the model learns this bias")


def _causal_mask_only(mask: torch.Tensor, q_len: int, kv_len: int) -> bool | None:
    """For a boolean mask: False if it keeps everything, True if it is exactly the causal
    pattern (query i keeps key j iff j <= i), None otherwise."""
    if bool(mask.all()):
        return False
    tril = torch.ones(q_len, kv_len, dtype=torch.bool, device=mask.device).tril()
    if q_len == kv_len and bool((mask == tril).all()):
        return True
    return None


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      *, recipe: str = "exact", kernel_recipe: bool = False, name: str = "dmref",
                      **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention function (the signature of ``sdpa_attention_forward``) with
    dmref's attention under ``recipe``. Returns ``(attn_output (batch, q_len, heads, head_dim),
    None)``. See the module docstring for masks, dtypes and what is refused."""
    _refuse_unsupported(name, module, dropout, kwargs)
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(f"{name}: query, key, value must be (batch, heads, len, head_dim), got "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    heads, kv_heads = query.shape[1], key.shape[1]
    groups = getattr(module, "num_key_value_groups", None)
    if groups is not None and kv_heads * groups != heads:
        raise ValueError(f"{name}: the model says num_key_value_groups={groups}, but query has {heads} heads "
                         f"and key {kv_heads}")
    q_len, kv_len = query.shape[2], key.shape[2]
    is_causal = kwargs.get("is_causal")
    is_causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scaling is None else float(scaling)

    mask, causal = attention_mask, False
    if mask is None:
        # as sdpa: a causal model's plain causal mask comes as None; one query attends to every key
        causal = is_causal and q_len > 1
        if causal and kv_len > q_len:
            # prefill of an empty static cache: sdpa crops the keys (its is_causal is top-left)
            key, value = key[:, :, :q_len], value[:, :, :q_len]
    elif not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name}: attention_mask must be a 4-D tensor or None (the sdpa mask), got "
                        f"{type(mask).__name__}")

    if kernel_recipe and query.shape[-1] not in (64, 128):
        raise ValueError(f"{name}: the kernels' recipes are defined for head dims 64 and 128; the model has "
                         f"head_dim={query.shape[-1]}")
    use_kernels = kernel_recipe and _hopper(query)
    run = get_recipe(recipe)  # a kernel recipe's name: the Recipe the kernels run
    if use_kernels:
        if query.dtype != torch.bfloat16 and torch.is_autocast_enabled("cuda") \
                and torch.get_autocast_dtype("cuda") == torch.bfloat16:
            # what autocast does to torch's SDPA: q, k, v in the autocast dtype, the output in it too
            query, key, value = (t.to(torch.bfloat16) for t in (query, key, value))
        out = _kernels(name, module, query, key, value, mask, causal, scale, recipe, kwargs)
    else:
        out = emulated_attention(query, key, value, causal=causal, scale=scale, mask=mask, recipe=run)
    if _RECORDERS:
        _record(AttentionCall(getattr(module, "layer_idx", None), name, run, use_kernels, query.detach(),
                              key.detach(), value.detach(), None if mask is None else mask.detach(),
                              causal, scale, out.detach()), out)
    return out.transpose(1, 2).contiguous(), None


def _kernels(name, module, query, key, value, mask, causal, scale, recipe, kwargs) -> torch.Tensor:
    from .. import kernels

    if query.dtype != torch.bfloat16:
        raise TypeError(f"{name}: dmref.kernels take bfloat16; the model runs attention in {query.dtype} "
                        "(load it with dtype=torch.bfloat16 or run it under torch.autocast(dtype=torch.bfloat16))")
    if query.shape[-1] not in (64, 128):
        raise ValueError(f"{name}: dmref.kernels take head dims 64 and 128; the model has "
                         f"head_dim={query.shape[-1]}")
    if key.shape[2] != query.shape[2]:
        raise ValueError(f"{name}: dmref.kernels attend over as many keys as queries; the model passed "
                         f"{query.shape[2]} queries against {key.shape[2]} keys (a KV cache: generate with "
                         "attn_implementation='sdpa')")
    if mask is not None:
        pattern = _causal_mask_only(mask, query.shape[2], key.shape[2]) if mask.dtype == torch.bool else None
        if pattern is None:
            window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
            what = f"sliding_window={window}" if window else "a padding or custom attention mask"
            raise ValueError(f"{name}: dmref.kernels implement causal and full attention only; the model "
                             f"passed {what} (emulate it on the CPU, or pass no attention_mask)")
        causal = pattern
    return kernels.attention(query.contiguous(), key.contiguous(), value.contiguous(), causal=causal,
                             scale=scale, recipe=recipe)


# ----------------------------------------------------------------------------------------------
# Registration
# ----------------------------------------------------------------------------------------------


def _function(name: str, recipe: str, kernel_recipe: bool):
    def dmref_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        return attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                 recipe=recipe, kernel_recipe=kernel_recipe, name=name, **kwargs)

    dmref_attention.__name__ = dmref_attention.__qualname__ = f"dmref_attention_{name.replace(':', '_')}"
    dmref_attention.__doc__ = f"transformers attention function {name!r}: {attention_forward.__doc__}"
    return dmref_attention


def register() -> list[str]:
    """Register every name of :data:`NAMES` (done on import; calling again is harmless).
    The masks are sdpa's (``masking_utils.sdpa_mask``): boolean, padding and sliding windows
    included, None for a plain causal mask. Returns the names."""
    for name, (recipe, kernel_recipe) in _names().items():
        transformers.AttentionInterface.register(name, _function(name, recipe, kernel_recipe))
        AttentionMaskInterface.register(name, sdpa_mask)
    return list(NAMES)


register()
