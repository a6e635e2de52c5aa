"""A node other than node 0 (``--node-rank`` > 0): its ranks, and nothing else.

:func:`run_node` is what ``hicache serve`` runs there instead of an HTTP server: it
reaches node 0's rendezvous (``--dist-init-addr``), has node 0 accept what it was started
with (:func:`~hicache.engine.nodes.announce`), links to node 0
(:class:`~hicache.engine.node_link.NodeLink`), spawns its ranks as followers (the same
step body, rank 0's inputs), says ready once they have built their engines, then beats
for them: their heartbeat ages every :data:`~hicache.engine.heartbeat.BEAT_INTERVAL_S`,
and a rank's death at once. It returns when its ranks have ended: 0 when rank 0 stopped
them, 1 when one died or rank 0 was lost (its link closed); its ranks never outlive it.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import time
from collections.abc import Callable

from hicache.engine.config import EngineConfig
from hicache.engine.drivers.start import node_card, rank_processes
from hicache.engine.heartbeat import BEAT_INTERVAL_S
from hicache.engine.node_link import NodeLink
from hicache.engine.nodes import LINK_KEY, NodeStartError, announce, connect_store
from hicache.engine.ranks import CLOSE_TIMEOUT_S, RankProcesses, RankStartError
from hicache.engine.step.build import RoleMaker
from hicache.engine.tp_fit import check_tp_model

log = logging.getLogger(__name__)

__all__ = ["NodeEnd", "run_node"]


class NodeEnd(RuntimeError):
    """This node's ranks ended on a failure; the message names it (one line)."""


def run_node(config: EngineConfig, follower_roles: Callable[[], RoleMaker] | None) -> None:
    """Run node ``config.nodes.node_rank``'s ranks until rank 0 stops them (returns).
    :class:`~hicache.engine.nodes.NodeStartError` or
    :class:`~hicache.engine.ranks.RankStartError` when the start fails (naming the
    node or rank), ValueError for a model the ranks cannot split, :class:`NodeEnd` when a
    rank died or rank 0 was lost."""
    nodes = config.nodes
    if nodes.leader:
        raise ValueError("run_node() runs a node other than node 0")
    check_tp_model(config.model_path, config.tp_size, config.device)  # as node 0 does
    timeout = config.dist_init_timeout_s
    store = connect_store(nodes, config.tp_size, timeout)
    announce(store, node_card(config), timeout)
    address = bytes(store.get(LINK_KEY)).decode()
    try:
        link = NodeLink(address, nodes.node_rank, timeout)
    except OSError as exc:
        raise NodeStartError(
            f"node {nodes.node_rank} could not reach node 0's link at {address}: {exc}"
        ) from exc
    host, port = nodes.address
    ranks = rank_processes(config, follower_roles)
    try:
        ranks.spawn(f"tcp://{host}:{port}")
        try:
            ranks.wait_joined()
            ranks.wait_ready()
        except RankStartError as exc:
            link.send({"error": str(exc)})
            raise
        link.send({"ready": True})
        _beat(ranks, link, nodes.node_rank)
    finally:
        ranks.terminate()  # nothing left running (a no-op once they have exited)
        link.close()


def _beat(ranks: RankProcesses, link: NodeLink, node: int) -> None:
    """Until this node's ranks have ended (see the module docstring)."""
    while True:
        codes = ranks.exit_codes()
        if link.lost:  # rank 0 stopped (a Stop reached the ranks first) or is gone
            deadline = time.monotonic() + CLOSE_TIMEOUT_S
            while any(c is None for c in ranks.exit_codes().values()):
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.1)
            if all(c == 0 for c in ranks.exit_codes().values()):
                return
            raise NodeEnd(f"node {node}: rank 0 stopped or was lost (its link closed)")
        failed = [r for r, c in codes.items() if c not in (None, 0)]
        if failed:
            why = ranks.dead_rank() or f"rank {failed[0]} stopped"
            link.send({"dead": why})
            raise NodeEnd(f"node {node}: {why}")
        if codes and all(c == 0 for c in codes.values()):
            return  # rank 0 stopped them
        link.send({"beat": {str(r): a for r, a in ranks.ages().items()}})
        multiprocessing.connection.wait(ranks.sentinels, timeout=BEAT_INTERVAL_S)
