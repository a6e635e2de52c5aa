"""A follower rank's driver: the same step body as rank 0, over the inputs rank 0 sends.

:func:`run_follower` is the main of a spawned follower process: it joins the group,
builds its :class:`~hicache.engine.step.core.EngineCore` and runs :func:`follow`. Each step it
takes rank 0's :class:`~hicache.engine.step_inputs.StepInputs` (a broadcast) and runs
:meth:`EngineCore.step <hicache.engine.step.core.EngineCore.step>` over them. Its requests have
no client (outputs are rank 0's) and its scheduler takes rank 0's sampled tokens. The
error policy: nothing recovers here alone; a step that raises, or an exchange with rank 0
that fails or times out (rank 0 gone), ends this rank (exit code 1), as a
:class:`~hicache.engine.step_inputs.Stop` does (exit code 0).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from hicache.engine.config import EngineConfig
from hicache.engine.ranks import (
    RankSetup,
    cpu_threads_per_rank,
    join_group,
    leave_group,
    rank_device,
    use_interface,
)
from hicache.engine.step.build import RoleMaker, build_core
from hicache.engine.step.core import EngineCore, StepFailed, error_line

log = logging.getLogger(__name__)


def follow(core: EngineCore) -> int:
    """A follower rank's loop (its main thread, once built): each step, the inputs rank 0
    broadcast, through the one step body. Returns 0 at a :class:`Stop`, 1 when a step
    fails here or an exchange with rank 0 fails. The requests in flight are released and
    the cache closed before it returns."""
    channel = core.channel
    if channel is None or channel.leader:
        raise RuntimeError("follow() runs on a follower rank (a core with a follower's channel)")
    code = 0
    reason = "rank 0 stopped the engine"
    try:
        while True:
            inputs = channel.inputs(None)
            core.step(inputs)
            if inputs.stop is not None:
                reason = inputs.stop.reason
                break
    except BaseException as exc:
        failed = exc.error if isinstance(exc, StepFailed) else exc
        code = 1
        reason = f"rank {core.rank} stopped: {type(failed).__name__}: {failed}"
        log.error("%s", reason)
    core.fail_in_flight(reason)
    core.close_cache()
    return code


def run_follower(
    setup: RankSetup,
    payload: tuple[dict[str, Any], Callable[[], RoleMaker] | None],
    conn: Any,
) -> None:
    """The main of follower rank ``setup.rank`` (a spawned process): join the group, build
    the core (``EngineConfig(**fields)``, see :func:`~hicache.engine.config.config_fields`,
    with the role ``roles()`` makes: ``payload`` is ``(fields, roles)``, pickled) on this
    rank's device, say so on ``conn`` (``("joining",)``, ``("joined",)``, ``("ready",)``, or
    ``("error", line)`` before exiting 1), then :func:`follow` until told to stop."""
    fields, roles = payload
    config = EngineConfig(**fields)
    logging.basicConfig(
        level=logging.WARNING, format=f"%(asctime)s %(levelname)s rank {setup.rank}: %(message)s"
    )
    if torch.device(config.device).type == "cpu":
        torch.set_num_threads(cpu_threads_per_rank(setup.size))
    if setup.heartbeats is not None:
        setup.heartbeats.start(setup.rank)
    code = 1
    try:
        try:
            conn.send(("joining",))
            use_interface(setup.interface)
            channel = join_group(setup)
        except BaseException as exc:
            conn.send(("error", f"could not join the process group: {error_line(exc)}"))
            return
        conn.send(("joined",))
        device = rank_device(config.device, setup.local)
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        try:
            make_role = None if roles is None else roles()
            core = build_core(
                dataclasses.replace(config, device=device), channel=channel, make_role=make_role
            )
        except BaseException as exc:
            conn.send(("error", error_line(exc)))
            return
        conn.send(("ready",))
        code = follow(core)
    finally:
        with contextlib.suppress(OSError):
            conn.close()
        leave_group()
        os._exit(code)  # no interpreter teardown that could wait on a broken group


__all__ = ["follow", "run_follower"]
