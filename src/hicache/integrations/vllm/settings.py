"""A vLLM tier config -> hicache's L3 choice (:class:`VllmTierSettings`).

vLLM's ``TieringOffloadingSpec`` builds each entry of ``secondary_tiers`` by calling the
tier class with the entry's keys as keyword arguments, less ``type``, ``module_path`` and
``backpressure`` (which vLLM reads itself). The keys left are vLLM's, passed through
(:data:`VLLM_KEYS`: ``locality``, ``"LOCAL"`` / ``"REMOTE"``), this integration's and the
backend's (:mod:`hicache.integrations.l3_choice`). Pure: no vllm import, no IO.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hicache.integrations.l3_choice import L3Choice

__all__ = ["LOCALITIES", "VLLM_KEYS", "VllmTierSettings"]

VLLM_KEYS: tuple[str, ...] = ("locality",)
"""Tier keys vLLM defines for every tier (the factory passes them on)."""

LOCALITIES: tuple[str, ...] = ("LOCAL", "REMOTE")
"""vLLM's ``Locality`` values."""


@dataclass(frozen=True, kw_only=True)
class VllmTierSettings(L3Choice):
    """The validated hicache side of one vLLM tier config (``model`` None: vLLM's).
    ``locality``: one of :data:`LOCALITIES` or None (vLLM: unknown)."""

    locality: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.locality is not None and self.locality not in LOCALITIES:
            raise ValueError(
                f"locality={self.locality!r} is invalid; choose one of {list(LOCALITIES)}"
            )

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> VllmTierSettings:
        """Split and validate a tier's keyword arguments; ValueError as
        :meth:`L3Choice.fields_of` says, or for a bad ``locality``."""
        raw = dict(params)
        fields = cls.fields_of(raw, who="hicache vLLM tier", engine="vLLM", engine_keys=VLLM_KEYS)
        return cls(**fields, locality=raw.get("locality"))
