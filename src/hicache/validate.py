"""The checks every config dataclass uses in ``__post_init__``.

A failed check raises :class:`ValueError` worded one way everywhere:
``"<field>=<value!r> is invalid; <what is allowed>"`` (or, for an enum,
``"<field>=<value!r> is not allowed; choose one of ..."``), so a user sees which field,
which value and what would do.

This module is pure: no torch, no threads, no IO; it imports nothing from hicache.
"""

from __future__ import annotations

import enum
import math
from typing import Any, TypeVar

__all__ = [
    "enum_value",
    "int_at_least",
    "is_finite_number",
    "is_int",
    "is_number",
    "number_at_least",
    "require",
]

E = TypeVar("E", bound=enum.Enum)


def require(ok: bool, field: str, value: Any, allowed: str) -> None:
    """Raise ``ValueError("<field>=<value!r> is invalid; <allowed>")`` unless ``ok``."""
    if not ok:
        raise ValueError(f"{field}={value!r} is invalid; {allowed}")


def is_int(value: Any) -> bool:
    """True for an ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """True for an ``int`` or ``float`` that is not a ``bool`` (NaN and infinities included)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_finite_number(value: Any) -> bool:
    """True for an ``int`` or a finite ``float`` (not a ``bool``, NaN or an infinity)."""
    return is_number(value) and math.isfinite(value)


def enum_value(cls: type[E], field: str, value: Any) -> E:
    """``value`` as a member of ``cls`` (a member, or a member's value such as its string).

    Raises ValueError naming ``field``, ``value`` and every allowed value.
    """
    if isinstance(value, cls):
        return value
    try:
        return cls(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"{field}={value!r} is not allowed; choose one of {allowed}") from None


def int_at_least(field: str, value: Any, low: int, note: str = "") -> None:
    """Require an int ``>= low``; ``note`` (e.g. ``"(tokens)"``) ends the message."""
    tail = f" {note}" if note else ""
    require(is_int(value) and value >= low, field, value, f"must be an int >= {low}{tail}")


def number_at_least(field: str, value: Any, low: float, note: str = "") -> None:
    """Require a finite number ``>= low``; ``note`` (e.g. ``"of seconds"``) names the unit."""
    unit = f" {note}" if note else ""
    require(
        is_finite_number(value) and value >= low,
        field,
        value,
        f"must be a finite number{unit} >= {low:g}",
    )
