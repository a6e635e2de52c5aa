"""A request's bootstrap fields (prefill/decode disaggregation) as the router sends them:
``bootstrap_host``, ``bootstrap_port`` and ``bootstrap_room`` at the top level of the
body, scalars for one prompt and arrays for a batch (one entry per prompt) or for ``n`` >
1 choices (one entry per sequence, prompt-major: smg's chat route); a null port means
this instance's ``--disaggregation-bootstrap-port``. :func:`bootstraps` turns them into
one :class:`~hicache.disagg.config.Bootstrap` per prompt (a prompt's first entry), or
refuses them naming the field; a plain instance ignores them.

``n`` > 1 through a pair: the prompt's room carries its first copy (the prefill instance
computes the prompt once, samples that copy's first token and sends the pages); the
decode instance runs the other copies from the prompt's KV the room brought, as a plain
instance runs them from its prefix cache (:func:`copy_bootstrap`); the other entries of a
per-sequence array are not used by either side."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, StrictInt

from hicache.disagg.config import NO_TRANSFER_HOST, Bootstrap, DisaggConfig, DisaggMode
from hicache.engine.sampling import InvalidRequest

__all__ = ["BootstrapFields", "bootstraps", "copy_bootstrap"]

FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


class BootstrapFields(BaseModel):
    """The three fields, declared on every generation body (see the module docstring)."""

    bootstrap_host: str | list[str] | None = None
    bootstrap_port: StrictInt | list[StrictInt | None] | None = None
    bootstrap_room: StrictInt | list[StrictInt] | None = None
    """Integers, strictly: ``true`` is not room 1, nor ``"7"`` room 7 (as for token ids)."""


def bootstraps(
    body: BootstrapFields, prompts: int, n: int, disagg: DisaggConfig
) -> list[Bootstrap | None]:
    """One bootstrap per prompt (None on a plain instance). InvalidRequest naming the
    field when one is missing on a PD instance, an array's length is neither the number
    of prompts nor of sequences (``prompts * n``), or a value is out of range."""
    if not disagg.enabled:
        return [None] * prompts
    got = {f: getattr(body, f) for f in FIELDS}
    missing = [f for f in ("bootstrap_host", "bootstrap_room") if got[f] is None]
    if missing:
        raise InvalidRequest(
            f"a {disagg.mode.value} instance needs {' and '.join(missing)} (the router adds"
            " bootstrap_host, bootstrap_port and bootstrap_room; send the request through it)",
            param=missing[0],
        )
    columns = {f: _column(f, v, prompts, n) for f, v in got.items()}
    out: list[Bootstrap | None] = []
    for i in range(prompts):
        host, port, room = (columns[f][i] for f in FIELDS)
        try:
            out.append(Bootstrap(host, disagg.bootstrap_port if port is None else port, room))
        except (TypeError, ValueError) as exc:
            field = str(exc).split("=", 1)[0]
            raise InvalidRequest(
                str(exc), param=field if field in FIELDS else "bootstrap_room"
            ) from None
    return out


def copy_bootstrap(
    bootstrap: Bootstrap | None, copy: int, mode: DisaggMode
) -> tuple[bool, Bootstrap | None]:
    """``(runs, bootstrap)`` of choice ``copy`` of a prompt whose room is ``bootstrap``
    on a ``mode`` instance (see the module docstring): copy 0 takes the room; a later
    copy of a room that transfers does not run on the prefill instance, and runs alone on
    the decode instance (the router's no-transfer host: nothing is sent or awaited)."""
    if copy == 0 or bootstrap is None or not bootstrap.transfers:
        return True, bootstrap
    if mode is DisaggMode.PREFILL:
        return False, None
    return True, Bootstrap(NO_TRANSFER_HOST, bootstrap.port, bootstrap.room)


def _column(field: str, value: Any, prompts: int, n: int) -> Sequence[Any]:
    """``field``'s entry for each prompt: a scalar's value, or each prompt's first entry
    of an array of one per prompt or one per sequence."""
    if not isinstance(value, list):
        if prompts != 1 and field == "bootstrap_room":
            raise InvalidRequest(
                f"{field} must be an array of {prompts} rooms, one per prompt", param=field
            )
        return [value] * prompts
    if len(value) == prompts:
        return value
    if len(value) == prompts * n:
        return value[::n]
    sequences = f" or {prompts * n} sequences" if n > 1 else ""
    raise InvalidRequest(
        f"{field} has {len(value)} entries for {prompts} prompts{sequences}", param=field
    )
