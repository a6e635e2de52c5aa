"""A quarantine for SGLang host pages that a read may still write after it returned.

SGLang frees the host pages of a failed or partial prefetch read at once
(``mem_pool_host.free``) and hands them to the next allocation. A zero-copy get that
overran its deadline (Mooncake, over the pool's registered ``kv_buffer``) goes on writing
those pages until its transfer returns, which would change another request's KV.
:class:`HostQuarantine` closes that hole without staging:

- :meth:`HostQuarantine.hold` marks the host token indices a get reported False for while
  the backend says a late write may still land (``host_writes_settled(0)`` is False).
- It replaces the pool's ``free`` and ``alloc`` on the instance (SGLang calls them through
  the instance, from its scheduler and cache-controller threads): a ``free`` of held
  indices frees the others at once and defers those, which stay allocated in SGLang's
  eyes (``slot_used``), so no ``alloc`` can hand them out.
- :meth:`HostQuarantine.settle` (run at every ``free``, ``alloc`` and get) asks the backend
  again; once it is settled no earlier get can write any page, so every deferred index is
  freed and every hold dropped.

Invariant: an index held is never in the pool's free list until the backend reported
settled after the hold. A page SGLang never frees while held needs nothing: the hold is
just dropped at settle. The pool's own lock is taken inside this one's, never the other
way (``available_size`` is not wrapped: SGLang's ``alloc`` calls it under the pool lock).

Under tensor parallelism, a quarantine makes one rank's host pool show fewer free pages
than the others' until it settles (only after a get overran its deadline on that rank).

No sglang import: the pool is duck-typed (``free(indices) -> int``, ``alloc(n)``).
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
