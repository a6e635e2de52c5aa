"""The ``nixl`` L3 backend: the ``file`` backend's record files, moved by NIXL's POSIX plugin.

Records, directory and names are the ``file`` backend's (:mod:`.file`): key ``hc3-<hex>`` is
the file ``<dir>/<hex[:2]>/hc3-<hex>`` holding one record (here written to a temp file and
renamed into place: a late transfer then lands nowhere), so either backend reads the
other's records. NIXL (:mod:`.nixl_client`) moves the bytes, one transfer per chunk of at
most ``max_batch_pages`` pages between registered host memory (``DRAM``) and ``FILE``
ranges ``(offset, bytes, fd)``: zero-copy for ``page_first`` / ``page_first_direct`` pools
(three ranges per record: header, K, V), staged through a registered arena for
``layer_first`` pools and state slots. Invariants: a get checks each file's size before
reading (a young short file is one being written, as for ``file``) and each record as
``file`` does; a set skips present keys unless healing, computes headers before the
transfer, and renames nothing when it overran its deadline; a transfer is never released
while it runs (the backend refuses new calls as timeouts meanwhile, and a late zero-copy
get shows in ``host_writes_settled``). Extra config: :mod:`.nixl_config`; NIXL must import
(``requirements/nixl.txt``), else :meth:`start` raises. In full: ``docs/integrations.md``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import ClassVar, TypeVar

from hicache.keys import Namespace, PageKey
from hicache.storage.arena import Arena, ArenaPool, BufferRegistry
from hicache.storage.backends.file import TMP_SUFFIX, FileStorage, being_written
from hicache.storage.backends.nixl_client import NixlError, PosixAgent, require_nixl
from hicache.storage.backends.nixl_config import NixlConfig
from hicache.storage.base import Deadline, StorageOptions
from hicache.storage.deadline import DeadlineRunner
from hicache.storage.pageio import HostPages, Payloads, byte_view
from hicache.storage.record import HEADER_SIZE, check_blob, check_record, encode_header, record_size
from hicache.storage.stats import MissReason, SetOutcome

__all__ = ["NixlConfig", "NixlStorage"]

T = TypeVar("T")
_WORKERS = 4
"""Chunks of one instance that may be in flight at once (its runner's threads)."""
_FULL = (errno.ENOSPC, errno.EDQUOT)
_ABANDONED: list[PosixAgent] = []
"""Agents whose close was skipped because a transfer was stuck in them (never torn down)."""

Ranges = list[tuple[int, int]]
"""Host ranges ``(address, bytes)`` of one record, in record order."""


class _Timeout(Exception):
    """A chunk's call overran the deadline (or was refused behind a stuck one)."""


class NixlStorage(FileStorage):
    """NIXL POSIX backend over record files (registry name ``nixl``)."""

    name: ClassVar[str] = "nixl"
    SETTINGS: ClassVar[type[NixlConfig]] = NixlConfig

    def __init__(
        self, namespace: Namespace, options: StorageOptions | None = None, *, config: NixlConfig
    ) -> None:
        super().__init__(namespace, options, config=config)
        self.config: NixlConfig = config
        self._agent: PosixAgent | None = None
        self._runner = DeadlineRunner("nixl", workers=_WORKERS)
        self._host_io = self._runner  # zero-copy gets write host pages on its workers
        self._buffers = BufferRegistry(self._register, self._unregister)
        self._arenas = ArenaPool(self._buffers.ensure_tensor)

    # -- lifecycle -------------------------------------------------------------------------
    def _start(self) -> None:
        api = require_nixl()  # first: a missing package is the clearest error
        super()._start()  # the directory, stale temp files, the LRU index
        self._agent = PosixAgent(api, self.config.plugin_params)
        self._runner.start()

    def _close(self) -> None:
        agent, self._agent = self._agent, None
        if agent is not None:
            if self._runner.wait_idle(self.options.timeout_s):
                self._buffers.drain()
                agent.close()
            else:  # a transfer still runs into registered memory: leave the agent be
                _ABANDONED.append(agent)
                self._stats.error("close", "a transfer is still stuck; NIXL agent abandoned")
        self._runner.close()

    def registered_ranges(self) -> dict[int, int]:
        """``address -> bytes`` of the host memory registered with the NIXL agent: host
        pool buffers and staging arenas."""
        return self._buffers.ranges()

    # -- registration ----------------------------------------------------------------------
    def _register(self, ptr: int, nbytes: int) -> bool:
        agent = self._agent
        if agent is None:
            return False
        try:
            agent.register(ptr, nbytes)
        except NixlError as e:
            self._stats.error("register", str(e))
            return False
        return True

    def _unregister(self, ptr: int) -> None:
        agent = self._agent
        if agent is not None and not self._runner.stuck:
            try:
                agent.deregister(ptr)
            except NixlError as e:
                self._stats.error("deregister", str(e))

    def _zero_copy(self, pages: Payloads) -> bool:
        """Whether ``pages`` move in place: page views of a host pool now registered."""
        if not (isinstance(pages, HostPages) and pages.zero_copy):
            return False
        return self._buffers.ensure_pool(pages.host)

    # -- plumbing --------------------------------------------------------------------------
    def _call(
        self,
        op: str,
        fn: Callable[[], T],
        deadline: Deadline,
        arena: Arena,
        *,
        keep: object = None,
        writes_host: bool = False,
    ) -> T:
        """``fn()`` on the runner within ``deadline``; the call releases its reference to
        ``arena`` when it ends, and keeps ``keep`` (a host buffer it moves bytes of)
        referenced until then. A call still queued at the deadline never runs. Raises
        :class:`_Timeout` (counted) past the deadline or behind a stuck call; ``fn``'s own
        exception propagates."""
        keep_alive = [keep]
        gate = threading.Lock()
        state = {"started": False, "dropped": False}

        def run() -> T | None:
            with gate:
                if state["dropped"]:
                    return None
                state["started"] = True
            try:
                return fn()
            finally:
                arena.release()
                keep_alive.clear()

        res = self._runner.call(run, deadline.remaining, writes_host=writes_host)
        if not res.ok:
            with gate:
                if not state["started"]:  # never ran, and now never will
                    state["dropped"] = True
                    arena.release()
                    keep_alive.clear()
        if res.timed_out or res.refused:
            self._stats.timeout(op, deadline.timeout_s)
            raise _Timeout(op)
        if res.error is not None:
            raise res.error
        return res.value  # type: ignore[return-value]

    def _chunks(self, n: int) -> list[range]:
        size = self.options.max_batch_pages
        return [range(lo, min(lo + size, n)) for lo in range(0, n, size)]

    # -- get -------------------------------------------------------------------------------
    def _get(
        self, keys: Sequence[PageKey], pages: Payloads, deadline: Deadline
    ) -> list[MissReason | None]:
        out: list[MissReason | None] = []
        for idx in self._chunks(len(keys)):
            if deadline.expired:
                self._stats.timeout("get", deadline.timeout_s)
                return out + [MissReason.TIMEOUT] * (len(keys) - len(out))
            try:
                out.extend(self._get_chunk(keys, pages, idx, deadline))
            except _Timeout:
                return out + [MissReason.TIMEOUT] * (len(keys) - len(out))
        return out

    def _get_chunk(
        self, keys: Sequence[PageKey], pages: Payloads, idx: range, deadline: Deadline
    ) -> list[MissReason | None]:
        rec = record_size(pages.payload_len)
        zero_copy = self._zero_copy(pages)
        arena = self._arenas.take(len(idx) * (HEADER_SIZE if zero_copy else rec))
        if arena is None:
            return [MissReason.ERROR] * len(idx)
        try:
            ranges = self._ranges(pages, idx, arena, zero_copy, rec)
            paths = [self.path_str(keys[i].key) for i in idx]
            agent = self._agent
            assert agent is not None
            found, errors = self._call(
                "get",
                lambda: _read_records(agent, paths, ranges, rec),
                deadline,
                arena,
                keep=pages.host.buffer if isinstance(pages, HostPages) else None,
                writes_host=zero_copy,
            )
            failed = found.count(MissReason.ERROR)
            if failed:
                self._stats.error("get", f"{failed} page(s) failed; first {errors[0]}")
            raw = byte_view(arena.tensor)
            out: list[MissReason | None] = [
                found[j]
                if found[j] is not None
                else self._check(keys[i], pages, i, raw, j, zero_copy)
                for j, i in enumerate(idx)
            ]
            if self._index is not None:
                for j, i in enumerate(idx):
                    if out[j] is None:
                        self._index.touch(keys[i].key, rec)
                        with contextlib.suppress(FileNotFoundError):
                            os.utime(paths[j])
            return out
        finally:
            arena.release()

    def _ranges(
        self, pages: Payloads, idx: range | Sequence[int], arena: Arena, zero_copy: bool, rec: int
    ) -> list[Ranges]:
        """Per page of ``idx``, the host ranges of its record: the header's slot in
        ``arena`` and the page's views (zero-copy), or the record's slot in ``arena``."""
        base = arena.addr
        if not zero_copy:
            return [[(base + j * rec, rec)] for j in range(len(idx))]
        assert isinstance(pages, HostPages)
        host, page = pages.host, pages.pages
        return [
            [(base + j * HEADER_SIZE, HEADER_SIZE), *host.page_ranges(page[i])]
            for j, i in enumerate(idx)
        ]

    def _check(
        self, key: PageKey, pages: Payloads, i: int, raw: memoryview, j: int, zero_copy: bool
    ) -> MissReason | None:
        """Check the record read into slot ``j``: its header in the arena and its payload
        in place (``zero_copy``), or the whole record in the arena, copied into page ``i``
        only when good."""
        digest = self._digest_of(key)
        if zero_copy:
            return check_record(
                raw[j * HEADER_SIZE : (j + 1) * HEADER_SIZE],
                pages.parts(i),
                namespace_digest=digest,
                fingerprint=key.fingerprint,
                payload_len=pages.payload_len,
            ).reason
        rec = record_size(pages.payload_len)
        blob = raw[j * rec : (j + 1) * rec]
        check = check_blob(
            blob,
            namespace_digest=digest,
            fingerprint=key.fingerprint,
            payload_len=pages.payload_len,
        )
        if check.ok:
            pages.fill(i, blob[HEADER_SIZE:])
        return check.reason

    # -- set -------------------------------------------------------------------------------
    def _set(
        self, keys: Sequence[PageKey], pages: Payloads, deadline: Deadline
    ) -> list[SetOutcome]:
        return self._overwrite(keys, pages, deadline, [False] * len(keys))

    def _overwrite(
        self, keys: Sequence[PageKey], pages: Payloads, deadline: Deadline, replace: Sequence[bool]
    ) -> list[SetOutcome]:
        out: list[SetOutcome] = []
        for idx in self._chunks(len(keys)):
            if deadline.expired:
                self._stats.timeout("set", deadline.timeout_s)
                return out + [SetOutcome.FAILED] * (len(keys) - len(out))
            try:
                out.extend(self._set_chunk(keys, pages, idx, deadline, replace))
            except _Timeout:
                return out + [SetOutcome.FAILED] * (len(keys) - len(out))
        return out

    def _set_chunk(
        self,
        keys: Sequence[PageKey],
        pages: Payloads,
        idx: range,
        deadline: Deadline,
        replace: Sequence[bool],
    ) -> list[SetOutcome]:
        out = {i: SetOutcome.SKIPPED for i in idx}
        path = {i: self.path_str(keys[i].key) for i in idx}
        todo = [i for i in idx if replace[i] or not os.path.isfile(path[i])]
        if not todo:
            return [out[i] for i in idx]
        rec = record_size(pages.payload_len)
        zero_copy = self._zero_copy(pages)
        arena = self._arenas.take(len(todo) * (HEADER_SIZE if zero_copy else rec))
        if arena is None:
            return [SetOutcome.FAILED if i in todo else out[i] for i in idx]
        try:
            raw = byte_view(arena.tensor)
            for slot, i in enumerate(todo):  # headers from the pages, before any transfer
                parts = pages.parts(i)
                header = encode_header(self._digest_of(keys[i]), keys[i].fingerprint, parts)
                if zero_copy:
                    raw[slot * HEADER_SIZE : (slot + 1) * HEADER_SIZE] = header
                else:
                    off = slot * rec
                    raw[off : off + HEADER_SIZE] = header
                    off += HEADER_SIZE
                    for p in parts:
                        raw[off : off + p.nbytes] = p
                        off += p.nbytes
            ranges = self._ranges(pages, todo, arena, zero_copy, rec)
            paths = [path[i] for i in todo]
            agent = self._agent
            assert agent is not None
            late = threading.Event()
            try:
                written, errors = self._call(
                    "set",
                    lambda: _write_records(agent, paths, ranges, self.config.fsync, late),
                    deadline,
                    arena,
                    keep=pages.host.buffer if isinstance(pages, HostPages) else None,
                )
            except _Timeout:
                late.set()  # the call renames nothing once it sees this
                raise
        finally:
            arena.release()
        failed = written.count(False)
        if failed:
            first = errors[0] if errors else "no detail"
            self._stats.error("set", f"{failed} page(s) not written; first {first}")
        for slot, i in enumerate(todo):
            out[i] = SetOutcome.WRITTEN if written[slot] else SetOutcome.FAILED
            if written[slot] and self._index is not None:
                for victim in self._index.add(keys[i].key, rec):
                    self._unlink(self.path_of(victim))
        return [out[i] for i in idx]


# -- the work of one chunk, on a runner worker ----------------------------------------------


def _read_records(
    agent: PosixAgent, paths: Sequence[str], ranges: Sequence[Ranges], rec: int
) -> tuple[list[MissReason | None], list[str]]:
    """Open each record file, check its size, and read the good-sized ones into their
    host ranges in one transfer. Returns per file None (read; its record still to be
    checked) or the miss, and the error messages."""
    found: list[MissReason | None] = []
    errors: list[str] = []
    opened: list[int] = []
    todo: list[tuple[int, int]] = []
    try:
        for j, path in enumerate(paths):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                found.append(MissReason.ABSENT)
                continue
            except OSError as e:
                errors.append(f"{os.path.basename(path)}: {e!r}")
                found.append(MissReason.ERROR)
                continue
            opened.append(fd)
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != rec:
                writing = stat.S_ISREG(st.st_mode) and being_written(st.st_size, rec, st.st_mtime)
                found.append(MissReason.ABSENT if writing else MissReason.CORRUPT)
                continue
            found.append(None)
            todo.append((j, fd))
        if todo:
            dram, files = _pair(ranges, todo)
            try:
                agent.transfer("READ", dram, files)
            except NixlError as e:
                errors.append(str(e))
                for j, _ in todo:
                    found[j] = MissReason.ERROR
    finally:
        for fd in opened:
            os.close(fd)
    return found, errors


def _write_records(
    agent: PosixAgent,
    paths: Sequence[str],
    ranges: Sequence[Ranges],
    fsync: bool,
    late: threading.Event,
) -> tuple[list[bool], list[str]]:
    """Write each record to a temp file beside its path in one transfer, then rename the
    written ones into place (none once ``late`` is set: the caller gave up on them).
    Returns per record whether it is in place, and the error messages."""
    written = [False] * len(paths)
    errors: list[str] = []
    tmps: dict[int, str] = {}
    fds: dict[int, int] = {}
    tag = f"{os.getpid()}.{uuid.uuid4().hex[:8]}"  # this call's temp names: tag and slot
    try:
        for j, path in enumerate(paths):
            folder, name = os.path.split(path)
            tmp = os.path.join(folder, f".{name}.{tag}.{j}{TMP_SUFFIX}")
            try:
                fds[j] = _open_tmp(tmp)
                tmps[j] = tmp
            except OSError as e:
                errors.append(f"{name}: {e!r}")
                if e.errno in _FULL:  # the rest would fail the same way
                    break
        todo = list(fds.items())
        if todo:
            dram, files = _pair(ranges, todo)
            try:
                agent.transfer("WRITE", dram, files)
                if fsync:
                    for _, fd in todo:
                        os.fsync(fd)
            except (NixlError, OSError) as e:
                errors.append(str(e))
                todo = []
        for j, fd in list(fds.items()):
            del fds[j]
            os.close(fd)
        if late.is_set():
            return written, errors
        for j, _ in todo:
            try:
                os.replace(tmps.pop(j), paths[j])
                written[j] = True
            except OSError as e:
                errors.append(f"{os.path.basename(paths[j])}: {e!r}")
        if fsync:
            for parent in {os.path.dirname(paths[j]) for j, ok in enumerate(written) if ok}:
                dfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
    finally:
        for fd in fds.values():
            os.close(fd)
        for tmp in tmps.values():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    return written, errors


def _open_tmp(path: str) -> int:
    """Create the temp file ``path``, making its fan-out folder only when the open finds it
    missing (never the record directory itself: a lost directory fails the write)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
    try:
        return os.open(path, flags, 0o600)
    except FileNotFoundError:
        with contextlib.suppress(FileExistsError):
            os.mkdir(os.path.dirname(path), 0o700)
        return os.open(path, flags, 0o600)


def _pair(
    ranges: Sequence[Ranges], todo: Sequence[tuple[int, int]]
) -> tuple[list[tuple[int, int]], list[tuple[int, int, int]]]:
    """The paired descriptor rows of records ``todo`` (``(slot, fd)``): each record's host
    ranges, and the file ranges they map to, back to back from offset 0 of its fd."""
    dram: list[tuple[int, int]] = []
    files: list[tuple[int, int, int]] = []
    for j, fd in todo:
        off = 0
        for addr, n in ranges[j]:
            dram.append((addr, n))
            files.append((off, n, fd))
            off += n
    return dram, files
