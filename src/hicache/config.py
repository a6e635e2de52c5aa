"""Frozen, validated configuration.

Every config is a keyword-only frozen dataclass validated in ``__post_init__``; a bad value
raises :class:`ValueError` naming the field, the value and what is allowed. Derived sizes are
properties. Names and defaults follow SGLang's ``--hicache-*`` flags where they exist.

This module is pure: no torch, no threads, no IO.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, ClassVar

from hicache.validate import (
    enum_value,
    int_at_least,
    is_finite_number,
    is_int,
    is_number,
    number_at_least,
    require,
)


class WritePolicy(str, enum.Enum):
    """When a device (L1) node is copied to host (L2)."""

    WRITE_THROUGH = "write_through"
    """Back up on first insert."""
    WRITE_THROUGH_SELECTIVE = "write_through_selective"
    """Back up once a node has been hit ``write_through_threshold`` times."""
    WRITE_BACK = "write_back"
    """Back up only when the node is evicted from the device."""


class IOBackend(str, enum.Enum):
    """How pages move between L1 and L2."""

    DIRECT = "direct"
    """One copy per page (and per layer when loading layer by layer)."""
    KERNEL = "kernel"
    """Vectorized gather/scatter over all pages of an operation at once."""


class MemLayout(str, enum.Enum):
    """Host (L2) tensor layout; see DESIGN.md."""

    LAYER_FIRST = "layer_first"
    PAGE_FIRST = "page_first"
    PAGE_FIRST_DIRECT = "page_first_direct"


class EvictionPolicy(str, enum.Enum):
    """Order in which evictable leaves go first."""

    LRU = "lru"
    LFU = "lfu"
    FIFO = "fifo"
    PRIORITY = "priority"


class PrefetchPolicy(str, enum.Enum):
    """When a prefetch from L3 stops (whatever was fetched by then is used)."""

    BEST_EFFORT = "best_effort"
    """Never wait: stop as soon as the request could run."""
    WAIT_COMPLETE = "wait_complete"
    """Wait until every hit page has arrived (or failed)."""
    TIMEOUT = "timeout"
    """Wait until done or ``min(max, base + per_ki_token * tokens / 1024)`` seconds."""


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


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """How the hierarchical cache is shaped and how it behaves.

    Sizes: the device (L1) pool holds ``device_tokens`` tokens. The host (L2) pool holds
    ``hicache_size`` GB (10**9 bytes) per rank when that is set (> 0), else
    ``hicache_ratio x device_tokens`` tokens. Both are rounded down to whole pages.
    """

    page_size: int = 64
    device_tokens: int = 65536
    enable_hierarchical_cache: bool = True
    hicache_ratio: float = 2.0
    hicache_size: float = 0.0
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    write_through_threshold: int = 2
    io_backend: IOBackend = IOBackend.KERNEL
    mem_layout: MemLayout = MemLayout.PAGE_FIRST
    eviction_policy: EvictionPolicy = EvictionPolicy.LRU
    load_back_threshold: int = 10
    swa_full_tokens_ratio: float = 0.8
    """Hybrid models with sliding-window layers: the SWA layers' L1 pool holds this ratio
    of ``device_tokens`` (SGLang's ``--swa-full-tokens-ratio``;
    :meth:`SlidingWindowSpec.device_pages`)."""
    max_mamba_cache_size: int = 0
    """Hybrid models with recurrent layers: state slots in the L1 state pool (SGLang's
    ``--max-mamba-cache-size``); 0 derives it from ``mamba_full_memory_ratio``
    (:meth:`SnapshotSpec.device_slots`)."""
    mamba_full_memory_ratio: float = 0.9
    """L1 state-pool bytes per byte of the L1 full KV pool, when ``max_mamba_cache_size``
    is 0 (SGLang's ``--mamba-full-memory-ratio``)."""
    mamba_track_interval: int = 256
    """Tokens between state snapshots taken during a prefill (SGLang's
    ``--mamba-track-interval``); snapshots sit on page boundaries, every
    :meth:`SnapshotSpec.track_pages` pages."""

    def __post_init__(self) -> None:
        for field, cls in (
            ("write_policy", WritePolicy),
            ("io_backend", IOBackend),
            ("mem_layout", MemLayout),
            ("eviction_policy", EvictionPolicy),
        ):
            object.__setattr__(self, field, enum_value(cls, field, getattr(self, field)))
        int_at_least("page_size", self.page_size, 1, "(64 is the default, 1 is allowed)")
        require(
            is_int(self.device_tokens) and self.device_tokens >= self.page_size,
            "device_tokens",
            self.device_tokens,
            f"must be an int >= page_size ({self.page_size})",
        )
        require(
            isinstance(self.enable_hierarchical_cache, bool),
            "enable_hierarchical_cache",
            self.enable_hierarchical_cache,
            "must be a bool",
        )
        require(
            is_finite_number(self.hicache_ratio) and self.hicache_ratio > 1.0,
            "hicache_ratio",
            self.hicache_ratio,
            "must be a finite number > 1 (the host pool must be larger than the device pool)",
        )
        number_at_least("hicache_size", self.hicache_size, 0, "of GB (0: size by hicache_ratio)")
        int_at_least("write_through_threshold", self.write_through_threshold, 1)
        int_at_least("load_back_threshold", self.load_back_threshold, 0, "(tokens)")
        require(
            is_finite_number(self.swa_full_tokens_ratio) and self.swa_full_tokens_ratio > 0,
            "swa_full_tokens_ratio",
            self.swa_full_tokens_ratio,
            "must be a finite number > 0",
        )
        int_at_least("max_mamba_cache_size", self.max_mamba_cache_size, 0, "(0: derive it)")
        require(
            is_finite_number(self.mamba_full_memory_ratio) and self.mamba_full_memory_ratio > 0,
            "mamba_full_memory_ratio",
            self.mamba_full_memory_ratio,
            "must be a finite number > 0",
        )
        int_at_least("mamba_track_interval", self.mamba_track_interval, 1, "(tokens)")

    @property
    def device_pages(self) -> int:
        """Whole pages in the device pool."""
        return self.device_tokens // self.page_size

    def page_bytes(self, spec: KVSpec) -> int:
        """Bytes of one page over all layers for a KV of shape ``spec``."""
        return spec.token_bytes * self.page_size

    def device_bytes(self, spec: KVSpec) -> int:
        """Bytes of the device (L1) pool's buffer: ``device_pages`` whole pages."""
        return self.device_pages * self.page_bytes(spec)

    def host_pages(self, spec: KVSpec) -> int:
        """Whole pages in the host pool for a KV of shape ``spec``."""
        if self.hicache_size > 0:
            return int(self.hicache_size * 1e9) // self.page_bytes(spec)
        return int(self.device_pages * self.hicache_ratio)

    def host_tokens(self, spec: KVSpec) -> int:
        """Token slots of the host pool: ``host_pages(spec) * page_size``."""
        return self.host_pages(spec) * self.page_size

    def host_bytes(self, spec: KVSpec) -> int:
        """Bytes of the host (L2) pool's buffer (0 without the hierarchical cache)."""
        if not self.enable_hierarchical_cache:
            return 0
        return self.host_pages(spec) * self.page_bytes(spec)

    def host_scale(self, spec: KVSpec) -> float:
        """L2 size over L1 size of the full KV pools; the component pools' L2 sizes follow
        it (so ``hicache_size`` and ``hicache_ratio`` size every component's L2)."""
        return self.host_pages(spec) / self.device_pages


DEFAULT_NEGATIVE_TTL_S = 2.0
"""Seconds an L3 miss is trusted by default (:mod:`hicache.storage.negative`): a page
another instance wrote is found at most this late (the ``timeout`` prefetch's base wait is
2 s too, so a request loses at most about one prefetch window of sharing), while a stream
of requests over the same absent run asks the store about once per 2 s, not per request."""

DEFAULT_NEGATIVE_ENTRIES = 65536
"""L3 misses remembered by default (a few MiB of Python objects at most)."""


PREFETCH_KEYS: tuple[str, ...] = (
    "prefetch_threshold",
    "prefetch_timeout_base",
    "prefetch_timeout_per_ki_token",
    "prefetch_timeout_max",
)
"""Keys of ``--hicache-storage-backend-extra-config`` that tune prefetch, not the backend."""


@dataclass(frozen=True, kw_only=True)
class PrefetchConfig:
    """How prefetch from L3 starts and stops.

    A prefetch starts when the L3 hit beyond the local match is at least
    ``prefetch_threshold`` tokens. Under the ``timeout`` policy it stops after
    ``min(prefetch_timeout_max, prefetch_timeout_base + prefetch_timeout_per_ki_token *
    tokens / 1024)`` seconds (defaults 30, 2, 0.1).

    ``negative_ttl_s``: seconds a page key the store did not have is remembered, so that
    lookups through it do not ask again (:mod:`hicache.storage.negative`; 0: off, every
    lookup asks); ``negative_max_entries``: keys remembered at most (LRU).
    """

    policy: PrefetchPolicy = PrefetchPolicy.TIMEOUT
    prefetch_threshold: int = 256
    prefetch_timeout_base: float = 2.0
    prefetch_timeout_per_ki_token: float = 0.1
    prefetch_timeout_max: float = 30.0
    negative_ttl_s: float = DEFAULT_NEGATIVE_TTL_S
    negative_max_entries: int = DEFAULT_NEGATIVE_ENTRIES

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", enum_value(PrefetchPolicy, "policy", self.policy))
        int_at_least("prefetch_threshold", self.prefetch_threshold, 0, "(tokens)")
        for name in (
            "prefetch_timeout_base",
            "prefetch_timeout_per_ki_token",
            "prefetch_timeout_max",
        ):
            v = getattr(self, name)
            require(is_number(v) and v >= 0, name, v, "must be a number of seconds >= 0")
        ttl = self.negative_ttl_s
        require(
            is_finite_number(ttl) and ttl >= 0,
            "negative_ttl_s",
            ttl,
            "must be a finite number of seconds >= 0 (0: off)",
        )
        int_at_least("negative_max_entries", self.negative_max_entries, 1)

    @classmethod
    def from_extra(cls, policy: PrefetchPolicy | str, extra: dict[str, Any]) -> PrefetchConfig:
        """The prefetch keys of an extra-config dict (other keys are the backend's)."""
        return cls(
            policy=PrefetchPolicy(policy), **{k: extra[k] for k in PREFETCH_KEYS if k in extra}
        )

    def timeout_s(self, tokens: int) -> float:
        """Seconds a ``timeout`` prefetch of ``tokens`` tokens may take."""
        linear = self.prefetch_timeout_base + self.prefetch_timeout_per_ki_token * tokens / 1024
        return min(self.prefetch_timeout_max, linear)
