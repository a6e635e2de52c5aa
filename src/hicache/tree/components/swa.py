"""Sliding-window KV: only the last ``window`` tokens of a sequence are needed.

The SWA layers' pages live in their own pools (own allocators, own ids), one id per page
of a node, like full KV. A node's SWA value is dropped (a *tombstone*: ``None`` in that
tier) when it falls out of every live request's window or is evicted under the SWA pool's
own budget, while the node's full-attention pages stay.

A match may end at a node only if the SWA KV of the ``window`` tokens before its end is
present in some tier (L1 or L2; L1 only for an L1 hit): the nodes just above the boundary
must hold SWA values without a gap over at least ``window`` tokens, or up to the root.
That is ``ceil(window / page_size)`` pages (whole pages: a superset of what a layer that
attends to the previous ``window - 1`` tokens reads). Pins, load back and backup cover
exactly those pages (:meth:`SlidingWindow.hit_span`): a hit at a node pins its window,
and nothing above it.
"""

from __future__ import annotations

import math
from typing import ClassVar

from hicache.tokens import TOKEN_BYTES
from hicache.tree.components.base import Granularity, MatchValidator, TreeComponent
from hicache.tree.node import TreeNode
from hicache.validate import int_at_least

__all__ = ["SlidingWindow"]


class SlidingWindow(TreeComponent):
    """Sliding-window KV pages, ``window`` tokens per sequence (>= 1)."""

    name: ClassVar[str] = "swa"
    granularity: ClassVar[Granularity] = Granularity.PAGE

    def __init__(self, window: int) -> None:
        int_at_least("window", window, 1, "(tokens)")
        self.window = window

    def window_pages(self, page_size: int) -> int:
        """Pages a hit needs: ``ceil(window / page_size)``."""
        return math.ceil(self.window / page_size)

    def validator(self, *, device_only: bool) -> MatchValidator:
        window = self.window
        run = math.inf  # tokens of SWA values without a gap up to here; from the root: all

        def valid(node: TreeNode) -> bool:
            nonlocal run
            if self.present(node, device_only=device_only):
                run += len(node.key) // TOKEN_BYTES
            else:
                run = 0
            return run >= window

        return valid

    def hit_span(self, depth_pages: int, page_size: int) -> int:
        return min(self.window_pages(page_size), depth_pages)

    def __repr__(self) -> str:
        return f"SlidingWindow(window={self.window})"
