"""hicache's L3 as an SGLang storage backend: :class:`HiCacheL3`.

Load it with ``--hicache-storage-backend dynamic`` and the extra config
``{"backend_name": "hicache", "module_path": "hicache.integrations.sglang",
"class_name": "HiCacheL3", "interface_v1": 1, "hicache_backend": ..., ...}`` (see
docs/integrations.md). ``HiCacheL3`` is imported on first access (SGLang's factory does
``getattr(module, "HiCacheL3")``), which imports sglang; the submodules below but
``backend`` do not, and neither does ``import hicache``.

- :mod:`~hicache.integrations.sglang.settings`: the extra config -> hicache's backend choice;
- :mod:`~hicache.integrations.sglang.namespace`: the namespace of an SGLang pool, SGLang
  page hashes as hicache keys;
- :mod:`~hicache.integrations.sglang.pages`: record payloads over SGLang host pages;
- :mod:`~hicache.integrations.sglang.head_pages`: a ``page_head`` pool's pages as
  head-group records, shared across TP sizes;
- :mod:`~hicache.integrations.sglang.backend`: the backend class.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hicache.integrations.sglang.backend import HiCacheL3

__all__ = ["HiCacheL3"]


def __getattr__(name: str) -> Any:
    if name == "HiCacheL3":
        from hicache.integrations.sglang.backend import HiCacheL3

        return HiCacheL3
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
