"""A quarantine for SGLang host pages that a read may still write after it returned.

SGLang frees the host pages of a failed prefetch read at once, while a zero-copy get that
overran its deadline may still write them. :class:`HostQuarantine` replaces the pool's
``free`` and ``alloc`` on the instance: :meth:`~HostQuarantine.hold` marks the host token
indices a get reported False for while ``host_writes_settled(0)`` is False; a ``free`` of
held indices defers those (they stay allocated in SGLang's eyes, ``slot_used``);
:meth:`~HostQuarantine.settle` (at every ``free``, ``alloc`` and get) frees every deferred
index and drops every hold once the backend is settled. Invariants: an index held is never
in the pool's free list until the backend reported settled after the hold; the pool's own
lock is taken inside this one's, never the other way (``available_size`` is not wrapped).
Under tensor parallelism one rank's pool may show fewer free pages until it settles. No
sglang import: the pool is duck-typed (``free(indices) -> int``, ``alloc(n)``). Why:
``docs/integrations.md``, "SGLang".
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["HostQuarantine"]


class HostQuarantine:
    """Defers SGLang host-pool frees of indices a late read may still write (see module).

    ``settled()``: True once no earlier get of the backend can write a host page any more
    (``HiCacheStorage.host_writes_settled(0)``). Nothing is wrapped until :meth:`install`.
    """

    def __init__(self, pool: Any, settled: Callable[[], bool]) -> None:
        self.pool = pool
        self._settled = settled
        self._free: Callable[..., int] = pool.free
        self._alloc: Callable[..., Any] = pool.alloc
        self._lock = threading.Lock()
        self._held: torch.Tensor | None = None
        """Held token indices (int64, unique), or None when nothing is held."""
        self._deferred: list[torch.Tensor] = []
        self._installed = False

    # -- wiring ------------------------------------------------------------------------------
    def install(self) -> None:
        """Replace the pool's ``free`` and ``alloc`` with this quarantine's (idempotent)."""
        if not self._installed:
            self.pool.free = self.free
            self.pool.alloc = self.alloc
            self._installed = True

    # -- state -------------------------------------------------------------------------------
    @property
    def held(self) -> list[int]:
        """The held host token indices, ascending."""
        with self._lock:
            return [] if self._held is None else sorted(self._held.tolist())

    @property
    def deferred(self) -> list[int]:
        """Host token indices SGLang freed that are not back in its free list yet, ascending."""
        with self._lock:
            return sorted(i for d in self._deferred for i in d.tolist())

    # -- operations --------------------------------------------------------------------------
    def hold(self, indices: torch.Tensor) -> None:
        """Keep ``indices`` (host token indices of a get's failed pages) out of the free list
        until :meth:`settle` finds the backend settled."""
        idx = indices.detach().to("cpu", torch.int64).reshape(-1)
        if idx.numel() == 0:
            return
        with self._lock:
            self._held = (
                idx.unique() if self._held is None else torch.cat([self._held, idx]).unique()
            )

    def settle(self) -> bool:
        """Free every deferred index and drop every hold if the backend is settled; True
        when nothing is held afterwards."""
        with self._lock:
            return self._settle_locked()

    def _settle_locked(self) -> bool:
        if self._held is None:
            return True
        if not self._settled():
            return False
        deferred, self._deferred, self._held = self._deferred, [], None
        if deferred:
            self._free(torch.cat(deferred))
        return True

    def free(self, indices: torch.Tensor, *args: Any, **kwargs: Any) -> int:
        """SGLang's ``free``: indices not held go back at once, held ones are deferred.
        Returns ``len(indices)``, as SGLang's does. A call with other arguments than the
        indices (not the KV pool's own signature) passes straight through."""
        if args or kwargs:
            return int(self._free(indices, *args, **kwargs))
        with self._lock:
            if self._settle_locked():
                return int(self._free(indices))
            assert self._held is not None
            idx = indices.detach().cpu()
            mask = torch.isin(idx, self._held)
            if not bool(mask.any()):
                return int(self._free(indices))
            self._deferred.append(idx[mask].to(torch.int64))
            rest = idx[~mask]
            if rest.numel():
                self._free(rest)
            return len(indices)

    def alloc(self, *args: Any, **kwargs: Any) -> Any:
        """SGLang's ``alloc``, after giving back whatever has settled."""
        self.settle()
        return self._alloc(*args, **kwargs)
