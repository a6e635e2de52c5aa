"""A request's bootstrap fields (prefill/decode disaggregation) as the router sends them:
``bootstrap_host``, ``bootstrap_port`` and ``bootstrap_room`` at the top level of the
body, scalars for one prompt and arrays (one entry per prompt) for a batch; a null port
means this instance's ``--disaggregation-bootstrap-port``. :func:`bootstraps` turns them
into one :class:`~hicache.disagg.config.Bootstrap` per prompt, or refuses them naming the
field; a plain instance ignores them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, StrictInt

from hicache.disagg.config import Bootstrap, DisaggConfig
from hicache.engine.sampling import InvalidRequest

__all__ = ["BootstrapFields", "bootstraps"]

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
    field when one is missing on a PD instance, an array's length is not the number of
    prompts, a value is out of range, or ``n`` > 1 (each sequence would need a room)."""
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
    if n > 1:
        raise InvalidRequest(
            f"n={n}: a prefill/decode pair serves one sequence per room; send n=1", param="n"
        )
    columns = {f: _column(f, v, prompts) for f, v in got.items()}
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


def _column(field: str, value: Any, prompts: int) -> Sequence[Any]:
    if not isinstance(value, list):
        if prompts != 1 and field == "bootstrap_room":
            raise InvalidRequest(
                f"{field} must be an array of {prompts} rooms, one per prompt", param=field
            )
        return [value] * prompts
    if len(value) != prompts:
        raise InvalidRequest(f"{field} has {len(value)} entries for {prompts} prompts", param=field)
    return value
