"""The hicache namespace of vLLM's offloaded chunks, and vLLM offload keys as hicache keys.

A secondary tier moves whole rows of vLLM's primary (CPU) tier buffer: row ``c`` holds one
offloaded chunk (``blocks_per_chunk`` KV blocks of one KV cache group) for every worker, in
vLLM's own byte order, padded to the row stride. :class:`ChunkLayout` keeps what fixes those
bytes, and :func:`vllm_namespace` pins it in a :class:`~hicache.keys.Namespace`: vLLM's
model, ``weights_fingerprint``, ``kv_dtype`` (one of :data:`hicache.spec.DTYPES`),
``layout`` ``page_first``, ``page_size`` = ``tokens_per_hash * blocks_per_chunk``, ``tp_size``
1 / ``tp_rank`` None (a row holds every worker's bytes), component ``"full"``, no tenant
salt, and ``engine_layout`` ``"vllm:chunk;row=...;hash=...;kvb=...;groups=...;layers=..."``
(plus ``;par=...``, ``;replicated``, ``;canonical=...`` where they apply). Keys
(:func:`vllm_page_key`): ``"hc3-" + hex(sha256(namespace digest || offload key))``, the
offload key being vLLM's chained block hash + the 4-byte group index; fingerprint = the
first 8 bytes of ``sha256(offload key)``. Pure: no vllm import, no IO. The fields in
full: ``docs/integrations.md``, "vLLM".
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hicache.config import MemLayout
from hicache.keys import Namespace, PageKey, engine_page_key
from hicache.spec import DTYPES

__all__ = [
    "ENGINE",
    "ChunkLayout",
    "GroupLayout",
    "page_keys_of",
    "vllm_namespace",
    "vllm_page_key",
]

ENGINE = "vllm"

_LAYER_DIGEST_HEX = 16
"""Hex digits of the layer-name digest kept in ``engine_layout`` (64 bits)."""


def _positive(name: str, value: object) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        raise ValueError(f"{name}={value!r} is invalid; must be an int >= 1")


@dataclass(frozen=True, kw_only=True)
class GroupLayout:
    """One KV cache group of vLLM's offloading config: ``tokens_per_block``, its layers'
    names (in vLLM's order) and ``window_chunks`` (chunks kept for a sliding-window layer,
    None for full attention)."""

    tokens_per_block: int
    layer_names: tuple[str, ...]
    window_chunks: int | None = None

    def __post_init__(self) -> None:
        _positive("tokens_per_block", self.tokens_per_block)
        if not self.layer_names or not all(isinstance(n, str) for n in self.layer_names):
            raise ValueError(f"layer_names={self.layer_names!r} is invalid; need >= 1 str")
        if self.window_chunks is not None:
            _positive("window_chunks", self.window_chunks)


@dataclass(frozen=True, kw_only=True)
class ChunkLayout:
    """What fixes the bytes of one row of vLLM's primary tier (see the module docstring).

    ``row_bytes``: the row stride of the primary tier's memoryview (a record's payload
    length). ``topology``: ``(tp, pp, pcp, dcp, world)`` sizes, or None when vLLM says the
    bytes are parallelism-agnostic (then engines of any topology share them).
    """

    model: str
    dtype: str
    row_bytes: int
    tokens_per_hash: int
    blocks_per_chunk: int
    worker_kv_bytes_per_block: int
    groups: tuple[GroupLayout, ...]
    topology: tuple[int, int, int, int, int] | None
    replicated: bool = False
    canonical: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model={self.model!r} is invalid; must be a non-empty str")
        for name in ("row_bytes", "tokens_per_hash", "blocks_per_chunk"):
            _positive(name, getattr(self, name))
        _positive("worker_kv_bytes_per_block", self.worker_kv_bytes_per_block)
        if not self.groups:
            raise ValueError("groups=() is invalid; vLLM's config has at least one KV group")
        if self.topology is not None:
            if len(self.topology) != 5:
                raise ValueError(f"topology={self.topology!r} is invalid; need 5 sizes")
            for size in self.topology:
                _positive("topology size", size)

    @classmethod
    def from_config(cls, config: Any, row_bytes: int) -> ChunkLayout:
        """The layout of vLLM's ``OffloadingConfig`` ``config`` (read by attribute, so this
        module imports no vLLM) with rows of ``row_bytes``."""
        par = config.parallel
        topology = (
            None
            if par.is_parallelism_agnostic
            else (par.tp_size, par.pp_size, par.pcp_size, par.dcp_size, par.world_size)
        )
        canonical = (config.kv_cache_layout or "unknown") if config.canonical_layout else None
        return cls(
            model=config.model.name,
            dtype=str(config.model.dtype).removeprefix("torch."),
            row_bytes=row_bytes,
            tokens_per_hash=config.cache.tokens_per_hash,
            blocks_per_chunk=config.cache.blocks_per_chunk,
            worker_kv_bytes_per_block=config.worker_kv_bytes_per_block,
            groups=tuple(
                GroupLayout(
                    tokens_per_block=g.tokens_per_block,
                    layer_names=tuple(g.layer_names),
                    window_chunks=g.sliding_window_size_in_chunks,
                )
                for g in config.groups
            ),
            topology=topology,
            replicated=bool(config.replicated_layout),
            canonical=canonical,
        )

    @property
    def tokens_per_chunk(self) -> int:
        return self.tokens_per_hash * self.blocks_per_chunk

    def engine_layout(self) -> str:
        """The ``engine_layout`` string of the namespace (see the module docstring)."""
        names = "\n".join(n for g in self.groups for n in (*g.layer_names, ""))
        layers = hashlib.sha256(names.encode("utf-8")).hexdigest()[:_LAYER_DIGEST_HEX]
        groups = ",".join(
            f"{g.tokens_per_block}/{len(g.layer_names)}/{g.window_chunks or 0}" for g in self.groups
        )
        parts = [
            f"{ENGINE}:chunk",
            f"row={self.row_bytes}",
            f"hash={self.tokens_per_hash}x{self.blocks_per_chunk}",
            f"kvb={self.worker_kv_bytes_per_block}",
            f"groups={groups}",
            f"layers={layers}",
        ]
        if self.topology is not None:
            tp, pp, pcp, dcp, world = self.topology
            parts.append(f"par=tp{tp}pp{pp}pcp{pcp}dcp{dcp}w{world}")
        if self.replicated:
            parts.append("replicated")
        if self.canonical is not None:
            parts.append(f"canonical={self.canonical}")
        return ";".join(parts)


def vllm_namespace(
    layout: ChunkLayout, *, weights_fingerprint: str, model: str | None = None
) -> Namespace:
    """The namespace of the chunks ``layout`` describes (see the module docstring).

    ``model`` overrides vLLM's model name. Raises ValueError naming the dtype when hicache
    cannot store it (:data:`hicache.spec.DTYPES`; vLLM's fp8 KV caches are refused).
    """
    if layout.dtype not in DTYPES:
        raise ValueError(
            f"vLLM KV cache dtype {layout.dtype!r} cannot be stored by hicache; supported: "
            f"{list(DTYPES)}"
        )
    return Namespace(
        model=model or layout.model,
        weights_fingerprint=weights_fingerprint,
        kv_dtype=layout.dtype,
        layout=MemLayout.PAGE_FIRST,
        page_size=layout.tokens_per_chunk,
        tp_size=1,
        tp_rank=None,
        engine_layout=layout.engine_layout(),
    )


def vllm_page_key(namespace: Namespace, offload_key: bytes) -> PageKey:
    """The hicache key of vLLM offload key ``offload_key`` (block hash + group index)."""
    if not isinstance(offload_key, bytes) or len(offload_key) <= 4:
        raise ValueError(
            f"vLLM offload key {offload_key!r} is invalid; must be bytes (a block hash "
            "followed by a 4-byte group index)"
        )
    return engine_page_key(namespace, offload_key)


def page_keys_of(namespace: Namespace, offload_keys: Sequence[bytes]) -> list[PageKey]:
    """:func:`vllm_page_key` of each key, in order."""
    return [vllm_page_key(namespace, k) for k in offload_keys]
