"""Building an instance's prefill/decode role at start: :func:`start_role`.

A plain instance gets the base :class:`~hicache.engine.role.Role`. A PD instance gets its
transport with every L1 pool of its per-position stores registered (the full KV, then the
sliding-window and indexer pools: what :func:`~hicache.cache.held.held_pages` lists), its
:class:`~hicache.disagg.layout.InstanceLayout`, and:

- prefill: the room table and the bootstrap server on ``host:bootstrap_port``, and the
  sender thread;
- decode: the receiver.

Their threads post :class:`~hicache.engine.step_inputs.PagesArrived`,
:class:`~hicache.engine.step_inputs.RoomFailed` and
:class:`~hicache.engine.step_inputs.RoomEnded` records through ``post``.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from hicache.cache import HiCache
from hicache.disagg.backends import make_transport
from hicache.disagg.bootstrap import BootstrapServer, PrefillRooms
from hicache.disagg.config import DisaggConfig, DisaggMode
from hicache.disagg.layout import InstanceLayout, StoreLayout
from hicache.disagg.pages import PoolGeometry
from hicache.disagg.receiver import DecodeReceiver
from hicache.disagg.rooms import RoomResult
from hicache.disagg.sender import PrefillSender
from hicache.disagg.transport import Transport
from hicache.engine.role import Role
from hicache.engine.roles.decode import DecodeRole
from hicache.engine.roles.prefill import PrefillRole
from hicache.engine.step_inputs import PagesArrived, RoomEnded, RoomFailed, StepInput
from hicache.runner.loader import LoadedModel
from hicache.runner.model_runner import ModelRunner
from hicache.spec import AttentionKind

__all__ = ["start_role"]


def start_role(
    disagg: DisaggConfig,
    cache: HiCache,
    model: LoadedModel,
    runner: ModelRunner,
    *,
    tp_size: int,
    post: Callable[[StepInput], None],
) -> Role:
    """The started role of the instance of ``cache``, ``model`` and ``runner`` (see the
    module docstring), built with them, before its scheduler. ValueError for a model a
    pair cannot serve; OSError naming the port when the bootstrap port cannot be bound;
    :class:`~hicache.disagg.transport.TransportUnavailable` when the transfer backend
    cannot start."""
    if not disagg.enabled:
        return Role()
    if not runner.resumable_prefix:
        raise ValueError(
            f"--disaggregation-mode {disagg.mode.value}: {model.name} carries recurrent"
            " state, which a prefill/decode pair does not move yet; serve it as a plain instance"
        )
    pools = {"full": cache.full.pages.device_pool, **cache.stores.runner_pools()}
    geometry = {name: PoolGeometry.of(pool) for name, pool in pools.items()}
    layout = InstanceLayout(
        model=model.name,
        fingerprint=model.fingerprint,
        page_size=cache.context.page_size,
        tp_size=tp_size,
        mla=cache.context.spec.attention is AttentionKind.MLA,
        transfer_backend=disagg.transfer_backend.value,
        stores=tuple(
            StoreLayout(name, g.num_kv, g.layers, g.row_bytes, g.dtype)
            for name, g in geometry.items()
        ),
    )
    name = f"hicache-{disagg.mode.value}-{uuid.uuid4().hex[:12]}"
    transport = make_transport(disagg.transfer_backend, disagg.host, name)
    try:
        transport.register([g.region() for g in geometry.values()])
        if disagg.mode is DisaggMode.PREFILL:
            return _prefill(disagg, cache, transport, layout, geometry, post)
        return _decode(disagg, cache, transport, layout, geometry, post)
    except BaseException:
        transport.close()
        raise


def _prefill(
    disagg: DisaggConfig,
    cache: HiCache,
    transport: Transport,
    layout: InstanceLayout,
    geometry: dict[str, PoolGeometry],
    post: Callable[[StepInput], None],
) -> PrefillRole:
    rooms = PrefillRooms(
        layout,
        timeout_s=disagg.room_timeout_s,
        closed_ttl_s=disagg.closed_room_ttl_s,
        work_timeout_s=disagg.room_work_timeout_s,
        max_rooms_per_client=disagg.max_rooms_per_client,
    )
    try:
        server = BootstrapServer(
            rooms, disagg.host, disagg.bootstrap_port, key=disagg.bootstrap_key
        )
    except OSError as exc:
        raise OSError(
            f"--disaggregation-bootstrap-port {disagg.bootstrap_port}: cannot listen on"
            f" {disagg.host}:{disagg.bootstrap_port} ({exc.strerror or exc})"
        ) from None

    def done(rid: str, error: str | None) -> None:
        post(RoomEnded(rid, error))

    sender = PrefillSender(rooms, transport, done, timeout_s=disagg.transfer_timeout_s)
    server.start()
    sender.start()
    return PrefillRole(cache, rooms, server, sender, transport, geometry)


def _decode(
    disagg: DisaggConfig,
    cache: HiCache,
    transport: Transport,
    layout: InstanceLayout,
    geometry: dict[str, PoolGeometry],
    post: Callable[[StepInput], None],
) -> DecodeRole:
    def arrived(rid: str, result: RoomResult) -> None:
        cached = (result.cached_device, result.cached_host, result.cached_storage)
        post(PagesArrived(rid=rid, first_token=result.first_token, cached=cached))

    def ended(rid: str, why: str) -> None:
        post(RoomEnded(rid, why))

    def failed(rid: str, why: str) -> None:
        post(RoomFailed(rid, why))

    receiver = DecodeReceiver(
        arrived,
        ended,
        failed=failed,
        health_bound_s=disagg.health_bound_s,
        drain_timeout_s=disagg.drain_timeout_s,
        allow=disagg.allow,
        key=disagg.bootstrap_key,
        max_links=disagg.max_links,
        link_idle_timeout_s=disagg.link_idle_timeout_s,
    )
    return DecodeRole(cache, receiver, transport, layout, geometry)
