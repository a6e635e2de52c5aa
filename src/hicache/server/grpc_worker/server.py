"""The gRPC server of ``hicache serve --grpc-mode``: :class:`GrpcWorker` serves
:class:`~hicache.server.grpc_worker.servicer.SchedulerServicer` on ``host:port``, on the
running asyncio loop (the HTTP server's), from :meth:`GrpcWorker.start` to
:meth:`GrpcWorker.stop`.
"""

from __future__ import annotations

import logging

import grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from hicache.server.grpc_worker.servicer import SchedulerServicer

__all__ = ["GRPC_MAX_MESSAGE_BYTES", "GrpcWorker", "grpc_address"]

log = logging.getLogger(__name__)

GRPC_MAX_MESSAGE_BYTES = 64 << 20
"""Largest message either way (64 MiB): a prompt of a million token ids fits."""


def grpc_address(host: str, port: int) -> str:
    """``host:port`` as gRPC takes it (an IPv6 address in brackets)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class GrpcWorker:
    """Lifecycle: ``await start()`` binds ``host:port`` and serves; ``await stop(grace)``
    ends the calls in flight after ``grace`` seconds and closes the port. Binding is
    exclusive (no ``SO_REUSEPORT``: a second server on the port fails to start)."""

    def __init__(self, servicer: SchedulerServicer, host: str, port: int) -> None:
        self.servicer = servicer
        self.host = host
        self.port = port
        self._server: grpc.aio.Server | None = None

    async def start(self) -> GrpcWorker:
        """Bind and serve; OSError naming the address when it cannot be bound."""
        server = grpc.aio.server(
            options=[
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", GRPC_MAX_MESSAGE_BYTES),
            ]
        )
        pb_grpc.add_SglangSchedulerServicer_to_server(self.servicer, server)
        address = grpc_address(self.host, self.port)
        try:
            bound = server.add_insecure_port(address)
        except RuntimeError as exc:
            raise OSError(f"cannot listen on {address} for gRPC ({exc})") from None
        if bound == 0:
            raise OSError(f"cannot listen on {address} for gRPC")
        await server.start()
        self._server = server
        log.debug("gRPC worker serving on %s", address)
        return self

    async def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving (idempotent): calls still running are cancelled after ``grace_s``."""
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace_s)
