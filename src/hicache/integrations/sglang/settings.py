"""SGLang's storage extra config -> hicache's L3 choice (:class:`SGLangL3Settings`).

SGLang hands a ``dynamic`` storage backend the whole ``--hicache-storage-backend-extra-config``
object (``HiCacheStorageConfig.extra_config``). Its keys are SGLang's own
(:data:`SGLANG_KEYS`: ``backend_name``, ``module_path``, ``class_name``, ``interface_v1``, the
prefetch keys, ...), ignored here, this integration's and the backend's
(:mod:`hicache.integrations.l3_choice`), and ``hicache_kv_heads`` (:data:`KV_HEADS_KEY`: the
model's K/V heads, needed to share ``page_head`` pages across TP sizes when a rank holds one
head). Pure: no sglang import, no IO.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hicache.integrations.l3_choice import L3Choice

__all__ = ["KV_HEADS_KEY", "SGLANG_KEYS", "SGLangL3Settings"]

KV_HEADS_KEY = "hicache_kv_heads"
"""The extra config's key of the model's K/V head count (optional)."""

SGLANG_KEYS: tuple[str, ...] = (
    "backend_name",
    "module_path",
    "class_name",
    "interface_v1",
    "tp_lcm_size",
    "prefetch_threshold",
    "prefetch_timeout_base",
    "prefetch_timeout_per_ki_token",
    "hicache_storage_pass_prefix_keys",
)
"""Keys SGLang itself reads from the extra config (this integration ignores them)."""


@dataclass(frozen=True, kw_only=True)
class SGLangL3Settings(L3Choice):
    """The validated hicache side of one SGLang extra config (``model`` None: SGLang's
    ``model_name``; ``kv_heads`` None: the host pool's heads times the TP size)."""

    kv_heads: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        n = self.kv_heads
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ValueError(f"{KV_HEADS_KEY}={n!r} is invalid; must be an int >= 1")

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> SGLangL3Settings:
        """Split and validate SGLang's extra config; ValueError as
        :meth:`L3Choice.fields_of` says."""
        raw = dict(extra or {})
        kv_heads = raw.pop(KV_HEADS_KEY, None)
        fields = cls.fields_of(
            raw, who="hicache SGLang backend", engine="SGLang", engine_keys=SGLANG_KEYS,
        )  # fmt: skip
        return cls(**fields, kv_heads=kv_heads)
