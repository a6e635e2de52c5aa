"""SGLang's storage extra config -> hicache's L3 choice (:class:`SGLangL3Settings`).

SGLang hands a ``dynamic`` storage backend the whole ``--hicache-storage-backend-extra-config``
object (``HiCacheStorageConfig.extra_config``). Its keys fall in three groups:

- SGLang's own (:data:`SGLANG_KEYS`): read by SGLang (``backend_name``, ``module_path``,
  ``class_name``, ``interface_v1``, the prefetch keys, ...), ignored here;
- this integration's (:data:`OWN_KEYS`): ``hicache_backend`` (registry name such as
  ``file`` (default), ``redis``, ``mooncake``, ``aibrix`` where installed, or
  ``package.module:Class``), ``hicache_model`` (the namespace's model name instead of
  SGLang's ``model_name``), ``hicache_weights_fingerprint`` (checkpoint revision or hash,
  default ``"unset"``);
- every other key goes to hicache's registry (:meth:`StorageConfig.parse`) as that backend's
  extra config: its own keys (``file_path``, ``url``, ``master_server_address``, ...) and
  the :class:`~hicache.storage.base.StorageOptions` keys (``timeout_s``,
  ``connect_timeout_s``, ``max_batch_pages``, ``stall_s``).

So an unknown backend or key is refused when SGLang constructs the backend (ValueError
naming it and what is accepted), before any IO. Pure: no sglang import, no IO.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hicache.storage.registry import StorageConfig

__all__ = ["DEFAULT_WEIGHTS_FINGERPRINT", "OWN_KEYS", "SGLANG_KEYS", "SGLangL3Settings"]

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

OWN_KEYS: tuple[str, ...] = ("hicache_backend", "hicache_model", "hicache_weights_fingerprint")
"""Keys this integration reads; see the module docstring."""

DEFAULT_BACKEND = "file"
DEFAULT_WEIGHTS_FINGERPRINT = "unset"
"""The namespace's weights fingerprint when none is given: pages are then shared by every
server of the same model name (set ``hicache_weights_fingerprint`` to split revisions)."""


@dataclass(frozen=True, kw_only=True)
class SGLangL3Settings:
    """The validated hicache side of one SGLang extra config.

    ``storage``: the backend choice, its settings and :class:`StorageOptions` (every call's
    deadline is ``storage.options.timeout_s``). ``model``: the namespace's model name, or
    None to take SGLang's ``model_name``. ``weights_fingerprint``: non-empty.
    """

    storage: StorageConfig
    model: str | None
    weights_fingerprint: str

    def __post_init__(self) -> None:
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"hicache_model={self.model!r} is invalid; must be a non-empty str")
        fp = self.weights_fingerprint
        if not isinstance(fp, str) or not fp:
            raise ValueError(
                f"hicache_weights_fingerprint={fp!r} is invalid; must be a non-empty str"
            )

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> SGLangL3Settings:
        """Split and validate SGLang's extra config (see the module docstring).

        Raises ValueError naming an unknown backend (with the registry's choices) or an
        unknown key (with every key accepted here), or a bad value.
        """
        raw = dict(extra or {})
        backend = raw.get("hicache_backend", DEFAULT_BACKEND)
        if not isinstance(backend, str) or not backend:
            raise ValueError(
                f"hicache_backend={backend!r} is invalid; must be a registry name such as "
                "'file', 'redis', 'mooncake' or 'package.module:Class'"
            )
        rest = {k: v for k, v in raw.items() if k not in SGLANG_KEYS and k not in OWN_KEYS}
        try:
            storage = StorageConfig.parse(backend, rest, prefetch_keys=())
        except ValueError as e:
            raise ValueError(
                f"hicache SGLang backend: {e} (besides these, the extra config takes this "
                f"integration's keys {list(OWN_KEYS)} and SGLang's {list(SGLANG_KEYS)})"
            ) from None
        return cls(
            storage=storage,
            model=raw.get("hicache_model"),
            weights_fingerprint=raw.get("hicache_weights_fingerprint", DEFAULT_WEIGHTS_FINGERPRINT),
        )
