"""Registered memory for address-based backends (Mooncake): buffers and staging arenas.

:class:`BufferRegistry` remembers which address ranges the client has registered (a host
pool's buffer once, on first use; forgotten and unregistered when the pool is freed, since
its memory may be reused). A backend that moves bytes by address needs them in registered memory: record headers of
a zero-copy call, or whole records when it stages. An :class:`_Arena` is shared by the
caller and the one call that uses it (reference count 2); it goes back to the pool only when
both are done, so a call that overran its deadline never sees its buffer reused.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

import torch

from hicache.memory import HostPool

__all__ = ["Arena", "ArenaPool", "BufferRegistry"]


class Arena:
    """A registered uint8 buffer shared by a caller and one in-flight call (refcount 2)."""

    def __init__(self, pool: ArenaPool, tensor: torch.Tensor) -> None:
        self.pool = pool
        self.tensor = tensor
        self._refs = 2
        self._lock = threading.Lock()

    @property
    def addr(self) -> int:
        return int(self.tensor.data_ptr())

    def release(self) -> None:
        with self._lock:
            self._refs -= 1
            done = self._refs == 0
        if done:
            self.pool.give_back(self.tensor)


class ArenaPool:
    """Registered staging buffers, reused; one still used by a stuck call is not reused."""

    def __init__(self, register: Callable[[torch.Tensor], bool]) -> None:
        self._register = register
        self._free: list[torch.Tensor] = []
        # every buffer ever registered, held for the pool's life: registered memory must
        # outlive its registration, even a buffer whose arena was dropped unreleased
        self._all: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> Arena | None:
        """An arena of at least ``nbytes`` bytes, or None if registration failed."""
        with self._lock:
            for i, t in enumerate(self._free):
                if t.numel() >= nbytes:
                    return Arena(self, self._free.pop(i))
        # zeroed: registered memory is readable by transfer-engine peers, and recycled heap
        # memory would show them whatever this process kept there before (log text, ...)
        t = torch.zeros(max(nbytes, 4096), dtype=torch.uint8)
        if not self._register(t):
            return None
        with self._lock:
            self._all.append(t)
        return Arena(self, t)

    def give_back(self, t: torch.Tensor) -> None:
        with self._lock:
            self._free.append(t)


class BufferRegistry:
    """Registered ``ptr -> nbytes`` ranges; ``register(ptr, nbytes) -> ok`` does the work."""

    def __init__(
        self, register: Callable[[int, int], bool], unregister: Callable[[int], None]
    ) -> None:
        self._register = register
        self._unregister = unregister
        self._ranges: dict[int, int] = {}
        self._lock = threading.Lock()

    def ensure(self, ptr: int, nbytes: int) -> bool:
        """Register ``[ptr, ptr + nbytes)`` unless already covered; False if that failed."""
        with self._lock:
            if self._ranges.get(ptr, -1) >= nbytes:
                return True
        if not self._register(ptr, nbytes):
            return False
        with self._lock:
            self._ranges[ptr] = nbytes
        return True

    def ensure_tensor(self, t: torch.Tensor) -> bool:
        return self.ensure(int(t.data_ptr()), t.numel() * t.element_size())

    def ensure_pool(self, host: HostPool) -> bool:
        """Register a host pool's buffer; it is forgotten (and unregistered) when freed."""
        return self.ensure_owned(host.buffer)

    def ensure_owned(self, buf: torch.Tensor) -> bool:
        """Register ``buf`` (a long-lived tensor: a pool's buffer, hicache's or an engine's);
        it is forgotten (and unregistered) when ``buf`` is freed."""
        ptr = int(buf.data_ptr())
        with self._lock:
            known = ptr in self._ranges
        ok = self.ensure_tensor(buf)
        if ok and not known:
            weakref.finalize(buf, self.forget, ptr)
        return ok

    def forget(self, ptr: int) -> None:
        with self._lock:
            known = self._ranges.pop(ptr, None) is not None
        if known:
            self._unregister(ptr)

    def ranges(self) -> dict[int, int]:
        """A copy of the registered ``ptr -> nbytes`` ranges."""
        with self._lock:
            return dict(self._ranges)

    def drain(self) -> list[int]:
        """Forget every range; returns their addresses (for unregistering at close)."""
        with self._lock:
            ptrs, self._ranges = list(self._ranges), {}
        return ptrs
