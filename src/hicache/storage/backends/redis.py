"""The ``redis`` L3 backend: Redis or Valkey through redis-py, pipelined.

One record per key, stored as one string value. exists: pipelined ``EXISTS``, leading hits
counted; get: one ``MGET`` per ``max_batch_pages`` keys, each record checked before its
payload touches the host pool; set: pipelined ``EXISTS`` (pages of
:data:`PRECHECK_MIN_BYTES` and more), then ``SET key record NX [EX ttl]`` (a present key is
skipped), or a plain ``SET`` (atomic replace) for a key a read found bad. Pipelines are
written in RESP by this module into one buffer, each record copied once from the host
pages. Invariants: network calls run on a :class:`~hicache.storage.deadline.DeadlineRunner`
(socket timeouts, no retries); records are encoded before the network call, so a late
call never reads host pages; a connection whose exchange failed midway is closed. Extra
config: ``url`` (default ``$HICACHE_REDIS_URL`` or ``redis://127.0.0.1:6379/0``),
``key_prefix``, ``ttl_s`` (s, 0 = none), ``max_connections`` (16). In full:
``docs/architecture.md``, "The backends".
"""

from __future__ import annotations

import os
import threading
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
from hicache.storage.blob import decode_page
from hicache.storage.deadline import DeadlineRunner
from hicache.storage.pageio import Payloads
from hicache.storage.record import HEADER_SIZE, encode_header
from hicache.storage.stats import MissReason, SetOutcome

__all__ = ["DEFAULT_URL", "ENV_URL", "PRECHECK_MIN_BYTES", "RedisConfig", "RedisStorage"]

PRECHECK_MIN_BYTES = 64 << 10
"""Records whose payload is at least this many bytes are looked up (``EXISTS``) before
they are sent, so present ones cost no transfer; smaller ones go straight to
``SET ... NX``, which skips present keys itself: the lookup's round trip cost more than
sending a small page again (12 KiB pages: the round trip is about a tenth of a 64-page
put)."""
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


def _bulk(arg: bytes) -> bytes:
    """``arg`` as a RESP bulk string."""
    return b"$%d\r\n%s\r\n" % (len(arg), arg)


def _command(*args: bytes) -> bytes:
    """One RESP command (an array of bulk strings)."""
    return b"*%d\r\n" % len(args) + b"".join(_bulk(a) for a in args)


class _Stages:
    """Reusable ``bytearray`` buffers for ``SET`` pipelines: one is taken per call and
    given back when that call ends (a call that overran its deadline keeps its buffer
    until it returns), so a fresh buffer's page faults are paid once, not per batch."""

    def __init__(self, keep: int = 2) -> None:
        self._keep = keep
        self._free: list[bytearray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> bytearray:
        with self._lock:
            for i, b in enumerate(self._free):
                if len(b) >= nbytes:
                    return self._free.pop(i)
        return bytearray(nbytes)

    def give(self, b: bytearray) -> None:
        with self._lock:
            self._free.append(b)
            self._free.sort(key=len, reverse=True)
            del self._free[self._keep :]


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
        self._set_stages = _Stages()
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

    def _exchange(
        self, packed: Sequence[bytes | bytearray | memoryview], replies: int
    ) -> list[Any]:
        """Send ``packed`` (RESP commands) on one pooled connection and read ``replies``
        replies; a connection whose exchange failed is closed before it goes back."""
        pool = self._client.connection_pool
        conn = pool.get_connection()
        try:
            conn.send_packed_command(packed)
            return [conn.read_response() for _ in range(replies)]
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)

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
        prefix = self.config.key_prefix
        packed = b"".join(_command(b"EXISTS", (prefix + k.key).encode()) for k in keys)
        return [bool(v) for v in self._exchange([packed], len(keys))]

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

        names = [self._rkey(k) for k in keys]

        def fetch() -> list[bytes | None]:
            blobs: list[bytes | None] = []
            for part in _chunks(len(keys), chunk):
                got = self._client.mget(names[part.start : part.stop])
                if len(got) != len(part):
                    raise RuntimeError(f"MGET of {len(part)} keys answered {len(got)} values")
                blobs.extend(got)
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
        if pages.payload_len < PRECHECK_MIN_BYTES:
            flags: list[bool] | MissReason = [False] * len(keys)  # SET NX alone decides
        else:
            flags = self._call("set (exists)", lambda: self._exists_flags(keys), deadline)
        if isinstance(flags, MissReason):
            return [SetOutcome.FAILED] * len(keys)
        out = [SetOutcome.SKIPPED if f else SetOutcome.FAILED for f in flags]
        todo = [i for i, f in enumerate(flags) if not f or replace[i]]
        if not todo:
            return out
        ttl = b"%d" % self.config.ttl_s if self.config.ttl_s else None
        chunk = self.options.max_batch_pages
        prefix = self.config.key_prefix
        rec = HEADER_SIZE + pages.payload_len
        plan: list[tuple[bytes, bytes]] = []  # (command head up to the value, tail after)
        for i in todo:
            extra = ([b"NX"] if not replace[i] else []) + ([b"EX", ttl] if ttl else [])
            name = (prefix + keys[i].key).encode()
            head = b"*%d\r\n" % (3 + len(extra)) + _bulk(b"SET") + _bulk(name)
            plan.append((head + b"$%d\r\n" % rec, b"\r\n" + b"".join(map(_bulk, extra))))
        stage = self._set_stages.take(sum(len(h) + rec + len(t) for h, t in plan))
        ends: list[int] = []  # where each chunk's commands end in the stage
        try:
            view, off = memoryview(stage), 0
            for j, ((head, tail), i) in enumerate(zip(plan, todo, strict=True)):
                parts = pages.parts(i)
                header = encode_header(self._digest_of(keys[i]), keys[i].fingerprint, parts)
                pieces: list[bytes | memoryview] = [head, header, *parts, tail]
                for piece in pieces:
                    n = len(piece) if isinstance(piece, bytes) else piece.nbytes
                    view[off : off + n] = piece
                    off += n
                if (j + 1) % chunk == 0 or j + 1 == len(todo):
                    ends.append(off)
        except BaseException:
            self._set_stages.give(stage)
            raise

        def store() -> list[Any]:
            try:
                answers: list[Any] = []
                start = 0
                for part, end in zip(_chunks(len(todo), chunk), ends, strict=True):
                    answers.extend(self._exchange([view[start:end]], len(part)))
                    start = end
                return answers
            finally:
                self._set_stages.give(stage)

        answers = self._call("set", store, deadline)
        if isinstance(answers, MissReason):
            return out
        for i, answer in zip(todo, answers, strict=True):
            out[i] = SetOutcome.WRITTEN if answer else SetOutcome.SKIPPED
        return out
