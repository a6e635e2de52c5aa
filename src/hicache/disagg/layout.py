"""What a prefill and a decode instance must agree on, and what the decode side tells the
prefill side of one request: :class:`InstanceLayout` (checked at the handshake,
:func:`check_pair`) and :class:`Registration`.

The two instances may run at different tensor-parallel sizes: a store whose rows are split
by K/V heads (``StoreLayout.kv_heads``) is compared per head, and the decode side
registers every rank's pools (:class:`RankTarget`), the page ids being the same on every
rank of an instance.

Both are plain frozen records with a JSON form (``to_json`` / ``from_json``): they cross
the bootstrap server's HTTP. Nothing here does IO.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from hicache.heads import HeadSplit

__all__ = [
    "InstanceLayout",
    "LayoutMismatch",
    "RankTarget",
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
    """One store's L1 page on one rank: ``name`` (``full`` or the component's), ``num_kv``
    (2: K and V; 1: an MLA latent or one tensor), ``layers``, ``row_bytes`` (one token's
    bytes in one layer of one kind on one rank: the rank's heads x dim x itemsize),
    ``dtype``; ``kv_heads``: the model's K/V heads when the rows are split across ranks
    by :class:`~hicache.heads.HeadSplit` (each rank holds its heads' columns), 0 when
    every rank holds the whole row (an MLA latent, indexer keys). ``state``: the store is
    one slot per request, a recurrent model's state after the whole prompt (this rank's
    shard of it), not sequence pages: sent whole with the final job, whatever prefix the
    decode side holds."""

    name: str
    num_kv: int
    layers: int
    row_bytes: int
    dtype: str
    kv_heads: int = 0
    state: bool = False


@dataclass(frozen=True, slots=True)
class InstanceLayout:
    """What a pair must share: the ``model`` served (its name and ``fingerprint`` of the
    weights), ``page_size`` (tokens), ``mla`` (the KV is a latent that does not depend on
    the TP rank), the ``transfer_backend`` and each store's page (``stores``, the full KV
    first); and what may differ: ``tp_size``, with ``num_heads`` (the model's query
    heads, which with a store's ``kv_heads`` say which heads each rank holds)."""

    model: str
    fingerprint: str
    page_size: int
    tp_size: int
    mla: bool
    transfer_backend: str
    stores: tuple[StoreLayout, ...]
    num_heads: int = 0

    def heads(self, store: StoreLayout, rank: int) -> HeadSplit | None:
        """The heads ``rank`` holds of ``store`` (None: the rows are whole on every rank)."""
        if not store.kv_heads:
            return None
        return HeadSplit(self.num_heads, store.kv_heads, self.tp_size, rank)

    def head_bytes(self, store: StoreLayout) -> int:
        """Bytes of one head of ``store``'s row (of the whole row when it is not split)."""
        split = self.heads(store, 0)
        return store.row_bytes if split is None else store.row_bytes // split.local_kv_heads

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "fingerprint": self.fingerprint,
            "page_size": self.page_size,
            "tp_size": self.tp_size,
            "mla": self.mla,
            "transfer_backend": self.transfer_backend,
            "num_heads": self.num_heads,
            "stores": [
                {
                    "name": s.name,
                    "num_kv": s.num_kv,
                    "layers": s.layers,
                    "row_bytes": s.row_bytes,
                    "dtype": s.dtype,
                    "kv_heads": s.kv_heads,
                    "state": s.state,
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
                num_heads=int(d.get("num_heads", 0)),
                stores=tuple(
                    StoreLayout(
                        name=str(s["name"]),
                        num_kv=int(s["num_kv"]),
                        layers=int(s["layers"]),
                        row_bytes=int(s["row_bytes"]),
                        dtype=str(s["dtype"]),
                        kv_heads=int(s.get("kv_heads", 0)),
                        state=bool(s.get("state", False)),
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
    pages would not mean the same on both sides. TP sizes may differ: a whole row is
    compared whole, a row split by K/V heads head by head (its ``row_bytes`` per head);
    each side's split was checked when its model loaded, so any two sizes pair, but for a
    model with recurrent state (a ``state`` store): each rank's state holds its heads in
    its own layout, moved rank to rank, so its pair needs equal TP sizes."""

    def differ(what: str, p: object, d: object) -> LayoutMismatch:
        return LayoutMismatch(
            f"{what} differs: the prefill instance has {p!r}, the decode instance {d!r}"
        )

    for what in ("model", "fingerprint", "page_size", "transfer_backend", "mla"):
        if getattr(prefill, what) != getattr(decode, what):
            raise differ(what, getattr(prefill, what), getattr(decode, what))
    names_p = [s.name for s in prefill.stores]
    names_d = [s.name for s in decode.stores]
    if names_p != names_d:
        raise differ("stores", names_p, names_d)
    if any(s.state for s in prefill.stores) and prefill.tp_size != decode.tp_size:
        raise LayoutMismatch(
            f"tp_size differs: the prefill instance has {prefill.tp_size!r}, the decode"
            f" instance {decode.tp_size!r}; {prefill.model} carries recurrent state, split by"
            " heads per rank, which a pair moves only rank to rank: run both at one TP size"
        )
    if any(s.kv_heads for s in prefill.stores) and prefill.num_heads != decode.num_heads:
        raise differ("num_heads", prefill.num_heads, decode.num_heads)
    for sp, sd in zip(prefill.stores, decode.stores, strict=True):
        for what in ("num_kv", "layers", "dtype", "kv_heads"):
            if getattr(sp, what) != getattr(sd, what):
                raise differ(f"store {sp.name!r} {what}", getattr(sp, what), getattr(sd, what))
        if sp.kv_heads:
            hp, hd = prefill.head_bytes(sp), decode.head_bytes(sd)
            if hp != hd:
                raise LayoutMismatch(
                    f"{differ(f'store {sp.name!r} bytes per head', hp, hd)} (prefill: TP"
                    f" {prefill.tp_size}, {_heads(prefill, sp)}; decode: TP {decode.tp_size},"
                    f" {_heads(decode, sd)})"
                )
        elif sp.row_bytes != sd.row_bytes:
            raise differ(f"store {sp.name!r} row_bytes", sp.row_bytes, sd.row_bytes)


def _heads(layout: InstanceLayout, store: StoreLayout) -> str:
    split = layout.heads(store, 0)
    assert split is not None
    return (
        f"rows of {store.row_bytes} bytes holding {split.local_kv_heads} of"
        f" {split.num_kv_heads} K/V heads"
    )


@dataclass(frozen=True, slots=True)
class StoreTarget:
    """Where one store's pages of a request go on the decode side: ``pages[i]`` receives
    sequence page ``first + i`` (the same page ids on every rank)."""

    name: str
    first: int
    pages: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class RankTarget:
    """One decode rank as a writer reaches it: its transport's ``endpoint`` and each
    store's L1 pool there (``geometry``: store name -> the pool's
    :class:`~hicache.disagg.pages.PoolGeometry` as JSON)."""

    endpoint: str
    geometry: Mapping[str, Mapping[str, Any]]

    def to_json(self) -> dict[str, Any]:
        return {
            "endpoint": self.endpoint,
            "geometry": {k: dict(v) for k, v in self.geometry.items()},
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RankTarget:
        """The rank ``to_json`` wrote (KeyError/TypeError/ValueError on anything else)."""
        return cls(str(d["endpoint"]), {str(k): dict(v) for k, v in d["geometry"].items()})


@dataclass(frozen=True, slots=True)
class Registration:
    """The decode side's half of a room: the ``room``; its ``layout``; its ``ranks``
    (rank ``r``'s endpoint and pools, ``layout.tp_size`` of them); the request's
    ``prompt_len`` and ``prompt_hash`` (both sides must have tokenized the same prompt);
    ``skip_pages``: leading sequence pages it already holds (its own cache's hit, loaded
    into L1 before it registers: the prefill sends none of them); ``targets``: per store,
    the pages it allocated."""

    room: int
    layout: InstanceLayout
    ranks: tuple[RankTarget, ...]
    prompt_len: int
    prompt_hash: str
    skip_pages: int
    targets: tuple[StoreTarget, ...]

    def __post_init__(self) -> None:
        if len(self.ranks) != self.layout.tp_size:
            raise ValueError(
                f"a registration names {len(self.ranks)} ranks for a decode instance of"
                f" tp_size {self.layout.tp_size}"
            )

    def to_json(self) -> dict[str, Any]:
        return {
            "room": self.room,
            "layout": self.layout.to_json(),
            "ranks": [r.to_json() for r in self.ranks],
            "prompt_len": self.prompt_len,
            "prompt_hash": self.prompt_hash,
            "skip_pages": self.skip_pages,
            "targets": [
                {"name": t.name, "first": t.first, "pages": list(t.pages)} for t in self.targets
            ],
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Registration:
        """The registration ``to_json`` wrote; ValueError naming what is wrong."""
        try:
            return cls(
                room=int(d["room"]),
                layout=InstanceLayout.from_json(d["layout"]),
                ranks=tuple(RankTarget.from_json(r) for r in d["ranks"]),
                prompt_len=int(d["prompt_len"]),
                prompt_hash=str(d["prompt_hash"]),
                skip_pages=int(d["skip_pages"]),
                targets=tuple(
                    StoreTarget(
                        name=str(t["name"]),
                        first=int(t["first"]),
                        pages=tuple(int(p) for p in t["pages"]),
                    )
                    for t in d["targets"]
                ),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(
                f"a registration that cannot be read ({type(exc).__name__}: {exc})"
            ) from None


def prompt_hash(prompt_ids: Sequence[int]) -> str:
    """A digest of a prompt's token ids, to check both sides tokenized the same prompt."""
    return xxhash.xxh3_64_hexdigest(array("q", prompt_ids).tobytes())
