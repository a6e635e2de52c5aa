"""Session retention: an idle agent session's KV kept in L2 until its next turn.

When a request with a session hint ends, its sequence (the prefix the session's next
turn extends) is recorded and the deepest span of it whose L2 copy has landed is pinned in
L2 (``host_ref``: path-wise, so a subagent's pin keeps the prefix it shares with its
parent). The pins never reach L1: L1 evicts a kept span down to L2 as any other. The
pinned L2 pages (each page counted once) stay within ``ratio`` of the L2 pool: past it the
least recently active sessions are *demoted* (what L3 lacks of their spans is written
first, then they are unpinned and left to eviction; the next turn prefetches them). An L2 allocation that
finds nothing else to evict makes the least recently active sessions *yield* (counted), so
retention never refuses pages to a request. Sessions end at their TTL (rank 0's clock
decides; the engine broadcasts the close) or when closed. Pure bookkeeping on the cache's
thread; every decision depends on the tree and the order of the calls only (the same on
every rank), never on a clock.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from hicache.metrics import CacheCounters
from hicache.tokens import TOKEN_BYTES, TokenIds, encode_tokens
from hicache.tree import HiRadixTree, TreeNode

__all__ = ["SessionState", "SessionView", "Sessions"]


class SessionState(str, enum.Enum):
    """Where a session's KV is kept."""

    KEPT = "kept"
    """Pinned in L2 (up to what has landed there)."""
    DEMOTED = "demoted"
    """Unpinned past the bound or by a yield: left to L3 and to eviction."""


@dataclass(frozen=True, slots=True)
class SessionView:
    """A session as the cache keeps it: ``state``, the ``tokens`` of its last sequence
    (whole pages), the ``pinned_tokens`` of it pinned in L2 (0 when demoted),
    ``deadline`` (the caller's clock, s) and its ``parent`` (a subagent's)."""

    session_id: str
    state: SessionState
    tokens: int
    pinned_tokens: int
    deadline: float
    parent: str | None


class _Entry:
    """A live session (mutable, private to :class:`Sessions`)."""

    __slots__ = ("deadline", "key", "parent", "pinned", "tenant", "tokens")

    def __init__(self, tenant: str, parent: str | None) -> None:
        self.tenant = tenant
        self.parent = parent
        self.key = b""
        """Its last sequence's whole pages, encoded, while kept (dropped when demoted)."""
        self.tokens = 0
        """Tokens of its last sequence's whole pages."""
        self.deadline = 0.0
        self.pinned: TreeNode | None = None
        """The deepest landed span of ``key`` pinned in L2 (None: none yet, or demoted)."""


class Sessions:
    """The retained sessions of one cache's ``tree`` (``host_pages``: L2 pages in all;
    ``ratio`` of them may be pinned; ``page_size``: tokens per page).

    ``landed_end``: the deepest node at or above a node whose L2 copy has landed (a backup
    in flight may fail and drop its pages, so only landed spans are pinned). ``write_path``: writes to L3 what
    L2 holds of a path and L3 does not (nothing without a tier), called before a demoted
    session's pin goes, so its spans leave L2 only with a copy. Work per call is bounded by the
    kept sessions, never by the demoted ones (thousands may wait for their TTL)."""

    def __init__(
        self,
        tree: HiRadixTree,
        *,
        host_pages: int,
        ratio: float,
        page_size: int,
        counters: CacheCounters,
        landed_end: Callable[[TreeNode | None], TreeNode | None],
        write_path: Callable[[TreeNode], object],
    ) -> None:
        self._tree = tree
        self._bound = int(host_pages * ratio)
        self._page_size = page_size
        self._counters = counters
        self._landed_end = landed_end
        self._write_path = write_path
        self._live: OrderedDict[str, _Entry] = OrderedDict()
        """Every live session, least recently active first."""
        self._kept: OrderedDict[str, _Entry] = OrderedDict()
        """The kept ones among them, in the same order."""
        self._closing: set[str] = set()
        """Sessions :meth:`expired` named, until they are closed (rank 0's own)."""

    # ------------------------------------------------------------------ queries

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._live

    @property
    def bound_pages(self) -> int:
        """L2 pages sessions may keep pinned."""
        return self._bound

    def view(self, session_id: str) -> SessionView | None:
        e = self._live.get(session_id)
        if e is None:
            return None
        pinned = 0 if e.pinned is None else self._tree.depth_pages(e.pinned) * self._page_size
        state = SessionState.KEPT if session_id in self._kept else SessionState.DEMOTED
        return SessionView(session_id, state, e.tokens, pinned, e.deadline, e.parent)

    def views(self) -> list[SessionView]:
        """Every live session, least recently active first."""
        return [v for s in self._live if (v := self.view(s)) is not None]

    def kept_pages(self) -> int:
        """L2 pages the sessions pin, each counted once (shared prefixes too)."""
        seen: set[int] = set()
        pages = 0
        for e in self._kept.values():
            n = e.pinned
            while n is not None and n.parent is not None and n.id not in seen:
                seen.add(n.id)
                pages += self._tree.num_pages(n)
                n = n.parent
        return pages

    def expired(self, now: float) -> list[str]:
        """Sessions whose deadline passed by ``now`` (rank 0's clock) and that were not
        named before: the engine closes them on every rank."""
        out = [s for s, e in self._live.items() if e.deadline <= now and s not in self._closing]
        self._closing.update(out)
        return out

    # ------------------------------------------------------------------ changes

    def touch(
        self,
        session_id: str,
        tokens: TokenIds,
        *,
        tenant: str,
        deadline: float,
        parent: str | None = None,
    ) -> None:
        """A request of ``session_id`` ended with ``tokens`` committed (its sequence):
        keep their whole pages until ``deadline``, as the most recently active session. A
        subagent (``parent``) refreshes its parent too (to at least the same deadline)."""
        page_bytes = self._page_size * TOKEN_BYTES
        key = encode_tokens(tokens)
        key = key[: len(key) // page_bytes * page_bytes]
        e = self._live.pop(session_id, None)
        if e is None:
            e = _Entry(tenant, parent)
        e.tenant, e.parent = tenant, parent or e.parent
        e.key, e.tokens, e.deadline = key, len(key) // TOKEN_BYTES, deadline
        self._live[session_id] = e
        self._kept.pop(session_id, None)
        self._kept[session_id] = e
        self._closing.discard(session_id)
        if parent is not None and (p := self._live.get(parent)) is not None:
            p.deadline = max(p.deadline, deadline)
            for order in (self._live, self._kept):
                if parent in order:
                    order.move_to_end(parent)
                    order.move_to_end(session_id)
        self._pin(e)
        self._bind()

    def refresh(self) -> None:
        """Pin deeper the kept sessions whose spans landed in L2 since (their backups
        were in flight), then hold the bound. Once per step."""
        changed = False
        for e in self._kept.values():
            depth = 0 if e.pinned is None else self._tree.depth_pages(e.pinned)
            if depth * self._page_size < e.tokens:
                changed |= self._pin(e)
        if changed:
            self._bind()

    def close(self, session_id: str, *, expired: bool = False) -> bool:
        """End ``session_id``: unpin what it keeps. False when no such session is live."""
        e = self._live.pop(session_id, None)
        self._kept.pop(session_id, None)
        self._closing.discard(session_id)
        if e is None:
            return False
        self._unpin(e)
        if expired:
            self._counters.session_expired_total += 1
        return True

    def clear(self) -> None:
        """End every session (the cache is emptied)."""
        for s in list(self._live):
            self.close(s)

    def yield_pages(self, pages: int) -> int:
        """An L2 allocation found nothing else to evict: demote the least recently active
        kept sessions until at least ``pages`` pinned pages are free of every session's
        pin (or none is left); returns the pages freed so. Counted per session."""
        freed = 0
        before = self.kept_pages()
        for s, e in list(self._kept.items()):
            if freed >= pages:
                break
            if e.pinned is None:
                continue
            self._demote(s)
            self._counters.session_yields_total += 1
            freed = before - self.kept_pages()
        return freed

    # ------------------------------------------------------------------ internals

    def _pin(self, e: _Entry) -> bool:
        """Move ``e``'s pin to the deepest span of its key whose L2 copy has landed (none
        when sessions may pin nothing); returns whether it moved."""
        tree = self._tree
        node: TreeNode | None = None
        if self._bound > 0:  # a look: the idle spans stay as old as they are
            node = self._landed_end(tree.within(e.key, e.tenant))
        if node is e.pinned:
            return False
        if node is not None:
            tree.inc_host_ref(node)
        self._unpin(e)
        e.pinned = node
        return True

    def _unpin(self, e: _Entry) -> None:
        if e.pinned is not None:
            self._tree.dec_host_ref(e.pinned)
            e.pinned = None

    def _demote(self, session_id: str) -> None:
        """Leave the session's spans to L3 and to eviction: what L3 lacks of them is
        written first (pinned in L2 by its write until it landed)."""
        e = self._kept.pop(session_id)
        e.key = b""
        if e.pinned is not None:
            self._write_path(e.pinned)
        self._unpin(e)

    def _bind(self) -> None:
        """Demote the least recently active kept sessions while the pins pass the bound."""
        kept = self.kept_pages()
        for s, e in list(self._kept.items()):
            if kept <= self._bound:
                return
            if e.pinned is None:
                continue
            self._demote(s)
            self._counters.session_demotions_total += 1
            kept = self.kept_pages()
