"""Which key each RPC of the gRPC worker needs (:data:`RPC_ACCESS`), as over HTTP.

The same keys and the same policy as the HTTP routes (:mod:`hicache.server.access`, one
check: :func:`~hicache.server.access.key_refusal`), read from the call's ``authorization``
metadata (``Bearer <key>``): inference and what describes the model need ``--api-key``
when one is set, ``FlushCache`` needs ``--admin-api-key`` (refused without one),
``HealthCheck`` is open, ``GetLoads`` is open unless ``--metrics-require-api-key``. A
refusal is ``UNAUTHENTICATED`` (key missing or wrong) or ``PERMISSION_DENIED`` (no admin
key configured). smg 1.13 sends no metadata of its own on gRPC: behind it, leave
``--api-key`` unset (docs/router.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import grpc

from hicache.server.access import Access, key_refusal

__all__ = ["RPC_ACCESS", "GrpcKeys", "KeyDenied"]

RPC_ACCESS: Mapping[str, Access] = MappingProxyType(
    {
        "Generate": Access.INFERENCE,
        "Abort": Access.INFERENCE,
        "GetModelInfo": Access.INFERENCE,
        "GetServerInfo": Access.INFERENCE,
        "GetTokenizer": Access.INFERENCE,
        "SubscribeKvEvents": Access.INFERENCE,
        "HealthCheck": Access.OPEN,
        "GetLoads": Access.METRICS,
        "FlushCache": Access.ADMIN,
    }
)
"""RPC name -> the key it needs (any other RPC of the service answers UNIMPLEMENTED)."""

_STATUS = {401: grpc.StatusCode.UNAUTHENTICATED, 403: grpc.StatusCode.PERMISSION_DENIED}


@dataclass(frozen=True, slots=True)
class KeyDenied:
    """A call refused for its key: the status to end it with, and why."""

    code: grpc.StatusCode
    message: str


@dataclass(frozen=True)
class GrpcKeys:
    """The worker's keys (``None``: not set), as ``hicache serve`` was given them."""

    api_key: str | None = None
    admin_api_key: str | None = None
    metrics_require_api_key: bool = False

    def check(
        self, rpc: str, metadata: Iterable[tuple[str, str | bytes]] | None
    ) -> KeyDenied | None:
        """None when a call of ``rpc`` with ``metadata`` may run; else the refusal."""
        authorization = ""
        for key, value in metadata or ():
            if key.lower() == "authorization":
                authorization = value if isinstance(value, str) else value.decode(errors="replace")
                break
        refused = key_refusal(
            RPC_ACCESS[rpc],
            authorization,
            api_key=self.api_key,
            admin_api_key=self.admin_api_key,
            metrics_require_api_key=self.metrics_require_api_key,
        )
        if refused is None:
            return None
        return KeyDenied(_STATUS[refused.status], f"{rpc}: {refused.message}")
