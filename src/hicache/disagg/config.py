"""What role an instance plays in prefill/decode disaggregation, and its bounds:
:class:`DisaggConfig`, frozen and validated once (SGLang's flag names, see
``hicache serve --help``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from hicache.disagg.allow import LOOPBACK, BootstrapAllow
from hicache.validate import enum_value, int_at_least, number_at_least

__all__ = [
    "DEFAULT_BOOTSTRAP_PORT",
    "NO_TRANSFER_HOST",
    "Bootstrap",
    "DisaggConfig",
    "DisaggMode",
    "TransferBackend",
]

DEFAULT_BOOTSTRAP_PORT = 8998
"""SGLang's default ``--disaggregation-bootstrap-port``."""


class DisaggMode(str, enum.Enum):
    """An instance's role."""

    NULL = "null"
    """A plain instance: prefill and decode in one."""
    PREFILL = "prefill"
    """Computes prompts and sends their KV to the decode instance the room names."""
    DECODE = "decode"
    """Receives a prompt's KV from the prefill instance, then decodes and streams."""


class TransferBackend(str, enum.Enum):
    """What moves the pages between a pair."""

    MOONCAKE = "mooncake"
    """Mooncake's transfer engine (TCP here; RDMA where the host has it)."""
    NIXL = "nixl"
    """NVIDIA's NIXL over its UCX backend."""


@dataclass(frozen=True, kw_only=True)
class DisaggConfig:
    """The disaggregation role and its bounds.

    ``mode``: the role (:class:`DisaggMode`); ``transfer_backend``: what moves the pages;
    ``host``: the address the bootstrap server and the transport listen on (the
    server's ``--host``); ``bootstrap_port``: where a prefill instance's bootstrap server listens (a decode
    instance uses it for a room whose ``bootstrap_port`` is null); ``decode_offload``: a
    decode instance writes each finished conversation (prompt and output, whole pages)
    to L3. Bounds, in seconds: ``room_timeout_s``, how long either side waits for the
    other side's request of a room before it fails it; ``room_work_timeout_s``, how long
    a prefill instance's room with both sides may wait for its prefill and then be sent
    before it ends (so that every room ends); ``transfer_timeout_s``, one transfer's
    bound; ``health_interval_s`` and ``health_failures``, how often a decode
    instance checks its prefill instances and after how many failed checks in a row it
    fails their rooms; ``drain_timeout_s``, how long an aborted request waits for the
    other side's acknowledgement before it ends (its pages then stay fenced, out of use,
    until the acknowledgement: :mod:`hicache.disagg.receiver`); ``closed_room_ttl_s``, how long a closed room's
    number stays refused.

    Bounds on what a peer or a client can make an instance hold: ``bootstrap_key``, the
    key the pair shares (``--disaggregation-bootstrap-key``, else ``--api-key``): when
    set, a prefill instance's bootstrap server refuses (401) registrations, status polls
    and aborts without it and a decode instance sends it; ``bootstrap_allow``, the
    bootstrap addresses a decode instance may contact (:mod:`hicache.disagg.allow`;
    loopback only by default); ``max_links`` and ``link_idle_timeout_s``, how many
    prefill instances a decode instance follows at once (a thread and a connection
    each) and after how many idle seconds it closes one; ``max_rooms_per_client``, how
    many open rooms one client address may have registered with a prefill instance."""

    mode: DisaggMode = DisaggMode.NULL
    transfer_backend: TransferBackend = TransferBackend.MOONCAKE
    host: str = "127.0.0.1"
    bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT
    decode_offload: bool = False
    room_timeout_s: float = 60.0
    room_work_timeout_s: float = 300.0
    transfer_timeout_s: float = 30.0
    health_interval_s: float = 1.0
    health_failures: int = 3
    drain_timeout_s: float = 10.0
    closed_room_ttl_s: float = 300.0
    bootstrap_key: str | None = field(default=None, repr=False)
    bootstrap_allow: tuple[str, ...] = LOOPBACK
    max_links: int = 64
    link_idle_timeout_s: float = 30.0
    max_rooms_per_client: int = 4096
    _allow: BootstrapAllow = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", enum_value(DisaggMode, "mode", self.mode))
        object.__setattr__(
            self,
            "transfer_backend",
            enum_value(TransferBackend, "transfer_backend", self.transfer_backend),
        )
        int_at_least("bootstrap_port", self.bootstrap_port, 1)
        if self.bootstrap_port > 65535:
            raise ValueError(f"bootstrap_port={self.bootstrap_port!r} is invalid; must be <= 65535")
        for name in (
            "room_timeout_s",
            "room_work_timeout_s",
            "transfer_timeout_s",
            "health_interval_s",
            "drain_timeout_s",
            "closed_room_ttl_s",
            "link_idle_timeout_s",
        ):
            number_at_least(name, getattr(self, name), 0.01, "of seconds")
        int_at_least("health_failures", self.health_failures, 1)
        int_at_least("max_links", self.max_links, 1)
        int_at_least("max_rooms_per_client", self.max_rooms_per_client, 1)
        if self.bootstrap_key is not None and (
            not isinstance(self.bootstrap_key, str)
            or not self.bootstrap_key
            or not self.bootstrap_key.isprintable()
            or not self.bootstrap_key.isascii()
        ):
            raise ValueError(
                "bootstrap_key=(hidden) is invalid; must be a non-empty printable ASCII string (an"
                " empty key would let anyone in; leave it out for no key)"
            )
        allow = tuple(self.bootstrap_allow)
        object.__setattr__(self, "bootstrap_allow", allow)
        try:
            object.__setattr__(self, "_allow", BootstrapAllow.parse(allow))
        except ValueError as exc:
            raise ValueError(f"bootstrap_allow={','.join(allow)!r} is invalid; {exc}") from None
        if self.enabled and self.host in ("0.0.0.0", "::", ""):
            raise ValueError(
                f"host={self.host!r} is invalid for a {self.mode.value} instance: its transfer"
                " backend advertises this address to the other instance of each pair; give"
                " the instance's own routable address (or 127.0.0.1 on one machine)"
            )
        if self.decode_offload and self.mode is not DisaggMode.DECODE:
            raise ValueError(
                f"decode_offload=True is invalid; it is for a decode instance, not {self.mode.value}"
            )

    @property
    def enabled(self) -> bool:
        """Whether this instance has a PD role."""
        return self.mode is not DisaggMode.NULL

    @property
    def health_bound_s(self) -> float:
        """Seconds after which a decode instance fails the rooms of a prefill instance it
        cannot reach."""
        return self.health_interval_s * self.health_failures

    @property
    def allow(self) -> BootstrapAllow:
        """``bootstrap_allow`` parsed."""
        return self._allow


NO_TRANSFER_HOST = "2.2.2.2"
"""The ``bootstrap_host`` the router sends in health checks and warm-ups: no transfer
(the instance serves the request alone, as a plain one would)."""


@dataclass(frozen=True, slots=True)
class Bootstrap:
    """A request's bootstrap fields: the prefill instance's bootstrap server
    (``host``, ``port``) and the ``room`` that pairs the request's two halves (a 63-bit
    integer the router draws)."""

    host: str
    port: int
    room: int

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(
                f"bootstrap_host={self.host!r} is invalid; must be a host name or address"
            )
        int_at_least("bootstrap_port", self.port, 1)
        if self.port > 65535:
            raise ValueError(f"bootstrap_port={self.port!r} is invalid; must be <= 65535")
        int_at_least("bootstrap_room", self.room, 0)
        if self.room >= 1 << 63:
            raise ValueError(f"bootstrap_room={self.room!r} is invalid; must be < 2**63")

    @property
    def transfers(self) -> bool:
        """False for the router's no-transfer host (:data:`NO_TRANSFER_HOST`)."""
        return self.host != NO_TRANSFER_HOST
