"""Rotary position embeddings of the Llama family: frequencies for every rope type the
checkpoints use (default, linear, dynamic, llama3, yarn), per-position cos / sin tables, and the
rotation itself (Hugging Face's half-split layout)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters; unused fields keep their defaults for simpler rope types."""

    theta: float = 10000.0
    type: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0  # linear, dynamic, llama3, yarn
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int | None = None  # llama3, yarn (None: the model's max)
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn cos/sin scale; None: derived from factor/mscale
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn: round the correction range to whole dims

    def __post_init__(self):
        if self.type not in ROPE_TYPES:
            raise ValueError(f"invalid value for 'rope_type': {self.type!r}; expected one of "
                             f"{', '.join(ROPE_TYPES)}")


class RopeShape(Protocol):
    """What the frequencies depend on (a ``ModelConfig`` or a drafter layer's config)."""

    rope: "RopeConfig"
    head_dim: int
    max_position_embeddings: int


def rope_frequencies(cfg: RopeShape, device=None) -> tuple[Tensor, float]:
    """Inverse frequencies ``[head_dim // 2]`` (fp32) and the cos/sin scale (1 except for yarn).

    "dynamic" (NTK) rescales only beyond ``max_position_embeddings`` and then depends on the
    current length, which a static cache cannot follow; here it is exact up to
    ``max_position_embeddings`` (plain RoPE there, as in Hugging Face) and not rescaled beyond.
    """
    r, dim = cfg.rope, cfg.head_dim
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    inv_freq = 1.0 / (r.theta ** exponent)  # [dim / 2]
    if r.type == "linear":
        return inv_freq / r.factor, 1.0
    if r.type == "llama3":
        return _llama3_frequencies(inv_freq, r, cfg.max_position_embeddings), 1.0
    if r.type == "yarn":
        return _yarn_frequencies(r, dim, cfg.max_position_embeddings, device)
    return inv_freq, 1.0


def _llama3_frequencies(inv_freq: Tensor, r: RopeConfig, max_pos: int) -> Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by ``factor``, blend in between."""
    old_len = r.original_max_position_embeddings or max_pos
    low_wavelen, high_wavelen = old_len / r.low_freq_factor, old_len / r.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / r.factor, inv_freq)
    smooth = (old_len / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
    smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_frequencies(r: RopeConfig, dim: int, max_pos: int, device) -> tuple[Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, ramp between; scale cos/sin."""
    old_len = r.original_max_position_embeddings or max_pos

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = r.attention_factor
    if attn is None:
        attn = (mscale(r.factor, r.mscale) / mscale(r.factor, r.mscale_all_dim)
                if r.mscale and r.mscale_all_dim else mscale(r.factor))

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(r.theta))

    low, high = correction_dim(r.beta_fast), correction_dim(r.beta_slow)
    if r.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low))
    extrapolate = 1 - ramp.clamp(0, 1)  # [dim / 2]: 1 = keep the original frequency
    pos_freqs = r.theta ** (torch.arange(0, dim, 2, device=device).float() / dim)
    inv_freq = (1 / (r.factor * pos_freqs)) * (1 - extrapolate) + (1 / pos_freqs) * extrapolate
    return inv_freq, float(attn)


def rope_cos_sin(inv_freq: Tensor, positions: Tensor, scale: float,
                 dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and *signed* sin ``[B, 1, T, head_dim]`` for ``positions [B, T]`` (fp32, then cast),
    as :func:`apply_rope` takes them: the sin's first half is negated, which folds
    ``rotate_half``'s negation into the table (computed once per forward, not per layer)."""
    freqs = positions[..., None].float() * inv_freq  # [B, T, hd / 2]
    cos, sin = freqs.cos(), freqs.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)  # [B, T, hd]
    return cos[:, None].to(dtype), sin[:, None].to(dtype)


class RopeTable:
    """:func:`rope_cos_sin` of positions ``0 .. size - 1``, computed once, for cached forwards.

    Why: at decode sizes on a CPU every op costs microseconds of dispatch whatever its size, and
    computing cos / sin per forward is a dozen ops; for a one-layer draft head that was about a
    tenth of its step (a target spreads it over all its layers). A cached forward's positions
    are bounded by its cache, so a table of ``cache.capacity`` rows covers every valid token
    (padding beyond it is clamped: its outputs are discarded). The rows are the same
    elementwise math as :func:`rope_cos_sin`, so the values are identical bit for bit.
    """

    def __init__(self, inv_freq: Tensor, scale: float, size: int, dtype: torch.dtype):
        positions = torch.arange(size, device=inv_freq.device)[None]  # [1, P]
        cos, sin = rope_cos_sin(inv_freq, positions, scale, dtype)  # [1, 1, P, hd] each
        self.cos, self.sin = cos[0, 0], sin[0, 0]  # [P, hd]
        self._cos4, self._sin4 = cos, sin  # [1, 1, P, hd]: the same storage
        self.inv_freq, self.scale = inv_freq, scale

    @property
    def size(self) -> int:
        return self.cos.shape[0]

    def serves(self, inv_freq: Tensor, scale: float, size: int, dtype: torch.dtype) -> bool:
        """Whether this table holds these rows: the same frequency tensor (``init_buffers`` or a
        move to another device makes a new one), scale and dtype, and at least ``size`` rows (a
        larger table serves a smaller cache too, so a model shared by engines of different
        lengths keeps one table)."""
        return (self.inv_freq is inv_freq and self.scale == scale and self.cos.dtype == dtype
                and self.size >= size)

    def __call__(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """``positions [B, T]`` -> cos, signed sin ``[B, 1, T, hd]`` (as :func:`rope_cos_sin`)."""
        index = positions.clamp_max(self.size - 1)  # [B, T]
        return self.cos[index][:, None], self.sin[index][:, None]

    def rows(self, start: int, seq: int) -> tuple[Tensor, Tensor]:
        """Positions ``start .. start + seq - 1`` of one row (known on the host, in the table):
        cos, signed sin ``[1, 1, T, hd]``, views instead of a gather."""
        return self._cos4.narrow(2, start, seq), self._sin4.narrow(2, start, seq)


def step_rope(owner, positions: Tensor, dtype: torch.dtype, step) -> tuple[Tensor, Tensor]:
    """cos / sin for a forward of ``owner`` (a module with ``inv_freq`` and ``rope_scale``):
    looked up in its :class:`RopeTable` when ``step`` writes a KV cache (a ``CacheStep`` or a
    grouped one: anything with a ``cache``), computed by :func:`rope_cos_sin` otherwise
    (training steps, whose positions are not bounded by a cache)."""
    cache = getattr(step, "cache", None)
    if cache is None:
        return rope_cos_sin(owner.inv_freq, positions, owner.rope_scale, dtype)
    table = owner.__dict__.get("_rope_table")
    if table is None or not table.serves(owner.inv_freq, owner.rope_scale, cache.capacity, dtype):
        table = RopeTable(owner.inv_freq, owner.rope_scale, cache.capacity, dtype)
        object.__setattr__(owner, "_rope_table", table)  # not a buffer: never saved or moved
    start = getattr(step, "start", None)  # one row planned with a host-known start
    if start is not None:
        return table.rows(start, positions.shape[1])
    return table(positions)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x [B, heads, T, hd]`` (half-split layout, as in Hugging Face checkpoints), with
    ``cos, sin`` from :func:`rope_cos_sin`: Hugging Face's ``x * cos + cat(-x2, x1) * sin``,
    bit for bit, as ``x * cos + cat(x2, x1) * cat(-sin, sin)`` (one roll instead of a chunk, a
    negation and a concatenation per layer)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin
