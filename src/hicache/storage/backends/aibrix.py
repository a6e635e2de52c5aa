"""The ``aibrix`` L3 backend: hicache records in AIBrix KVCache (``aibrix-kvcache``).

Each page is one hicache record (:mod:`hicache.storage.record`) stored as one AIBrix block
under the page's key, through AIBrix's ``BaseKVCacheManager`` (connector ``SHFS`` or
``ROCKSDB``, its own L1 host cache off; blocks, keys, sharing and environment in
:mod:`~hicache.storage.backends.aibrix_client`, keys in
:mod:`~hicache.storage.backends.aibrix_config`). Every AIBrix call runs on a
:class:`~hicache.storage.deadline.DeadlineRunner` within the batch deadline; a run AIBrix
stops early is asked again past its miss. exists: the longest leading run over the stores
of every block size under ``root``. get: ``acquire``, each record checked in AIBrix's
buffer and only a good payload copied into its host page (``writes_host``: an overrun get
shows in ``host_writes_settled``). set: the leading present run is skipped (first writer
wins), the records are filled into AIBrix's buffers on the caller's thread (a late
``put`` never reads a host page), then ``put``, which replaces a block (healing). A failure
or timeout is a miss / False, never an exception. In full: ``docs/integrations.md``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import ClassVar, TypeVar

from hicache.keys import Namespace, PageKey
from hicache.storage.backends.aibrix_client import (
    AibrixCallError,
    AibrixManager,
    GetRun,
    block_bytes_for,
    open_manager,
    require_aibrix,
    root_listing_version,
    stored_block_sizes,
)
from hicache.storage.backends.aibrix_config import AibrixConfig
from hicache.storage.base import ConfiguredStorage, Deadline, StorageError, StorageOptions
from hicache.storage.blob import decode_page
from hicache.storage.deadline import DeadlineRunner
from hicache.storage.pageio import Payloads
from hicache.storage.record import HEADER_SIZE, encode_header
from hicache.storage.stats import MissReason, SetOutcome

__all__ = ["AibrixStorage"]

T = TypeVar("T")
_WORKERS = 4
"""Calls of one instance that may run at once (its runner's threads)."""


class _CallFailed(Exception):
    """An AIBrix call did not return in time or raised; ``reason`` says which."""

    def __init__(self, reason: MissReason) -> None:
        super().__init__(reason.value)
        self.reason = reason


class AibrixStorage(ConfiguredStorage):
    """AIBrix KVCache backend (registry name ``aibrix``)."""

    name: ClassVar[str] = "aibrix"
    SETTINGS: ClassVar[type[AibrixConfig]] = AibrixConfig

    def __init__(
        self, namespace: Namespace, options: StorageOptions | None = None, *, config: AibrixConfig
    ) -> None:
        super().__init__(namespace, options, config=config)
        self.config: AibrixConfig = config
        self._runner = DeadlineRunner("aibrix", workers=_WORKERS)
        self._host_io = self._runner  # gets check and copy records into pages on it
        self._managers: dict[int, AibrixManager] = {}
        self._mlock = threading.Lock()
        self._listed: int | None = None
        """The root's listing version when :meth:`_open_stored` last read it."""

    # -- lifecycle -------------------------------------------------------------------------
    def _start(self) -> None:
        self._runner.start()
        opts = self.options
        # open the stores already under root now, so that a broken store (a RocksDB held
        # by another process, a missing package) is refused at start, not met as misses
        res = self._runner.call(self._open_all, opts.connect_timeout_s)
        if not res.ok:
            why = "timed out" if res.timed_out else str(res.error)
            self._close()
            if isinstance(res.error, StorageError):
                raise res.error
            raise StorageError(f"aibrix backend: cannot open {self.config.root!r}: {why}")

    def _close(self) -> None:
        with self._mlock:
            managers, self._managers = list(self._managers.values()), {}
        for m in managers:
            m.close()
        self._runner.close()

    def _manager(self, block_bytes: int) -> AibrixManager:
        """This instance's reference to the store of ``block_bytes`` blocks (opened now if
        new); runs on the runner (opening may touch the disk)."""
        with self._mlock:
            m = self._managers.get(block_bytes)
            if m is None:
                m = open_manager(
                    self.config,
                    block_bytes,
                    timeout_s=self.options.timeout_s,
                    concurrency=_WORKERS * self.options.max_batch_pages,
                )
                self._managers[block_bytes] = m
            return m

    def _opened(self, op: str, block_bytes: int, deadline: Deadline) -> AibrixManager:
        """The store of ``block_bytes`` blocks: looked up here when already open (no hop
        to the runner), else opened on the runner within ``deadline`` (raises
        :class:`_CallFailed`)."""
        with self._mlock:
            m = self._managers.get(block_bytes)
        if m is not None:
            return m
        return self._call(op, partial(self._manager, block_bytes), deadline)

    def _open_all(self) -> list[AibrixManager]:
        """Import AIBrix (a missing package fails here, at start), then :meth:`_open_stored`."""
        require_aibrix()
        return self._open_stored()

    def _open_stored(self) -> list[AibrixManager]:
        """References to every store found under ``root`` (opening the new ones). The
        listing is read again only when ``root`` may have changed since the last one
        (:func:`~hicache.storage.backends.aibrix_client.root_listing_version`): a lookup
        that misses asks for it, so a steady stream of misses costs one ``stat``, not a
        directory listing each."""
        version = root_listing_version(self.config)
        with self._mlock:
            if version is not None and version == self._listed:
                return list(self._managers.values())
        managers = [self._manager(b) for b in stored_block_sizes(self.config)]
        with self._mlock:
            self._listed = version
        return managers

    # -- plumbing --------------------------------------------------------------------------
    def _call(
        self, op: str, fn: Callable[[], T], deadline: Deadline, *, writes_host: bool = False
    ) -> T:
        """``fn()`` on the runner within ``deadline``; raises :class:`_CallFailed` (counted
        and logged) when it times out, is refused behind a stuck call, or raises.
        ``writes_host``: ``fn`` writes host pages (see ``host_writes_settled``)."""
        res = self._runner.call(fn, deadline.remaining, writes_host=writes_host)
        if res.ok:
            return res.value  # type: ignore[return-value]
        if res.timed_out or res.refused:
            self._stats.timeout(op, deadline.timeout_s)
            raise _CallFailed(MissReason.TIMEOUT)
        self._stats.error(op, repr(res.error))
        raise _CallFailed(MissReason.ERROR)

    def _chunks(self, n: int) -> list[range]:
        size = self.options.max_batch_pages
        return [range(i, min(i + size, n)) for i in range(0, n, size)]

    # -- operations ------------------------------------------------------------------------
    def _exists(self, keys: Sequence[PageKey], deadline: Deadline) -> int:
        names = [k.key for k in keys]
        best = 0
        tried: set[int] = set()
        for rescan in (False, True):
            if rescan:  # nothing found: a store may have appeared since (another writer)
                try:
                    managers = self._call("exists", self._open_stored, deadline)
                except _CallFailed:
                    return 0
            else:
                with self._mlock:
                    managers = list(self._managers.values())
            for m in managers:
                if m.block_bytes in tried:
                    continue
                tried.add(m.block_bytes)
                try:
                    best = max(best, self._call("exists", partial(m.exists, names), deadline))
                except _CallFailed:
                    return best
                if best == len(names):
                    return best
            if best:
                return best
        return best

    def _get(
        self, keys: Sequence[PageKey], pages: Payloads, deadline: Deadline
    ) -> list[MissReason | None]:
        record_len = HEADER_SIZE + pages.payload_len
        out: list[MissReason | None] = [MissReason.ERROR] * len(keys)
        try:
            m = self._opened("get", block_bytes_for(record_len), deadline)
        except _CallFailed as e:
            return [e.reason] * len(keys)
        names = [k.key for k in keys]

        def sink(got: list[MissReason | None], base: int, j: int, block: memoryview) -> None:
            # on the runner: each record is checked in AIBrix's buffer before its payload
            # is copied into its page (the call is made with writes_host); the verdicts go
            # to this call's own list, used only if the call returns in time
            i = base + j
            got.append(decode_page(block[:record_len], self._digest_of(keys[i]), keys[i], pages, i))

        lo = 0
        while lo < len(keys):
            hi = min(lo + self.options.max_batch_pages, len(keys))
            got: list[MissReason | None] = []
            try:
                run: GetRun = self._call(
                    "get",
                    partial(m.get_into, names[lo:hi], partial(sink, got, lo)),
                    deadline,
                    writes_host=True,
                )
            except _CallFailed as e:
                out[lo:] = [e.reason] * (len(keys) - lo)
                return out
            out[lo : lo + run.fetched] = got[: run.fetched]
            lo += run.fetched
            if lo < hi and (run.why is not None or not run.fetched):
                out[lo] = self._miss(run.why, deadline)
                lo += 1
        return out

    def _miss(self, code: str | None, deadline: Deadline) -> MissReason:
        """The miss reason of an AIBrix status name (counted unless the key is absent;
        None: AIBrix reported success without a block)."""
        if code == "NOT_FOUND":
            return MissReason.ABSENT
        if code in ("TIMEOUT", "CANCELLED"):
            self._stats.timeout("get", deadline.timeout_s)
            return MissReason.TIMEOUT
        self._stats.error("get", f"aibrix status {code or 'OK without a block'}")
        return MissReason.ERROR

    def _set(
        self, keys: Sequence[PageKey], pages: Payloads, deadline: Deadline
    ) -> list[SetOutcome]:
        return self._overwrite(keys, pages, deadline, [False] * len(keys))

    def _overwrite(
        self, keys: Sequence[PageKey], pages: Payloads, deadline: Deadline, replace: Sequence[bool]
    ) -> list[SetOutcome]:
        record_len = HEADER_SIZE + pages.payload_len
        out = [SetOutcome.FAILED] * len(keys)
        names = [k.key for k in keys]
        try:
            m = self._opened("set", block_bytes_for(record_len), deadline)
            for part in self._chunks(len(keys)):
                hits = self._call(
                    "set (exists)",
                    partial(m.exists_probed, names[part.start : part.stop]),
                    deadline,
                )
                todo = []
                for j, i in enumerate(part):
                    if j < hits and not replace[i]:
                        out[i] = SetOutcome.SKIPPED
                    else:
                        todo.append(i)
                if not todo:
                    continue
                # AIBrix's buffers are taken and filled here, on the caller's thread (no IO
                # for these connectors): a put that overruns never reads a host page late
                try:
                    blocks = m.allocate([names[i] for i in todo])
                except AibrixCallError as e:  # out of AIBrix's buffers: nothing taken
                    self._stats.error("set", str(e))
                    return out
                try:
                    for j, i in enumerate(todo):
                        payload = pages.parts(i)
                        header = encode_header(
                            self._digest_of(keys[i]), keys[i].fingerprint, payload
                        )
                        blocks.fill(j, [header, *payload])
                except BaseException:
                    blocks.release()
                    raise
                done = self._call("set", partial(m.put, blocks), deadline)
                for i in todo[:done]:
                    out[i] = SetOutcome.WRITTEN
                if done < len(todo):
                    self._stats.error("set", f"aibrix stored {done} of {len(todo)} blocks")
                    return out
        except _CallFailed:
            return out
        return out
