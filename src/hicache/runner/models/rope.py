"""Rotary position embeddings (RoPE) with ``default``, ``linear``, ``llama3`` and ``yarn``
scaling.

Head vectors are rotated in the "half split" convention of Hugging Face checkpoints: the
pair for frequency ``i`` is ``(x[i], x[i + head_dim/2])`` (:func:`apply_rotary`). DeepSeek
lays its rotary dims out in interleaved pairs ``(x[2i], x[2i + 1])``
(:func:`apply_interleaved_rotary`).
"""

from __future__ import annotations

import math

import torch

from hicache.runner.models.config import RopeConfig

__all__ = [
    "RotaryEmbedding",
    "apply_interleaved_rotary",
    "apply_rotary",
    "attention_scaling",
    "inverse_frequencies",
    "softmax_scale_factor",
]


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Per-pair angular frequencies, fp32 CPU tensor ``(head_dim/2,)`` in radians/position.

    ``default``: ``theta ** (-2i / head_dim)``. ``linear``: divided by ``factor``.
    ``llama3``: wavelengths longer than ``original / low_freq_factor`` are divided by
    ``factor``, shorter than ``original / high_freq_factor`` are kept, and the band between
    blends the two linearly in ``original / wavelength``.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        original = rope.original_max_position_embeddings
        wavelen = 2 * math.pi / inv_freq
        long_wave = wavelen > original / rope.low_freq_factor
        short_wave = wavelen < original / rope.high_freq_factor
        scaled = torch.where(long_wave, inv_freq / rope.factor, inv_freq)
        smooth = (original / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
        return torch.where(~long_wave & ~short_wave, blended, scaled)
    if rope.rope_type == "yarn":
        return _yarn_frequencies(rope, head_dim, inv_freq)
    return inv_freq


def _yarn_frequencies(rope: RopeConfig, dim: int, extrapolated: torch.Tensor) -> torch.Tensor:
    """YaRN: frequency ``i`` keeps its extrapolated value above the band of dimensions that
    make ``beta_fast`` .. ``beta_slow`` full turns over the original context, takes the
    interpolated one (divided by ``factor``) below it, and ramps linearly inside it."""

    def band_edge(turns: float) -> float:
        wavelength = rope.original_max_position_embeddings / (turns * 2 * math.pi)
        return dim * math.log(wavelength) / (2 * math.log(rope.theta))

    low, high = band_edge(rope.beta_fast), band_edge(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(
        0, 1
    )
    keep = 1 - ramp  # weight of the extrapolated (unscaled) frequency
    return extrapolated / rope.factor * (1 - keep) + extrapolated * keep


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 mscale ln(factor) + 1`` (1 when not scaled up)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_scaling(rope: RopeConfig) -> float:
    """The factor YaRN applies to cos/sin (1 for every other type): ``attention_factor``,
    else ``m(mscale) / m(mscale_all_dim)`` when both are set (DeepSeek), else ``m(1)``."""
    if rope.rope_type != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.mscale and rope.mscale_all_dim:
        return _yarn_mscale(rope.factor, rope.mscale) / _yarn_mscale(
            rope.factor, rope.mscale_all_dim
        )
    return _yarn_mscale(rope.factor)


def softmax_scale_factor(rope: RopeConfig) -> float:
    """What DeepSeek multiplies its softmax scale ``qk_head_dim ** -0.5`` by:
    ``m(mscale_all_dim) ** 2`` for a scaled rope type with ``mscale_all_dim`` set, else 1."""
    if rope.rope_type == "default" or not rope.mscale_all_dim:
        return 1.0
    return _yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2


class RotaryEmbedding:
    """Computes ``cos``/``sin`` tables for token positions.

    Not an ``nn.Module``: it has no weights, and keeping its frequencies out of the module
    tree lets the model be built on the meta device and materialized without recomputing.
    """

    def __init__(self, rope: RopeConfig, head_dim: int) -> None:
        self.head_dim = head_dim
        self._inv_freq = inverse_frequencies(rope, head_dim)
        self._scale = attention_scaling(rope)
        self._on_device: dict[torch.device, torch.Tensor] = {}

    def __call__(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions (T,)`` int -> ``(cos, sin)``, each ``(T, head_dim)`` in ``dtype``.

        Angles are computed in fp32 and cast at the end.
        """
        inv_freq = self._on_device.get(positions.device)
        if inv_freq is None:
            inv_freq = self._inv_freq.to(positions.device)
            self._on_device[positions.device] = inv_freq
        angles = positions.float()[:, None] * inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        if self._scale != 1.0:
            return (angles.cos() * self._scale).to(dtype), (angles.sin() * self._scale).to(dtype)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x (T, heads, head_dim)`` by ``cos``/``sin (T, head_dim)``; same shape out."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def apply_interleaved_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x (T, heads, dim)`` whose pair for frequency ``i`` is ``(x[2i], x[2i + 1])``
    by ``cos``/``sin (T, dim)`` (as :class:`RotaryEmbedding` makes them: the angles twice).

    The result is de-interleaved: first the pairs' rotated first elements, then their
    second ones. That permutes the dims the same way for queries and keys, so their dot
    products equal those of the interleaved rotation.
    """
    half = x.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
