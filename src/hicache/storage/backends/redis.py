"""The ``redis`` L3 backend: Redis or Valkey through redis-py, pipelined.

One record per key, stored as one string value (header + payload). Operations:

- exists: one pipeline of ``EXISTS`` per key; the answer counts leading hits.
- get: pipelines of ``GET`` (``max_batch_pages`` keys each); records are checked before
  their payload is copied into the host pool, so a bad record never touches the pool.
- set: one ``EXISTS`` pipeline, then ``SET key record NX [EX ttl]`` pipelines for the
  missing keys (a key that appears in between is skipped, not overwritten); a key whose
  record a read found bad (``hicache.storage.heal``) gets a plain ``SET`` (an atomic
  replace) instead.

Network calls run on a :class:`~hicache.storage.deadline.DeadlineRunner` and the client has
socket timeouts and no retries, so a dead or stalled server costs at most the deadline.
Records are encoded on the caller's thread before the network call, so a late call never
reads host pages the caller has moved on from.

Extra config: ``url`` (default ``$HICACHE_REDIS_URL`` or ``redis://127.0.0.1:6379/0``;
``rediss://`` and passwords in the URL work), ``key_prefix`` (default ``""``), ``ttl_s``
(seconds, 0 = no expiry), ``max_connections`` (default 16). Eviction of a full server is
the server's ``maxmemory-policy`` (e.g. ``allkeys-lru``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from hicache.keys import Namespace, PageKey
from hicache.storage.base import (
    ConfiguredStorage,
    Deadline,
    StorageError,
    StorageOptions,
)
from hicache.storage.blob import decode_page, encode_page
from hicache.storage.deadline import DeadlineRunner
from hicache.storage.pageio import Payloads
from hicache.storage.stats import MissReason, SetOutcome

__all__ = ["DEFAULT_URL", "ENV_URL", "RedisConfig", "RedisStorage"]

DEFAULT_URL = "redis://127.0.0.1:6379/0"
ENV_URL = "HICACHE_REDIS_URL"
T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class RedisConfig:
    """Connection and storage settings; see the module docstring."""

    url: str = DEFAULT_URL
    key_prefix: str = ""
    ttl_s: int = 0
    max_connections: int = 16

    EXTRA_KEYS: ClassVar[tuple[str, ...]] = ("url", "key_prefix", "ttl_s", "max_connections")

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or "://" not in self.url:
            raise ValueError(
                f"url={self.url!r} is invalid; use redis://host:port/db (or rediss://)"
            )
        if not isinstance(self.key_prefix, str):
            raise ValueError(f"key_prefix={self.key_prefix!r} is invalid; must be a str")
        for name, low in (("ttl_s", 0), ("max_connections", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ValueError(f"{name}={v!r} is invalid; must be an int >= {low}")

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> RedisConfig:
        unknown = sorted(set(extra) - set(cls.EXTRA_KEYS))
        if unknown:
            raise ValueError(
                f"redis backend: unknown extra config keys {unknown}; allowed {cls.EXTRA_KEYS}"
            )
        kw = {k: extra[k] for k in cls.EXTRA_KEYS if k in extra}
        kw.setdefault("url", os.environ.get(ENV_URL) or DEFAULT_URL)
        return cls(**kw)


def _chunks(n: int, size: int) -> list[range]:
    return [range(i, min(i + size, n)) for i in range(0, n, size)]


class RedisStorage(ConfiguredStorage):
    """Redis / Valkey backend (registry name ``redis``)."""

    name: ClassVar[str] = "redis"
    SETTINGS: ClassVar[type[RedisConfig]] = RedisConfig

    def __init__(
        self, namespace: Namespace, options: StorageOptions | None = None, *, config: RedisConfig
    ) -> None:
        super().__init__(namespace, options, config=config)
        self.config: RedisConfig = config
        self._client: Any = None
        self._runner = DeadlineRunner("redis")
        self._timeout_errors: tuple[type[BaseException], ...] = (TimeoutError,)

    # -- lifecycle -------------------------------------------------------------------------
    def _start(self) -> None:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as e:
            raise StorageError("redis backend needs the 'redis' package (pip install redis)") from e
        opts = self.options
        self._timeout_errors = (TimeoutError, redis.exceptions.TimeoutError)
        self._client = redis.Redis.from_url(
            self.config.url,
            socket_timeout=opts.timeout_s,
            socket_connect_timeout=min(opts.timeout_s, opts.connect_timeout_s),
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
            health_check_interval=0,
            max_connections=self.config.max_connections,
        )
        self._runner.start()
        res = self._runner.call(self._client.ping, opts.connect_timeout_s)
        if not res.ok:
            why = "timed out" if res.timed_out else repr(res.error)
            self._close()
            raise StorageError(f"redis backend: cannot reach {self._safe_url()}: {why}")

    def _close(self) -> None:
        if self._client is not None:
            try:
                self._client.close()
            finally:
                self._client = None
        self._runner.close()

    def _safe_url(self) -> str:
        """The URL without a password, for messages."""
        scheme, _, rest = self.config.url.partition("://")
        return f"{scheme}://{rest.rpartition('@')[2]}"

    # -- plumbing --------------------------------------------------------------------------
    def _rkey(self, key: PageKey) -> str:
        return self.config.key_prefix + key.key

    def _call(self, op: str, fn: Callable[[], T], deadline: Deadline) -> T | MissReason:
        """Run ``fn`` within ``deadline``; a failure is counted, logged and returned as a reason."""
        res = self._runner.call(fn, deadline.remaining)
        if res.ok:
            return res.value  # type: ignore[return-value]
        if res.timed_out or res.refused or isinstance(res.error, self._timeout_errors):
            # the client's socket timeout (the same as the deadline) is a timeout too
            self._stats.timeout(op, deadline.timeout_s)
            return MissReason.TIMEOUT
        self._stats.error(op, repr(res.error))
        return MissReason.ERROR

    def _exists_flags(self, keys: Sequence[PageKey]) -> list[bool]:
        pipe = self._client.pipeline(transaction=False)
        for k in keys:
            pipe.exists(self._rkey(k))
        return [bool(v) for v in pipe.execute()]

    # -- operations ------------------------------------------------------------------------
    def _exists(self, keys: Sequence[PageKey], deadline: Deadline) -> int:
        flags = self._call("exists", lambda: self._exists_flags(keys), deadline)
        if isinstance(flags, MissReason):
            return 0
        n = 0
        for f in flags:
            if not f:
                break
            n += 1
        return n

    def _get(
        self, keys: Sequence[PageKey], pages: Payloads, deadline: Deadline
    ) -> list[MissReason | None]:
        chunk = self.options.max_batch_pages

        def fetch() -> list[bytes | None]:
            blobs: list[bytes | None] = []
            for part in _chunks(len(keys), chunk):
                pipe = self._client.pipeline(transaction=False)
                for i in part:
                    pipe.get(self._rkey(keys[i]))
                blobs.extend(pipe.execute())
            return blobs

        blobs = self._call("get", fetch, deadline)
        if isinstance(blobs, MissReason):
            return [blobs] * len(keys)
        return [
            decode_page(b, self._digest_of(k), k, pages, i)
            for i, (k, b) in enumerate(zip(keys, blobs, strict=True))
        ]

    def _set(
        self, keys: Sequence[PageKey], pages: Payloads, deadline: Deadline
    ) -> list[SetOutcome]:
        return self._overwrite(keys, pages, deadline, [False] * len(keys))

    def _overwrite(
        self, keys: Sequence[PageKey], pages: Payloads, deadline: Deadline, replace: Sequence[bool]
    ) -> list[SetOutcome]:
        flags = self._call("set (exists)", lambda: self._exists_flags(keys), deadline)
        if isinstance(flags, MissReason):
            return [SetOutcome.FAILED] * len(keys)
        out = [SetOutcome.SKIPPED if f else SetOutcome.FAILED for f in flags]
        todo = [i for i, f in enumerate(flags) if not f or replace[i]]
        if not todo:
            return out
        blobs = {i: encode_page(self._digest_of(keys[i]), keys[i], pages, i) for i in todo}
        ttl = self.config.ttl_s or None
        chunk = self.options.max_batch_pages

        def store() -> list[Any]:
            answers: list[Any] = []
            for part in _chunks(len(todo), chunk):
                pipe = self._client.pipeline(transaction=False)
                for j in part:
                    i = todo[j]
                    pipe.set(self._rkey(keys[i]), blobs[i], nx=not replace[i], ex=ttl)
                answers.extend(pipe.execute())
            return answers

        answers = self._call("set", store, deadline)
        if isinstance(answers, MissReason):
            return out
        for i, answer in zip(todo, answers, strict=True):
            out[i] = SetOutcome.WRITTEN if answer else SetOutcome.SKIPPED
        return out
