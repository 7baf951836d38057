"""The emulated reference's own intermediates (P, dS, the quantized operands), read where
``dmref.tiled`` makes them, for the tests that compare the kernels' debug dumps with them.

``dmref.tiled`` casts in one function, ``tiled._quantize`` (its docstring: "Every cast of
dmref.tiled happens here"), and names the Q-point in each call (``r.p``, ``r.p_dv``,
``r.ds_dk``, ...). :func:`tap` wraps that function for the duration of a block: each call is
identified by the function that made it and the recipe field it names, and recorded with what it
received and returned, and where (the caller's key tile ``j0:j1`` and first row ``i0``). So these
tests read the reference's numbers, not a second description of the recipe. They depend on those
spellings in ``dmref/tiled.py``: a change there makes :meth:`Tap.assemble` find nothing and fail,
never pass silently.
"""

from __future__ import annotations

import linecache
import re
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from dmref import tiled

_FIELD = re.compile(r"\b(?:r|spec|strategy)\.(\w+)")


@dataclass
class Cast:
    """One call of ``tiled._quantize``: where it was made and what went in and out."""

    caller: str  #: the function of dmref.tiled that called it (forward, backward, _backward_operands, ...)
    point: str  #: the recipe field the call names (q, p, p_dv, ds_dk, ...)
    x: torch.Tensor  #: what the cast received (float32, or float64)
    out: torch.Tensor  #: what it returned: s * Q(x / s), the dequantized operand
    i0: int | None  #: the caller's first query row of the tile (None outside the sweeps)
    j0: int | None  #: the caller's key tile j0:j1
    j1: int | None


@dataclass
class Tap:
    casts: list[Cast] = field(default_factory=list)

    def operand(self, caller: str, point: str) -> Cast:
        """The one cast of ``point`` made by ``caller`` (an operand quantized once)."""
        found = [c for c in self.casts if c.caller == caller and c.point == point]
        assert len(found) == 1, f"{caller}: {len(found)} casts of {point} recorded (dmref/tiled.py changed?)"
        return found[0]

    def assemble(self, caller: str, point: str, n_keys: int, *, value: str = "out") -> torch.Tensor:
        """The per-tile casts of ``point`` by ``caller`` put together as ``(B, H, Nq, n_keys)``
        (``value``: "out" or "x"); rows a tile skipped (causal) are 0."""
        found = [c for c in self.casts if c.caller == caller and c.point == point]
        assert found, f"{caller}: no cast of {point} recorded (dmref/tiled.py changed?)"
        first = getattr(found[0], value)
        rows = found[0].i0 + first.shape[-2]
        full = torch.zeros(*first.shape[:-2], rows, n_keys, dtype=first.dtype, device=first.device)
        for c in found:
            full[..., c.i0:, c.j0:c.j1] = getattr(c, value)
        return full


@contextmanager
def tap(substitute=None):
    """Record every cast of ``dmref.tiled`` made inside the block (yields a :class:`Tap`).
    ``substitute``: ``{(caller, point): fn(cast) -> tensor}``, a value the reference uses instead
    of its own cast there (e.g. a kernel's dumped P codes)."""
    substitute = substitute or {}
    record = Tap()
    original = tiled._quantize

    def tapped(x, point, **kwargs):
        out = original(x, point, **kwargs)
        frame = sys._getframe(1)
        line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
        names = _FIELD.findall(line)
        loc = frame.f_locals
        cast = Cast(frame.f_code.co_name, names[0] if names else "?", x.detach().clone(), out.detach().clone(),
                    loc.get("i0"), loc.get("j0"), loc.get("j1"))
        fn = substitute.get((cast.caller, cast.point))
        if fn is not None:
            out = fn(cast).to(out.dtype)
            cast.out = out.detach().clone()
        record.casts.append(cast)
        return out

    tiled._quantize = tapped
    try:
        yield record
    finally:
        tiled._quantize = original


def flat(x: torch.Tensor) -> torch.Tensor:
    """(B, H, ...) -> (B*H, ...), the kernels' layout of per-head tensors."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
