"""Backend registry: name -> factory, plus ``module:Class`` for a custom backend.

Built-in names: ``file`` (default), ``memory`` (fake, for tests), ``redis``, ``mooncake``.
Their modules are imported only when used, so a missing optional client package only
matters to the backend that needs it.

The engine's ``--hicache-storage-backend-extra-config`` is JSON text or ``@path/to.json``;
:func:`parse_extra_config` turns it into a dict. Keys ``timeout_s``, ``connect_timeout_s``
and ``max_batch_pages`` set :class:`~hicache.storage.base.StorageOptions` for any backend;
the rest go to the backend, which rejects keys it does not know.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hicache.keys import Namespace
from hicache.storage.base import HiCacheStorage, StorageOptions

__all__ = [
    "BUILTIN_BACKENDS",
    "StorageFactory",
    "backend_names",
    "create_storage",
    "parse_extra_config",
    "register_backend",
    "resolve_backend",
]

StorageFactory = Callable[[Namespace, Mapping[str, Any], StorageOptions], HiCacheStorage]
"""``factory(namespace, backend_extra_config, options) -> unstarted backend``."""

BUILTIN_BACKENDS: dict[str, str] = {
    "file": "hicache.storage.backends.file:FileStorage",
    "memory": "hicache.storage.backends.memory:MemoryStorage",
    "redis": "hicache.storage.backends.redis:RedisStorage",
    "mooncake": "hicache.storage.backends.mooncake:MooncakeStorage",
}

_REGISTERED: dict[str, StorageFactory] = {}


def register_backend(name: str, factory: StorageFactory) -> None:
    """Register ``factory`` under ``name`` (overrides a built-in of the same name)."""
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"backend name={name!r} is invalid; must be a non-empty str without ':'")
    _REGISTERED[name] = factory


def backend_names() -> list[str]:
    """Names :func:`create_storage` accepts (besides ``module:Class``)."""
    return sorted(set(BUILTIN_BACKENDS) | set(_REGISTERED))


def _load_class(spec: str) -> type[HiCacheStorage]:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"custom backend {spec!r} is invalid; use 'package.module:ClassName'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"custom backend {spec!r}: cannot import module {module_name!r}: {e}"
        ) from e
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(
                f"custom backend {spec!r}: {module_name!r} has no attribute {attr!r}"
            ) from None
    if not (isinstance(obj, type) and issubclass(obj, HiCacheStorage)):
        raise ValueError(f"custom backend {spec!r} is not a subclass of HiCacheStorage")
    return obj


def resolve_backend(name: str) -> StorageFactory:
    """The factory for ``name``: registered, built-in, or ``module:Class``."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name in BUILTIN_BACKENDS:
        return _load_class(BUILTIN_BACKENDS[name]).from_extra_config
    if ":" in name:
        return _load_class(name).from_extra_config
    raise ValueError(
        f"storage backend {name!r} is unknown; choose one of {backend_names()} "
        "or give a custom class as 'package.module:ClassName'"
    )


def create_storage(
    name: str,
    *,
    namespace: Namespace,
    extra_config: Mapping[str, Any] | None = None,
    options: StorageOptions | None = None,
) -> HiCacheStorage:
    """An unstarted backend ``name`` for ``namespace``; call ``start()`` or use ``with``.

    ``extra_config`` keys named in ``StorageOptions.KEYS`` override ``options``; the rest
    are the backend's own.
    """
    extra = dict(extra_config or {})
    opts = StorageOptions.from_extra(extra, options)
    backend_extra = {k: v for k, v in extra.items() if k not in StorageOptions.KEYS}
    factory = resolve_backend(name)
    return factory(namespace, backend_extra, opts)


def parse_extra_config(text: str | None) -> dict[str, Any]:
    """Parse ``--hicache-storage-backend-extra-config``: JSON object text or ``@file.json``.

    ``None`` or blank text gives ``{}``. Raises ValueError saying what is wrong and where.
    """
    if text is None or not text.strip():
        return {}
    source = "extra config"
    text = text.strip()
    if text.startswith("@"):
        path = Path(text[1:]).expanduser()
        source = f"extra config file {str(path)!r}"
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ValueError(f"cannot read {source}: {e.strerror or e}") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{source} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
        ) from None
    if not isinstance(value, dict):
        raise ValueError(f"{source} must be a JSON object, got {type(value).__name__}")
    return value
