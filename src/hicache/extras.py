"""Per-sequence records that travel between the cache and the model runner.

The scheduler carries them untouched: what the runner kept of a sequence during a forward
(``ModelRunner.take_extras``) goes to the cache (``HiCache.commit(..., extras=)``, with
the pages or without), and what a sequence resumes from (``CacheRequest.take_resume``) goes
to the runner (``ModelRunner.resume``). Which positions the runner keeps is the cache's
plan for the forward (``HiCache.plan_chunk``). Only the cache's component stores and the
runner read the contents; neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["KeptState", "SequenceExtras"]


@dataclass(frozen=True, slots=True)
class KeptState:
    """A sequence's carried state after its first ``tokens`` positions, in the canonical
    form of a cache state slot: one ``(1, L, *shape)`` tensor per state tensor, ``L`` the
    stateful layers in layer order (:mod:`hicache.runner.recurrent_states`)."""

    tokens: int
    tensors: tuple[torch.Tensor, ...]

    def __post_init__(self) -> None:
        if self.tokens < 1:
            raise ValueError(f"a kept state covers at least 1 position, got tokens={self.tokens}")


@dataclass(frozen=True, slots=True)
class SequenceExtras:
    """What one sequence carries besides its KV: ``states`` kept at distinct positions,
    ascending."""

    states: tuple[KeptState, ...] = ()

    def __post_init__(self) -> None:
        at = [s.tokens for s in self.states]
        if at != sorted(set(at)):
            raise ValueError(f"kept states must be at distinct ascending positions, got {at}")
