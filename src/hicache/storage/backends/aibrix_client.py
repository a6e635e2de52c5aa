"""AIBrix KVCache managers, one per store and block size, shared by the whole process.

The ``aibrix`` backend (:mod:`hicache.storage.backends.aibrix`) and the storage bench's raw
AIBrix path talk to AIBrix only through :class:`AibrixManager`. Shapes: one hicache record
per AIBrix block (``block_ntokens=1``, ``uint8``, NCLD, one layer, one head of ``head_size =
block_bytes / 2``), ``block_bytes`` the record length rounded up to even (the pad byte is
zero, never read); each block size has its own store (:func:`block_bytes_for`,
:func:`stored_block_sizes`). Keys: ``BlockHashes([PageKey.key, ...], block_ntokens=1)``,
never a prefix (the chain is inside each key). Invariants: one manager per
:class:`StoreKey`, reference-counted; managers are built under one lock that sets
AIBrix's ``AIBRIX_KV_CACHE_OL_*`` variables and puts the previous values back; AIBrix token
validation must be off. Calls block: the backend runs them on its
:class:`~hicache.storage.deadline.DeadlineRunner`; a status other than OK (NOT_FOUND for
lookups) raises :class:`AibrixCallError`, a get's stop is a :class:`GetRun`. Why each of
these: ``docs/integrations.md``, "AIBrix KVCache".
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hicache.storage.backends.aibrix_config import AibrixConfig
from hicache.storage.base import StorageError
from hicache.storage.pageio import byte_view

__all__ = [
    "AibrixCallError",
    "AibrixManager",
    "Blocks",
    "GetRun",
    "StoreKey",
    "block_bytes_for",
    "open_manager",
    "require_aibrix",
    "root_listing_version",
    "stored_block_sizes",
]

CLOSE_WAIT_S = 10.0
"""How long closing a manager may hold up :meth:`AibrixManager.close` (seconds)."""

_ENV_LOCK = threading.Lock()
_POOL_LOCK = threading.Lock()


class AibrixCallError(RuntimeError):
    """An AIBrix call returned a status other than OK / NOT_FOUND; ``code`` is its name."""

    def __init__(self, op: str, code: str, detail: str = "") -> None:
        super().__init__(f"aibrix {op}: {code}{': ' + detail if detail else ''}")
        self.code = code


def block_bytes_for(record_len: int) -> int:
    """Bytes of the AIBrix block holding a record of ``record_len`` bytes (even, >= 2)."""
    if record_len < 1:
        raise ValueError(f"record_len={record_len!r} is invalid; must be >= 1")
    return record_len + (record_len & 1)


@dataclass(frozen=True, slots=True)
class StoreKey:
    """What makes two managers the same store: they share one in a process."""

    connector: str
    root: str
    aibrix_namespace: str
    block_bytes: int


@dataclass(frozen=True, slots=True)
class GetRun:
    """The outcome of one :meth:`AibrixManager.get_into`: the first ``fetched`` keys were
    copied into their rows; when fewer than asked, ``why`` names AIBrix's status for the
    next key (``"NOT_FOUND"``, ``"TIMEOUT"``, ...) or is None when AIBrix stopped without
    saying (ask again from that key)."""

    fetched: int
    why: str | None = None


ROOT_SETTLED_S = 2.0
"""Seconds after which a ``root`` whose modification time is unchanged is taken to hold the
same stores (coarser than any file system's timestamp granularity, FAT's 2 s included)."""


def root_listing_version(config: AibrixConfig, now: float | None = None) -> int | None:
    """A version of ``config.root``'s listing: its modification time (ns), which a new
    store's folder changes; None when the root is missing or changed within
    :data:`ROOT_SETTLED_S` of ``now`` (wall clock), so that a listing read then is never
    trusted past a change a coarse timestamp could hide."""
    try:
        mtime = os.stat(config.root).st_mtime_ns
    except OSError:
        return None
    if (time.time() if now is None else now) - mtime / 1e9 < ROOT_SETTLED_S:
        return None
    return mtime


def stored_block_sizes(config: AibrixConfig) -> list[int]:
    """Block sizes of the stores under ``config.root`` for its AIBrix namespace (from the
    folder names), ascending; [] when the root does not exist."""
    pat = re.compile(re.escape(config.aibrix_namespace) + r"-r(\d+)_")
    try:
        names = os.listdir(config.root)
    except OSError:
        return []
    return sorted({int(m.group(1)) for n in names if (m := pat.match(n))})


class Blocks:
    """Allocated AIBrix blocks, ``views[i]`` (writable, ``block_bytes`` each) for the
    ``i``-th key: filled by the caller, then given to :meth:`AibrixManager.put` (which
    releases them) or :meth:`release`-d."""

    def __init__(self, hashes: Any, handle: Any) -> None:
        self.hashes = hashes
        self._handle: Any = handle
        self.views: list[memoryview] = [byte_view(t.reshape(-1)) for t in handle.to_tensors()]

    def fill(self, i: int, parts: Sequence[bytes | memoryview]) -> None:
        """Write ``parts`` one after another into block ``i``; the rest is zeroed."""
        view, off = self.views[i], 0
        for part in parts:
            n = memoryview(part).nbytes
            view[off : off + n] = part
            off += n
        view[off:] = bytes(view.nbytes - off)

    def take(self) -> Any:
        """The AIBrix handle, handed over (this object no longer owns it)."""
        handle, self._handle = self._handle, None
        if handle is None:
            raise RuntimeError("these AIBrix blocks were already put or released")
        self.views = []
        return handle

    def release(self) -> None:
        """Give the buffers back without storing them (idempotent)."""
        if self._handle is not None:
            self.take().release()


class _Shared:
    """One built AIBrix manager and its reference count (guarded by ``_POOL_LOCK``)."""

    def __init__(self, manager: Any, config: AibrixConfig, block_hashes: Any) -> None:
        self.manager = manager
        self.config = config
        self.block_hashes = block_hashes
        self.refs = 0


_POOL: dict[StoreKey, _Shared] = {}


def _import_aibrix() -> tuple[Any, Any]:
    """``(aibrix_kvcache, aibrix_kvcache.cache_manager)``; StorageError when absent."""
    try:
        ak = importlib.import_module("aibrix_kvcache")
        cm = importlib.import_module("aibrix_kvcache.cache_manager")
        mr = importlib.import_module("aibrix_kvcache.memory")
    except ImportError as e:
        raise StorageError(
            "aibrix backend needs the 'aibrix-kvcache' package and its modules "
            f"(pip install --no-deps -r requirements/aibrix.txt): {e}"
        ) from e
    if not mr.MemoryRegion.use_compact_layout():
        raise StorageError(
            "aibrix backend: aibrix_kvcache was imported with "
            "AIBRIX_KV_CACHE_OL_TOKEN_VALIDATION_ENABLED on; hicache checks its own records "
            "and needs AIBrix's compact block layout (unset it)"
        )
    return ak, cm


def require_aibrix() -> None:
    """Import ``aibrix_kvcache`` (with token validation off, under the environment lock)
    or raise StorageError saying what is missing."""
    var = "AIBRIX_KV_CACHE_OL_TOKEN_VALIDATION_ENABLED"
    with _ENV_LOCK:
        saved = os.environ.get(var)
        os.environ[var] = "0"
        try:
            _import_aibrix()
        finally:
            if saved is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = saved


def _build(key: StoreKey, config: AibrixConfig, timeout_s: float, concurrency: int) -> _Shared:
    """Build the manager of ``key`` with its environment set (under ``_ENV_LOCK``).

    ``concurrency``: blocks that may be in flight at once (calls x blocks per call); the
    allocator gets room for that many (AIBrix sizes it as 3 batches of
    ``max_num_batched_tokens``, rounded up to whole 1 GiB slabs)."""
    env = config.environment(block_bytes=key.block_bytes, timeout_s=timeout_s)
    env["AIBRIX_KV_CACHE_OL_TOKEN_VALIDATION_ENABLED"] = "0"
    try:  # AIBrix makes what is under root with the umask: root itself keeps others out
        os.makedirs(config.root, mode=0o700, exist_ok=True)
    except OSError as e:
        raise StorageError(f"aibrix backend: cannot create root {config.root!r}: {e}") from e
    with _ENV_LOCK:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            ak, cm = _import_aibrix()
            saved_pin = cm.TESTING_DISABLE_PIN_MEMORY
            if not torch.cuda.is_available():
                cm.TESTING_DISABLE_PIN_MEMORY = True  # AIBrix pins through CUDA otherwise
            try:
                spec = ak.KVCacheBlockSpec(
                    block_ntokens=1,
                    block_dtype=torch.uint8,
                    block_layout=ak.KVCacheBlockLayout.NCLD,
                    tensor_spec=ak.KVCacheTensorSpec(
                        heads=[0], layers=[0], head_size=key.block_bytes // 2
                    ),
                )
                batch = max(1, math.ceil(concurrency / 3))
                model = ak.ModelSpec(max_model_len=batch, max_num_batched_tokens=batch)
                manager = ak.BaseKVCacheManager(ak.KVCacheConfig(block_spec=spec, model_spec=model))
            finally:
                cm.TESTING_DISABLE_PIN_MEMORY = saved_pin
        except StorageError:
            raise
        except Exception as e:
            raise StorageError(
                f"aibrix backend: cannot open the {config.connector} store under "
                f"{config.root!r}: {e!r}"
            ) from e
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return _Shared(manager, config, ak.BlockHashes)


def open_manager(
    config: AibrixConfig, block_bytes: int, *, timeout_s: float, concurrency: int
) -> AibrixManager:
    """A reference to the process's manager for ``config``'s store and ``block_bytes``
    (built now if it is the first); :meth:`AibrixManager.close` drops it. A store opened
    earlier with other AIBrix settings (ttl, op_batch, async_workers) is refused
    (StorageError naming them): one process has one manager per store."""
    key = StoreKey(config.connector, config.root, config.aibrix_namespace, block_bytes)
    with _POOL_LOCK:
        shared = _POOL.get(key)
        if shared is None:
            shared = _build(key, config, timeout_s, concurrency)
            _POOL[key] = shared
        elif shared.config != config:
            raise StorageError(
                f"aibrix backend: the {config.connector} store under {config.root!r} is open "
                f"in this process with other settings ({shared.config}); one process uses "
                f"one set per store, got {config}"
            )
        shared.refs += 1
    return AibrixManager(key, shared)


class AibrixManager:
    """A counted reference to a shared AIBrix manager; blocking calls (see module doc)."""

    def __init__(self, key: StoreKey, shared: _Shared) -> None:
        self.key = key
        self._shared = shared
        self._closed = False

    @property
    def block_bytes(self) -> int:
        return self.key.block_bytes

    def _hashes(self, keys: Sequence[str]) -> Any:
        return self._shared.block_hashes(list(keys), 1)

    def exists(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first, AIBrix holds."""
        if not keys:
            return 0
        st = self._shared.manager.exists(None, self._hashes(keys))
        if st.is_ok():
            return int(st.value)
        if st.error_code.name == "NOT_FOUND":
            return 0
        raise AibrixCallError("exists", st.error_code.name, str(st.value or ""))

    def exists_probed(self, keys: Sequence[str]) -> int:
        """:meth:`exists`, asking for the first key alone first and for the rest only when
        it is present: AIBrix looks up a whole ``op_batch`` of keys at once (one task
        each, however early a miss), so a run of new keys (a put's usual lookup) costs
        one lookup instead of ``op_batch``; a present run costs one call more."""
        first = self.exists(keys[:1])
        if not first or len(keys) == 1:
            return first
        return 1 + self.exists(keys[1:])

    def get_into(self, keys: Sequence[str], sink: Callable[[int, memoryview], None]) -> GetRun:
        """Read the blocks of ``keys`` (a leading run of them) and hand block ``i``'s bytes
        (a read-only view of :attr:`block_bytes`, valid during the call only) to
        ``sink(i, view)``, in order, before AIBrix's buffers are released."""
        st = self._shared.manager.acquire(None, self._hashes(keys))
        if not st.is_ok():
            return GetRun(0, st.error_code.name)
        n, handle = st.value
        try:
            for i, t in enumerate(handle.to_tensors()[:n]):
                sink(i, byte_view(t.reshape(-1)).toreadonly())
        finally:
            handle.release()
        return GetRun(int(n))

    def allocate(self, keys: Sequence[str]) -> Blocks:
        """AIBrix buffers for the blocks of ``keys``, to fill and then :meth:`put`. For the
        SHFS and ROCKSDB connectors this takes memory from AIBrix's allocator and does no
        IO, so the caller may run it (and fill the blocks) on its own thread."""
        if not keys:
            raise ValueError("allocate needs at least one key")
        hashes = self._hashes(keys)
        st = self._shared.manager.allocate_for(None, hashes)
        if not st.is_ok():
            raise AibrixCallError("allocate", st.error_code.name, str(st.value or ""))
        return Blocks(hashes, st.value)

    def put(self, blocks: Blocks) -> int:
        """Store ``blocks`` (replacing what is there; they are released either way);
        returns how many, from the first, AIBrix reports stored."""
        st = self._shared.manager.put(None, blocks.hashes, blocks.take())
        if not st.is_ok():
            raise AibrixCallError("put", st.error_code.name, str(st.value or ""))
        return int(st.value)

    def put_from(self, keys: Sequence[str], rows: Sequence[bytes | memoryview]) -> int:
        """:meth:`allocate`, fill block ``i`` with ``rows[i]`` (zero-padded), :meth:`put`."""
        if len(keys) != len(rows):
            raise ValueError(f"{len(keys)} keys but {len(rows)} rows")
        blocks = self.allocate(keys)
        try:
            for i, row in enumerate(rows):
                blocks.fill(i, [row])
        except BaseException:
            blocks.release()
            raise
        return self.put(blocks)

    def delete(self, keys: Sequence[str]) -> None:
        """Drop the blocks of ``keys`` (absent ones are ignored)."""
        if keys:
            st = self._shared.manager.delete(None, self._hashes(keys))
            if not st.is_ok() and st.error_code.name != "NOT_FOUND":
                raise AibrixCallError("delete", st.error_code.name, str(st.value or ""))

    def close(self) -> None:
        """Drop this reference; the last one closes the manager (idempotent)."""
        with _POOL_LOCK:
            if self._closed:
                return
            self._closed = True
            self._shared.refs -= 1
            if self._shared.refs > 0:
                return
            if _POOL.get(self.key) is self._shared:
                del _POOL[self.key]
            # closed under the lock (a RocksDB store must be shut before it is reopened),
            # on a daemon thread waited for at most CLOSE_WAIT_S: AIBrix's close joins its
            # connector threads, which a hung disk can hold forever
            closer = threading.Thread(target=self._close_manager, name="aibrix-close", daemon=True)
            closer.start()
            closer.join(CLOSE_WAIT_S)

    def _close_manager(self) -> None:
        with contextlib.suppress(Exception):
            self._shared.manager.close()
