"""A vLLM tier config -> hicache's L3 choice (:class:`VllmTierSettings`).

vLLM's ``TieringOffloadingSpec`` builds each entry of ``secondary_tiers`` by calling the
tier class with the entry's keys as keyword arguments, less ``type``, ``module_path`` and
``backpressure`` (which vLLM reads itself). The keys left fall in three groups:

- vLLM's, passed through (:data:`VLLM_KEYS`): ``locality`` (``"LOCAL"`` / ``"REMOTE"``);
- this integration's (:data:`OWN_KEYS`): ``hicache_backend`` (registry name such as
  ``file`` (default), ``redis``, ``mooncake``, or ``package.module:Class``),
  ``hicache_model`` (the namespace's model name instead of vLLM's), and
  ``hicache_weights_fingerprint`` (checkpoint revision or hash, default ``"unset"``);
- every other key goes to hicache's registry (:meth:`StorageConfig.parse`) as that
  backend's extra config: its own keys (``file_path``, ``url``, ``master_server_address``,
  ...) and the :class:`~hicache.storage.base.StorageOptions` keys (``timeout_s``,
  ``connect_timeout_s``, ``max_batch_pages``, ``stall_s``).

So an unknown backend or key is refused when vLLM builds the tier (ValueError naming it and
what is accepted), before any IO. Pure: no vllm import, no IO.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hicache.storage.registry import StorageConfig

__all__ = [
    "DEFAULT_BACKEND",
    "DEFAULT_WEIGHTS_FINGERPRINT",
    "LOCALITIES",
    "OWN_KEYS",
    "VLLM_KEYS",
    "VllmTierSettings",
]

VLLM_KEYS: tuple[str, ...] = ("locality",)
"""Tier keys vLLM defines for every tier (the factory passes them on)."""

OWN_KEYS: tuple[str, ...] = ("hicache_backend", "hicache_model", "hicache_weights_fingerprint")
"""Keys this integration reads; see the module docstring."""

LOCALITIES: tuple[str, ...] = ("LOCAL", "REMOTE")
"""vLLM's ``Locality`` values."""

DEFAULT_BACKEND = "file"
DEFAULT_WEIGHTS_FINGERPRINT = "unset"
"""The namespace's weights fingerprint when none is given: chunks are then shared by every
engine of the same model name and chunk layout (set ``hicache_weights_fingerprint`` to
split checkpoint revisions)."""


@dataclass(frozen=True, kw_only=True)
class VllmTierSettings:
    """The validated hicache side of one vLLM tier config.

    ``storage``: the backend choice, its settings and options (every call's deadline is
    ``storage.options.timeout_s``). ``model``: the namespace's model name, or None to take
    vLLM's. ``weights_fingerprint``: non-empty. ``locality``: one of :data:`LOCALITIES` or
    None (vLLM: unknown).
    """

    storage: StorageConfig
    model: str | None = None
    weights_fingerprint: str = DEFAULT_WEIGHTS_FINGERPRINT
    locality: str | None = None

    def __post_init__(self) -> None:
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"hicache_model={self.model!r} is invalid; must be a non-empty str")
        fp = self.weights_fingerprint
        if not isinstance(fp, str) or not fp:
            raise ValueError(
                f"hicache_weights_fingerprint={fp!r} is invalid; must be a non-empty str"
            )
        if self.locality is not None and self.locality not in LOCALITIES:
            raise ValueError(
                f"locality={self.locality!r} is invalid; choose one of {list(LOCALITIES)}"
            )

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> VllmTierSettings:
        """Split and validate a tier's keyword arguments (see the module docstring).

        Raises ValueError naming an unknown backend (with the registry's choices) or an
        unknown key (with every key accepted here), or a bad value.
        """
        raw = dict(params)
        backend = raw.get("hicache_backend", DEFAULT_BACKEND)
        if not isinstance(backend, str) or not backend:
            raise ValueError(
                f"hicache_backend={backend!r} is invalid; must be a registry name such as "
                "'file', 'redis', 'mooncake' or 'package.module:Class'"
            )
        rest = {k: v for k, v in raw.items() if k not in VLLM_KEYS and k not in OWN_KEYS}
        try:
            storage = StorageConfig.parse(backend, rest, prefetch_keys=())
        except ValueError as e:
            raise ValueError(
                f"hicache vLLM tier: {e} (besides these, the tier config takes this "
                f"integration's keys {list(OWN_KEYS)} and vLLM's {list(VLLM_KEYS)})"
            ) from None
        return cls(
            storage=storage,
            model=raw.get("hicache_model"),
            weights_fingerprint=raw.get("hicache_weights_fingerprint", DEFAULT_WEIGHTS_FINGERPRINT),
            locality=raw.get("locality"),
        )
