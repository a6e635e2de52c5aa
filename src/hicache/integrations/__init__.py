"""hicache's L3 inside other serving engines and caches.

Each submodule adapts one outside interface and imports that project's package only when
it is itself imported, so hicache runs without any of them installed:

- :mod:`hicache.integrations.sglang`: an SGLang ``HiCacheStorage`` backend over hicache's
  L3 backends (``--hicache-storage-backend dynamic``).
- :mod:`hicache.integrations.vllm`: a secondary tier of vLLM's offloading connector
  (``TieringOffloadingSpec``) over hicache's L3 backends.

See ``docs/integrations.md``.
"""
