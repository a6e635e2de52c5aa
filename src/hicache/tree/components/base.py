"""The component seam: what a kind of per-token state stores in a tree node.

A hybrid model keeps several kinds of state per token span in one tree: full-attention KV
(every page), sliding-window KV (only the last window is needed), Mamba state (one state at
a span's end), indexer keys. Each kind is a :class:`TreeComponent`; the tree asks the
components how to split a node's value when the node splits and how to check it.

Only full attention is implemented now; its device and host page lists live directly on
:class:`~hicache.tree.node.TreeNode` (``device`` / ``host``) because every node has them
and they are on the hot path. Other components keep their values in ``node.extra[name]``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar


class TreeComponent(ABC):
    """Rules for one component's per-node value. Stateless; one instance per tree."""

    name: ClassVar[str]

    @abstractmethod
    def split(self, value: Any, at_page: int, num_pages: int) -> tuple[Any, Any]:
        """Split a node value covering ``num_pages`` pages at page ``at_page``.

        Returns ``(head, tail)``: the values of the new parent (pages ``[0, at_page)``) and
        of the remaining child (pages ``[at_page, num_pages)``).
        """

    @abstractmethod
    def check(self, value: Any, num_pages: int) -> None:
        """Raise AssertionError if ``value`` is not a valid value for a node of ``num_pages``."""


class FullAttention(TreeComponent):
    """Full-attention KV: one L1/L2 page id per page of the span, split by slicing."""

    name = "full"

    def split(self, value: Any, at_page: int, num_pages: int) -> tuple[Any, Any]:
        if value is None:
            return None, None
        return value[:at_page], value[at_page:]

    def check(self, value: Any, num_pages: int) -> None:
        if value is not None and len(value) != num_pages:
            raise AssertionError(
                f"full-attention value has {len(value)} pages, span has {num_pages}"
            )
