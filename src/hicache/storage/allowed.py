"""Which namespaces' records one storage instance stores and accepts. Pure.

An instance accepts records of its own namespace and, once allowed, of every allowed
tenant's (``tenant_salt``) namespace with every allowed component (``"mamba"``, ``"swa"``,
...). A record written or read under any other namespace is checked against the
instance's own digest, so it is ``foreign``. Keys of slot components, and of namespaces
allowed whole (an engine's side pool), are one record each, never split per head; under
head records a slot component's namespace is the rank's shard
(:meth:`hicache.keys.Namespace.for_slots`). Sets only grow: nothing allowed is withdrawn.
"""

from __future__ import annotations

from hicache.heads import HeadSplit
from hicache.keys import Namespace, PageKey

__all__ = ["AllowedNamespaces"]


class AllowedNamespaces:
    """The digests of the namespaces an instance of ``namespace`` stores and accepts."""

    def __init__(self, namespace: Namespace) -> None:
        self._namespace = namespace
        self._salts = {namespace.tenant_salt}
        self._components = {namespace.component}
        self._slot_components: set[str] = set()
        self._heads: HeadSplit | None = None
        self._accepted = {namespace.digest}
        self._whole: set[bytes] = set()
        """Digests of namespaces whose records are one per key."""

    def allow_tenant(self, tenant_salt: str) -> None:
        """Accept ``tenant_salt``'s namespace too, for every allowed component."""
        self._salts.add(tenant_salt)
        self._build()

    def allow_component(self, component: str, *, slots: bool = False) -> None:
        """Accept ``component``'s namespace too, for every allowed tenant; ``slots``: its
        records are whole state slots, one per key even under head records."""
        self._components.add(component)
        if slots:
            self._slot_components.add(component)
        self._build()

    def allow_whole(self, namespace: Namespace) -> None:
        """Keys of ``namespace`` are one record each (their records still carry this
        instance's digest)."""
        self._whole.add(namespace.digest)

    def use_heads(self, heads: HeadSplit) -> None:
        """The rank's head split: slot components' namespaces become its shard's too."""
        self._heads = heads
        self._build()

    def digest_of(self, key: PageKey) -> bytes:
        """The namespace digest ``key``'s record must carry: the key's own when its
        namespace is accepted, else this instance's."""
        d = key.namespace_digest
        return d if d in self._accepted else self._namespace.digest

    def whole(self, key: PageKey) -> bool:
        """Whether ``key``'s record is one per key, never split per head."""
        return key.namespace_digest in self._whole

    def _build(self) -> None:
        ns, heads = self._namespace, self._heads
        for s in self._salts:
            for c in self._components:
                component = ns.with_salt(s).with_component(c)
                if c in self._slot_components:  # one rank's shard of whole slots
                    if heads is not None:
                        component = component.for_slots(heads.tp_size, heads.tp_rank)
                    self._whole.add(component.digest)
                self._accepted.add(component.digest)
