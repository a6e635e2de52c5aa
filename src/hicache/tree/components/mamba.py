"""Mamba / linear-attention state: one state snapshot per cached boundary.

A recurrent layer's state after a prefix is one fixed-size slot (SSM or Gated DeltaNet
state plus conv state) in a state pool (L1 and L2). A node's value is the slot holding
the state at the *end* of its span; most nodes have none (snapshots are taken at chosen
chunk ends and at the end of each request). A match may end only at a node whose snapshot
is in some tier (L1 for an L1 hit): prefill resumes from that state. A split leaves the
snapshot on the tail (it is the state at the tail's end); the new head has none.
"""

from __future__ import annotations

from typing import ClassVar

from hicache.tree.components.base import Granularity, MatchValidator, TreeComponent

__all__ = ["MambaState"]


class MambaState(TreeComponent):
    """One state slot per boundary (``Granularity.BOUNDARY``)."""

    name: ClassVar[str] = "mamba"
    granularity: ClassVar[Granularity] = Granularity.BOUNDARY

    def validator(self, *, device_only: bool) -> MatchValidator:
        return lambda node: self.present(node, device_only=device_only)

    def hit_span(self, depth_pages: int, page_size: int) -> int:
        return 0
