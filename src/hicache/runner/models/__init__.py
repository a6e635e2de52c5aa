"""Decoder models over the paged KV pool.

Every family implements :class:`~hicache.runner.models.cached.CachedModel`: it declares
what it caches and binds the pools it is given (:mod:`.cached`), so the runner names none.
Llama / Qwen2 / Qwen3 (:class:`DecoderLM`, exported here) and the hybrid families in their
own modules: :mod:`.gemma3`, :mod:`.gpt_oss`, :mod:`.qwen3_next`, :mod:`.nemotron_h` on the
frame of :mod:`.hybrid`, with :mod:`.sliding` (window/sinks attention), :mod:`.moe`,
:mod:`.gated_deltanet`, :mod:`.mamba2`, :mod:`.recurrent` (the state-carrying API) and
:mod:`.registry` (supported architectures).
"""

from hicache.runner.models.attention import AttentionContext, DecodeGather, PagedAttention
from hicache.runner.models.config import (
    FAMILIES,
    ROPE_TYPES,
    DecoderConfig,
    RopeConfig,
    UnsupportedModelError,
)
from hicache.runner.models.decoder import DecoderLM, WeightLoadError, build_model
from hicache.runner.models.rope import RotaryEmbedding, apply_rotary, inverse_frequencies

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
