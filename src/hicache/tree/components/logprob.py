"""Scoring entries: per-token prompt logprobs on the full KV's page ids, never required.

A node's ``"logprob"`` value in a tier is the *same* page ids as its full KV's, like the
DSA indexer's keys (:class:`~hicache.tree.components.IndexerKeys`), and says that every
token slot of its pages holds its scoring entry (the logprob of the prompt token that
followed it, and the most likely tokens there). Unlike the indexer's keys the entries are
optional: only requests that score a prompt compute them, so a match may end anywhere
(the validator always accepts) and the cache caps a scoring request's match itself where
the entries it needs stop. Pins, eviction and access order are the full KV's.
"""

from __future__ import annotations

from typing import ClassVar

from hicache.tree.components.base import MatchValidator
from hicache.tree.components.indexer import IndexerKeys
from hicache.tree.node import TreeNode

__all__ = ["LogprobEntries"]


class LogprobEntries(IndexerKeys):
    """Scoring entries on the full KV's page ids (``Granularity.PAGE``), never required."""

    name: ClassVar[str] = "logprob"
    optional: ClassVar[bool] = True

    def validator(self, *, device_only: bool) -> MatchValidator:
        """Every node may end a match: a request that does not score needs no entry, and
        one that does is capped by its store (``LogprobStore.cap``)."""

        def valid(node: TreeNode) -> bool:
            return True

        return valid
