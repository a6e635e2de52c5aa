"""What role an instance plays in prefill/decode disaggregation, and its bounds:
:class:`DisaggConfig`, frozen and validated once (SGLang's flag names, see
``hicache serve --help``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from hicache.validate import enum_value, int_at_least, number_at_least

__all__ = ["DEFAULT_BOOTSTRAP_PORT", "DisaggConfig", "DisaggMode", "TransferBackend"]

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
    ``bootstrap_port``: where a prefill instance's bootstrap server listens (a decode
    instance uses it for a room whose ``bootstrap_port`` is null); ``decode_offload``: a
    decode instance writes each finished conversation (prompt and output, whole pages)
    to L3. Bounds, in seconds: ``room_timeout_s``, how long either side waits for the
    other side's request of a room before it fails it; ``transfer_timeout_s``, one
    transfer's bound; ``health_interval_s`` and ``health_failures``, how often a decode
    instance checks its prefill instances and after how many failed checks in a row it
    fails their rooms; ``drain_timeout_s``, how long an aborted room's pages stay held
    for the other side's acknowledgement; ``closed_room_ttl_s``, how long a closed room's
    number stays refused."""

    mode: DisaggMode = DisaggMode.NULL
    transfer_backend: TransferBackend = TransferBackend.MOONCAKE
    bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT
    decode_offload: bool = False
    room_timeout_s: float = 60.0
    transfer_timeout_s: float = 30.0
    health_interval_s: float = 1.0
    health_failures: int = 3
    drain_timeout_s: float = 10.0
    closed_room_ttl_s: float = 300.0

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
            "transfer_timeout_s",
            "health_interval_s",
            "drain_timeout_s",
            "closed_room_ttl_s",
        ):
            number_at_least(name, getattr(self, name), 0.01, "of seconds")
        int_at_least("health_failures", self.health_failures, 1)
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
