"""SGLang's real router for the router tests: :class:`hicache.bench.smgproc.Smg` (one
``smg launch`` subprocess on free ports, stopped by PID), re-exported here, and
:func:`require_smg`, which skips a test when the ``smg`` binary is missing (and fails it
under ``CI=true``)."""

from __future__ import annotations

from hicache.bench.smgproc import SMG_HINT, Smg, SmgError, smg_path, smg_router
from tests.helpers.services import missing

__all__ = ["Smg", "SmgError", "require_smg", "smg_path", "smg_router"]


def require_smg() -> str:
    """The ``smg`` executable; skips the test when there is none (fails it under CI)."""
    path = smg_path()
    if path is None:
        missing("smg (SGLang's router)", SMG_HINT)
    return path
