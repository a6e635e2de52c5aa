"""Follower mains that misbehave, for the rank start-up tests (spawned processes import
this module, so it stays light: no torch model, no pytest)."""

from __future__ import annotations

import os
import time
from typing import Any


def never_joins(setup: Any, payload: Any, conn: Any) -> None:
    """A rank that never joins the process group (stuck before it)."""
    time.sleep(120)


def exits_at_once(setup: Any, payload: Any, conn: Any) -> None:
    """A rank that dies before joining (exit code 3)."""
    os._exit(3)


def joins_and_gathers(setup: Any, payload: Any, conn: Any) -> None:
    """A rank that joins the process group, takes part in one gather (its rank), and
    leaves."""
    from hicache.engine.ranks import join_group, leave_group

    conn.send(("joining",))
    channel = join_group(setup)
    conn.send(("joined",))
    channel.gather(f"rank {setup.rank}")
    leave_group()
