"""NIXL plumbing of the ``nixl`` L3 backend: one agent with the POSIX plugin, its host
memory registrations, and blocking transfers between host memory and open files.

NIXL (``nixl==1.5.1`` with ``nixl-cu12``) pairs ``DRAM`` descriptors ``(address, bytes, 0)``
in registered host memory one to one with ``FILE`` descriptors ``(file offset, bytes, fd)``;
the POSIX plugin serves a transfer as one batch of AIO / io_uring / POSIX AIO reads or
writes (``posix_io``). Facts it rests on (1.5.1): a host range must lie in registered
memory and its fd be registered as ``FILE`` (bookkeeping, no IO; the caller closes the fd
after deregistering); a transfer progresses only when polled (``check_xfer_state``) and
ends ``DONE`` or with one error for the whole transfer; releasing a handle while kernel IO
may still complete into it is unsafe. Invariant: a handle is released only after its
transfer ended, never at a deadline, so :meth:`PosixAgent.transfer` blocks and the backend
bounds it on a :class:`~hicache.storage.deadline.DeadlineRunner` (the agent uses NIXL's
reader-writer thread sync, so its workers transfer concurrently).
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from hicache.storage.base import StorageError

__all__ = ["INSTALL_HINT", "NixlError", "PosixAgent", "require_nixl"]

INSTALL_HINT = (
    "pip install --no-deps -r requirements/nixl.txt (nixl==1.5.1 and nixl-cu12==1.5.1; "
    "`make venv` does it)"
)
"""What to install when NIXL does not import."""

_SPINS = 200
"""Polls of a transfer before the poll loop starts sleeping between polls."""
_NAP_S = (20e-6, 1e-3)
"""First and longest sleep between polls, seconds (doubling)."""


class NixlError(RuntimeError):
    """A NIXL registration or transfer failed (the message says which and why)."""


def require_nixl() -> Any:
    """The ``nixl._api`` module; :class:`StorageError` naming what to install when NIXL
    (or a library it loads) does not import.

    NIXL's Python logger (``nixl``) prints INFO lines to stdout (one per agent made); it is
    set to WARNING here unless ``NIXL_LOG_LEVEL`` chooses a level."""
    try:
        api = importlib.import_module("nixl._api")
    except Exception as e:  # ImportError, or OSError from a missing shared library
        raise StorageError(f"nixl backend needs NIXL: {INSTALL_HINT}; import failed: {e!r}") from e
    if not os.environ.get("NIXL_LOG_LEVEL"):
        logging.getLogger("nixl").setLevel(logging.WARNING)
    return api


def _rows(rows: Sequence[tuple[int, ...]]) -> np.ndarray:
    """An ``(N, 3)`` uint64 array of descriptor rows (NIXL's fast path for long lists)."""
    return np.asarray(rows, dtype=np.uint64).reshape(len(rows), 3)


class PosixAgent:
    """A NIXL agent with the POSIX plugin; thread-safe.

    Raises :class:`StorageError` when NIXL has no POSIX plugin or it does not start with
    ``params`` (its init parameters, e.g. ``{"use_aio": "true"}``).
    """

    def __init__(self, api: Any, params: Mapping[str, str], name: str = "") -> None:
        self.name = name or f"hicache-l3-{uuid.uuid4().hex[:12]}"
        sync = api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW
        config = api.nixl_agent_config(enable_prog_thread=False, backends=[], sync_mode=sync)
        try:
            agent = api.nixl_agent(self.name, config)
        except Exception as e:
            raise StorageError(f"nixl backend: cannot create a NIXL agent: {e!r}") from e
        plugins = list(agent.get_plugin_list())
        if "POSIX" not in plugins:
            raise StorageError(
                f"nixl backend: NIXL has no POSIX plugin (found {plugins}); reinstall NIXL: "
                f"{INSTALL_HINT}"
            )
        try:
            agent.create_backend("POSIX", dict(params))
        except Exception as e:
            raise StorageError(
                f"nixl backend: NIXL's POSIX plugin did not start with {dict(params)}: {e!r}"
            ) from e
        self._agent = agent
        self._lock = threading.Lock()
        self._dram: dict[int, Any] = {}
        """Registered host ranges: address -> NIXL's registration list (to deregister)."""

    # -- host memory -------------------------------------------------------------------------
    def register(self, ptr: int, nbytes: int) -> None:
        """Register host memory ``[ptr, ptr + nbytes)`` as ``DRAM`` (once per address: a
        new registration of the same address replaces the old one)."""
        try:
            reg = self._agent.register_memory(_rows([(ptr, nbytes, 0)]), "DRAM")
        except Exception as e:
            raise NixlError(f"registering {nbytes} bytes of host memory failed: {e!r}") from e
        with self._lock:
            old = self._dram.pop(ptr, None)
            self._dram[ptr] = reg
        if old is not None:
            self._deregister(old)

    def deregister(self, ptr: int) -> None:
        """Deregister the host memory registered at ``ptr`` (no-op if none)."""
        with self._lock:
            reg = self._dram.pop(ptr, None)
        if reg is not None:
            self._deregister(reg)

    def _deregister(self, reg: Any) -> None:
        try:
            self._agent.deregister_memory(reg)
        except Exception as e:
            raise NixlError(f"deregistering host memory failed: {e!r}") from e

    def close(self) -> None:
        """Deregister every host range (the agent itself goes with its last reference)."""
        with self._lock:
            regs, self._dram = list(self._dram.values()), {}
        for reg in regs:
            self._deregister(reg)

    # -- transfers ---------------------------------------------------------------------------
    def transfer(
        self, op: str, dram: Sequence[tuple[int, int]], files: Sequence[tuple[int, int, int]]
    ) -> None:
        """Move bytes between host ranges ``dram[k] = (address, bytes)`` and file ranges
        ``files[k] = (offset, bytes, fd)``: ``op`` ``"READ"`` fills the host ranges from
        the files, ``"WRITE"`` writes them to the files. Blocks until the transfer ended
        (its fds registered for the call and deregistered after); raises
        :class:`NixlError` when it failed (then any of its ranges may be partly written).
        """
        if op not in ("READ", "WRITE"):
            raise ValueError(f"op={op!r} is invalid; must be 'READ' or 'WRITE'")
        if len(dram) != len(files):
            raise ValueError(f"{len(dram)} host ranges but {len(files)} file ranges")
        if not files:
            return
        extent: dict[int, int] = {}
        for off, n, fd in files:
            extent[fd] = max(extent.get(fd, 0), off + n)
        agent = self._agent
        try:
            freg = agent.register_memory(
                _rows([(0, end, fd) for fd, end in extent.items()]), "FILE"
            )
        except Exception as e:
            raise NixlError(f"registering {len(extent)} file(s) failed: {e!r}") from e
        try:
            try:
                local = agent.get_xfer_descs(_rows([(a, n, 0) for a, n in dram]), "DRAM")
                remote = agent.get_xfer_descs(_rows(files), "FILE")
                handle = agent.initialize_xfer(op, local, remote, agent.name)
            except Exception as e:
                raise NixlError(f"preparing a {op} of {len(files)} range(s) failed: {e!r}") from e
            try:
                self._run(op, handle, len(files))
            finally:
                handle.release()
        finally:
            try:
                agent.deregister_memory(freg)
            except Exception as e:  # the transfer's outcome stands; say what leaked
                raise NixlError(f"deregistering {len(extent)} file(s) failed: {e!r}") from e

    def _run(self, op: str, handle: Any, n: int) -> None:
        """Post ``handle`` and poll it until it ends; NixlError unless it ended ``DONE``."""
        agent = self._agent
        try:
            state = agent.transfer(handle)
            spins, nap = 0, _NAP_S[0]
            while state == "PROC":
                if spins < _SPINS:
                    spins += 1
                else:
                    time.sleep(nap)
                    nap = min(nap * 2, _NAP_S[1])
                state = agent.check_xfer_state(handle)
        except Exception as e:
            raise NixlError(f"{op} of {n} range(s) failed: {e!r}") from e
        if state != "DONE":
            raise NixlError(f"{op} of {n} range(s) ended {state}")
