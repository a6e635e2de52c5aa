"""Starting rank 0 of a tensor-parallel engine: the followers spawned and joined, every
rank's core built, or none left running.

Invariant: :func:`start_ranks` returns only once every rank has built its core; on any
failure every follower is stopped and rank 0's cache closed before the error is raised.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hicache.engine.config import EngineConfig, config_fields
from hicache.engine.drivers.follower import run_follower
from hicache.engine.nodes import NodeCard
from hicache.engine.ranks import RankProcesses, RankStartError, cpu_threads_per_rank
from hicache.engine.step.build import RoleMaker, build_core, close_alone
from hicache.engine.step.core import EngineCore, error_line
from hicache.engine.tp_fit import check_tp_model

__all__ = ["node_card", "rank_processes", "start_ranks"]


def node_card(config: EngineConfig) -> NodeCard:
    """What this node was started with, as node 0 compares it."""
    return NodeCard(
        node_rank=config.nodes.node_rank,
        nnodes=config.nodes.nnodes,
        tp_size=config.tp_size,
        model=str(config.model_path),
    )


def rank_processes(
    config: EngineConfig, follower_roles: Callable[[], RoleMaker] | None
) -> RankProcesses:
    """This node's followers of ``config`` (not started; on CPU, this process's torch
    threads set to its share of the cores)."""
    on_cuda = torch.device(config.device).type == "cuda"
    if not on_cuda:  # the cores shared out between the ranks
        torch.set_num_threads(cpu_threads_per_rank(config.tp_size))
    return RankProcesses(
        config.tp_size,
        run_follower,
        (config_fields(config), follower_roles),
        backend="nccl" if on_cuda else "gloo",
        init_timeout_s=config.dist_init_timeout_s,
        collective_timeout_s=config.collective_timeout_s,
        nodes=config.nodes,
        host=config.disagg.host,
        card=node_card(config),
    )


def start_ranks(
    config: EngineConfig,
    make_role: RoleMaker | None = None,
    follower_roles: Callable[[], RoleMaker] | None = None,
) -> tuple[RankProcesses, EngineCore]:
    """Rank 0 of ``config.tp_size`` ranks: check the model splits, spawn and join the
    followers, build rank 0's core (with ``make_role``'s role; each follower's with the
    one ``follower_roles()`` makes there: a picklable callable), wait until every follower
    has built its own. A rank
    that fails (rank 0 included: its error in one line) or does not make it within
    ``dist_init_timeout_s`` fails it (:class:`~hicache.engine.ranks.RankStartError`,
    naming it), every follower stopped and rank 0's cache closed."""
    check_tp_model(config.model_path, config.tp_size, config.device)  # before any spawn
    ranks = rank_processes(config, follower_roles)
    channel = ranks.start()  # stops what it started when it fails
    try:
        core = build_core(config, channel=channel, make_role=make_role)
    except Exception as exc:
        ranks.close(timeout=5.0, broken=True)
        line = f"rank 0 failed while building its engine: {error_line(exc)}"
        raise RankStartError(line) from exc
    except BaseException:
        ranks.close(timeout=5.0, broken=True)
        raise
    try:
        ranks.wait_ready()
    except BaseException:
        ranks.close(timeout=5.0, broken=True)  # leaves the group: no rank joins a collective
        core.scheduler.role.close()
        close_alone(core.cache)
        raise
    return ranks, core
