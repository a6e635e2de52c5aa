"""Tensor parallelism across machines: which ranks a node runs, and the nodes' rendezvous.

``nnodes`` nodes (machines, or process trees) share the ``tp_size`` ranks evenly: node
``r`` runs global ranks ``r * local_size .. (r + 1) * local_size - 1`` (``local_size =
tp_size / nnodes``); node 0 runs rank 0, serves HTTP, and opens the rendezvous store (a
``TCPStore``) on ``dist_init_addr``; every other node connects to it, writes what it was
started with (:class:`NodeCard`) and waits for node 0's verdict (:func:`announce`,
:func:`check_nodes`), so that a node started with other ``--nnodes``, ``--tp-size`` or
model, or a ``--node-rank`` taken twice, fails the start on both sides, named. Store keys:
``hicache/nodes`` (a counter), ``hicache/node/<i>`` (the i-th card, JSON),
``hicache/verdict`` (``ok`` or the error line), ``hicache/link`` (node 0's liveness
listener, :mod:`hicache.engine.node_link`). Flows: docs/architecture.md, "Ranks on several
nodes".
"""

from __future__ import annotations

import ipaddress
import json
import socket
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

__all__ = [
    "NodeCard",
    "NodeConfig",
    "NodeStartError",
    "announce",
    "check_listenable",
    "check_nodes",
    "connect_store",
    "interface_of",
]

_COUNT = "hicache/nodes"
_VERDICT = "hicache/verdict"
_READ = "hicache/verdict-read"
VERDICT_READ_S = 5.0
"""Longest node 0 waits, after refusing a node, for every node to read why."""
LINK_KEY = "hicache/link"
"""Where node 0 publishes ``host:port`` of its liveness listener."""
POLL_S = 0.1


class NodeStartError(RuntimeError):
    """The nodes could not start together; the message is one line naming the node."""


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeConfig:
    """This node's place: ``nnodes`` nodes, this one ``node_rank``; ``dist_init_addr``
    (``HOST:PORT``) node 0's rendezvous (required with several nodes, None with one)."""

    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None

    def __post_init__(self) -> None:
        n = self.nnodes
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"nnodes={n!r} is invalid; must be an int >= 1")
        r = self.node_rank
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < n:
            raise ValueError(f"node_rank={r!r} is invalid; must be in [0, {n - 1}] with nnodes={n}")
        if n > 1 and self.dist_init_addr is None:
            raise ValueError(
                f"dist_init_addr=None is invalid with nnodes={n}: give node 0's HOST:PORT"
            )
        if self.dist_init_addr is not None:
            self.address  # noqa: B018 - validates

    @property
    def address(self) -> tuple[str, int]:
        """``dist_init_addr`` as (host, port); ValueError when it is not ``HOST:PORT``."""
        text = self.dist_init_addr or ""
        host, sep, port = text.rpartition(":")
        host = host.strip("[]")
        if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError(
                f"dist_init_addr={text!r} is invalid; give HOST:PORT (port in [1, 65535])"
            )
        return host, int(port)

    @property
    def leader(self) -> bool:
        """Whether this node runs rank 0."""
        return self.node_rank == 0

    def local_size(self, tp_size: int) -> int:
        """Ranks per node; ValueError when ``tp_size`` does not split evenly."""
        if tp_size % self.nnodes:
            raise ValueError(
                f"tp_size={tp_size} is invalid with nnodes={self.nnodes}: every node runs"
                " as many ranks, so nnodes must divide tp_size"
            )
        return tp_size // self.nnodes

    def ranks(self, tp_size: int) -> range:
        """The global ranks this node runs."""
        local = self.local_size(tp_size)
        return range(self.node_rank * local, (self.node_rank + 1) * local)

    def node_of(self, rank: int, tp_size: int) -> int:
        return rank // self.local_size(tp_size)


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeCard:
    """What a node was started with; node 0 compares every other node's with its own."""

    node_rank: int
    nnodes: int
    tp_size: int
    model: str

    def differs(self, mine: NodeCard) -> str | None:
        """Why this node (``self``) cannot join node 0 (``mine``), one line; None if it can."""
        them = f"node {self.node_rank}"
        for flag, theirs, ours in (
            ("--nnodes", self.nnodes, mine.nnodes),
            ("--tp-size", self.tp_size, mine.tp_size),
            ("--model-path", self.model, mine.model),
        ):
            if theirs != ours:
                return f"{them} was started with {flag} {theirs}, node 0 with {flag} {ours}"
        if not 0 < self.node_rank < mine.nnodes:
            return (
                f"{them}: --node-rank {self.node_rank} is out of range for --nnodes"
                f" {mine.nnodes} (other nodes are 1 .. {mine.nnodes - 1})"
            )
        return None


def connect_store(config: NodeConfig, world: int, timeout_s: float) -> Any:
    """A client of node 0's store (this node is not node 0), connected within
    ``timeout_s``; :class:`NodeStartError` naming this node and the address otherwise."""
    import torch.distributed as dist

    host, port = config.address
    began = time.monotonic()
    try:
        return dist.TCPStore(
            host, port, world, is_master=False, timeout=timedelta(seconds=timeout_s)
        )
    except Exception as exc:
        took = time.monotonic() - began
        raise NodeStartError(
            f"node {config.node_rank} could not reach node 0's --dist-init-addr"
            f" {config.dist_init_addr} (waited {took:.0f} s of --dist-init-timeout"
            f" {timeout_s:g}): {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
        ) from exc


def announce(store: Any, card: NodeCard, timeout_s: float) -> None:
    """Node ``card.node_rank`` (not 0) tells node 0 what it was started with and waits
    for its verdict (at most ``timeout_s``); :class:`NodeStartError` with node 0's line."""
    deadline = time.monotonic() + timeout_s
    try:
        index = int(store.add(_COUNT, 1))
        store.set(f"hicache/node/{index}", json.dumps(asdict(card)))
        while not store.check([_VERDICT]):
            if time.monotonic() >= deadline:
                raise NodeStartError(
                    f"node {card.node_rank}: node 0 did not accept it within {timeout_s:g} s"
                    " (--dist-init-timeout): are the other nodes started?"
                )
            time.sleep(POLL_S)
        verdict = bytes(store.get(_VERDICT)).decode()
        store.add(_READ, 1)
    except NodeStartError:
        raise
    except Exception as exc:  # node 0 gone before its verdict
        raise NodeStartError(
            f"node {card.node_rank}: node 0 closed its --dist-init-addr before accepting"
            f" it (node 0 failed to start?): {type(exc).__name__}"
        ) from exc
    if verdict != "ok":
        raise NodeStartError(verdict)


def check_nodes(store: Any, mine: NodeCard, deadline: float) -> None:
    """Node 0 waits for every other node's card (until ``deadline``, ``time.monotonic()``)
    and compares it with ``mine``; the verdict is written for every node to read.
    :class:`NodeStartError` naming the first node at fault, or the nodes missing."""
    seen: dict[int, NodeCard] = {}
    read = 0
    try:
        while len(seen) < mine.nnodes - 1:
            count = int(store.add(_COUNT, 0))
            while read < count:
                key = f"hicache/node/{read + 1}"
                if not store.check([key]):
                    break
                card = NodeCard(**json.loads(bytes(store.get(key)).decode()))
                read += 1
                why = card.differs(mine)
                if why is None and card.node_rank in seen:
                    why = f"node {card.node_rank}: --node-rank {card.node_rank} is taken twice"
                if why is not None:
                    raise NodeStartError(why)
                seen[card.node_rank] = card
            if len(seen) == mine.nnodes - 1:
                break
            if time.monotonic() >= deadline:
                missing = [r for r in range(1, mine.nnodes) if r not in seen]
                raise NodeStartError(
                    f"node {', '.join(str(r) for r in missing)} did not reach"
                    " --dist-init-addr in time (--dist-init-timeout)"
                )
            time.sleep(POLL_S)
    except NodeStartError as exc:
        store.set(_VERDICT, str(exc))
        until = time.monotonic() + VERDICT_READ_S  # the store closes as node 0 exits
        while int(store.add(_READ, 0)) < int(store.add(_COUNT, 0)) and time.monotonic() < until:
            time.sleep(POLL_S)
        raise
    store.set(_VERDICT, "ok")


def check_listenable(config: NodeConfig) -> None:
    """Node 0 can listen on ``dist_init_addr``'s host (an address of this machine):
    :class:`NodeStartError` naming node 0 and the address otherwise. (The store itself
    listens on every interface and would only fail its own connection, after seconds.)"""
    host, _ = config.address
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
        family, _, _, _, where = infos[0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind(where)
    except OSError as exc:
        raise NodeStartError(
            f"node 0 cannot listen on --dist-init-addr {config.dist_init_addr}: {host} is"
            f" not an address of this machine ({exc.strerror or exc}); give node 0's own"
        ) from None


def interface_of(host: str) -> str | None:
    """The name of this machine's network interface that holds address ``host`` (None
    when ``host`` is not an address of one, or is a wildcard)."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if address.is_unspecified:
        return None
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            try:
                if ipaddress.ip_address(a.address.split("%")[0]) == address:
                    return name
            except ValueError:
                continue
    return None
