"""The built-in L3 backends, one module each; the registry imports each only when used.

- :mod:`.file`: ``file``, one record file per key in a local or shared directory;
- :mod:`.memory`: ``memory``, an in-process fake with injectable faults, for tests;
- :mod:`.redis`: ``redis``, Redis or Valkey through redis-py;
- :mod:`.mooncake`: ``mooncake``, Mooncake Store (settings in :mod:`.mooncake_config`);
- :mod:`.aibrix`: ``aibrix``, AIBrix KVCache (settings in :mod:`.aibrix_config`);
- :mod:`.nixl`: ``nixl``, the ``file`` backend's records moved by NIXL's POSIX plugin
  (settings in :mod:`.nixl_config`, NIXL plumbing in :mod:`.nixl_client`).

This package imports none of them, so a missing optional client package only matters to
the backend that needs it.
"""
