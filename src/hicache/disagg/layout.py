"""What a prefill and a decode instance must agree on, and what the decode side tells the
prefill side of one request: :class:`InstanceLayout` (checked at the handshake,
:func:`check_pair`) and :class:`Registration`.

Both are plain frozen records with a JSON form (``to_json`` / ``from_json``): they cross
the bootstrap server's HTTP. Nothing here does IO.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

__all__ = [
    "InstanceLayout",
    "LayoutMismatch",
    "Registration",
    "StoreLayout",
    "StoreTarget",
    "check_pair",
    "prompt_hash",
]


class LayoutMismatch(ValueError):
    """A prefill and a decode instance that cannot be paired: names the field and both
    values."""


@dataclass(frozen=True, slots=True)
class StoreLayout:
    """One store's L1 page, as both sides must have it: ``name`` (``full`` or the
    component's), ``num_kv`` (2: K and V; 1: an MLA latent or one tensor), ``layers``,
    ``row_bytes`` (one token's bytes in one layer of one kind: heads x dim x itemsize),
    ``dtype``."""

    name: str
    num_kv: int
    layers: int
    row_bytes: int
    dtype: str


@dataclass(frozen=True, slots=True)
class InstanceLayout:
    """What a pair must share: the ``model`` served (its name and ``fingerprint`` of the
    weights), ``page_size`` (tokens), ``tp_size``, ``mla`` (the KV is a latent that does
    not depend on the TP rank), the ``transfer_backend`` and each store's page
    (``stores``, the full KV first)."""

    model: str
    fingerprint: str
    page_size: int
    tp_size: int
    mla: bool
    transfer_backend: str
    stores: tuple[StoreLayout, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "fingerprint": self.fingerprint,
            "page_size": self.page_size,
            "tp_size": self.tp_size,
            "mla": self.mla,
            "transfer_backend": self.transfer_backend,
            "stores": [
                {
                    "name": s.name,
                    "num_kv": s.num_kv,
                    "layers": s.layers,
                    "row_bytes": s.row_bytes,
                    "dtype": s.dtype,
                }
                for s in self.stores
            ],
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> InstanceLayout:
        """The layout ``to_json`` wrote; ValueError naming what is missing or wrong."""
        try:
            return cls(
                model=str(d["model"]),
                fingerprint=str(d["fingerprint"]),
                page_size=int(d["page_size"]),
                tp_size=int(d["tp_size"]),
                mla=bool(d["mla"]),
                transfer_backend=str(d["transfer_backend"]),
                stores=tuple(
                    StoreLayout(
                        name=str(s["name"]),
                        num_kv=int(s["num_kv"]),
                        layers=int(s["layers"]),
                        row_bytes=int(s["row_bytes"]),
                        dtype=str(s["dtype"]),
                    )
                    for s in d["stores"]
                ),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"a layout that cannot be read ({type(exc).__name__}: {exc})"
            ) from None


def check_pair(prefill: InstanceLayout, decode: InstanceLayout) -> None:
    """Refuse (:class:`LayoutMismatch`, naming the field and both values) a pair whose
    pages would not mean the same on both sides. TP sizes may differ for an MLA model
    (its latent is whole on every rank) but must match otherwise."""

    def differ(what: str, p: object, d: object) -> LayoutMismatch:
        return LayoutMismatch(
            f"{what} differs: the prefill instance has {p!r}, the decode instance {d!r}"
        )

    for what in ("model", "fingerprint", "page_size", "transfer_backend", "mla"):
        if getattr(prefill, what) != getattr(decode, what):
            raise differ(what, getattr(prefill, what), getattr(decode, what))
    if prefill.tp_size != decode.tp_size and not prefill.mla:
        raise differ("tp_size", prefill.tp_size, decode.tp_size)
    names_p = [s.name for s in prefill.stores]
    names_d = [s.name for s in decode.stores]
    if names_p != names_d:
        raise differ("stores", names_p, names_d)
    for sp, sd in zip(prefill.stores, decode.stores, strict=True):
        for what in ("num_kv", "layers", "row_bytes", "dtype"):
            if getattr(sp, what) != getattr(sd, what):
                raise differ(f"store {sp.name!r} {what}", getattr(sp, what), getattr(sd, what))


@dataclass(frozen=True, slots=True)
class StoreTarget:
    """Where one store's pages of a request go on the decode side: ``pages[i]`` of its
    pool (described by ``geometry``, the pool's
    :class:`~hicache.disagg.pages.PoolGeometry` as JSON) receives sequence page
    ``first + i``."""

    name: str
    geometry: Mapping[str, Any]
    first: int
    pages: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Registration:
    """The decode side's half of a room: the ``room``; its ``layout``; its transport
    ``endpoint``; the request's ``prompt_len`` and ``prompt_hash`` (both sides must
    have tokenized the same prompt); ``skip_pages``: leading sequence pages it already
    holds (its own cache's hit, loaded into L1 before it registers: the prefill sends none
    of them); ``targets``: per store, the pages it allocated."""

    room: int
    layout: InstanceLayout
    endpoint: str
    prompt_len: int
    prompt_hash: str
    skip_pages: int
    targets: tuple[StoreTarget, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "room": self.room,
            "layout": self.layout.to_json(),
            "endpoint": self.endpoint,
            "prompt_len": self.prompt_len,
            "prompt_hash": self.prompt_hash,
            "skip_pages": self.skip_pages,
            "targets": [
                {
                    "name": t.name,
                    "geometry": dict(t.geometry),
                    "first": t.first,
                    "pages": list(t.pages),
                }
                for t in self.targets
            ],
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Registration:
        """The registration ``to_json`` wrote; ValueError naming what is wrong."""
        try:
            return cls(
                room=int(d["room"]),
                layout=InstanceLayout.from_json(d["layout"]),
                endpoint=str(d["endpoint"]),
                prompt_len=int(d["prompt_len"]),
                prompt_hash=str(d["prompt_hash"]),
                skip_pages=int(d["skip_pages"]),
                targets=tuple(
                    StoreTarget(
                        name=str(t["name"]),
                        geometry=dict(t["geometry"]),
                        first=int(t["first"]),
                        pages=tuple(int(p) for p in t["pages"]),
                    )
                    for t in d["targets"]
                ),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"a registration that cannot be read ({type(exc).__name__}: {exc})"
            ) from None


def prompt_hash(prompt_ids: Sequence[int]) -> str:
    """A digest of a prompt's token ids, to check both sides tokenized the same prompt."""
    return xxhash.xxh3_64_hexdigest(array("q", prompt_ids).tobytes())
