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
    listens on: every interface, which the library does not let us narrow), or a NIXL
    agent named ``name`` (unique among the agents that talk to it), whose UCX listener
    stays on the interface that holds ``host`` (``UCX_NET_DEVICES`` set to it, ``lo`` for
    a loopback address, unless the environment sets the variable: :func:`ucx_device`).

    Each backend's package is imported here, on demand: when it is missing,
    :class:`~hicache.disagg.transport.TransportUnavailable` names what to install.
    """
    kind = enum_value(TransferBackend, "transfer_backend", backend)
    if kind is TransferBackend.MOONCAKE:
        from hicache.disagg.mooncake_transport import MooncakeTransport

        return MooncakeTransport(host)
    from hicache.disagg.nixl_transport import NixlTransport

    device = ucx_device(host)
    if device is not None:
        # UCX listens on every interface unless told otherwise (before its first agent);
        # an instance keeps its transfer port on the interface of its --host
        os.environ.setdefault("UCX_NET_DEVICES", device)
    return NixlTransport(name)


def ucx_device(host: str) -> str | None:
    """The network interface that holds ``host``'s IPv4 address (``lo`` for a loopback
    address), or None when no interface here holds it (UCX then keeps its default: every
    interface)."""
    ip = ipaddress.ip_address(socket.gethostbyname(host))
    if ip.is_loopback:
        return "lo"
    import psutil

    for device, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == str(ip) for a in addresses):
            return device
    return None
