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
