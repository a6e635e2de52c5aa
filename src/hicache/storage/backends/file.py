"""The ``file`` L3 backend: one record file per page key in a local (or shared) directory.

Directory: ``file_path``, else ``$HICACHE_FILE_BACKEND_STORAGE_DIR``, else ``/tmp/hicache``
(mode 0700); key ``hc3-<hex>`` lives at ``<dir>/<hex[:2]>/hc3-<hex>``. Invariants: a new
record is created in place (``O_EXCL``: one of racing writers writes it, the rest skip) by
one ``writev``; a file shorter than its record is a miss, ``absent`` while younger than
:data:`PARTIAL_GRACE_S` (being written), else ``corrupt`` (healed); heals replace atomically
(temp file, ``os.replace``); stale temp files and sub-header files are removed at start;
reads go straight into the host pages (one ``preadv`` per record), checked after; the size
cap (``max_bytes``, 0 = none) is an in-process LRU index over the records this process
knows; a full disk fails the rest of the batch's writes; the deadline is checked between
pages. In full: ``docs/architecture.md``, "The backends".
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from hicache.keys import Namespace, PageKey
from hicache.storage.base import (
    ConfiguredStorage,
    Deadline,
    StorageError,
    StorageOptions,
)
from hicache.storage.pageio import Payloads
from hicache.storage.record import HEADER_SIZE, check_record, encode_header, record_size
from hicache.storage.stats import MissReason, SetOutcome

__all__ = [
    "DEFAULT_DIR",
    "ENV_DIR",
    "PARTIAL_GRACE_S",
    "STALE_TMP_S",
    "TMP_SUFFIX",
    "FileConfig",
    "FileStorage",
    "being_written",
]

DEFAULT_DIR = "/tmp/hicache"
ENV_DIR = "HICACHE_FILE_BACKEND_STORAGE_DIR"
STALE_TMP_S = 600.0
"""A temp file older than this (seconds) at start is a crash leftover and is removed."""
TMP_SUFFIX = ".tmp"
"""Suffix of a healing record being written (renamed over the bad one when complete); the
start-up sweep removes such files older than :data:`STALE_TMP_S`."""
PARTIAL_GRACE_S = 10.0
"""A record file shorter than its record whose last write is younger than this (seconds)
is being written: a miss ``absent`` that marks nothing. Older, its writer is taken for
crashed or stuck: ``corrupt``, and the next write of the key replaces it (harmless to a
writer still alive: it goes on writing a file no longer in the folder)."""
_FULL = (errno.ENOSPC, errno.EDQUOT)


@dataclass(frozen=True, kw_only=True)
class FileConfig:
    """``path``: record directory; ``max_bytes``: size cap (0 = none); ``fsync``: durable writes."""

    path: str
    max_bytes: int = 0
    fsync: bool = False

    EXTRA_KEYS: ClassVar[tuple[str, ...]] = ("file_path", "max_bytes", "fsync")

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"file_path={self.path!r} is invalid; must be a non-empty path")
        m = self.max_bytes
        if not isinstance(m, int) or isinstance(m, bool) or m < 0:
            raise ValueError(f"max_bytes={m!r} is invalid; must be an int >= 0 (0 = no cap)")
        if not isinstance(self.fsync, bool):
            raise ValueError(f"fsync={self.fsync!r} is invalid; must be a bool")

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> FileConfig:
        unknown = sorted(set(extra) - set(cls.EXTRA_KEYS))
        if unknown:
            raise ValueError(
                f"file backend: unknown extra config keys {unknown}; allowed {cls.EXTRA_KEYS}"
            )
        path = extra.get("file_path") or os.environ.get(ENV_DIR) or DEFAULT_DIR
        return cls(path=path, max_bytes=extra.get("max_bytes", 0), fsync=extra.get("fsync", False))


class _LruIndex:
    """Record sizes in least-recently-used-first order, with the running total."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._lock = threading.Lock()
        self._order: OrderedDict[str, int] = OrderedDict()
        self.total = 0

    def load(self, entries: Sequence[tuple[float, str, int]]) -> None:
        """Seed with ``(mtime, key, size)`` entries, oldest first after sorting."""
        with self._lock:
            for _, key, size in sorted(entries):
                self._order[key] = size
                self.total += size

    def touch(self, key: str, size: int) -> None:
        """Mark ``key`` most recently used (adding it if unknown)."""
        with self._lock:
            old = self._order.pop(key, None)
            self.total += size - (old or 0)
            self._order[key] = size

    def add(self, key: str, size: int) -> list[str]:
        """Record a write; returns the keys to evict (oldest first, never ``key``)."""
        self.touch(key, size)
        return self.over_cap(protect=key)

    def over_cap(self, protect: str | None = None) -> list[str]:
        """Drop least recently used keys until the total fits the cap; returns them.

        ``protect`` (the record just written) is never dropped, even if alone over the cap.
        """
        victims: list[str] = []
        with self._lock:
            while self.total > self.cap and self._order:
                victim, vsize = next(iter(self._order.items()))
                if victim == protect:
                    break
                del self._order[victim]
                self.total -= vsize
                victims.append(victim)
        return victims

    def discard(self, key: str) -> None:
        with self._lock:
            size = self._order.pop(key, None)
            if size is not None:
                self.total -= size


def being_written(got: int, want: int, mtime: float) -> bool:
    """Whether a record file that held ``got`` of its ``want`` bytes, last modified at
    ``mtime`` (``st_mtime``, seconds), is a record still being written (see
    :data:`PARTIAL_GRACE_S`)."""
    return got < want and time.time() - mtime < PARTIAL_GRACE_S


def _open_new(path: str, flags: int) -> int:
    """``os.open(path, flags, 0o600)``, making the fan-out folder when it is missing (not
    made yet, or removed behind our back)."""
    try:
        return os.open(path, flags, 0o600)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        return os.open(path, flags, 0o600)


def _unlink_own(path: str, fd: int) -> None:
    """Remove ``path`` if it is still the file open as ``fd`` (a failed create's leftover),
    never a record someone renamed over it since (a race of microseconds remains: at
    worst that record is removed, a miss)."""
    with contextlib.suppress(OSError):
        mine, there = os.fstat(fd), os.stat(path)
        if (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino):
            os.unlink(path)


def _write_all(fd: int, bufs: list[memoryview]) -> None:
    """``writev`` every buffer completely (retrying after partial writes)."""
    while bufs:
        n = os.writev(fd, bufs)
        while bufs and n >= bufs[0].nbytes:
            n -= bufs[0].nbytes
            bufs.pop(0)
        if n:
            bufs[0] = bufs[0][n:]


class FileStorage(ConfiguredStorage):
    """Local-directory backend (registry name ``file``)."""

    name: ClassVar[str] = "file"
    SETTINGS: ClassVar[type[FileConfig]] = FileConfig

    def __init__(
        self, namespace: Namespace, options: StorageOptions | None = None, *, config: FileConfig
    ) -> None:
        super().__init__(namespace, options, config=config)
        self.config: FileConfig = config
        self.root = Path(config.path)
        self._root_str = str(self.root)
        self._index: _LruIndex | None = _LruIndex(config.max_bytes) if config.max_bytes else None

    # -- lifecycle -------------------------------------------------------------------------
    def _start(self) -> None:
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            if not os.access(self.root, os.W_OK | os.X_OK):
                raise StorageError(f"file backend: directory {self.root} is not writable")
            self._scan()
        except OSError as e:
            raise StorageError(f"file backend: cannot use directory {self.root}: {e}") from e

    def _close(self) -> None:
        pass

    def _scan(self) -> None:
        """Remove stale temp files and stale record files shorter than a header (a writer
        that died between its create and its write); seed the LRU index when a cap is set."""
        now = time.time()
        entries: list[tuple[float, str, int]] = []
        with os.scandir(self.root) as top:
            subdirs = [e.path for e in top if e.is_dir(follow_symlinks=False) and len(e.name) == 2]
        for sub in subdirs:
            with os.scandir(sub) as it:
                for e in it:
                    try:
                        st = e.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if e.name.endswith(TMP_SUFFIX) or st.st_size < HEADER_SIZE:
                        if now - st.st_mtime > STALE_TMP_S:
                            self._unlink(Path(e.path))
                    elif self._index is not None:
                        entries.append((st.st_mtime, e.name, st.st_size))
        if self._index is not None:
            self._index.load(entries)
            for victim in self._index.over_cap():
                self._unlink(self.path_of(victim))

    # -- paths -----------------------------------------------------------------------------
    def path_of(self, key: str) -> Path:
        """Where the record of ``key`` lives."""
        return Path(self.path_str(key))

    def path_str(self, key: str) -> str:
        """:meth:`path_of` as a ``str`` (no ``Path`` built: cheaper per page)."""
        if not key or "/" in key or key.startswith("."):
            raise ValueError(f"unsafe key {key!r}")
        tail = key.rsplit("-", 1)[-1]
        return os.path.join(self._root_str, tail[:2], key)

    @staticmethod
    def _unlink(path: Path) -> None:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()

    # -- operations ------------------------------------------------------------------------
    def _exists(self, keys: Sequence[PageKey], deadline: Deadline) -> int:
        n = 0
        for k in keys:
            if deadline.expired:
                self._stats.timeout("exists", deadline.timeout_s)
                break
            try:  # a record being created is empty until its one writev: not there yet
                st = os.stat(self.path_str(k.key))
            except OSError:
                break
            if not (stat.S_ISREG(st.st_mode) and st.st_size):
                break
            n += 1
        return n

    def _get(
        self, keys: Sequence[PageKey], pages: Payloads, deadline: Deadline
    ) -> list[MissReason | None]:
        out: list[MissReason | None] = []
        first_error = ""
        errors = 0
        paths = self._paths(keys)
        want = record_size(pages.payload_len)
        for i, k in enumerate(keys):
            if deadline.expired:
                self._stats.timeout("get", deadline.timeout_s)
                out.extend([MissReason.TIMEOUT] * (len(keys) - i))
                break
            try:
                out.append(self._read(k, paths[i], pages, i, want))
            except OSError as e:
                errors += 1
                first_error = first_error or f"{k.key}: {e!r}"
                out.append(MissReason.ERROR)
        if errors:
            self._stats.error("get", f"{errors} page(s) failed; first {first_error}")
        return out

    def _paths(self, keys: Sequence[PageKey]) -> list[str]:
        """:meth:`path_str` of each key (ValueError naming an unsafe one)."""
        join, root = os.path.join, self._root_str
        out = []
        for k in keys:
            key = k.key
            if not key or "/" in key or key[0] == ".":
                raise ValueError(f"unsafe key {key!r}")
            out.append(join(root, key[key.rfind("-") + 1 :][:2], key))
        return out

    def _read(
        self, key: PageKey, path: str, pages: Payloads, i: int, want: int
    ) -> MissReason | None:
        """Open, one ``preadv`` of header, payload parts and one byte past the record's
        end (a longer file reads ``want + 1`` bytes: no ``fstat`` needed), close, check.
        A short read ``fstat``s: a young file is a record being written (:func:`being_written`)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            if self._index is not None:
                self._index.discard(key.key)
            return MissReason.ABSENT
        header = bytearray(HEADER_SIZE)
        parts = pages.parts(i)
        try:
            got = os.preadv(fd, [header, *parts, bytearray(1)], 0)
            writing = got < want and being_written(got, want, os.fstat(fd).st_mtime)
        finally:
            os.close(fd)
        if writing:
            return MissReason.ABSENT
        if got != want:
            return MissReason.CORRUPT
        check = check_record(
            header,
            parts,
            namespace_digest=self._digest_of(key),
            fingerprint=key.fingerprint,
            payload_len=pages.payload_len,
        )
        if check.ok and self._index is not None:
            self._index.touch(key.key, want)
            with contextlib.suppress(FileNotFoundError):
                os.utime(path)
        return check.reason

    def _set(
        self, keys: Sequence[PageKey], pages: Payloads, deadline: Deadline
    ) -> list[SetOutcome]:
        return self._overwrite(keys, pages, deadline, [False] * len(keys))

    def _overwrite(
        self, keys: Sequence[PageKey], pages: Payloads, deadline: Deadline, replace: Sequence[bool]
    ) -> list[SetOutcome]:
        out: list[SetOutcome] = []
        errors = 0
        first_error = ""
        paths = self._paths(keys)
        tmp_tail = f".{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}"
        fsync = self.config.fsync
        for i, k in enumerate(keys):
            if deadline.expired:
                self._stats.timeout("set", deadline.timeout_s)
                out.extend([SetOutcome.FAILED] * (len(keys) - i))
                break
            try:
                rec = _Record(self._digest_of(k), k.fingerprint, pages.parts(i))
                if replace[i]:  # heal: atomically over the record read bad
                    _replace(paths[i], tmp_tail, rec, fsync=fsync)
                    written = True
                else:
                    written = _create(paths[i], rec, fsync=fsync)
                if written and self._index is not None:
                    for victim in self._index.add(k.key, record_size(pages.payload_len)):
                        self._unlink(self.path_of(victim))
            except OSError as e:
                errors += 1
                first_error = first_error or f"{k.key}: {e!r}"
                out.append(SetOutcome.FAILED)
                if e.errno in _FULL:  # the rest would fail the same way
                    out.extend([SetOutcome.FAILED] * (len(keys) - i - 1))
                    errors += len(keys) - i - 1
                    break
            else:
                out.append(SetOutcome.WRITTEN if written else SetOutcome.SKIPPED)
        if errors:
            self._stats.error("set", f"{errors} page(s) not written; first {first_error}")
        return out


@dataclass(frozen=True, slots=True)
class _Record:
    """What a record file holds: the header's namespace digest and token fingerprint, and
    the payload parts (concatenated in order). :meth:`buffers` checksums the payload."""

    digest: bytes
    fingerprint: bytes
    parts: Sequence[memoryview]

    def buffers(self) -> list[memoryview]:
        """Header then payload parts, for one ``writev``."""
        header = encode_header(self.digest, self.fingerprint, self.parts)
        return [memoryview(header), *self.parts]


def _create(path: str, rec: _Record, *, fsync: bool) -> bool:
    """Create the record file ``path`` (``O_EXCL``) and write ``rec`` into it; False,
    writing nothing (not even its checksum), when it exists (a record, or one being
    written). A failed write removes the file it made."""
    try:
        fd = _open_new(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC)
    except FileExistsError:
        return False
    try:
        _write_all(fd, rec.buffers())
        if fsync:
            os.fsync(fd)
    except BaseException:
        _unlink_own(path, fd)
        raise
    finally:
        os.close(fd)
    if fsync:
        _fsync_dir(os.path.dirname(path))
    return True


def _replace(path: str, tmp_tail: str, rec: _Record, *, fsync: bool) -> None:
    """Write ``rec`` to a temp file beside ``path`` (``.<name><tmp_tail>``) and rename it
    over whatever ``path`` holds: a reader sees the old file or the new record."""
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}{tmp_tail}")
    try:
        fd = _open_new(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC)
        try:
            _write_all(fd, rec.buffers())
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if fsync:
        _fsync_dir(folder)


def _fsync_dir(folder: str) -> None:
    dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
