"""The tree's residency changes as KV event records, kept until the owner drains them.

:class:`ResidencyRecorder` is the :class:`~hicache.tree.residency.ResidencyObserver` the
owner attaches to its cache (``HiCache.observe_residency``). It runs in the owner's
thread, inside tree mutations, and only appends immutable records; the owner takes them
with :meth:`ResidencyRecorder.drain` at one point per step and publishes them to the hub.

Semantics: a node's pages are *stored* when it gets its first tier (L1 or L2) and
*removed* when it loses its last, with the medium it was stored with, so a prefix
demoted from L1 to L2 stays reported; a tree reset is ``AllBlocksCleared``. Each
resident node keeps its pages' digests here (32 bytes a page) so children chain on them
without rehashing the path.
"""

from __future__ import annotations

from dataclasses import dataclass

from hicache.kv_events.hashing import chain_digests, event_hash, salt_seed
from hicache.kv_events.records import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    Medium,
)
from hicache.tokens import TOKEN_BYTES, decode_tokens
from hicache.tree.node import TreeNode

__all__ = ["ResidencyRecorder"]


@dataclass(slots=True)
class _Resident:
    """A resident node's page digests (one per page) and the medium it was stored with."""

    digests: list[bytes]
    medium: Medium


class ResidencyRecorder:
    """Records :class:`BlockStored` / :class:`BlockRemoved` / :class:`AllBlocksCleared`
    for the nodes of one tree whose pages are ``page_size`` tokens."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._page_bytes = page_size * TOKEN_BYTES
        self._resident: dict[int, _Resident] = {}
        self._pending: list[KvEvent] = []

    # ------------------------------------------------------------------ observer

    def resident(self, node: TreeNode) -> None:
        """Record ``node``'s pages as stored, in the tier it holds (L1 first)."""
        prior = self._chain_end(node.parent)
        digests = chain_digests(prior, node.key, self._page_bytes)
        if not digests:
            return
        medium = Medium.DEVICE if node.device is not None else Medium.HOST
        self._resident[node.id] = _Resident(digests, medium)
        self._pending.append(
            BlockStored(
                block_hashes=tuple(event_hash(d) for d in digests),
                parent_block_hash=None
                if prior is None or _is_root(node.parent)
                else event_hash(prior),
                token_ids=tuple(decode_tokens(node.key)),
                block_size=self.page_size,
                medium=medium,
                cache_salt=node.tenant or None,
            )
        )

    def left(self, node: TreeNode) -> None:
        """Record ``node``'s pages as removed (with the medium they were stored with)."""
        entry = self._resident.pop(node.id, None)
        if entry is not None:
            hashes = tuple(event_hash(d) for d in entry.digests)
            self._pending.append(BlockRemoved(block_hashes=hashes, medium=entry.medium))

    def split(self, head: TreeNode, child: TreeNode, at_page: int) -> None:
        """Move the first ``at_page`` digests of ``child`` to ``head`` (no event: the
        pages and their hashes stay as they were)."""
        entry = self._resident.get(child.id)
        if entry is not None:
            self._resident[head.id] = _Resident(entry.digests[:at_page], entry.medium)
            entry.digests = entry.digests[at_page:]

    def cleared(self) -> None:
        """Record that every page left (a reset)."""
        self._resident.clear()
        self._pending.append(AllBlocksCleared())

    # ------------------------------------------------------------------ owner

    def drain(self) -> tuple[KvEvent, ...]:
        """The events recorded since the last drain, in order; forgets them."""
        if not self._pending:
            return ()
        events = tuple(self._pending)
        self._pending.clear()
        return events

    @property
    def resident_pages(self) -> int:
        """Pages currently reported resident."""
        return sum(len(r.digests) for r in self._resident.values())

    # ------------------------------------------------------------------ internals

    def _chain_end(self, node: TreeNode | None) -> bytes | None:
        """The digest of ``node``'s last page: the tenant's seed for a root."""
        if node is None:
            return None
        if _is_root(node):
            return salt_seed(node.tenant)
        entry = self._resident.get(node.id)
        if entry is not None and entry.digests:
            return entry.digests[-1]
        # Not resident (contiguity makes this rare): hash its path from the root.
        digests = chain_digests(self._chain_end(node.parent), node.key, self._page_bytes)
        return digests[-1] if digests else self._chain_end(node.parent)


def _is_root(node: TreeNode | None) -> bool:
    return node is not None and node.parent is None
