"""hicache's L3 as a secondary tier of vLLM's offloading connector: :class:`HiCacheTier`.

vLLM loads it from ``"secondary_tiers": [{"type": "HiCacheTier", "module_path":
"hicache.integrations.vllm", "hicache_backend": ..., ...}]`` in the ``TieringOffloadingSpec``
extra config (see docs/integrations.md). ``HiCacheTier`` is imported on first access
(vLLM's factory does ``getattr(module, "HiCacheTier")``), which imports vllm; the
submodules below but ``tier`` do not, and neither does ``import hicache``.

- :mod:`~hicache.integrations.vllm.settings`: a tier config -> hicache's backend choice;
- :mod:`~hicache.integrations.vllm.namespace`: the namespace of vLLM's chunks, offload
  keys as hicache keys;
- :mod:`~hicache.integrations.vllm.rows`: record payloads over the primary tier's rows;
- :mod:`~hicache.integrations.vllm.transfers`: the IO thread and its completion records;
- :mod:`~hicache.integrations.vllm.tier`: the tier class.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hicache.integrations.vllm.tier import HiCacheTier

__all__ = ["HiCacheTier"]


def __getattr__(name: str) -> Any:
    if name == "HiCacheTier":
        from hicache.integrations.vllm.tier import HiCacheTier

        return HiCacheTier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
