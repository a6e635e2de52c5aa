"""Decoder models (Llama, Qwen2, Qwen3 families) over the paged KV pool."""

from hicache.engine.models.attention import AttentionContext, DecodeGather, PagedAttention
from hicache.engine.models.config import (
    FAMILIES,
    ROPE_TYPES,
    DecoderConfig,
    RopeConfig,
    UnsupportedModelError,
)
from hicache.engine.models.decoder import DecoderLM, WeightLoadError, build_model
from hicache.engine.models.rope import RotaryEmbedding, apply_rotary, inverse_frequencies

__all__ = [
    "FAMILIES",
    "ROPE_TYPES",
    "AttentionContext",
    "DecodeGather",
    "DecoderConfig",
    "DecoderLM",
    "PagedAttention",
    "RopeConfig",
    "RotaryEmbedding",
    "UnsupportedModelError",
    "WeightLoadError",
    "apply_rotary",
    "build_model",
    "inverse_frequencies",
]
