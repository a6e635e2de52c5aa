"""Backend registry and the one parse step of a backend's extra config.

Built-in names: ``file`` (default), ``memory`` (tests), ``redis``, ``mooncake``, ``aibrix``,
``nixl`` (:mod:`hicache.storage.backends`), each module imported only when used, so a
missing optional client matters only to its backend. A custom backend is
``package.module:Class`` (a :class:`HiCacheStorage` subclass) or a factory given to
:func:`register_backend`. The extra config is JSON text or ``@path/to.json``
(:func:`parse_extra_config`); :meth:`StorageConfig.parse` splits and validates it once:
``timeout_s``, ``connect_timeout_s`` and ``max_batch_pages`` set
:class:`~hicache.storage.base.StorageOptions`, prefetch keys
(``hicache.config.PREFETCH_KEYS``) pass untouched, the rest go to the backend's
``parse_extra_config`` (an unknown key is refused naming it and every accepted key). Use:
``storage_config_from_args(backend, extra)`` (None: no L3; ValueError: bad flags), then
``storage.prefetch_config(policy)`` and ``storage.create(namespace)`` (unstarted).
"""

from __future__ import annotations

import functools
import importlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from hicache.config import PREFETCH_KEYS, PrefetchConfig, PrefetchPolicy
from hicache.keys import Namespace
from hicache.storage.base import HiCacheStorage, StorageOptions

__all__ = [
    "BUILTIN_BACKENDS",
    "BackendEntry",
    "StorageConfig",
    "StorageFactory",
    "backend_names",
    "create_storage",
    "parse_extra_config",
    "register_backend",
    "resolve_backend",
    "storage_config_from_args",
]

StorageFactory = Callable[[Namespace, Mapping[str, Any], StorageOptions], HiCacheStorage]
"""``factory(namespace, backend_extra_config, options) -> unstarted backend``."""

BUILTIN_BACKENDS: dict[str, str] = {
    "file": "hicache.storage.backends.file:FileStorage",
    "memory": "hicache.storage.backends.memory:MemoryStorage",
    "redis": "hicache.storage.backends.redis:RedisStorage",
    "mooncake": "hicache.storage.backends.mooncake:MooncakeStorage",
    "aibrix": "hicache.storage.backends.aibrix:AibrixStorage",
    "nixl": "hicache.storage.backends.nixl:NixlStorage",
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


@dataclass(frozen=True, slots=True)
class BackendEntry:
    """How to parse and build one backend.

    ``keys``: the backend-specific extra-config keys it accepts, or None when only building
    it can tell (a registered factory, a custom class that overrides ``from_extra_config``).
    ``parse(extra) -> settings`` validates without IO; ``build(namespace, options,
    settings)`` makes the unstarted backend.
    """

    name: str
    keys: tuple[str, ...] | None
    parse: Callable[[Mapping[str, Any]], Any]
    build: Callable[[Namespace, StorageOptions, Any], HiCacheStorage]


def _overrides(cls: type[HiCacheStorage], attr: str) -> bool:
    """True when a subclass (not HiCacheStorage itself) defines ``attr``."""
    owner = next(k for k in cls.__mro__ if attr in vars(k))
    return owner is not HiCacheStorage


def _class_entry(name: str, cls: type[HiCacheStorage]) -> BackendEntry:
    if _overrides(cls, "from_extra_config") and not _overrides(
        cls, "parse_extra_config"
    ):  # the one-step protocol: validated when built
        return BackendEntry(
            name, None, dict, lambda ns, opts, extra: cls.from_extra_config(ns, extra, opts)
        )
    return BackendEntry(name, tuple(cls.EXTRA_KEYS), cls.parse_extra_config, cls.from_settings)


def resolve_backend(name: str) -> BackendEntry:
    """The entry for ``name``: registered, built-in, or ``module:Class`` (imported now)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"storage backend {name!r} is invalid; must be a non-empty str")
    if name in _REGISTERED:
        factory = _REGISTERED[name]
        return BackendEntry(name, None, dict, lambda ns, opts, extra: factory(ns, extra, opts))
    if name in BUILTIN_BACKENDS:
        return _class_entry(name, _load_class(BUILTIN_BACKENDS[name]))
    if ":" in name:
        return _class_entry(name, _load_class(name))
    raise ValueError(
        f"storage backend {name!r} is unknown; choose one of {backend_names()} "
        "or give a custom class as 'package.module:ClassName'"
    )


@dataclass(frozen=True, kw_only=True)
class StorageConfig:
    """An L3 backend choice, parsed and validated once from the engine's extra config.

    ``backend``: registry name or ``module:Class``. ``options``: the
    :class:`StorageOptions` (extra keys ``timeout_s``, ``connect_timeout_s``,
    ``max_batch_pages`` over the given base). ``settings``: the backend's validated
    settings (its ``parse_extra_config`` result, e.g. a ``FileConfig``; for a registered
    factory, the raw dict it will get). ``prefetch_extra``: the prefetch keys
    (``hicache.config.PREFETCH_KEYS``) found, handed over untouched for
    ``PrefetchConfig.from_extra`` (see :meth:`prefetch_config`).

    Build one with :meth:`parse` (or :func:`storage_config_from_args` for command-line
    flags), then :meth:`create` the backend once the namespace is known.
    """

    backend: str
    options: StorageOptions = field(default_factory=StorageOptions)
    settings: Any = None
    prefetch_extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.backend, str) or not self.backend:
            raise ValueError(f"backend={self.backend!r} is invalid; must be a non-empty str")
        if not isinstance(self.options, StorageOptions):
            raise ValueError(f"options={self.options!r} is invalid; must be StorageOptions")
        object.__setattr__(self, "prefetch_extra", MappingProxyType(dict(self.prefetch_extra)))

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Picklable (a mapping proxy is not): the engine's config, this included, goes to
        every tensor-parallel rank process."""
        rebuild = functools.partial(
            type(self),
            backend=self.backend,
            options=self.options,
            settings=self.settings,
            prefetch_extra=dict(self.prefetch_extra),
        )
        return (rebuild, ())

    @classmethod
    def parse(
        cls,
        backend: str,
        extra: Mapping[str, Any] | str | None = None,
        *,
        options: StorageOptions | None = None,
        prefetch_keys: Sequence[str] = PREFETCH_KEYS,
    ) -> StorageConfig:
        """Validate ``backend`` and ``extra`` (a dict, or JSON text / ``@file.json`` as in
        :func:`parse_extra_config`) without IO; ValueError naming the key, the value and
        what is accepted. Imports the backend's module (not its client package)."""
        raw = parse_extra_config(extra) if extra is None or isinstance(extra, str) else extra
        if not isinstance(raw, Mapping):
            raise ValueError(f"extra config must be a JSON object, got {type(raw).__name__}")
        entry = resolve_backend(backend)
        opt_keys, pf_keys = StorageOptions.KEYS, tuple(prefetch_keys)
        if entry.keys is not None:
            for key, value in raw.items():
                if key not in (*entry.keys, *opt_keys, *pf_keys):
                    groups = [("backend", entry.keys), ("option", opt_keys), ("prefetch", pf_keys)]
                    accepted = "; ".join(f"{g} keys {list(ks)}" for g, ks in groups if ks)
                    raise ValueError(
                        f"{backend} backend: extra config key {key!r} (value {value!r}) is "
                        f"unknown; accepted: {accepted}"
                    )
        own = {k: v for k, v in raw.items() if k not in opt_keys and k not in pf_keys}
        try:
            opts = StorageOptions.from_extra(raw, options)
            settings = entry.parse(own)
        except ValueError as e:
            msg = str(e)
            raise ValueError(
                msg if msg.startswith(f"{backend} backend") else f"{backend} backend: {msg}"
            ) from None
        prefetch = {k: v for k, v in raw.items() if k in pf_keys}
        return cls(backend=backend, options=opts, settings=settings, prefetch_extra=prefetch)

    def create(self, namespace: Namespace) -> HiCacheStorage:
        """The unstarted backend for ``namespace``; call ``start()`` or use ``with``."""
        return resolve_backend(self.backend).build(namespace, self.options, self.settings)

    def prefetch_config(self, policy: PrefetchPolicy | str) -> PrefetchConfig:
        """The prefetch settings under ``policy`` from :attr:`prefetch_extra`."""
        return PrefetchConfig.from_extra(policy, dict(self.prefetch_extra))


def storage_config_from_args(
    backend: str | None, extra: Mapping[str, Any] | str | None
) -> StorageConfig | None:
    """``--hicache-storage-backend`` and ``--hicache-storage-backend-extra-config`` -> a
    :class:`StorageConfig`, or None when neither is given (no L3). An extra config without
    a backend is refused (ValueError): nothing would use it."""
    if backend is None or backend == "":
        raw = parse_extra_config(extra) if extra is None or isinstance(extra, str) else extra
        if raw:
            raise ValueError(
                "--hicache-storage-backend-extra-config was given without "
                f"--hicache-storage-backend, so nothing would use keys {sorted(raw)}; choose "
                f"a backend ({', '.join(backend_names())} or package.module:Class)"
            )
        return None
    return StorageConfig.parse(backend, extra)


def create_storage(
    name: str,
    *,
    namespace: Namespace,
    extra_config: Mapping[str, Any] | None = None,
    options: StorageOptions | None = None,
) -> HiCacheStorage:
    """An unstarted backend ``name`` for ``namespace``; call ``start()`` or use ``with``.

    ``extra_config`` keys named in ``StorageOptions.KEYS`` override ``options``; the rest
    are the backend's own (no prefetch keys: use :class:`StorageConfig` for those).
    """
    cfg = StorageConfig.parse(name, extra_config, options=options, prefetch_keys=())
    return cfg.create(namespace)


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
