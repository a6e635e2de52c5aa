"""SGLang's storage extra config -> hicache's L3 choice (:class:`SGLangL3Settings`).

SGLang hands a ``dynamic`` storage backend the whole ``--hicache-storage-backend-extra-config``
object (``HiCacheStorageConfig.extra_config``). Its keys are SGLang's own
(:data:`SGLANG_KEYS`: ``backend_name``, ``module_path``, ``class_name``, ``interface_v1``, the
prefetch keys, ...), ignored here, this integration's and the backend's
(:mod:`hicache.integrations.l3_choice`). Pure: no sglang import, no IO.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hicache.integrations.l3_choice import L3Choice

__all__ = ["SGLANG_KEYS", "SGLangL3Settings"]

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


class SGLangL3Settings(L3Choice):
    """The validated hicache side of one SGLang extra config (``model`` None: SGLang's
    ``model_name``)."""

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> SGLangL3Settings:
        """Split and validate SGLang's extra config; ValueError as
        :meth:`L3Choice.fields_of` says."""
        fields = cls.fields_of(
            dict(extra or {}), who="hicache SGLang backend", engine="SGLang",
            engine_keys=SGLANG_KEYS,
        )  # fmt: skip
        return cls(**fields)
