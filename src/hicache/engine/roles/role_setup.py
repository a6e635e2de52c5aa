"""Building an instance's prefill/decode role at start, on every rank: :func:`start_role`.

A plain instance gets the base :class:`~hicache.engine.role.Role`. Each rank of a PD
instance gets its transport with every L1 pool of its per-position stores registered (the
full KV, then the sliding-window and indexer pools: what
:func:`~hicache.cache.held.held_pages` lists), its
:class:`~hicache.disagg.layout.InstanceLayout`, and:

- prefill: its sender thread; rank 0 also the room table and the bootstrap server on
  ``host:bootstrap_port``;
- decode: every rank's endpoint and pools (one exchange at start); rank 0 also the receiver.

A model with recurrent layers also gets its :class:`~hicache.engine.roles.state_slots.StateSlots`
(registered too, one ``state.<tensor>`` store each), and its pair must run at one TP size.

Rank 0's threads post :class:`~hicache.engine.step_inputs.PagesArrived`,
:class:`~hicache.engine.step_inputs.RoomFailed` and
:class:`~hicache.engine.step_inputs.RoomEnded` records through ``post``.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable

from hicache.cache import HiCache
from hicache.disagg.backends import make_transport
from hicache.disagg.bootstrap import BootstrapServer, PrefillRooms
from hicache.disagg.config import DisaggConfig, DisaggMode
from hicache.disagg.layout import InstanceLayout, RankTarget, StoreLayout
from hicache.disagg.pages import PoolGeometry
from hicache.disagg.rank_rooms import RankRooms
from hicache.disagg.receiver import DecodeReceiver
from hicache.disagg.rooms import RoomResult
from hicache.disagg.sender import PrefillSender
from hicache.disagg.transport import Transport
from hicache.engine.config import EngineConfig
from hicache.engine.ranks import StepChannel
from hicache.engine.role import Role
from hicache.engine.roles.decode import DecodeRole
from hicache.engine.roles.prefill import Exchange, PrefillRole, RoomDesk, local_exchange
from hicache.engine.roles.state_slots import StateSlots
from hicache.engine.step_inputs import PagesArrived, RoomEnded, RoomFailed, StepInput
from hicache.runner.loader import LoadedModel
from hicache.runner.model_runner import ModelRunner, cache_spec_of
from hicache.spec import AttentionKind

__all__ = ["follower_roles", "instance_layout", "role_maker", "start_role"]

_SPLIT_STORES = ("full", "swa")
"""The stores whose rows hold a rank's K/V heads (for an MHA model): the others' rows
(an MLA latent, indexer keys) are whole on every rank."""


def instance_layout(
    disagg: DisaggConfig,
    cache: HiCache,
    model: LoadedModel,
    geometry: dict[str, PoolGeometry],
    tp_size: int,
    states: frozenset[str] = frozenset(),
) -> InstanceLayout:
    """The layout a pair compares (:func:`~hicache.disagg.layout.check_pair`) of one rank
    with pools ``geometry`` (``states``: those of them that are state slots). ValueError
    when a split store's pool does not hold the rank's K/V heads."""
    mla = cache.context.spec.attention is AttentionKind.MLA
    heads = None if mla else model.model.heads
    stores = []
    for name, g in geometry.items():
        kv_heads = 0
        state = name in states
        if heads is not None and name in _SPLIT_STORES:
            kv_heads = heads.num_kv_heads
            if g.row_bytes % heads.local_kv_heads:
                raise ValueError(
                    f"store {name!r}: a row of {g.row_bytes} bytes does not hold this rank's"
                    f" {heads.local_kv_heads} K/V heads"
                )
        stores.append(
            StoreLayout(name, g.num_kv, g.layers, g.row_bytes, g.dtype, kv_heads, state=state)
        )
    return InstanceLayout(
        model=model.name,
        fingerprint=model.fingerprint,
        page_size=cache.context.page_size,
        tp_size=tp_size,
        mla=mla,
        transfer_backend=disagg.transfer_backend.value,
        stores=tuple(stores),
        num_heads=0 if heads is None else heads.num_heads,
    )


def start_role(
    disagg: DisaggConfig,
    cache: HiCache,
    model: LoadedModel,
    runner: ModelRunner,
    *,
    tp_size: int,
    max_running: int,
    rank: int = 0,
    exchange: Exchange | None = None,
    post: Callable[[StepInput], None] | None = None,
) -> Role:
    """The started role of rank ``rank`` of the instance of ``cache``, ``model`` and
    ``runner`` (see the module docstring), built with them, before its scheduler, on
    every rank at the same point (``max_running``: its running requests at most, the
    state slots of a recurrent model; ``exchange``: the ranks' collective, None with one
    rank; ``post``: rank 0's step inputs). ValueError for a model a pair cannot serve;
    OSError naming the port when the bootstrap port cannot be bound;
    :class:`~hicache.disagg.transport.TransportUnavailable` when the transfer backend
    cannot start."""
    if not disagg.enabled:
        return Role()
    if exchange is None:
        if tp_size != 1:
            raise ValueError(f"tp_size={tp_size}: the ranks' exchange is required")
        exchange = local_exchange
    pools = {"full": cache.full.pages.device_pool, **cache.stores.runner_pools()}
    geometry = {name: PoolGeometry.of(pool) for name, pool in pools.items()}
    states = None
    if runner.recurrent:
        spec = cache_spec_of(model.model, model.dtype)  # what the cache was built with
        states = StateSlots.of(spec, max_running, runner.device)
        if states is None:
            raise ValueError(
                f"--disaggregation-mode {disagg.mode.value}: {model.name} carries recurrent"
                " state but its cache keeps no state snapshots; a pair cannot move it"
            )
        geometry.update(states.geometry())
    state_names = frozenset() if states is None else frozenset(states.geometry())
    layout = instance_layout(disagg, cache, model, geometry, tp_size, state_names)
    name = f"hicache-{disagg.mode.value}-{uuid.uuid4().hex[:12]}-r{rank}"
    transport = make_transport(disagg.transfer_backend, disagg.host, name)
    try:
        transport.register([g.region() for g in geometry.values()])
        if disagg.mode is DisaggMode.PREFILL:
            carried = None if states is None else (runner, states)
            return _prefill(
                disagg, cache, transport, layout, geometry, rank, exchange, post, carried
            )
        mine = RankTarget(transport.endpoint, {n: g.to_dict() for n, g in geometry.items()})
        ranks = tuple(exchange(mine))  # every rank's, by rank
        assert all(isinstance(r, RankTarget) for r in ranks)
        return _decode(disagg, cache, transport, layout, ranks, rank, post, states)  # type: ignore[arg-type]
    except BaseException:
        transport.close()
        raise


def role_maker(
    disagg: DisaggConfig,
    tp_size: int,
    post: Callable[[StepInput], None] | None = None,
    *,
    max_running: int,
) -> Callable[[HiCache, LoadedModel, ModelRunner, StepChannel | None], Role]:
    """What :func:`~hicache.engine.step.build.build_core` calls to build a rank's role:
    :func:`start_role` with the rank and exchange of its channel (``post``: rank 0's)."""

    def make(
        cache: HiCache, model: LoadedModel, runner: ModelRunner, channel: StepChannel | None
    ) -> Role:
        rank = 0 if channel is None else channel.rank
        exchange = None if channel is None else channel.exchange
        return start_role(
            disagg,
            cache,
            model,
            runner,
            tp_size=tp_size,
            max_running=max_running,
            rank=rank,
            exchange=exchange,
            post=post,
        )

    return make


def _prefill(
    disagg: DisaggConfig,
    cache: HiCache,
    transport: Transport,
    layout: InstanceLayout,
    geometry: dict[str, PoolGeometry],
    rank: int,
    exchange: Exchange,
    post: Callable[[StepInput], None] | None,
    carried: tuple[ModelRunner, StateSlots] | None,
) -> PrefillRole:
    rank_rooms = RankRooms(rank)
    desk = None
    if rank == 0:
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
        desk = RoomDesk(rooms, server, layout.tp_size)

    def done(rid: str, error: str | None) -> None:
        if post is not None:  # rank 0 reports; the others follow its RoomEnded
            post(RoomEnded(rid, error))

    sender = PrefillSender(
        rank_rooms, transport, done, layout=layout, timeout_s=disagg.transfer_timeout_s
    )
    if desk is not None:
        desk.server.start()
    sender.start()
    return PrefillRole(
        cache,
        rank_rooms,
        sender,
        transport,
        geometry,
        desk=desk,
        exchange=exchange,
        carried=carried,
    )


def _decode(
    disagg: DisaggConfig,
    cache: HiCache,
    transport: Transport,
    layout: InstanceLayout,
    ranks: tuple[RankTarget, ...],
    rank: int,
    post: Callable[[StepInput], None] | None,
    states: StateSlots | None,
) -> DecodeRole:
    if rank != 0:
        return DecodeRole(cache, None, transport, layout, ranks, states=states)
    assert post is not None, "rank 0 posts its step inputs"

    def arrived(rid: str, result: RoomResult) -> None:
        cached = (result.cached_device, result.cached_host, result.cached_storage)
        post(
            PagesArrived(
                rid=rid,
                first_token=result.first_token,
                cached=cached,
                first_logprob=result.first_logprob,
                prompt_logprobs=result.prompt_logprobs,
                sampler_state=result.sampler_state,
            )
        )

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
    return DecodeRole(cache, receiver, transport, layout, ranks, post, states=states)


def follower_roles(
    config: EngineConfig,
) -> Callable[[], Callable[[HiCache, LoadedModel, ModelRunner, StepChannel | None], Role]]:
    """What a follower rank of ``config``'s engine calls to get its role maker: picklable
    (it crosses to the rank's process), without ``post`` (rank 0 reports)."""
    return functools.partial(
        role_maker,
        config.disagg,
        config.tp_size,
        max_running=config.scheduler.max_running_requests,
    )
