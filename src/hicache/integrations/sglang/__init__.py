"""hicache's L3 as an SGLang storage backend: :class:`HiCacheL3`.

Load it with ``--hicache-storage-backend dynamic`` and the extra config
``{"backend_name": "hicache", "module_path": "hicache.integrations.sglang",
"class_name": "HiCacheL3", "interface_v1": 1, "hicache_backend": ..., ...}`` (see
docs/integrations.md). Importing this package imports sglang; ``import hicache`` does not.

- :mod:`~hicache.integrations.sglang.settings`: the extra config -> hicache's backend choice;
- :mod:`~hicache.integrations.sglang.namespace`: the namespace of an SGLang pool, SGLang
  page hashes as hicache keys;
- :mod:`~hicache.integrations.sglang.pages`: record payloads over SGLang host pages;
- :mod:`~hicache.integrations.sglang.backend`: the backend class.
"""

from hicache.integrations.sglang.backend import HiCacheL3

__all__ = ["HiCacheL3"]
