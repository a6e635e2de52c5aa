"""Picking a :class:`~hicache.disagg.transport.Transport` by
:class:`~hicache.disagg.config.TransferBackend`: :func:`make_transport`.

A module of its own because it imports every implementation, and each implementation
imports the contract (:mod:`hicache.disagg.transport`): the contract importing them back
would be a cycle.
"""

from __future__ import annotations

from hicache.disagg.config import TransferBackend
from hicache.disagg.transport import Transport
from hicache.validate import enum_value

__all__ = ["make_transport"]


def make_transport(backend: TransferBackend | str, host: str, name: str) -> Transport:
    """A started transport of ``backend``: Mooncake's transfer engine, reached by peers at
    ``host`` (an IPv4 address; see :mod:`hicache.disagg.mooncake_transport` for what it
    listens on), or a NIXL agent named ``name`` (unique among the agents that talk to it).

    Each backend's package is imported here, on demand: when it is missing,
    :class:`~hicache.disagg.transport.TransportUnavailable` names what to install.
    """
    kind = enum_value(TransferBackend, "transfer_backend", backend)
    if kind is TransferBackend.MOONCAKE:
        from hicache.disagg.mooncake_transport import MooncakeTransport

        return MooncakeTransport(host)
    from hicache.disagg.nixl_transport import NixlTransport

    return NixlTransport(name)
