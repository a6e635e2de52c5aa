"""Decoder architecture config, read from a Hugging Face ``PretrainedConfig``.

:class:`DecoderConfig` is the one place that knows how the Llama, Qwen2 and Qwen3 families
differ (biases, per-head q/k norms, head_dim, RoPE scaling); the modules only read its
fields. Unsupported features raise :class:`UnsupportedModelError` naming what is missing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Self

from hicache.heads import HeadSplit

__all__ = [
    "FAMILIES",
    "HYBRID_ROPE_TYPES",
    "ROPE_TYPES",
    "DecoderConfig",
    "HybridRopeConfig",
    "RopeConfig",
    "UnsupportedModelError",
    "check_split",
]

FAMILIES: tuple[str, ...] = ("llama", "qwen2", "qwen3")
"""Supported ``model_type`` values of a Hugging Face config."""

ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3")
"""Supported ``rope_type`` values of ``rope_parameters`` / ``rope_scaling`` (Llama families)."""

HYBRID_ROPE_TYPES: tuple[str, ...] = (*ROPE_TYPES, "yarn")
"""What :class:`HybridRopeConfig` (the hybrid families) accepts."""


class UnsupportedModelError(ValueError):
    """The checkpoint uses an architecture or feature this engine does not implement."""


def check_split(size: int, sizes: Sequence[tuple[str, int]], family: str) -> None:
    """ValueError naming the numbers unless ``size`` tensor-parallel ranks divide every
    ``(config field, value)`` of ``sizes`` (each rank holds a whole ``value / size``) of a
    ``family`` model."""
    bad = [f"{name}={v}" for name, v in sizes if v % size]
    if bad:
        every = ", ".join(f"{name}={v}" for name, v in sizes)
        raise ValueError(
            f"tensor-parallel size {size} does not divide {', '.join(bad)} of the"
            f" {family} model; choose a size that divides each of {every}"
        )


@dataclass(frozen=True, kw_only=True)
class RopeConfig:
    """Rotary position embedding parameters.

    ``theta`` is the frequency base. ``rope_type`` is one of :data:`ROPE_TYPES`; ``factor``
    scales the frequencies for ``linear`` and ``llama3``; ``low_freq_factor``,
    ``high_freq_factor`` and ``original_max_position_embeddings`` shape ``llama3``'s smooth
    interpolation between scaled (long wavelengths) and unscaled (short) frequencies.
    ``yarn`` blends interpolated and extrapolated frequencies over the dimension band set
    by ``beta_fast``/``beta_slow`` rotations (floored/ceiled when ``truncate``) and scales
    cos/sin by ``attention_factor`` (default ``0.1 ln(factor) + 1``; with DeepSeek's
    ``mscale`` and ``mscale_all_dim`` both set, ``m(mscale) / m(mscale_all_dim)`` where
    ``m(s) = 0.1 s ln(factor) + 1``). ``mscale_all_dim`` also corrects the softmax scale of
    DeepSeek's attention by ``m(mscale_all_dim) ** 2`` for any scaled rope type
    (:func:`~hicache.runner.models.rope.softmax_scale_factor`).
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None

    def allowed_types(self) -> tuple[str, ...]:
        """The ``rope_type`` values this config class accepts."""
        return ROPE_TYPES

    def __post_init__(self) -> None:
        allowed = self.allowed_types()
        if self.rope_type not in allowed:
            raise UnsupportedModelError(
                f"rope_type={self.rope_type!r} is not supported; choose one of {allowed}"
            )
        if not self.theta > 0:
            raise ValueError(f"rope theta={self.theta!r} is invalid; must be > 0")
        if not self.factor > 0:
            raise ValueError(f"rope factor={self.factor!r} is invalid; must be > 0")
        for name in ("mscale", "mscale_all_dim"):
            v = getattr(self, name)
            if v is not None and not v >= 0:
                raise ValueError(f"rope {name}={v!r} is invalid; must be >= 0")
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"llama3 rope high_freq_factor={self.high_freq_factor!r} must exceed "
                f"low_freq_factor={self.low_freq_factor!r}"
            )

    @classmethod
    def from_hf(cls, hf_config: Any) -> Self:
        """Read ``rope_parameters`` (transformers >= 5) or ``rope_theta`` + ``rope_scaling``."""
        params = dict(getattr(hf_config, "rope_parameters", None) or {})
        legacy = getattr(hf_config, "rope_scaling", None)
        if not params and isinstance(legacy, dict):
            params = dict(legacy)
        if "rope_theta" not in params and getattr(hf_config, "rope_theta", None) is not None:
            params["rope_theta"] = hf_config.rope_theta
        return cls.from_params(params, int(getattr(hf_config, "max_position_embeddings", 8192)))

    @classmethod
    def from_params(cls, params: dict[str, Any], max_position_embeddings: int) -> Self:
        """Build from one ``rope_parameters`` dict (per layer type for Gemma 3)."""
        rope_type = params.get("rope_type", params.get("type", "default"))
        original = params.get("original_max_position_embeddings", 0) or max_position_embeddings
        factor = params.get("factor")
        if factor is None:
            factor = max_position_embeddings / original if rope_type == "yarn" else 1.0
        attention_factor = params.get("attention_factor")
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        return cls(
            mscale=None if mscale is None else float(mscale),
            mscale_all_dim=None if mscale_all_dim is None else float(mscale_all_dim),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            truncate=bool(params.get("truncate", True)),
            attention_factor=None if attention_factor is None else float(attention_factor),
            theta=float(params.get("rope_theta", 10000.0)),
            rope_type=str(rope_type),
            factor=float(factor),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(original),
        )


@dataclass(frozen=True, kw_only=True)
class HybridRopeConfig(RopeConfig):
    """:class:`RopeConfig` of the hybrid families, which also accept ``yarn``."""

    def allowed_types(self) -> tuple[str, ...]:
        return HYBRID_ROPE_TYPES


@dataclass(frozen=True, kw_only=True)
class DecoderConfig:
    """Sizes and switches of a Llama-style decoder.

    Attention has ``num_heads`` query heads and ``num_kv_heads`` K/V heads (GQA:
    ``num_heads % num_kv_heads == 0``), each ``head_dim`` wide, which need not equal
    ``hidden_size / num_heads``. ``qkv_bias`` / ``o_bias`` / ``mlp_bias`` add biases to
    those projections; ``qk_norm`` applies a per-head RMSNorm to q and k before RoPE (Qwen3).
    """

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise UnsupportedModelError(
                f"model_type={self.family!r} is not supported; choose one of {FAMILIES}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}={v!r} is invalid; must be an int >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} is invalid; RoPE needs it even")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps={self.rms_norm_eps!r} is invalid; must be > 0")

    def check_tensor_parallel(self, size: int) -> None:
        """ValueError naming the numbers unless ``size`` tensor-parallel ranks can split this
        model: ``size`` must divide the query heads and either divide the K/V heads or be
        a multiple of them (then each K/V head is replicated on ``size / num_kv_heads``
        ranks; :class:`~hicache.heads.HeadSplit`), and divide the MLP's intermediate size.
        Nothing to check for the vocabulary, which is padded to a multiple of ``size``."""
        try:
            HeadSplit(self.num_heads, self.num_kv_heads, size)
        except ValueError as exc:
            raise ValueError(f"{exc} (the {self.family} model)") from None
        check_split(size, (("intermediate_size", self.intermediate_size),), self.family)

    @classmethod
    def from_hf(cls, hf_config: Any) -> DecoderConfig:
        """Build from a transformers ``LlamaConfig`` / ``Qwen2Config`` / ``Qwen3Config``."""
        family = str(getattr(hf_config, "model_type", ""))
        if family not in FAMILIES:
            raise UnsupportedModelError(
                f"model_type={family!r} is not supported; choose one of {FAMILIES}"
            )
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act={act!r} is not supported; only 'silu'")
        if getattr(hf_config, "use_sliding_window", False) or any(
            t != "full_attention" for t in getattr(hf_config, "layer_types", None) or ()
        ):
            raise UnsupportedModelError("sliding-window attention layers are not supported")
        num_heads = int(hf_config.num_attention_heads)
        hidden = int(hf_config.hidden_size)
        head_dim = getattr(hf_config, "head_dim", None) or hidden // num_heads
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        return cls(
            family=family,
            vocab_size=int(hf_config.vocab_size),
            hidden_size=hidden,
            intermediate_size=int(hf_config.intermediate_size),
            num_layers=int(hf_config.num_hidden_layers),
            num_heads=num_heads,
            num_kv_heads=int(getattr(hf_config, "num_key_value_heads", None) or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf_config.rms_norm_eps),
            rope=RopeConfig.from_hf(hf_config),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and no o_proj bias; Llama and Qwen3 follow
            # ``attention_bias`` for all four projections.
            qkv_bias=True if family == "qwen2" else attention_bias,
            o_bias=False if family == "qwen2" else attention_bias,
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            qk_norm=family == "qwen3",
        )
