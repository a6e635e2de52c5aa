"""The L3 page-key spec: chained SHA-256 over page tokens under a namespace digest.

See ``docs/l3-keys.md`` for the normative text and test vectors. In short (spec version 2):

- The :class:`Namespace` pins everything that changes a page's bytes or who may read it:
  model name and weights fingerprint, KV dtype, host layout, page size, tensor-parallel size
  and rank (rank omitted for MLA, where every rank holds the same latent), the cache
  component, and a tenant salt. Its canonical encoding is compact, key-sorted ASCII JSON
  that includes ``"spec": 2``; its *digest* is the SHA-256 of that encoding (32 bytes).
- Page ``i`` (1-based) of a token sequence gets ``h_i = sha256(h_{i-1} || tokens_i)`` with
  ``h_0`` = the namespace digest and ``tokens_i`` the page's ``page_size`` token ids as
  unsigned 32-bit little-endian integers. The key string is ``"hc2-" + hex(h_i)``.
- A component's record (a recurrent-state snapshot at the end of page ``i``, component
  ``"mamba"``; page ``i``'s sliding-window KV, component ``"swa"``) is keyed like page ``i`` under the same namespace with that ``component``:
  its chain starts at another digest, so it commits to the whole prefix too
  (:meth:`Namespace.with_component`).
- Only whole pages are keyed; a partial tail page never gets a key.
- Each :class:`PageKey` also carries a *token fingerprint*, the first 8 bytes of
  ``sha256(tokens_i)``, stored in the L3 record header to catch a record stored under the
  wrong key.

This module is pure: no torch, no threads, no IO.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from hicache.config import DTYPES, AttentionKind, KVSpec, MemLayout
from hicache.tokens import TOKEN_BYTES, TOKEN_ID_LIMIT, TokenIds, encode_tokens
from hicache.validate import enum_value, int_at_least, is_int, require

__all__ = [
    "DIGEST_BYTES",
    "FINGERPRINT_BYTES",
    "FULL_COMPONENT",
    "KEY_PREFIX",
    "KEY_SPEC_VERSION",
    "TOKEN_ID_LIMIT",
    "Namespace",
    "PageKey",
    "engine_page_key",
    "page_keys",
    "token_bytes",
    "token_fingerprint",
]

KEY_SPEC_VERSION = 2
"""Version of the key and namespace encoding; bumped on any change that alters a key or a
record (2: component records, such as recurrent-state snapshots, in their own namespace
component; a version-1 record reads as a miss)."""

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
    ``None`` when every rank stores the same bytes (MLA), and then ``tp_size`` is 1: such
    bytes do not depend on the tensor-parallel size, so servers of any size share them;
    use :meth:`for_spec` to get that right from a :class:`~hicache.config.KVSpec`. ``tenant_salt`` is the request's
    ``cache_salt`` (``""`` for none): different salts never share pages.
    """

    model: str
    weights_fingerprint: str
    kv_dtype: str
    layout: MemLayout
    page_size: int
    tp_size: int = 1
    tp_rank: int | None = 0
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
    ) -> Namespace:
        """The namespace of one rank's cache of shape ``spec``.

        Takes the dtype from ``spec``; for MLA the rank and the size are dropped
        (``tp_rank=None``, ``tp_size=1``): the latent KV does not depend on tensor
        parallelism, so every rank of every TP size shares one namespace (and only rank 0
        of a group writes L3).
        """
        require(
            is_int(tp_rank) and is_int(tp_size) and 0 <= tp_rank < tp_size,
            "tp_rank",
            tp_rank,
            f"must be an int in [0, {tp_size})",
        )
        shared = spec.attention is AttentionKind.MLA
        rank: int | None = None if shared else tp_rank
        return cls(
            model=model,
            weights_fingerprint=weights_fingerprint,
            kv_dtype=spec.dtype,
            layout=MemLayout(layout),
            page_size=page_size,
            tp_size=1 if shared else tp_size,
            tp_rank=rank,
            component=component,
            tenant_salt=tenant_salt,
        )

    def encode(self) -> bytes:
        """Canonical encoding: compact, key-sorted, ASCII-only JSON of the fields and spec
        (``engine_layout`` only when set)."""
        doc: dict[str, Any] = {
            "spec": KEY_SPEC_VERSION,
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
        text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return text.encode("ascii")

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


@dataclass(frozen=True, slots=True)
class PageKey:
    """The L3 key of one whole page.

    ``key`` is the string backends store under (``"hc2-"`` + 64 hex digits); ``digest`` is
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
    ``"hc2-" + hex(h)``, fingerprint the first 8 bytes of ``sha256(engine_key)`` (such an
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
