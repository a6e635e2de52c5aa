"""The ``mooncake`` L3 backend: Mooncake Store (``mooncake-transfer-engine-non-cuda``).

One Mooncake object per page key holding the record. Zero-copy: the host pool's buffer is
registered, and each key moves as ``[header slot, kind 0 view, kind 1 view]``; a
``layer_first`` pool, ``zero_copy: false`` or pages under ``zero_copy_min_bytes`` stage whole
records through a registered arena. By default no segment is mounted
(``global_segment_size`` 0): objects live in a long-lived holder's segment (``hicache store
mooncake``). Invariants: every call runs on a
:class:`~hicache.storage.deadline.DeadlineRunner`, misses / False at the deadline, further
calls refused (as timeouts) until a stuck one returns; a zero-copy get that overran keeps
``host_writes_settled`` False until it returns; a bad record is replaced whole with
``batch_upsert_from`` (a put of a present key is refused). Extra config:
:mod:`hicache.storage.backends.mooncake_config`. In full: ``docs/architecture.md``, "The
backends".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar

from hicache.keys import Namespace, PageKey
from hicache.storage.arena import Arena, ArenaPool, BufferRegistry
from hicache.storage.backends.mooncake_config import MC_ERRORS, MooncakeConfig
from hicache.storage.backends.mooncake_net import Listener, probe_master, tcp_listeners
from hicache.storage.base import (
    ConfiguredStorage,
    Deadline,
    StorageError,
    StorageOptions,
)
from hicache.storage.deadline import DeadlineRunner
from hicache.storage.pageio import Payloads, byte_view
from hicache.storage.record import HEADER_SIZE, check_blob, check_record, encode_header, record_size
from hicache.storage.stats import MissReason, SetOutcome

__all__ = ["MooncakeConfig", "MooncakeStorage"]

T = TypeVar("T")
log = logging.getLogger("hicache.storage")

_ABANDONED: list[Any] = []
"""Clients whose close was skipped because a call was stuck in them (never destroyed)."""

_NOT_FOUND = -704
_EXISTS = -705
_SIZE_MISMATCH = -600


class MooncakeStorage(ConfiguredStorage):
    """Mooncake Store backend (registry name ``mooncake``)."""

    name: ClassVar[str] = "mooncake"
    SETTINGS: ClassVar[type[MooncakeConfig]] = MooncakeConfig

    def __init__(
        self, namespace: Namespace, options: StorageOptions | None = None, *, config: MooncakeConfig
    ) -> None:
        super().__init__(namespace, options, config=config)
        self.config: MooncakeConfig = config
        self._store: Any = None
        self._runner = DeadlineRunner("mooncake")
        self._host_io = self._runner  # zero-copy gets write host pages on its workers
        self._listeners: list[Listener] = []
        self._buffers = BufferRegistry(self._register, self._unregister)
        self._arenas = ArenaPool(self._buffers.ensure_tensor)

    # -- lifecycle -------------------------------------------------------------------------
    def _start(self) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise StorageError(
                "mooncake backend needs 'mooncake-transfer-engine-non-cuda' (pip) and "
                f"libibverbs1 (apt): {e}"
            ) from e
        c = self.config
        timeout = self.options.connect_timeout_s
        end = time.monotonic() + timeout
        probe_master(c.master_server_address, timeout)
        before = set(tcp_listeners())
        store = MooncakeDistributedStore()
        self._runner.start()
        res = self._runner.call(
            lambda: store.setup(
                c.local_hostname,
                c.metadata_server,
                c.global_segment_size,
                c.local_buffer_size,
                c.protocol,
                c.device_name,
                c.master_server_address,
            ),
            max(end - time.monotonic(), 0.0),
        )
        if not res.ok or res.value != 0:
            why = (
                "timed out"
                if res.timed_out
                else repr(res.error)
                if res.error
                else f"setup returned {res.value}"
            )
            self._runner.close()
            raise StorageError(
                f"mooncake backend: cannot join the store at {c.master_server_address} "
                f"within {timeout:g} s (connect_timeout_s): {why}"
            )
        self._store = store
        self._listeners = [x for x in tcp_listeners() if x not in before]
        exposed = [x for x in self._listeners if not x.loopback_only]
        if exposed:
            where = ", ".join(x.address for x in exposed)
            log.warning(
                "mooncake backend: the transfer engine listens on %s (this Mooncake version "
                "ignores local_hostname=%s for its listeners); a peer that reaches them can "
                "read and write this process's registered memory, which is only the L2 host "
                "pool (unless zero_copy is false) and the backend's record staging; firewall "
                "these ports (docs/security.md)",
                where,
                c.local_hostname,
            )

    @property
    def listeners(self) -> list[Listener]:
        """TCP sockets the transfer engine opened in this process at :meth:`start`."""
        return list(self._listeners)

    def registered_ranges(self) -> dict[int, int]:
        """``address -> bytes`` of every buffer this backend registered with the transfer
        engine (what a peer can reach): host pool buffers and staging arenas only."""
        return self._buffers.ranges()

    def _close(self) -> None:
        store, self._store = self._store, None
        if store is not None:
            # Closing a client while a call is still inside it crashes the process, so a
            # client with a stuck call is abandoned (kept alive, never closed) instead.
            if not self._runner.wait_idle(self.options.timeout_s):
                _ABANDONED.append(store)
                self._stats.error("close", "a call is still stuck; client abandoned unclosed")
            else:
                res = self._runner.call(lambda: self._teardown(store), self.options.timeout_s)
                if not res.ok:
                    _ABANDONED.append(store)
                    self._stats.error("close", "timed out" if res.timed_out else repr(res.error))
        self._runner.close()

    def _teardown(self, store: Any) -> None:
        for ptr in self._buffers.drain():
            store.unregister_buffer(ptr)
        store.close()

    # -- registration ----------------------------------------------------------------------
    def _register(self, ptr: int, nbytes: int) -> bool:
        store = self._store
        res = self._runner.call(lambda: store.register_buffer(ptr, nbytes), self.options.timeout_s)
        if not res.ok or res.value != 0:
            why = f"rc={res.value} error={res.error!r} timed_out={res.timed_out}"
            self._stats.error("register_buffer", why)
            return False
        return True

    def _unregister(self, ptr: int) -> None:
        store = self._store
        if store is not None and not self._runner.stuck:
            try:
                store.unregister_buffer(ptr)
            except Exception as e:
                self._stats.error("unregister_buffer", repr(e))

    # -- plumbing --------------------------------------------------------------------------
    def _call(
        self,
        op: str,
        fn: Callable[[], T],
        deadline: Deadline,
        arena: Arena | None = None,
        keep: object = None,
        writes_host: bool = False,
    ) -> T | MissReason:
        """Run ``fn`` within ``deadline``; release ``arena``'s call reference when it ends.

        ``keep`` (the host buffer of a zero-copy call) stays referenced until the call
        returns, so memory a late call still writes is never freed under it.
        ``writes_host``: ``fn`` writes host pages (a zero-copy get), see
        :meth:`host_writes_settled`.
        """

        def run() -> T:
            try:
                return fn()
            finally:
                if arena is not None:
                    arena.release()
                del keep_alive[:]

        keep_alive = [keep]

        res = self._runner.call(run, deadline.remaining, writes_host=writes_host)
        if res.refused and arena is not None:
            arena.release()  # never ran
        if res.ok:
            return res.value  # type: ignore[return-value]
        if res.timed_out or res.refused:
            self._stats.timeout(op, deadline.timeout_s)
            return MissReason.TIMEOUT
        self._stats.error(op, repr(res.error))
        return MissReason.ERROR

    def _zero_copy(self, pages: Payloads) -> bool:
        """Whether ``pages`` move in place: their buffer (a host pool's, hicache's or an
        engine's) is registered and their pages are at least ``zero_copy_min_bytes`` (below
        it, one staged slice per record beats three in place); state slots are staged."""
        buf = pages.buffer
        if not (self.config.zero_copy and pages.zero_copy and buf is not None):
            return False
        if pages.payload_len < self.config.zero_copy_min_bytes:
            return False
        return self._buffers.ensure_owned(buf)

    # -- operations ------------------------------------------------------------------------
    def _exists(self, keys: Sequence[PageKey], deadline: Deadline) -> int:
        store = self._store
        codes = self._call("exists", lambda: store.batch_is_exist([k.key for k in keys]), deadline)
        if isinstance(codes, MissReason):
            return 0
        n = 0
        for c in codes:
            if c != 1:
                if c < 0:
                    self._stats.error("exists", f"code {c} {MC_ERRORS.get(c, '')}")
                break
            n += 1
        return n

    def _get(
        self, keys: Sequence[PageKey], pages: Payloads, deadline: Deadline
    ) -> list[MissReason | None]:
        out: list[MissReason | None] = []
        step = self.options.max_batch_pages
        for lo in range(0, len(keys), step):
            idx = range(lo, min(lo + step, len(keys)))
            out.extend(self._get_chunk(keys, pages, idx, deadline))
        return out

    def _get_chunk(
        self, keys: Sequence[PageKey], pages: Payloads, idx: range, deadline: Deadline
    ) -> list[MissReason | None]:
        n = len(idx)
        store = self._store
        rec = record_size(pages.payload_len)
        zero_copy = self._zero_copy(pages)
        arena = self._arenas.take(n * (HEADER_SIZE if zero_copy else rec))
        if arena is None:
            return [MissReason.ERROR] * n
        names = [keys[i].key for i in idx]
        base = arena.addr
        if zero_copy:
            addrs = [pages.addresses(i) for i in idx]
            ptrs = [[base + j * HEADER_SIZE, *(a for a, _ in pa)] for j, pa in enumerate(addrs)]
            sizes = [[HEADER_SIZE, *(n for _, n in pa)] for pa in addrs]
            codes = self._call(
                "get",
                lambda: store.batch_get_into_multi_buffers(names, ptrs, sizes),
                deadline,
                arena,
                keep=pages.buffer,
                writes_host=True,
            )
        else:
            flat_ptrs = [base + j * rec for j in range(n)]
            codes = self._call(
                "get", lambda: store.batch_get_into(names, flat_ptrs, [rec] * n), deadline, arena
            )
        try:
            if isinstance(codes, MissReason):
                return [codes] * n
            return self._check_gets(keys, pages, idx, codes, arena, zero_copy)
        finally:
            arena.release()

    def _check_gets(
        self,
        keys: Sequence[PageKey],
        pages: Payloads,
        idx: range,
        codes: Sequence[int],
        arena: Arena,
        zero_copy: bool,
    ) -> list[MissReason | None]:
        rec = record_size(pages.payload_len)
        raw = byte_view(arena.tensor)
        out: list[MissReason | None] = []
        errors: list[str] = []
        for j, (i, code) in enumerate(zip(idx, codes, strict=True)):
            key = keys[i]
            if code == _NOT_FOUND:
                out.append(MissReason.ABSENT)
            elif code == _SIZE_MISMATCH or (code >= 0 and code != rec):
                out.append(MissReason.CORRUPT)
            elif code < 0:
                errors.append(f"{key.key}: code {code} {MC_ERRORS.get(code, '')}")
                out.append(MissReason.ERROR)
            elif zero_copy:
                header = raw[j * HEADER_SIZE : (j + 1) * HEADER_SIZE]
                check = check_record(
                    header,
                    pages.parts(i),
                    namespace_digest=self._digest_of(key),
                    fingerprint=key.fingerprint,
                    payload_len=pages.payload_len,
                )
                out.append(check.reason)
            else:
                blob = raw[j * rec : (j + 1) * rec]
                check = check_blob(
                    blob,
                    namespace_digest=self._digest_of(key),
                    fingerprint=key.fingerprint,
                    payload_len=pages.payload_len,
                )
                if check.ok:
                    pages.fill(i, blob[HEADER_SIZE:])
                out.append(check.reason)
        if errors:
            self._stats.error("get", f"{len(errors)} page(s) failed; first {errors[0]}")
        return out

    def _set(
        self, keys: Sequence[PageKey], pages: Payloads, deadline: Deadline
    ) -> list[SetOutcome]:
        return self._overwrite(keys, pages, deadline, [False] * len(keys))

    def _overwrite(
        self, keys: Sequence[PageKey], pages: Payloads, deadline: Deadline, replace: Sequence[bool]
    ) -> list[SetOutcome]:
        out: list[SetOutcome] = [SetOutcome.FAILED] * len(keys)
        step = self.options.max_batch_pages
        for lo in range(0, len(keys), step):
            idx = range(lo, min(lo + step, len(keys)))
            put = [i for i in idx if not replace[i]]
            upsert = [i for i in idx if replace[i]]
            for group, run in ((put, self._set_chunk), (upsert, self._upsert_chunk)):
                if group:
                    for i, o in zip(group, run(keys, pages, group, deadline), strict=True):
                        out[i] = o
        return out

    def _upsert_chunk(
        self, keys: Sequence[PageKey], pages: Payloads, idx: Sequence[int], deadline: Deadline
    ) -> list[SetOutcome]:
        """Write the records of ``keys[i]`` for ``i`` in ``idx`` whether present or not
        (staged; these are the few records reads found bad)."""
        rec = record_size(pages.payload_len)
        arena = self._arenas.take(len(idx) * rec)
        if arena is None:
            return [SetOutcome.FAILED] * len(idx)
        self._pack(byte_view(arena.tensor), keys, pages, idx, rec)
        names = [keys[i].key for i in idx]
        flat = [arena.addr + slot * rec for slot in range(len(idx))]
        store = self._store
        codes = self._call(
            "set (replace)",
            lambda: store.batch_upsert_from(names, flat, [rec] * len(idx)),
            deadline,
            arena,
        )
        arena.release()
        if isinstance(codes, MissReason):
            return [SetOutcome.FAILED] * len(idx)
        out = [SetOutcome.WRITTEN if c == 0 else SetOutcome.FAILED for c in codes]
        errors = [
            f"{n}: code {c} {MC_ERRORS.get(c, '')}" for n, c in zip(names, codes, strict=True) if c
        ]
        if errors:
            self._stats.error(
                "set (replace)", f"{len(errors)} page(s) not written; first {errors[0]}"
            )
        return out

    def _pack(
        self,
        raw: memoryview,
        keys: Sequence[PageKey],
        pages: Payloads,
        idx: Sequence[int],
        rec: int,
    ) -> None:
        """Write the whole record (header, then payload parts) of ``keys[i]`` for the
        ``slot``-th ``i`` of ``idx`` at byte ``slot * rec`` of ``raw`` (``rec`` bytes
        each, ``raw`` at least ``len(idx) * rec`` bytes)."""
        for slot, i in enumerate(idx):
            parts = pages.parts(i)
            off = slot * rec
            raw[off : off + HEADER_SIZE] = encode_header(
                self._digest_of(keys[i]), keys[i].fingerprint, parts
            )
            off += HEADER_SIZE
            for p in parts:
                raw[off : off + p.nbytes] = p
                off += p.nbytes

    def _set_chunk(
        self, keys: Sequence[PageKey], pages: Payloads, idx: Sequence[int], deadline: Deadline
    ) -> list[SetOutcome]:
        names = [keys[i].key for i in idx]
        store = self._store
        present = self._call("set (exists)", lambda: store.batch_is_exist(names), deadline)
        if isinstance(present, MissReason):
            return [SetOutcome.FAILED] * len(idx)
        out = [SetOutcome.SKIPPED if c == 1 else SetOutcome.FAILED for c in present]
        todo = [j for j, c in enumerate(present) if c != 1]
        if not todo:
            return out
        rec = record_size(pages.payload_len)
        zero_copy = self._zero_copy(pages)
        arena = self._arenas.take(len(todo) * (HEADER_SIZE if zero_copy else rec))
        if arena is None:
            return out
        raw = byte_view(arena.tensor)
        base = arena.addr
        todo_names = [names[j] for j in todo]
        if zero_copy:
            ptrs: list[list[int]] = []
            sizes: list[list[int]] = []
            for slot, j in enumerate(todo):
                i = idx[j]
                addrs = pages.addresses(i)
                header = encode_header(
                    self._digest_of(keys[i]), keys[i].fingerprint, pages.parts(i)
                )
                raw[slot * HEADER_SIZE : (slot + 1) * HEADER_SIZE] = header
                ptrs.append([base + slot * HEADER_SIZE, *(a for a, _ in addrs)])
                sizes.append([HEADER_SIZE, *(n for _, n in addrs)])
            codes = self._call(
                "set",
                lambda: store.batch_put_from_multi_buffers(todo_names, ptrs, sizes),
                deadline,
                arena,
                keep=pages.buffer,
            )
        else:
            self._pack(raw, keys, pages, [idx[j] for j in todo], rec)
            flat = [base + slot * rec for slot in range(len(todo))]
            codes = self._call(
                "set",
                lambda: store.batch_put_from(todo_names, flat, [rec] * len(todo)),
                deadline,
                arena,
            )
        arena.release()
        if isinstance(codes, MissReason):
            return out
        errors: list[str] = []
        for j, code in zip(todo, codes, strict=True):
            if code == 0:
                out[j] = SetOutcome.WRITTEN
            elif code == _EXISTS:
                out[j] = SetOutcome.SKIPPED
            else:
                errors.append(f"{names[j]}: code {code} {MC_ERRORS.get(code, '')}")
        if errors:
            self._stats.error("set", f"{len(errors)} page(s) not written; first {errors[0]}")
        return out
