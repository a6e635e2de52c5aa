"""The L3 page-key spec: chained SHA-256 over page tokens under a namespace digest.

``docs/l3-keys.md`` is the normative text, with test vectors. In short (spec version 3):
the :class:`Namespace` pins everything that changes a page's bytes or who may read it
(model and weights fingerprint, KV dtype, host layout, page size, TP size and rank, the
latter omitted for MLA and for MHA head records, ``records`` ``"page"`` or ``"head"``, the
component, a tenant salt); its digest is the SHA-256 (32 bytes) of its compact, key-sorted
ASCII JSON encoding, which includes ``"spec": 3``. Page ``i`` (1-based) gets ``h_i =
sha256(h_{i-1} || tokens_i)``, ``h_0`` the namespace digest, tokens as u32 little-endian;
the key is ``"hc3-" + hex(h_i)``. Under ``"head"`` records, head ``j`` of page ``i`` is
``sha256(h_i || b"kv_head" || u32le(j))`` (:func:`head_key`). A component's record is keyed
like its page under the namespace with that component (:meth:`Namespace.with_component`).
Only whole pages are keyed. Each :class:`PageKey` carries a token fingerprint (the first 8
bytes of ``sha256(tokens_i)``) for the record header. Pure: no torch, no threads, no IO.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from hicache.config import MemLayout
from hicache.spec import DTYPES, AttentionKind, KVSpec
from hicache.tokens import TOKEN_BYTES, TOKEN_ID_LIMIT, TokenIds, encode_tokens
from hicache.validate import enum_value, int_at_least, is_int, require

__all__ = [
    "DIGEST_BYTES",
    "FINGERPRINT_BYTES",
    "FULL_COMPONENT",
    "HEAD_RECORDS",
    "KEY_PREFIX",
    "KEY_SPEC_VERSION",
    "PAGE_RECORDS",
    "PREVIOUS_SPEC_VERSION",
    "RECORDS",
    "TOKEN_ID_LIMIT",
    "Namespace",
    "PageKey",
    "PreviousPage",
    "engine_page_key",
    "head_key",
    "page_keys",
    "previous_page_key",
    "token_bytes",
    "token_fingerprint",
]

KEY_SPEC_VERSION = 3
"""Version of the key and namespace encoding; bumped on any change that alters a key or a
record (2: component records, such as recurrent-state snapshots, in their own namespace
component; 3: the ``records`` field, MHA pages stored as one record per K/V head under a
namespace without TP size or rank; a record of another version reads as a miss)."""

PREVIOUS_SPEC_VERSION = 2
"""The spec version before this one, whose records a reader may still meet (and counts:
:func:`previous_page_key`)."""

PAGE_RECORDS = "page"
"""``Namespace.records``: one record per page holding the page as the writer's pool holds
it (a rank's shard of the heads when ``tp_rank`` is set, the whole latent for MLA)."""

HEAD_RECORDS = "head"
"""``Namespace.records``: one record per page and group of ``head_group`` K/V heads
(:func:`head_key`), the same for every TP size whose ranks hold whole groups;
``tp_size`` 1 and ``tp_rank`` null."""

RECORDS = (PAGE_RECORDS, HEAD_RECORDS)

FULL_COMPONENT = "full"
"""The namespace component of full-attention KV pages."""

KEY_PREFIX = f"hc{KEY_SPEC_VERSION}-"
"""Readable prefix of every key string of this spec version."""

DIGEST_BYTES = 32
"""Bytes of a namespace digest and of a chained page hash (SHA-256)."""

FINGERPRINT_BYTES = 8
"""Bytes of a page's token fingerprint."""


@dataclass(frozen=True, kw_only=True)
class Namespace:
    """Everything that must match for an L3 page to be reusable.

    Two engines share L3 pages exactly when their namespaces are equal. ``tp_rank`` is
    ``None`` when a record's bytes do not depend on the rank (MLA, where every rank holds
    the same latent; ``records="head"``, where a record holds one K/V head), and then
    ``tp_size`` is 1: such bytes do not depend on the tensor-parallel size either, so
    servers of any size share them; use :meth:`for_spec` to get that right from a
    :class:`~hicache.spec.KVSpec`. ``tenant_salt`` is the request's
    ``cache_salt`` (``""`` for none): different salts never share pages.
    """

    model: str
    weights_fingerprint: str
    kv_dtype: str
    layout: MemLayout
    page_size: int
    tp_size: int = 1
    tp_rank: int | None = 0
    records: str = PAGE_RECORDS
    """How a page is split into records: ``"page"`` (one record, the pool's page) or
    ``"head"`` (one record per group of :attr:`head_group` K/V heads, :func:`head_key`;
    ``tp_rank`` must be null)."""
    head_group: int = 1
    """K/V heads per record under ``records="head"`` (1 under ``"page"``): record ``j`` of
    a page holds heads ``[j * head_group, (j + 1) * head_group)``. Encoded only when not
    1, so a one-head namespace's digest is unchanged by it."""
    component: str = FULL_COMPONENT
    tenant_salt: str = ""
    engine_layout: str = ""
    """Another engine's host layout whose byte order the payloads have, as
    ``"<engine>:<layout>[;<shard>...]"`` (e.g. ``"sglang:page_head"``); ``""`` (the
    default) for hicache's own pools, whose ``layout`` says it all. Encoded only when
    set, so every hicache namespace's encoding and digest is unchanged by it. See
    docs/l3-keys.md, "Keys for SGLang pages"."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "layout", enum_value(MemLayout, "layout", self.layout))
        for name in ("model", "weights_fingerprint", "component"):
            v = getattr(self, name)
            require(isinstance(v, str) and v != "", name, v, "must be a non-empty str")
        require(isinstance(self.tenant_salt, str), "tenant_salt", self.tenant_salt, "must be a str")
        require(
            isinstance(self.engine_layout, str)
            and (self.engine_layout == "" or ":" in self.engine_layout),
            "engine_layout",
            self.engine_layout,
            'must be "" or "<engine>:<layout>"',
        )
        require(self.kv_dtype in DTYPES, "kv_dtype", self.kv_dtype, f"choose one of {DTYPES}")
        int_at_least("page_size", self.page_size, 1)
        int_at_least("tp_size", self.tp_size, 1)
        require(
            self.tp_rank is None or (is_int(self.tp_rank) and 0 <= self.tp_rank < self.tp_size),
            "tp_rank",
            self.tp_rank,
            f"must be None (shared by all ranks, MLA) or an int in [0, {self.tp_size})",
        )
        require(
            self.tp_rank is not None or self.tp_size == 1,
            "tp_size",
            self.tp_size,
            "must be 1 when tp_rank is None (bytes every rank holds do not depend on TP)",
        )
        require(self.records in RECORDS, "records", self.records, f"choose one of {RECORDS}")
        require(
            self.records == PAGE_RECORDS or self.tp_rank is None,
            "tp_rank",
            self.tp_rank,
            'must be None with records="head" (a head record does not depend on the rank)',
        )
        int_at_least("head_group", self.head_group, 1)
        require(
            self.records == HEAD_RECORDS or self.head_group == 1,
            "head_group",
            self.head_group,
            'must be 1 with records="page" (a page record holds the pool\'s heads)',
        )

    @classmethod
    def for_spec(
        cls,
        spec: KVSpec,
        *,
        model: str,
        weights_fingerprint: str,
        layout: MemLayout | str,
        page_size: int,
        tp_size: int = 1,
        tp_rank: int = 0,
        component: str = FULL_COMPONENT,
        tenant_salt: str = "",
        head_records: bool = False,
        head_group: int = 1,
    ) -> Namespace:
        """The namespace of one rank's cache of shape ``spec``.

        Takes the dtype from ``spec``; for MLA the rank and the size are dropped
        (``tp_rank=None``, ``tp_size=1``): the latent KV does not depend on tensor
        parallelism, so every rank of every TP size shares one namespace (and only rank 0
        of a group writes L3). ``head_records`` (MHA; the engine's choice): one record per
        group of ``head_group`` K/V heads (``records="head"``), the rank and the size
        dropped too, so servers of every TP size whose ranks hold whole groups share the
        records (the lowest rank holding a head writes it,
        :class:`~hicache.heads.HeadSplit`); ignored for MLA, whose latent is one record.
        """
        require(
            is_int(tp_rank) and is_int(tp_size) and 0 <= tp_rank < tp_size,
            "tp_rank",
            tp_rank,
            f"must be an int in [0, {tp_size})",
        )
        mla = spec.attention is AttentionKind.MLA
        heads = head_records and not mla
        shared = mla or heads
        rank: int | None = None if shared else tp_rank
        return cls(
            model=model,
            weights_fingerprint=weights_fingerprint,
            kv_dtype=spec.dtype,
            layout=MemLayout(layout),
            page_size=page_size,
            tp_size=1 if shared else tp_size,
            tp_rank=rank,
            records=HEAD_RECORDS if heads else PAGE_RECORDS,
            head_group=head_group if heads else 1,
            component=component,
            tenant_salt=tenant_salt,
        )

    def encode(self) -> bytes:
        """Canonical encoding: compact, key-sorted, ASCII-only JSON of the fields and spec
        (``engine_layout`` only when set)."""
        doc = self._fields(KEY_SPEC_VERSION)
        doc["records"] = self.records
        if self.head_group != 1:
            doc["head_group"] = self.head_group
        return _canonical(doc)

    def previous_digest(self, tp_size: int, tp_rank: int | None) -> bytes:
        """The digest a spec-2 engine gave this namespace on rank ``tp_rank`` of
        ``tp_size`` (``records`` did not exist; ``tp_size`` / ``tp_rank`` as that engine
        had them: the rank's for MHA, 1 / None for MLA): where its records lie, for
        :func:`previous_page_key`."""
        doc = self._fields(PREVIOUS_SPEC_VERSION)
        doc["tp_size"], doc["tp_rank"] = tp_size, tp_rank
        return hashlib.sha256(_canonical(doc)).digest()

    def _fields(self, spec: int) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "spec": spec,
            "model": self.model,
            "weights_fingerprint": self.weights_fingerprint,
            "kv_dtype": self.kv_dtype,
            "layout": self.layout.value,
            "page_size": self.page_size,
            "tp_size": self.tp_size,
            "tp_rank": self.tp_rank,
            "component": self.component,
            "tenant_salt": self.tenant_salt,
        }
        if self.engine_layout:
            doc["engine_layout"] = self.engine_layout
        return doc

    @cached_property
    def digest(self) -> bytes:
        """SHA-256 of :meth:`encode` (32 bytes); the chain's ``h_0``."""
        return hashlib.sha256(self.encode()).digest()

    def with_salt(self, tenant_salt: str) -> Namespace:
        """The same namespace for another tenant."""
        return dataclasses.replace(self, tenant_salt=tenant_salt)

    def with_component(self, component: str) -> Namespace:
        """The same namespace for another component's records (``"mamba"``: recurrent-state
        snapshots; ``"swa"``: sliding-window KV pages; ``"full"``: full-attention KV
        pages)."""
        return dataclasses.replace(self, component=component)

    def for_slots(self, tp_size: int, tp_rank: int) -> Namespace:
        """The namespace of records that hold rank ``tp_rank`` of ``tp_size``'s shard of
        whole state slots (a recurrent model's snapshots, split by heads but recorded a
        slot per key): under ``records="head"``, page records of that rank and size (a
        shard no other TP size can read); a ``"page"`` namespace is already per rank and
        is returned as it is."""
        if self.records == PAGE_RECORDS:
            return self
        return dataclasses.replace(
            self, records=PAGE_RECORDS, head_group=1, tp_size=tp_size, tp_rank=tp_rank
        )


def _canonical(doc: dict[str, Any]) -> bytes:
    """Compact, key-sorted, ASCII-only JSON of ``doc``."""
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return text.encode("ascii")


@dataclass(frozen=True, slots=True)
class PageKey:
    """The L3 key of one whole page.

    ``key`` is the string backends store under (``"hc3-"`` + 64 hex digits); ``digest`` is
    the raw chained hash (32 bytes) from which the next page's key is chained;
    ``fingerprint`` is the first 8 bytes of ``sha256`` of this page's tokens alone.
    """

    key: str
    digest: bytes
    fingerprint: bytes
    namespace_digest: bytes = b""
    """The digest of the namespace the key was chained under (what its record's header
    must carry); empty means the storage instance's own namespace."""

    def __str__(self) -> str:
        return self.key


def token_fingerprint(page_tokens: TokenIds | Any) -> bytes:
    """First 8 bytes of ``sha256`` of one page's tokens as u32 little-endian."""
    return hashlib.sha256(encode_tokens(page_tokens, strict=True)).digest()[:FINGERPRINT_BYTES]


def page_keys(
    namespace: Namespace,
    tokens: TokenIds | Any,
    page_size: int | None = None,
    *,
    prior: PageKey | None = None,
) -> list[PageKey]:
    """Keys of the whole pages of ``tokens``; a partial tail page gets no key.

    ``page_size`` defaults to the namespace's and must equal it when given. ``prior`` is the
    key of the page just before ``tokens`` (to continue a chain from a cached prefix); by
    default the chain starts at the namespace digest. Returns ``len(tokens) // page_size``
    keys in page order. ``tokens`` are ids or bytes already encoded by
    :func:`hicache.tokens.encode_tokens`. Raises ValueError for ids outside ``[0, 2**32)``.
    """
    if page_size is None:
        page_size = namespace.page_size
    if page_size != namespace.page_size:
        raise ValueError(
            f"page_size={page_size!r} is invalid; must equal the namespace's page_size "
            f"({namespace.page_size})"
        )
    raw = encode_tokens(tokens, strict=True)
    step = TOKEN_BYTES * page_size
    n = len(raw) // step
    h = namespace.digest if prior is None else prior.digest
    sha256 = hashlib.sha256
    out: list[PageKey] = []
    for i in range(n):
        chunk = raw[i * step : (i + 1) * step]
        h = sha256(h + chunk).digest()
        fp = sha256(chunk).digest()[:FINGERPRINT_BYTES]
        out.append(PageKey(KEY_PREFIX + h.hex(), h, fp, namespace.digest))
    return out


def engine_page_key(namespace: Namespace, engine_key: bytes) -> PageKey:
    """The key of a page another engine names by a hash of its own (``engine_key``: SGLang's
    page hash as UTF-8, vLLM's offload key), under ``namespace`` (whose ``engine_layout``
    names that engine's page format): ``h = sha256(namespace digest || engine_key)``, key
    ``"hc3-" + hex(h)``, fingerprint the first 8 bytes of ``sha256(engine_key)`` (such an
    engine gives no tokens; its hash already commits to the prefix). See
    ``docs/l3-keys.md``, "Keys for SGLang pages"."""
    digest = namespace.digest
    h = hashlib.sha256(digest + engine_key).digest()
    fp = hashlib.sha256(engine_key).digest()[:FINGERPRINT_BYTES]
    return PageKey(KEY_PREFIX + h.hex(), h, fp, digest)


def token_bytes(tokens: TokenIds | Any) -> bytes:
    """Token ids as u32 little-endian bytes, strictly checked (no bools): the codec of
    :func:`hicache.tokens.encode_tokens`, under the name this module always exported."""
    return encode_tokens(tokens, strict=True)


HEAD_TAG = b"kv_head"
"""Bytes between a page's chained hash and the head index in :func:`head_key`'s input."""


def head_key(page: PageKey, kv_head: int) -> PageKey:
    """The key of record ``kv_head`` (of K/V heads ``[kv_head * g, (kv_head + 1) * g)``,
    model numbering, for the namespace's ``head_group`` ``g``) of the page keyed
    ``page`` under a ``records="head"`` namespace: ``h = sha256(page.digest || b"kv_head"
    || u32le(kv_head))``, key ``"hc3-" + hex(h)``; the page's fingerprint and namespace
    digest (every head record of a page carries the page's header fields)."""
    require(is_int(kv_head) and 0 <= kv_head < TOKEN_ID_LIMIT, "kv_head", kv_head, "must be a u32")
    h = hashlib.sha256(page.digest + HEAD_TAG + kv_head.to_bytes(4, "little")).digest()
    return PageKey(KEY_PREFIX + h.hex(), h, page.fingerprint, page.namespace_digest)


@dataclass(frozen=True, slots=True)
class PreviousPage:
    """A spec-2 page key not computed yet: the last whole page of ``tokens`` (encoded
    token bytes) chained from ``digest`` (:meth:`Namespace.previous_digest`). Built on
    the cache's thread at no hashing cost; :meth:`key` hashes, on the thread that probes
    it, only when a lookup found nothing."""

    digest: bytes
    tokens: bytes
    page_size: int

    def key(self) -> PageKey:
        """:func:`previous_page_key` of the fields."""
        return previous_page_key(self.digest, self.tokens, self.page_size)


def previous_page_key(digest: bytes, tokens: TokenIds | Any, page_size: int) -> PageKey:
    """The spec-2 key of the last whole page of ``tokens`` (from the first token), chained
    from ``digest`` (:meth:`Namespace.previous_digest`): ``"hc2-" + hex(h)``. A reader
    probes it to count records an engine of the previous version left
    (``StorageStats.previous``); it never reads them."""
    raw = encode_tokens(tokens, strict=True)
    step = TOKEN_BYTES * page_size
    n = len(raw) // step
    require(n >= 1, "tokens", len(raw) // TOKEN_BYTES, f"must hold a whole page of {page_size}")
    h = digest
    for i in range(n):
        h = hashlib.sha256(h + raw[i * step : (i + 1) * step]).digest()
    fp = hashlib.sha256(raw[(n - 1) * step : n * step]).digest()[:FINGERPRINT_BYTES]
    return PageKey(f"hc{PREVIOUS_SPEC_VERSION}-" + h.hex(), h, fp, digest)
