"""This rank's L3 keys: the namespace per tenant and component, and whether it writes.

:class:`TierKeys` keys the whole pages of a prompt (:func:`~hicache.keys.page_keys`)
under the attached namespace salted with a tenant's ``cache_salt`` and set to a
component's records; state-slot components are recorded per rank
(:meth:`~hicache.keys.Namespace.for_slots`). It also gives the previous key spec's key of
a page (probed on a lookup that finds nothing) and says which ranks write.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from hicache.cache.components.records import ComponentRecords
from hicache.controller.rank_group import RankGroup
from hicache.keys import FULL_COMPONENT, HEAD_RECORDS, Namespace, PageKey, PreviousPage, page_keys
from hicache.memory.state_pool import StatePool
from hicache.storage.base import HiCacheStorage
from hicache.tokens import TOKEN_BYTES

__all__ = ["MAX_TENANT_NAMESPACES", "TierKeys"]

MAX_TENANT_NAMESPACES = 1024
"""Salted namespaces kept ready (least recently used beyond this are rebuilt on demand)."""


class TierKeys:
    """The keys of one attached L3 tier on this rank (``namespace``: the shared one)."""

    def __init__(
        self,
        *,
        storage: HiCacheStorage,
        namespace: Namespace,
        ranks: RankGroup,
        page_size: int,
        components: Sequence[ComponentRecords],
    ) -> None:
        self.namespace = namespace
        self.page_size = page_size
        self._storage = storage
        self._ranks = ranks
        self._tenants: OrderedDict[tuple[str, str], Namespace] = OrderedDict()
        if namespace.records == HEAD_RECORDS:
            self.writer = storage.writes_pages
        else:
            self.writer = namespace.tp_rank is not None or ranks.rank == 0
        """Whether this rank writes L3 (head records: a rank holding K/V heads no lower rank
        holds, :meth:`~hicache.heads.HeadSplit.writes_any`; page records per rank: every
        rank its shard; MLA: rank 0 alone, whose writes every rank's lookups see: all ranks
        read one namespace)."""
        if namespace.records == HEAD_RECORDS:  # the previous spec: one record per rank
            self._previous_tp: tuple[int, int | None] = (ranks.size, ranks.rank)
        else:
            self._previous_tp = (namespace.tp_size, namespace.tp_rank)
        """The TP fields this rank's namespace had under the previous key spec."""
        self._previous_digests: dict[str, bytes] = {}
        """Each tenant's namespace digest under the previous key spec."""
        self.slot_components = frozenset(
            c.name for c in components if isinstance(c.pool, StatePool) or c.whole
        )
        """Components recorded whole per key (a state slot, or a page of a component whose
        payload does not follow the K/V heads: ``ComponentRecords.whole``): one rank's
        shard, per rank (:meth:`~hicache.keys.Namespace.for_slots`)."""
        for c in components:
            storage.allow_component(c.name, slots=c.name in self.slot_components)

    def of(self, key: bytes, tenant: str = "", component: str = FULL_COMPONENT) -> list[PageKey]:
        """L3 keys of the whole pages of the encoded tokens ``key``, under ``tenant``'s
        namespace (the shared one salted with the tenant's ``cache_salt``) for
        ``component``'s records (``"mamba"``: the snapshot after each page)."""
        return page_keys(self._namespace_of(tenant, component), key, self.page_size)

    def sends(self, component: str) -> bool:
        """Whether this rank sends ``component``'s writes: a writer always; under head
        records every rank its state-slot records too (each holds its own shard of the
        state, per rank, :meth:`~hicache.keys.Namespace.for_slots`, whether or not a lower
        rank holds its K/V heads)."""
        return self.writer or (
            component in self.slot_components and self.namespace.records == HEAD_RECORDS
        )

    def previous_page(self, key: bytes, tenant: str, pages: int) -> PreviousPage:
        """The previous key spec's key of page ``pages`` of ``key`` under ``tenant``'s
        namespace as this rank had it, unhashed (probed, and hashed then, on a lookup that
        finds nothing)."""
        digest = self._previous_digests.get(tenant)
        if digest is None:
            digest = self._namespace_of(tenant).previous_digest(*self._previous_tp)
            if len(self._previous_digests) >= MAX_TENANT_NAMESPACES:
                self._previous_digests.clear()
            self._previous_digests[tenant] = digest
        return PreviousPage(digest, key[: pages * self.page_size * TOKEN_BYTES], self.page_size)

    def _namespace_of(self, tenant: str, component: str = FULL_COMPONENT) -> Namespace:
        if not tenant and component == self.namespace.component:
            return self.namespace
        found = self._tenants.get((tenant, component))
        if found is not None:
            self._tenants.move_to_end((tenant, component))
            return found
        found = self.namespace.with_salt(tenant).with_component(component)
        if component in self.slot_components:
            found = found.for_slots(self._ranks.size, self._ranks.rank)
        if tenant:
            self._storage.allow_tenant(tenant)
        self._tenants[(tenant, component)] = found
        if len(self._tenants) > MAX_TENANT_NAMESPACES:
            self._tenants.popitem(last=False)
        return found
