"""What a model caches per token, as the model side describes it.

:class:`CacheSpec` holds the full KV's shape (:class:`KVSpec`: MHA K and V, or one MLA
latent, per layer) and one :class:`ComponentSpec` per extra component: a hybrid's
sliding-window layers (:class:`SlidingWindowSpec`), recurrent-state snapshots
(:class:`SnapshotSpec` of :class:`StateTensor`), DeepSeek-V3.2's indexer keys
(:class:`IndexerSpec`). Sizes are in bytes; ``dtype`` is one of :data:`DTYPES`. How many
pages or slots each pool gets is read from the cache's
:class:`~hicache.config.CacheConfig` by the specs' sizing methods.

Every spec is a keyword-only frozen dataclass validated in ``__post_init__`` (ValueError
naming the field). This module is pure: no torch, no threads, no IO.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar

from hicache.config import CacheConfig
from hicache.validate import enum_value, int_at_least, is_int, require


class AttentionKind(str, enum.Enum):
    """Shape family of the KV cache."""

    MHA = "mha"
    """Separate K and V per layer, ``(tokens, kv_heads, head_dim)`` each (GQA/MQA included)."""
    MLA = "mla"
    """One latent per layer, ``(tokens, 1, kv_lora_rank + qk_rope_head_dim)``."""


DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")
_DTYPE_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True, kw_only=True)
class KVSpec:
    """Shape of one rank's KV cache per token.

    For MHA a token holds K and V of ``num_layers x num_kv_heads x head_dim`` each; for MLA
    a token holds one latent of ``num_layers x (kv_lora_rank + qk_rope_head_dim)``.
    """

    num_layers: int
    attention: AttentionKind = AttentionKind.MHA
    num_kv_heads: int = 1
    head_dim: int = 64
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    dtype: str = "float32"

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "attention", enum_value(AttentionKind, "attention", self.attention)
        )
        int_at_least("num_layers", self.num_layers, 1)
        require(self.dtype in DTYPES, "dtype", self.dtype, f"choose one of {DTYPES}")
        if self.attention is AttentionKind.MHA:
            for name in ("num_kv_heads", "head_dim"):
                v = getattr(self, name)
                int_at_least(name, v, 1, "for MHA")
        else:
            int_at_least("kv_lora_rank", self.kv_lora_rank, 1, "for MLA")
            int_at_least("qk_rope_head_dim", self.qk_rope_head_dim, 0, "for MLA")

    @property
    def num_kv(self) -> int:
        """Tensors per layer: 2 (K and V) for MHA, 1 (latent) for MLA."""
        return 2 if self.attention is AttentionKind.MHA else 1

    @property
    def heads(self) -> int:
        """Heads per stored tensor: ``num_kv_heads`` for MHA, 1 for MLA."""
        return self.num_kv_heads if self.attention is AttentionKind.MHA else 1

    @property
    def dim(self) -> int:
        """Last dimension of a stored tensor: ``head_dim`` (MHA) or latent width (MLA)."""
        if self.attention is AttentionKind.MHA:
            return self.head_dim
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    @property
    def token_bytes_per_layer(self) -> int:
        """Bytes one token occupies in one layer (K and V together for MHA)."""
        return self.num_kv * self.heads * self.dim * self.dtype_bytes

    @property
    def token_bytes(self) -> int:
        """Bytes one token occupies across all layers."""
        return self.token_bytes_per_layer * self.num_layers


@dataclass(frozen=True, kw_only=True)
class StateTensor:
    """One tensor of a recurrent layer's state, per layer and slot: ``shape``, ``dtype``.

    E.g. Mamba2: ``conv`` ``(conv_dim, conv_kernel - 1)`` and ``ssm``
    ``(heads, head_dim, state_size)``; Gated DeltaNet: ``conv`` and ``recurrent``
    ``(heads, key_dim, value_dim)``.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    def __post_init__(self) -> None:
        require(
            isinstance(self.name, str) and bool(self.name), "name", self.name, "a non-empty str"
        )
        require(
            isinstance(self.shape, tuple)
            and len(self.shape) >= 1
            and all(is_int(d) and d >= 1 for d in self.shape),
            "shape",
            self.shape,
            "must be a non-empty tuple of ints >= 1",
        )
        require(self.dtype in DTYPES, "dtype", self.dtype, f"choose one of {DTYPES}")

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        """Bytes per layer and slot."""
        return self.numel * _DTYPE_BYTES[self.dtype]


@dataclass(frozen=True, kw_only=True)
class ComponentSpec:
    """What a cache component (a kind of per-token state besides the full KV) keeps, as
    the model side describes it; one subclass per component. ``name`` is the tree
    component's and the L3 namespace's name of it. The cache builds one store per spec
    (:mod:`hicache.cache.components`)."""

    name: ClassVar[str]

    def device_token_bytes(self, config: CacheConfig) -> float:
        """L1 bytes this component's pools take per token of the full KV's L1 pool (0 for
        one sized as a share of that pool's bytes): what sizing L1 from a byte budget
        counts besides the full KV."""
        return 0.0


@dataclass(frozen=True, kw_only=True)
class SnapshotSpec(ComponentSpec):
    """Shape of one rank's recurrent state per slot: ``tensors`` in each of ``num_layers``
    recurrent layers (one snapshot = one slot = every tensor of every such layer). The
    component of recurrent-state snapshots (Mamba2, Gated DeltaNet), ``"mamba"``."""

    name: ClassVar[str] = "mamba"

    num_layers: int
    tensors: tuple[StateTensor, ...]

    def __post_init__(self) -> None:
        int_at_least("num_layers", self.num_layers, 1)
        require(
            isinstance(self.tensors, tuple)
            and len(self.tensors) >= 1
            and all(isinstance(t, StateTensor) for t in self.tensors),
            "tensors",
            self.tensors,
            "must be a non-empty tuple of StateTensor",
        )
        names = [t.name for t in self.tensors]
        require(len(set(names)) == len(names), "tensors", names, "names must be unique")

    @property
    def slot_bytes_per_layer(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one snapshot over all layers and tensors."""
        return self.slot_bytes_per_layer * self.num_layers

    def device_slots(self, config: CacheConfig, kv: KVSpec) -> int:
        """Slots of the L1 state pool: ``config.max_mamba_cache_size``, or as many as
        ``config.mamba_full_memory_ratio`` x the L1 full KV pool's bytes hold (``kv``: the
        full KV's shape; at least 1)."""
        if config.max_mamba_cache_size > 0:
            return config.max_mamba_cache_size
        budget = config.mamba_full_memory_ratio * config.device_bytes(kv)
        return max(1, int(budget // self.slot_bytes))

    def host_slots(self, config: CacheConfig, kv: KVSpec) -> int:
        """Slots of the L2 state pool: the L1 slots scaled like the full KV's L2 pool
        (:meth:`CacheConfig.host_scale`; at least 1)."""
        return max(1, int(self.device_slots(config, kv) * config.host_scale(kv)))

    @staticmethod
    def track_pages(config: CacheConfig) -> int:
        """Pages between the snapshots taken during a prefill:
        ``config.mamba_track_interval // page_size``, at least 1."""
        return max(1, config.mamba_track_interval // config.page_size)


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(ComponentSpec):
    """The sliding-window layers of a hybrid model: their per-token KV shape ``kv`` (one
    pool layer per sliding layer) and the ``window`` in tokens (a query at position ``p``
    attends to keys at ``p - window < q <= p``). These layers get their own L1/L2 pools;
    the full pool (the cache's :class:`KVSpec`) then holds the global layers only. The
    component ``"swa"``."""

    name: ClassVar[str] = "swa"
    kv: KVSpec
    window: int

    def __post_init__(self) -> None:
        require(isinstance(self.kv, KVSpec), "kv", self.kv, "must be a KVSpec")
        int_at_least("window", self.window, 1, "(tokens)")

    def device_token_bytes(self, config: CacheConfig) -> float:
        """The SWA L1 pool holds ``swa_full_tokens_ratio`` pages per full L1 page."""
        return config.swa_full_tokens_ratio * self.kv.token_bytes

    @staticmethod
    def device_pages(config: CacheConfig) -> int:
        """Pages of the sliding layers' L1 pool: ``config.swa_full_tokens_ratio`` x the
        full KV's L1 pages (at least 1). It depends on the config alone (a page holds
        ``page_size`` tokens of the sliding layers whatever their shape)."""
        return max(1, int(config.device_pages * config.swa_full_tokens_ratio))

    @classmethod
    def host_pages(cls, config: CacheConfig, kv: KVSpec) -> int:
        """Pages of the sliding layers' L2 pool: the L1 pages scaled like the full KV's
        L2 pool (``kv``: the full KV's shape, :meth:`CacheConfig.host_scale`)."""
        return max(1, int(cls.device_pages(config) * config.host_scale(kv)))


@dataclass(frozen=True, kw_only=True)
class IndexerSpec(ComponentSpec):
    """The DSA indexer's key cache of a DeepSeek sparse-attention model (DeepSeek-V3.2):
    one key of ``index_head_dim`` values per token in each of ``num_layers`` layers, in
    ``dtype``. The component ``"indexer"``: its L1 and L2 pools have as many pages as the
    full KV's and are indexed by the same page ids (a page of full KV at L1 page ``p`` has
    its keys at indexer L1 page ``p``; likewise in L2), so it allocates nothing of its own.

    DeepSeek's own kernels keep these keys in fp8 with one scale per 128 values; this cache
    keeps them in the model's ``dtype`` (the reference the transformers model computes in),
    ``index_head_dim * dtype bytes`` per token and layer."""

    name: ClassVar[str] = "indexer"
    num_layers: int
    index_head_dim: int
    dtype: str = "float32"

    def __post_init__(self) -> None:
        int_at_least("num_layers", self.num_layers, 1)
        int_at_least("index_head_dim", self.index_head_dim, 1)
        require(self.dtype in DTYPES, "dtype", self.dtype, f"choose one of {DTYPES}")

    @property
    def kv(self) -> KVSpec:
        """The pools' shape: one tensor per layer of ``(tokens, 1, index_head_dim)`` (the
        MLA pool layout with a latent of ``index_head_dim``), in every host layout."""
        return KVSpec(
            num_layers=self.num_layers,
            attention=AttentionKind.MLA,
            kv_lora_rank=self.index_head_dim,
            qk_rope_head_dim=0,
            dtype=self.dtype,
        )

    def device_token_bytes(self, config: CacheConfig) -> float:
        """One key per layer for every token of the full KV's L1 pool."""
        return float(self.kv.token_bytes)


@dataclass(frozen=True, kw_only=True)
class LogprobSpec(ComponentSpec):
    """What a scoring request needs of a cached prefix, kept with its pages: the
    component ``"logprob"``. Token slot ``p`` of a page holds, from the fp32
    ``log_softmax`` of the logits at position ``p``: the id of the prompt token that
    followed (``p + 1``) as the request that computed it had it, that token's logprob,
    and the ``top`` most likely tokens with their logprobs. One fp32 row of
    :attr:`width` values per token (ids bit-cast from int32), on the full KV's page ids
    like the indexer's keys; the engine adds it (not the model) when
    ``prompt_logprobs_top`` >= 0."""

    name: ClassVar[str] = "logprob"
    top: int

    def __post_init__(self) -> None:
        int_at_least("top", self.top, 0)

    @property
    def width(self) -> int:
        """fp32 values per token: next token id, its logprob, ``top`` ids, ``top`` logprobs."""
        return 2 + 2 * self.top

    @property
    def kv(self) -> KVSpec:
        """The pools' shape: one layer of ``(tokens, 1, width)`` fp32 (the MLA layout)."""
        return KVSpec(
            num_layers=1,
            attention=AttentionKind.MLA,
            kv_lora_rank=self.width,
            qk_rope_head_dim=0,
            dtype="float32",
        )

    def device_token_bytes(self, config: CacheConfig) -> float:
        """One row for every token of the full KV's L1 pool."""
        return float(self.kv.token_bytes)


@dataclass(frozen=True, kw_only=True)
class CacheSpec:
    """Everything a model caches per token, as the model side describes it: the full KV
    (``kv``: every layer of a plain model; the global layers of one whose sliding layers
    have their own pools) and one :class:`ComponentSpec` per extra component, in the
    order the cache keeps their stores. Names are unique."""

    kv: KVSpec
    components: tuple[ComponentSpec, ...] = ()

    def __post_init__(self) -> None:
        require(isinstance(self.kv, KVSpec), "kv", self.kv, "must be a KVSpec")
        require(
            isinstance(self.components, tuple)
            and all(isinstance(c, ComponentSpec) for c in self.components),
            "components",
            self.components,
            "must be a tuple of ComponentSpec",
        )
        names = [c.name for c in self.components]
        require(len(set(names)) == len(names), "components", names, "names must be unique")

    @classmethod
    def of(cls, spec: KVSpec | CacheSpec) -> CacheSpec:
        """``spec`` itself, or a full-KV-only spec of a plain :class:`KVSpec`."""
        return spec if isinstance(spec, CacheSpec) else cls(kv=spec)

    def component(self, name: str) -> ComponentSpec | None:
        """The spec of component ``name``, or None when the model has none."""
        return next((c for c in self.components if c.name == name), None)

    def device_token_bytes(self, config: CacheConfig) -> float:
        """L1 bytes per token of the full KV's L1 pool, every component's pools included
        (to size ``device_tokens`` from a byte budget)."""
        return self.kv.token_bytes + sum(c.device_token_bytes(config) for c in self.components)
