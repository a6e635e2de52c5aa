"""An outside engine's backend config -> hicache's L3 choice (:class:`L3Choice`).

SGLang hands its ``dynamic`` storage backend the whole extra-config object; vLLM hands a
secondary tier its entry's keys. The keys fall in three groups: the engine's own
(``engine_keys``), ignored here; this integration's (:data:`OWN_KEYS`: ``hicache_backend``, a
registry name, default ``file``, or ``package.module:Class``; ``hicache_model``;
``hicache_weights_fingerprint``, default ``"unset"``); and every other key, handed to
:meth:`StorageConfig.parse` as that backend's extra config (its own keys and the
:class:`~hicache.storage.base.StorageOptions` ones). Invariant: an unknown backend or key
is refused when the engine builds the backend (ValueError naming it and what is
accepted), before any IO. Pure: no engine import, no IO.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hicache.storage.registry import StorageConfig

__all__ = ["DEFAULT_BACKEND", "DEFAULT_WEIGHTS_FINGERPRINT", "OWN_KEYS", "L3Choice"]

OWN_KEYS: tuple[str, ...] = ("hicache_backend", "hicache_model", "hicache_weights_fingerprint")
"""Keys an integration reads; see the module docstring."""

DEFAULT_BACKEND = "file"
DEFAULT_WEIGHTS_FINGERPRINT = "unset"
"""The namespace's weights fingerprint when none is given: pages are then shared by every
server of the same model name and page format (set ``hicache_weights_fingerprint`` to
split checkpoint revisions)."""


@dataclass(frozen=True, kw_only=True)
class L3Choice:
    """The validated hicache side of one engine's backend config.

    ``storage``: the backend choice, its settings and :class:`StorageOptions` (every call's
    deadline is ``storage.options.timeout_s``). ``model``: the namespace's model name, or
    None to take the engine's. ``weights_fingerprint``: non-empty.
    """

    storage: StorageConfig
    model: str | None = None
    weights_fingerprint: str = DEFAULT_WEIGHTS_FINGERPRINT

    def __post_init__(self) -> None:
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"hicache_model={self.model!r} is invalid; must be a non-empty str")
        fp = self.weights_fingerprint
        if not isinstance(fp, str) or not fp:
            raise ValueError(
                f"hicache_weights_fingerprint={fp!r} is invalid; must be a non-empty str"
            )

    @staticmethod
    def fields_of(
        raw: Mapping[str, Any], *, who: str, engine: str, engine_keys: tuple[str, ...]
    ) -> dict[str, Any]:
        """This class's fields from ``raw`` (the engine's keys ``engine_keys`` left out).

        Raises ValueError naming an unknown backend (with the registry's choices) or an
        unknown key (with every key accepted: the backend's, :data:`OWN_KEYS` and
        ``engine``'s); ``who`` starts the message.
        """
        backend = raw.get("hicache_backend", DEFAULT_BACKEND)
        if not isinstance(backend, str) or not backend:
            raise ValueError(
                f"hicache_backend={backend!r} is invalid; must be a registry name such as "
                "'file', 'redis', 'mooncake' or 'package.module:Class'"
            )
        rest = {k: v for k, v in raw.items() if k not in engine_keys and k not in OWN_KEYS}
        try:
            storage = StorageConfig.parse(backend, rest, prefetch_keys=())
        except ValueError as e:
            raise ValueError(
                f"{who}: {e} (besides these, the config takes this integration's keys "
                f"{list(OWN_KEYS)} and {engine}'s {list(engine_keys)})"
            ) from None
        return {
            "storage": storage,
            "model": raw.get("hicache_model"),
            "weights_fingerprint": raw.get(
                "hicache_weights_fingerprint", DEFAULT_WEIGHTS_FINGERPRINT
            ),
        }
