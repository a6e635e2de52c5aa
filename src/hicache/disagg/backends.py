"""Picking a :class:`~hicache.disagg.transport.Transport` by
:class:`~hicache.disagg.config.TransferBackend`: :func:`make_transport`.

A module of its own because it imports every implementation, and each implementation
imports the contract (:mod:`hicache.disagg.transport`): the contract importing them back
would be a cycle.
"""

from __future__ import annotations

import ipaddress
import os
import socket

from hicache.disagg.config import TransferBackend
from hicache.disagg.transport import Transport
from hicache.validate import enum_value

__all__ = ["make_transport"]


def make_transport(backend: TransferBackend | str, host: str, name: str) -> Transport:
    """A started transport of ``backend``: Mooncake's transfer engine, reached by peers at
    ``host`` (an IPv4 address; see :mod:`hicache.disagg.mooncake_transport` for what it
    listens on: every interface), or a NIXL agent named ``name`` (unique among the agents
    that talk to it), whose UCX listener stays on the loopback interface when ``host`` is
    a loopback address (``UCX_NET_DEVICES=lo`` unless the environment sets it).

    Each backend's package is imported here, on demand: when it is missing,
    :class:`~hicache.disagg.transport.TransportUnavailable` names what to install.
    """
    kind = enum_value(TransferBackend, "transfer_backend", backend)
    if kind is TransferBackend.MOONCAKE:
        from hicache.disagg.mooncake_transport import MooncakeTransport

        return MooncakeTransport(host)
    from hicache.disagg.nixl_transport import NixlTransport

    if ipaddress.ip_address(socket.gethostbyname(host)).is_loopback:
        # UCX listens on every interface unless told otherwise (before its first agent);
        # an instance bound to loopback keeps its transfer port there too
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
    return NixlTransport(name)
