"""hicache's L3 as a secondary tier of vLLM's offloading connector: :class:`HiCacheTier`.

vLLM loads it from ``"secondary_tiers": [{"type": "HiCacheTier", "module_path":
"hicache.integrations.vllm", "hicache_backend": ..., ...}]`` in the ``TieringOffloadingSpec``
extra config (see docs/integrations.md). Importing this package imports vllm; ``import
hicache`` does not.

- :mod:`~hicache.integrations.vllm.settings`: a tier config -> hicache's backend choice;
- :mod:`~hicache.integrations.vllm.namespace`: the namespace of vLLM's chunks, offload
  keys as hicache keys;
- :mod:`~hicache.integrations.vllm.rows`: record payloads over the primary tier's rows;
- :mod:`~hicache.integrations.vllm.transfers`: the IO thread and its completion records;
- :mod:`~hicache.integrations.vllm.tier`: the tier class.
"""

from hicache.integrations.vllm.tier import HiCacheTier

__all__ = ["HiCacheTier"]
