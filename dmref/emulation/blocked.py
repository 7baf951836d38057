"""Block scaling: one scale per block of elements, elements rounded as ``encode(x / s)``.

``quantize_blocked(x, fmt, block=..., scale_rule=...)`` returns ``(codes, scales)`` with
``x ~= scale * decode(code)``; ``dequantize_blocked`` multiplies back exactly (in float64). The
full statement of every rule, with the sources it follows (Transformer Engine, OCP MX v1.0,
NVIDIA's MXFP8 cast), is ``docs/block_scaling.md``. In short, with ``amax`` the largest magnitude
of a block, ``M = fmt.max``, ``RN32`` = round to nearest-even float32 (one rounding of the exact
quotient):

- ``fixed``      s = 2**margin for every block, whatever the data (FlashAttention-3's P);
- ``amax``       s = RN32(amax / M) * 2**margin, float32, clamped to [2**-126, float32 max];
- ``pow2_down``  Transformer Engine: the *multiplier* RN32(M / amax) (float32 max if it overflows)
                 with its mantissa masked, i.e. rounded down to 2**k; s = 2**(-k + margin). The
                 decode scale s is amax / M rounded *up*: nothing overflows (|x| / s <= M (1 + 2**-24));
- ``pow2_up``    the mirror: the multiplier rounded up to 2**k, s = 2**(-k + margin): s is amax / M
                 rounded *down*, amax / s lies in [M, 2M) and the largest elements saturate;
- ``mx_ocp``     E8M0 s = 2**(floor(log2 amax) - emax_elem + margin) (OCP MX v1.0 section 6.3,
                 Algorithm 1); exponent < -127 becomes -127, > 127 makes the scale NaN (0xFF);
- ``mx_nvidia``  E8M0 s = RN32(amax / M) rounded toward +inf to a power of two, times 2**margin,
                 exponent clamped to [-127, 127] (``cvt.rp.satfinite.ue8m0x2.f32``).

Power-of-two float32 scales have their exponent clamped to [-127, 127], the E8M0 range.
Exponents are read from the bits (``torch.frexp``), never from a float ``log2``.

Special blocks (every rule but ``fixed``): amax == 0 gives s = 1 (E8M0 code 127) and zero codes; a NaN or
+-inf anywhere in a block gives a NaN scale (float32 NaN, E8M0 0xFF) and every element of the
block the format's NaN code (``fmt.nan_code_for(sign of x)``), so the whole block dequantizes to
NaN. No other input produces an infinite or NaN scale.

Elements: ``encode(x / s, fmt, rounding=..., saturate=..., rbits=...)`` where ``x / s`` is the
exact quotient rounded *once*, whatever the input dtype. For float32 and narrower inputs the
plain float64 quotient already rounds like the exact one (see :func:`_quotient`); for float64
input it is formed in float64 with round-to-odd (an exact remainder decides the last bit), which
a later rounding to at most 51 bits cannot tell apart from the exact value (Boldo & Melquiond,
"Emulation of FMA and correctly rounded sums: proved algorithms using rounding to odd", IEEE TC
2008).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .cast import _as_torch, decode, encode
from .constants import FP32_MAX, FP32_MIN_NORMAL
from .formats import Format, Rounding, check_bool, get_format

__all__ = [
    "Block",
    "BlockQuantized",
    "ScaleRule",
    "block_amax",
    "dequantize_blocked",
    "quantize_blocked",
    "scales_from_amax",
]

_FLOAT32_MAX = FP32_MAX
_FLOAT32_MIN_NORMAL = FP32_MIN_NORMAL  # 2**-126
_E8M0_BIAS = 127
_E8M0_NAN = 0xFF
_SCALE_EXP_MIN, _SCALE_EXP_MAX = -127, 127  # E8M0 range, also used for power-of-two float scales


class ScaleRule(enum.Enum):
    """How a block's decode scale s (x ~= s * decode(code)) follows from its amax. The one
    scale-rule vocabulary of dmref: recipes, the kernels' configuration and the proofs use these
    members."""

    FIXED = "fixed"  #: no data-dependent scale: s = 2^margin for every block (FA3's P: 2^-8)
    AMAX = "amax"  #: s = RN32(amax / fmt.max), float32, not a power of two
    POW2_DOWN = "pow2_down"  #: Transformer Engine: multiplier RN32(max/amax) masked down to 2^k; s = 2^-k >= amax/max
    POW2_UP = "pow2_up"  #: multiplier RN32(max/amax) rounded up to 2^k; s = 2^-k <= amax/max, largest elements saturate
    MX_OCP = "mx_ocp"  #: E8M0 2^(floor(log2 amax) - emax_elem) (OCP MX v1.0 6.3); elements clamp to +-max
    MX_NVIDIA = "mx_nvidia"  #: E8M0 RN32(amax / fmt.max) rounded toward +inf to 2^k (cvt.rp.satfinite.ue8m0x2.f32)

    @property
    def is_e8m0(self) -> bool:
        """Whether the scales are stored as E8M0 codes (uint8) rather than float32."""
        return self in (ScaleRule.MX_OCP, ScaleRule.MX_NVIDIA)

    @property
    def is_dynamic(self) -> bool:
        """Whether the scale depends on the data (and so on which elements a block holds)."""
        return self is not ScaleRule.FIXED

    @property
    def is_pow2(self) -> bool:
        """Whether every scale is a power of two (all rules but AMAX)."""
        return self is not ScaleRule.AMAX

    @classmethod
    def get(cls, rule: "ScaleRule | str") -> "ScaleRule":
        """The rule for itself or its value string (``"pow2_down"`` ...)."""
        if isinstance(rule, ScaleRule):
            return rule
        try:
            return cls(rule)
        except ValueError:
            known = ", ".join(r.value for r in cls)
            raise ValueError(f"unknown scale_rule {rule!r}; known: {known}") from None


# ----------------------------------------------------------------------------------------------
# Blocks
# ----------------------------------------------------------------------------------------------

_TILE_RE = re.compile(r"^(\d+)x(\d+)$")
_MX_RE = re.compile(r"^mx(\d+)(?:_(row|col))?$")


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"block {name}={value!r} must be a positive integer")
    return int(value)


@dataclass(frozen=True)
class Block:
    """Which elements share a scale, over the last two dims (rows, cols); leading dims are batch.

    ``block_rows`` / ``block_cols`` is the block extent along that dim, ``None`` for the whole dim. Blocks
    start at index 0; when a dim is not a multiple of the extent the last block is shorter (a
    tail). ``spans_batch`` (only :meth:`tensor`) makes one block of the whole array, batch dims
    included. Build with the constructors or :meth:`get` (``"tensor"``, ``"row"``, ``"col"``,
    ``"1x128"``, ``"128x128"``, ``"mx32"`` = ``Block.mx(32, axis=-1)``, ``"mx32_col"`` =
    ``Block.mx(32, axis=-2)``).
    """

    block_rows: int | None = None
    block_cols: int | None = None
    spans_batch: bool = False

    def __post_init__(self):
        for name in ("block_rows", "block_cols"):
            value = getattr(self, name)
            if value is not None:
                _positive_int(name, value)
        if self.spans_batch and (self.block_rows, self.block_cols) != (None, None):
            raise ValueError("a block spanning the batch dims must span rows and cols too (Block.tensor())")

    # ---- constructors ----------------------------------------------------------------------
    @classmethod
    def tensor(cls) -> "Block":
        """One scale for the whole array (batch dims included); scales have shape ()."""
        return cls(None, None, spans_batch=True)

    @classmethod
    def matrix(cls) -> "Block":
        """One scale per matrix (per batch index); scales have shape (*batch, 1, 1)."""
        return cls(None, None)

    @classmethod
    def rows(cls) -> "Block":
        """One scale per row, over all columns; scales have shape (*batch, rows, 1)."""
        return cls(1, None)

    @classmethod
    def cols(cls) -> "Block":
        """One scale per column, over all rows; scales have shape (*batch, 1, cols)."""
        return cls(None, 1)

    @classmethod
    def tile(cls, rows: int, cols: int) -> "Block":
        """``rows x cols`` tiles (1x128: DeepSeek-V3 activations; 128x128: weights)."""
        return cls(_positive_int("rows", rows), _positive_int("cols", cols))

    @classmethod
    def mx(cls, k: int = 32, axis: int = -1) -> "Block":
        """MX blocks of ``k`` consecutive elements along ``axis``: -1 (within a row, 1 x k) or
        -2 (within a column, k x 1)."""
        k = _positive_int("k", k)
        if axis == -1:
            return cls(1, k)
        if axis == -2:
            return cls(k, 1)
        raise ValueError(f"Block.mx {axis=} must be -1 (k consecutive elements of a row) or -2 (of a column)")

    @classmethod
    def get(cls, block: "Block | str | tuple[int, int]") -> "Block":
        """A :class:`Block` from itself, a shorthand string or a ``(rows, cols)`` tuple."""
        if isinstance(block, Block):
            return block
        if isinstance(block, tuple) and len(block) == 2:
            return cls.tile(*block)
        if isinstance(block, str):
            name = block.strip().lower()
            named = {"tensor": cls.tensor, "matrix": cls.matrix, "row": cls.rows,
                     "rows": cls.rows, "col": cls.cols, "cols": cls.cols}
            if name in named:
                return named[name]()
            if m := _TILE_RE.match(name):
                return cls.tile(int(m[1]), int(m[2]))
            if m := _MX_RE.match(name):
                return cls.mx(int(m[1]), axis=-2 if m[2] == "col" else -1)
        raise ValueError(
            f"unknown block {block!r}; use a Block, a (rows, cols) tuple or one of 'tensor', 'matrix', "
            "'row', 'col', 'RxC' (e.g. '1x128', '128x128'), 'mxK' (e.g. 'mx32'), 'mxK_col'"
        )

    # ---- geometry ----------------------------------------------------------------------------
    def t(self) -> "Block":
        """The same blocks seen on the transposed matrix (rows and cols swapped)."""
        return Block(self.block_cols, self.block_rows, self.spans_batch)

    def extent(self, n_rows: int, n_cols: int) -> tuple[int, int]:
        """(rows, cols) of one full block on a matrix of that size."""
        br, bc = self.block_rows, self.block_cols
        return (n_rows if br is None else br, n_cols if bc is None else bc)

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of the scales for an array of ``shape``: () for :meth:`tensor`, else
        (*batch, ceil(rows / block rows), ceil(cols / block cols))."""
        shape = tuple(int(s) for s in shape)
        if self.spans_batch:
            return ()
        if len(shape) < 2:
            raise ValueError(
                f"block {self} needs x with at least 2 dims (rows, cols), got shape {shape}; "
                "reshape a vector to (1, n) or use Block.tensor()"
            )
        n_rows, n_cols = shape[-2:]
        br, bc = self.extent(n_rows, n_cols)
        return (*shape[:-2], -(-n_rows // br) if n_rows else 0, -(-n_cols // bc) if n_cols else 0)

    def __str__(self) -> str:
        if self.spans_batch:
            return "tensor"
        return f"{self.block_rows or 'all'}x{self.block_cols or 'all'}"


# ----------------------------------------------------------------------------------------------
# Exact float64 helpers
# ----------------------------------------------------------------------------------------------

_VELTKAMP = 134217729.0  # 2**27 + 1: splits a float64 into two halves of at most 26 bits


def _split(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    c = _VELTKAMP * a
    hi = c - (c - a)
    return hi, a - hi


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2**e as float64, exactly, for integer e in [-1022, 1023] (built from the bits)."""
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


def _div_round_odd(n: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """n / d in float64 rounded to odd (float64 n; finite positive float64 d; broadcasting).

    Rounding the result once more to at most 51 significant bits, in any rounding mode, gives
    the correctly rounded exact quotient. Both operands are first scaled to [0.5, 1) (exact), the
    remainder of the float64 quotient is computed exactly (Dekker's product), and an inexact
    quotient whose last bit is even moves one ulp toward the exact value. Quotients whose
    magnitude lies beyond 2**+-1000 come back as a value of the same sign in that range: every
    format here rounds all of them alike (to 0 / the smallest subnormal, or to overflow).
    Infinite or NaN ``n`` passes through.
    """
    mn, en = torch.frexp(n)
    md, ed = torch.frexp(d)
    q = mn / md  # |q| in (0.5, 2)
    p = q * md
    qh, ql = _split(q)
    dh, dl = _split(md)
    product_error = ((qh * dh - p) + qh * dl + ql * dh) + ql * dl  # q * md == p + product_error
    remainder = (mn - p) - product_error  # exact: mn - q * md (Sterbenz, then a representable result)
    even = (q.view(torch.int64) & 1) == 0
    toward = torch.where(remainder > 0, torch.inf, -torch.inf).to(q.dtype)
    q = torch.where((remainder != 0) & even, torch.nextafter(q, toward), q)
    e = torch.clamp(en.to(torch.int64) - ed.to(torch.int64), -1000, 1000)
    return torch.where(torch.isfinite(n), q * _pow2(e), n)


def _quotient(x: torch.Tensor, s: torch.Tensor, wide_input: bool) -> torch.Tensor:
    """x / s (float64, s broadcast) such that encoding it rounds the exact quotient once; a NaN
    scale gives NaN with the sign of x.

    float64 input: round to odd (:func:`_div_round_odd`). float32, float16 and bfloat16 input:
    the plain float64 quotient suffices. For a power-of-two s it is exact (|x / s| stays within
    2**+-400). Otherwise x = X 2**a and s = S 2**c with integers X, S < 2**24, and a rounding
    boundary b = B 2**d of the target has B < 2**27 (at most 1 + 10 mantissa bits + 16 random
    bits of stochastic rounding). If x / s != b then |x - b s| >= 2**min(a, c + d), which is more
    than 2**-52 |x| and more than 2**-52 |b s| (X, B S < 2**53); so the float64 rounding error,
    at most 2**-53 |x / s|, cannot carry the quotient onto or across b.
    """
    nan_scale = torch.isnan(s)
    any_nan = bool(nan_scale.any())
    if any_nan:
        s = torch.where(nan_scale, 1.0, s)
    q = _div_round_odd(x, s) if wide_input else x / s
    if any_nan:
        q = torch.where(nan_scale, torch.copysign(torch.tensor(torch.nan, dtype=x.dtype, device=x.device), x), q)
    return q


def _floor_log2(v: torch.Tensor) -> torch.Tensor:
    """floor(log2 v) for positive finite v, from the bits (int64)."""
    _, e = torch.frexp(v)
    return e.to(torch.int64) - 1


def _ceil_log2(v: torch.Tensor) -> torch.Tensor:
    """ceil(log2 v) for positive finite v, from the bits (int64)."""
    m, e = torch.frexp(v)
    return e.to(torch.int64) - (m == 0.5).to(torch.int64)


def _rn32(v: torch.Tensor) -> torch.Tensor:
    """Round a round-to-odd float64 to float32 (nearest-even), back in float64."""
    return v.to(torch.float32).to(torch.float64)


# ----------------------------------------------------------------------------------------------
# Scales
# ----------------------------------------------------------------------------------------------


def _check_margin(margin) -> int:
    if isinstance(margin, bool) or not isinstance(margin, (int, np.integer)):
        raise TypeError(f"margin must be an integer (the scale is multiplied by 2**margin), got {margin!r}")
    return int(margin)


def _element_format(fmt) -> Format:
    fmt = get_format(fmt)
    if not fmt.signed or not fmt.has_zero:
        raise ValueError(f"{fmt.name} cannot hold block elements (it has no sign or no zero); it is a scale format")
    return fmt


def _scales(amax: torch.Tensor, fmt: Format, rule: ScaleRule, margin: int):
    """(decode scale as float64, stored scales: float32 values or E8M0 codes as int64)."""
    special = torch.isnan(amax) | torch.isinf(amax)
    zero = amax == 0
    a = torch.where(special | zero, 1.0, amax).to(torch.float64)
    fmax = torch.tensor(fmt.max, dtype=torch.float64, device=a.device)
    big = 1 << 20  # stands for an exponent beyond every clamp (a zero or infinite float32)

    if rule is ScaleRule.FIXED:  # not data-dependent: no amax, no special blocks
        s = _pow2(torch.full_like(a, margin, dtype=torch.int64).clamp(_SCALE_EXP_MIN, _SCALE_EXP_MAX))
        return s, s.to(torch.float32)

    if rule is ScaleRule.AMAX:
        s = _rn32(_div_round_odd(a, fmax)) * _pow2(torch.full_like(a, margin, dtype=torch.int64).clamp(-1022, 1023))
        s = torch.clamp(s, _FLOAT32_MIN_NORMAL, _FLOAT32_MAX)  # RN32 overflow (inf) -> float32 max
        s = torch.where(zero, 1.0, s)
        s = torch.where(special, torch.nan, s)
        return s, s.to(torch.float32)

    if rule in (ScaleRule.POW2_DOWN, ScaleRule.POW2_UP):
        multiplier = _rn32(_div_round_odd(fmax.expand_as(a), a))
        multiplier = torch.where(torch.isinf(multiplier), _FLOAT32_MAX, multiplier)  # as TE
        positive = multiplier > 0
        safe = torch.where(positive, multiplier, 1.0)
        k = _floor_log2(safe) if rule is ScaleRule.POW2_DOWN else _ceil_log2(safe)
        e = torch.where(positive, -k, big) + margin  # multiplier 0 (float64 amax only): s huge
        e = torch.clamp(e, _SCALE_EXP_MIN, _SCALE_EXP_MAX)
    elif rule is ScaleRule.MX_OCP:
        e = _floor_log2(a) - fmt.emax + margin
        special = special | (e > _SCALE_EXP_MAX)  # OCP: a shared exponent above 127 is NaN
        e = torch.clamp(e, min=_SCALE_EXP_MIN)
    else:  # MX_NVIDIA
        v = _rn32(_div_round_odd(a, fmax))
        finite_positive = torch.isfinite(v) & (v > 0)
        k = _ceil_log2(torch.where(finite_positive, v, 1.0))
        k = torch.where(finite_positive, k, torch.where(v == 0, -big, big))
        e = torch.clamp(k + margin, _SCALE_EXP_MIN, _SCALE_EXP_MAX)  # satfinite

    e = torch.where(zero, 0, e)
    e = torch.where(special, 0, e)
    s = torch.where(special, torch.nan, _pow2(e))
    if rule.is_e8m0:
        return s, torch.where(special, _E8M0_NAN, e + _E8M0_BIAS)
    return s, s.to(torch.float32)


def _stored(stored: torch.Tensor, rule: ScaleRule) -> torch.Tensor:
    return stored.to(torch.uint8) if rule.is_e8m0 else stored


# ----------------------------------------------------------------------------------------------
# Layout: batch-flattened (B, R, C) <-> padded blocks (B, nR, br, nC, bc)
# ----------------------------------------------------------------------------------------------


def _to_blocks(t: torch.Tensor, br: int, bc: int, n_rb: int, n_cb: int) -> torch.Tensor:
    """(B, R, C) -> (B, nR, br, nC, bc), zero-padding the tails."""
    b, r, c = t.shape
    pad_r, pad_c = n_rb * br - r, n_cb * bc - c
    if pad_r or pad_c:
        t = torch.nn.functional.pad(t, (0, pad_c, 0, pad_r))
    return t.reshape(b, n_rb, br, n_cb, bc)


def _from_blocks(t: torch.Tensor, r: int, c: int) -> torch.Tensor:
    """(B, nR, br, nC, bc) -> (B, R, C), dropping the padding."""
    b, n_rb, br, n_cb, bc = t.shape
    return t.reshape(b, n_rb * br, n_cb * bc)[:, :r, :c]


def _kind(t: torch.Tensor, was_numpy: bool):
    if was_numpy:
        arr = t.cpu().numpy()
        return arr.view(np.uint16) if arr.dtype == np.int16 else arr
    return t


def block_amax(x, block: Block | str):
    """The largest magnitude of every block (NaN if the block holds a NaN), as float64, in the
    shape of the scales. Same kind (numpy / torch, device) as ``x``."""
    block = Block.get(block)
    t, was_numpy = _as_torch(x)
    return _kind(_block_amax(t.to(torch.float64), block), was_numpy)


def _block_amax(x64: torch.Tensor, block: Block) -> torch.Tensor:
    shape = tuple(x64.shape)
    scale_shape = block.scale_shape(shape)
    if x64.numel() == 0:
        # an empty block has amax 0 (so Block.tensor() of an empty array gets scale 1)
        return torch.zeros(scale_shape, dtype=torch.float64, device=x64.device)
    if block.spans_batch:
        return x64.abs().amax()
    r, c = shape[-2:]
    br, bc = block.extent(r, c)
    blocks = _to_blocks(x64.reshape(-1, r, c), br, bc, scale_shape[-2], scale_shape[-1])
    return blocks.abs().amax(dim=(2, 4)).reshape(scale_shape)


def scales_from_amax(amax, fmt: Format | str, scale_rule: ScaleRule | str, *, margin: int = 0):
    """The stored scales (float32, or E8M0 codes as uint8 for the MX rules) for block amaxes
    ``amax`` (any float array or tensor, non-negative or NaN/inf); see the module docstring."""
    fmt = _element_format(fmt)
    rule = ScaleRule.get(scale_rule)
    margin = _check_margin(margin)
    t, was_numpy = _as_torch(amax, "amax")
    if bool((t < 0).any()):
        raise ValueError("amax must be non-negative (a largest magnitude)")
    _, stored = _scales(t.to(torch.float64), fmt, rule, margin)
    return _kind(_stored(stored, rule), was_numpy)


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockQuantized:
    """A block-quantized array: ``codes`` (x's shape, uint8 for 8-bit formats), ``scales``
    (``block.scale_shape(codes.shape)``; float32, or uint8 E8M0 codes for the MX rules), the
    element format and the block layout. ``x ~= scale_of_block * decode(code)``."""

    codes: Any
    scales: Any
    fmt: Format
    block: Block
    scale_rule: ScaleRule

    @classmethod
    def quantize(cls, x, fmt: Format | str, *, block: Block | str, scale_rule: ScaleRule | str,
                 margin: int = 0, rounding: Rounding | str = Rounding.NEAREST_EVEN,
                 saturate: bool = True, rbits=None) -> "BlockQuantized":
        """Quantize ``x``; arguments as :func:`quantize_blocked` (row-major layout)."""
        saturate = check_bool(saturate, "saturate")
        fmt = _element_format(fmt)
        block = Block.get(block)
        rule = ScaleRule.get(scale_rule)
        margin = _check_margin(margin)
        t, was_numpy = _as_torch(x)
        x64 = t.to(torch.float64)
        shape = tuple(x64.shape)
        scale_shape = block.scale_shape(shape)  # raises for too few dims

        amax = _block_amax(x64, block)
        s, stored = _scales(amax, fmt, rule, margin)
        wide = t.dtype in (torch.float64,)  # narrower inputs divide exactly enough in float64
        if x64.numel() == 0:
            q = x64
        elif block.spans_batch:
            q = _quotient(x64, s, wide)
        else:
            r, c = shape[-2:]
            br, bc = block.extent(r, c)
            xb = _to_blocks(x64.reshape(-1, r, c), br, bc, scale_shape[-2], scale_shape[-1])
            sb = s.reshape(xb.shape[0], xb.shape[1], 1, xb.shape[3], 1)
            q = _from_blocks(_quotient(xb, sb, wide), r, c).reshape(shape)
        codes = encode(q.contiguous(), fmt, rounding=rounding, saturate=saturate, rbits=rbits)
        return cls(_kind(codes, was_numpy), _kind(_stored(stored, rule), was_numpy), fmt, block, rule)

    def astuple(self) -> tuple[Any, Any]:
        return self.codes, self.scales

    def dequantize(self):
        """``scale * decode(code)`` in float64 (exact); see :func:`dequantize_blocked`."""
        return dequantize_blocked(self.codes, self.scales, self.fmt, block=self.block)

    def t(self) -> "BlockQuantized":
        """The K-major copy: codes of the transposed matrix (last two dims swapped), contiguous,
        with the scale grid transposed to match and the block transposed. The quantized values
        are the same: ``self.t().dequantize()`` is ``self.dequantize()`` transposed, exactly."""
        return BlockQuantized(_transpose(self.codes), _transpose(self.scales), self.fmt,
                              self.block.t(), self.scale_rule)


def _transpose(a):
    if a.ndim < 2:
        return a
    if isinstance(a, torch.Tensor):
        return a.transpose(-1, -2).contiguous()
    return np.ascontiguousarray(np.swapaxes(a, -1, -2))


def quantize_blocked(x, fmt: Format | str, *, block: Block | str, scale_rule: ScaleRule | str,
                     margin: int = 0, rounding: Rounding | str = Rounding.NEAREST_EVEN,
                     saturate: bool = True, rbits=None, transposed: bool = False):
    """Quantize ``x`` with one scale per block; returns ``(codes, scales)``.

    Args:
        x: numpy array or torch tensor (CPU or CUDA) of float16, bfloat16, float32 or float64;
            at least 2-D (..., rows, cols) unless ``block`` is ``Block.tensor()``.
        fmt: element format (``"float8_e4m3fn"``, ``"e5m2"``, ... or a :class:`Format`).
        block: a :class:`Block` or shorthand (``"tensor"``, ``"row"``, ``"col"``, ``"1x128"``,
            ``"128x128"``, ``"mx32"``, ``"mx32_col"``).
        scale_rule: a :class:`ScaleRule` or its value (``"amax"``, ``"pow2_down"``,
            ``"pow2_up"``, ``"mx_ocp"``, ``"mx_nvidia"``).
        margin: integer; every scale is multiplied by ``2**margin`` before its range is
            clamped (blocks with amax 0 keep scale 1).
        rounding, saturate, rbits: as :func:`dmref.emulation.encode`, applied to ``x / s``.
            ``saturate=True`` (the default) clamps overflow to +-max, as OCP MX 6.3 asks;
            ``rbits`` is laid out like ``x``.
        transposed: return the K-major copy instead: codes of the transposed matrix, contiguous,
            scales transposed to match; dequantize it with ``block=Block.get(block).t()``.

    Returns:
        ``codes`` (shape of x; uint8 for 8-bit formats) and ``scales`` of shape
        ``block.scale_shape(x.shape)``: float32 for ``amax``/``pow2_*``, uint8 E8M0 codes for
        ``mx_*``. Same kind (numpy / torch, device) as ``x``. An empty ``x`` gives empty codes
        and scales of the shape above (``Block.tensor()``: scale 1).

    Raises:
        TypeError: non-float ``x`` (integer, bool, complex), non-integer margin, ``saturate`` or
            ``transposed`` not a bool (a string such as "no" would be truthy).
        ValueError: unknown format, rule or block; bad block extents; x with fewer than 2 dims
            for a row/column/tile block; a scale format (e8m0) as the element format.
    """
    transposed = check_bool(transposed, "transposed")
    q = BlockQuantized.quantize(x, fmt, block=block, scale_rule=scale_rule, margin=margin,
                                rounding=rounding, saturate=saturate, rbits=rbits)
    return (q.t() if transposed else q).astuple()


def dequantize_blocked(codes, scales, fmt: Format | str, *, block: Block | str):
    """``scale * decode(code)`` for every element, in float64: exact, since a code's value has at
    most 11 significant bits and a scale 24 (float32) or 1 (E8M0), and their range fits.

    ``scales`` are float32 (or float64) values, or uint8 E8M0 codes (0xFF is NaN). A NaN scale
    gives NaN for its whole block. numpy in, numpy out; torch in, torch out on the same device.
    """
    fmt = get_format(fmt)
    block = Block.get(block)
    was_numpy = not isinstance(codes, torch.Tensor)
    values = decode(codes, fmt)
    v = torch.from_numpy(np.asarray(values)) if was_numpy else values
    v = v.to(torch.float64)
    st = torch.from_numpy(np.asarray(scales)) if not isinstance(scales, torch.Tensor) else scales
    st = st.to(v.device)
    expected = block.scale_shape(tuple(v.shape))
    if tuple(st.shape) != expected:
        raise ValueError(
            f"scales of shape {tuple(st.shape)} do not fit codes of shape {tuple(v.shape)} with block "
            f"{block}: expected {expected}"
        )
    if st.dtype == torch.uint8:
        s = decode(st, "float8_e8m0fnu").to(torch.float64)
    elif st.dtype in (torch.float32, torch.float64):
        s = st.to(torch.float64)
    else:
        raise TypeError(f"scales must be float32/float64 values or uint8 E8M0 codes, got {st.dtype}")
    if block.spans_batch:
        out = v * s
    elif v.numel() == 0:
        out = v.clone()
    else:
        r, c = v.shape[-2:]
        br, bc = block.extent(r, c)
        vb = _to_blocks(v.reshape(-1, r, c), br, bc, expected[-2], expected[-1])
        out = _from_blocks(vb * s.reshape(vb.shape[0], vb.shape[1], 1, vb.shape[3], 1), r, c)
        out = out.reshape(v.shape)
    return out.cpu().numpy() if was_numpy else out
