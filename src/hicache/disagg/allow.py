"""Which bootstrap addresses a decode instance may contact: :class:`BootstrapAllow`
(pure: no IO, no name resolution).

So that a client cannot make a decode instance connect anywhere, a request's
``bootstrap_host`` / ``bootstrap_port`` must match one entry of
``--disaggregation-bootstrap-allow`` (comma-separated): ``*`` (any; the default with
``--api-key``), an IP address or CIDR network, or a host name (matched by name,
case-insensitive, never resolved), each optionally with ``:port`` (IPv6 in brackets,
``[::1]:8998``; without one, any port). Without the flag and without ``--api-key`` only
loopback is allowed (:data:`LOOPBACK`). The router's no-transfer host
(:data:`~hicache.disagg.config.NO_TRANSFER_HOST`) is never contacted and always allowed.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

__all__ = ["ANY", "LOOPBACK", "AllowEntry", "BootstrapAllow"]

ANY = "*"
LOOPBACK = ("127.0.0.0/8", "::1", "localhost")
"""The default without ``--disaggregation-bootstrap-allow`` or ``--api-key``."""

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_HOST_NAME = re.compile(r"(?i)[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*\.?")


@dataclass(frozen=True, slots=True)
class AllowEntry:
    """One parsed entry: ``network`` (an address is a /32 or /128) or a host ``name``
    (lower case), or neither for ``*``; ``port``: None for any."""

    text: str
    network: IPNetwork | None = None
    name: str | None = None
    port: int | None = None

    @classmethod
    def parse(cls, text: str) -> AllowEntry:
        """The entry ``text``; ValueError saying what is wrong with it."""
        t = text.strip()
        if not t:
            raise ValueError("an empty entry (two commas, or a comma at an end)")
        if t == ANY:
            return cls(t)
        host, port = _split_port(t)
        try:
            return cls(t, network=ipaddress.ip_network(host, strict=False), port=port)
        except ValueError:
            pass
        if not _HOST_NAME.fullmatch(host):
            raise ValueError(f"{t!r} is neither an IP address, a CIDR network nor a host name")
        return cls(t, name=host.lower().rstrip("."), port=port)

    def allows(self, host: str, ip: IPAddress | None, port: int) -> bool:
        """Whether this entry matches ``host`` (``ip``: it as an address, else None)."""
        if self.port is not None and self.port != port:
            return False
        if self.network is None and self.name is None:
            return True
        if self.network is not None:
            return ip is not None and ip.version == self.network.version and ip in self.network
        return self.name == host.lower().rstrip(".")


def _split_port(t: str) -> tuple[str, int | None]:
    """``(host, port)`` of ``host``, ``host:port`` or ``[v6]:port``."""
    if t.startswith("["):
        end = t.find("]")
        if end < 0:
            raise ValueError(f"{t!r}: a '[' without its ']'")
        host, rest = t[1:end], t[end + 1 :]
        if not rest:
            return host, None
        if not rest.startswith(":"):
            raise ValueError(f"{t!r}: expected ':port' after ']'")
        return host, _port(t, rest[1:])
    if t.count(":") == 1:  # an IPv6 address has several; give it in brackets with a port
        host, port = t.split(":")
        return host, _port(t, port)
    return t, None


def _port(t: str, text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise ValueError(f"{t!r}: the port {text!r} is not in [1, 65535]")
    return int(text)


@dataclass(frozen=True, slots=True)
class BootstrapAllow:
    """The parsed list (see the module docstring); ``entries`` in the order given.
    ValueError naming the entry that cannot be read."""

    entries: tuple[AllowEntry, ...]

    @classmethod
    def parse(cls, entries: tuple[str, ...] | list[str]) -> BootstrapAllow:
        if not entries:
            raise ValueError(
                "the list is empty; give at least one entry (host[:port], CIDR, or '*')"
            )
        return cls(tuple(AllowEntry.parse(e) for e in entries))

    @property
    def any(self) -> bool:
        """Every address is allowed."""
        return any(e.network is None and e.name is None and e.port is None for e in self.entries)

    def allows(self, host: str, port: int) -> bool:
        """Whether a decode instance may contact the bootstrap server at ``host:port``."""
        h = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        ip: IPAddress | None
        try:
            ip = ipaddress.ip_address(h)
        except ValueError:
            ip = None
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return any(e.allows(h, ip, port) for e in self.entries)

    def __str__(self) -> str:
        return ",".join(e.text for e in self.entries)
