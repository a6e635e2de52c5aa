"""The gRPC server of ``hicache serve --grpc-mode``: :class:`GrpcWorker` serves
:class:`~hicache.server.grpc_worker.servicer.SchedulerServicer` on ``host:port``, on the
running asyncio loop (the HTTP server's), from :meth:`GrpcWorker.start` to
:meth:`GrpcWorker.stop`.

The RPCs the servicer answers (:data:`~hicache.server.grpc_worker.keys.RPC_ACCESS`) are
registered from the service's descriptor in the generated stubs, each taking its request
as bytes and parsing it itself (:func:`service_handler`): a request that is not a valid
message ends ``INVALID_ARGUMENT`` naming its type, where grpcio's own parsing would end it
``UNKNOWN`` with a traceback in the log. Any other RPC of the service is ``UNIMPLEMENTED``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.message import DecodeError, Message
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from hicache.server.grpc_worker.keys import RPC_ACCESS
from hicache.server.grpc_worker.servicer import SchedulerServicer

__all__ = ["GRPC_MAX_MESSAGE_BYTES", "SERVICE", "GrpcWorker", "grpc_address", "service_handler"]

SERVICE = pb.DESCRIPTOR.services_by_name["SglangScheduler"]
"""smg's ``sglang.grpc.scheduler.SglangScheduler`` service, from the generated stubs."""

log = logging.getLogger(__name__)

GRPC_MAX_MESSAGE_BYTES = 64 << 20
"""Largest message either way (64 MiB): a prompt of a million token ids fits."""


def grpc_address(host: str, port: int) -> str:
    """``host:port`` as gRPC takes it (an IPv6 address in brackets)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


async def _parse(cls: type[Message], raw: bytes, context: grpc.aio.ServicerContext) -> Any:
    """``raw`` as a ``cls`` message; the call ends INVALID_ARGUMENT when it is not one."""
    try:
        return cls.FromString(raw)
    except DecodeError as exc:
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"request: not a valid {cls.DESCRIPTOR.full_name} message ({exc})",
        )


def _unary(
    cls: type[Message], method: Callable[[Any, Any], Awaitable[Message]]
) -> Callable[[bytes, grpc.aio.ServicerContext], Awaitable[Message]]:
    async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> Message:
        return await method(await _parse(cls, raw, context), context)

    return handle


def _streaming(
    cls: type[Message], method: Callable[[Any, Any], AsyncIterator[Message]]
) -> Callable[[bytes, grpc.aio.ServicerContext], AsyncIterator[Message]]:
    async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Message]:
        async for message in method(await _parse(cls, raw, context), context):
            yield message

    return handle


def service_handler(servicer: SchedulerServicer) -> grpc.GenericRpcHandler:
    """The handler of every RPC in :data:`RPC_ACCESS` (see the module docstring)."""
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for name in RPC_ACCESS:
        method = SERVICE.methods_by_name[name]
        request = message_factory.GetMessageClass(method.input_type)
        serialize = message_factory.GetMessageClass(method.output_type).SerializeToString
        bound = getattr(servicer, name)
        if method.server_streaming:
            handlers[name] = grpc.unary_stream_rpc_method_handler(
                _streaming(request, bound), response_serializer=serialize
            )
        else:
            handlers[name] = grpc.unary_unary_rpc_method_handler(
                _unary(request, bound), response_serializer=serialize
            )
    return grpc.method_handlers_generic_handler(SERVICE.full_name, handlers)


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
        server.add_generic_rpc_handlers((service_handler(self.servicer),))
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
