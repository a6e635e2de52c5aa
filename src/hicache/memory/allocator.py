"""Page allocator: a FIFO free list of page ids with used flags.

Pure data structure (no torch, no threads, no IO). Every call costs O(n) in the number of
pages it touches, never O(num_pages), except :meth:`PageAllocator.check_integrity` and
:meth:`PageAllocator.reset`.

Order is deterministic: the free list starts as ``0 .. num_pages-1`` ascending,
:meth:`PageAllocator.alloc` takes from its front and :meth:`PageAllocator.free` appends to
its back in the order given.
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Iterable
from itertools import islice

from hicache.validate import int_at_least

__all__ = ["AllocatorError", "PageAllocator"]


class AllocatorError(RuntimeError):
    """A page was handed out twice, freed twice, or the allocator's state is inconsistent."""


class PageAllocator:
    """Hands out page ids ``0 .. num_pages-1``.

    Invariants (checked by :meth:`check_integrity`): every page is either in the free list
    exactly once with its used flag clear, or out of it with its used flag set; so
    ``free_pages + used_pages == num_pages``. A call that raises leaves the state unchanged.
    """

    def __init__(self, num_pages: int) -> None:
        int_at_least("num_pages", num_pages, 0)
        self._num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._used = bytearray(num_pages)
        self._used_count = 0

    @property
    def num_pages(self) -> int:
        """Total pages managed."""
        return self._num_pages

    @property
    def free_pages(self) -> int:
        """Pages currently in the free list."""
        return len(self._free)

    @property
    def used_pages(self) -> int:
        """Pages currently handed out."""
        return self._used_count

    def is_used(self, page: int) -> bool:
        """Whether ``page`` is currently allocated. Raises IndexError when out of range."""
        page = operator.index(page)
        if not 0 <= page < self._num_pages:
            raise IndexError(f"page {page} out of range [0, {self._num_pages})")
        return bool(self._used[page])

    def alloc(self, n: int) -> list[int] | None:
        """Take ``n`` pages from the front of the free list.

        Returns the page ids in free-list order, ``[]`` for ``n == 0``, or ``None`` (and
        changes nothing) when fewer than ``n`` pages are free. Raises :class:`AllocatorError`
        without changing anything if a page about to be handed out is flagged used.
        """
        n = operator.index(n)
        if n < 0:
            raise ValueError(f"n={n} is invalid; must be >= 0")
        if n > len(self._free):
            return None
        pages = list(islice(self._free, n))
        used = self._used
        for p in pages:
            if used[p]:
                raise AllocatorError(
                    f"double allocation of page {p}: it is in the free list but flagged used"
                )
        popleft = self._free.popleft
        for p in pages:
            popleft()
            used[p] = 1
        self._used_count += n
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return ``pages`` to the back of the free list, in the given order.

        Every page must be in range and currently allocated, and appear once in the call;
        otherwise :class:`AllocatorError` is raised and nothing is freed. Accepts any iterable
        of ints (including 0-d integer tensors, via ``__index__``).
        """
        page_list = [operator.index(p) for p in pages]
        used = self._used
        n = self._num_pages
        for p in page_list:
            if not 0 <= p < n:
                raise AllocatorError(f"free of page {p}: out of range [0, {n})")
            if not used[p]:
                raise AllocatorError(
                    f"double free of page {p}: it is not allocated (freed twice or never allocated)"
                )
        if len(set(page_list)) != len(page_list):
            seen: set[int] = set()
            for p in page_list:
                if p in seen:
                    raise AllocatorError(f"double free of page {p}: it appears twice in one call")
                seen.add(p)
        for p in page_list:
            used[p] = 0
        self._free.extend(page_list)
        self._used_count -= len(page_list)

    def reset(self) -> None:
        """Free every page; the free list goes back to ``0 .. num_pages-1`` ascending."""
        self._free = deque(range(self._num_pages))
        self._used = bytearray(self._num_pages)
        self._used_count = 0

    def check_integrity(self) -> None:
        """Raise :class:`AllocatorError` describing the first violated invariant, if any."""
        n = self._num_pages
        seen = bytearray(n)
        for p in self._free:
            if not 0 <= p < n:
                raise AllocatorError(f"free list holds page {p}, out of range [0, {n})")
            if seen[p]:
                raise AllocatorError(f"page {p} is in the free list twice")
            seen[p] = 1
            if self._used[p]:
                raise AllocatorError(f"page {p} is in the free list but flagged used")
        flagged = sum(self._used)
        if flagged != self._used_count:
            raise AllocatorError(
                f"used count {self._used_count} disagrees with {flagged} pages flagged used"
            )
        if len(self._free) + flagged != n:
            raise AllocatorError(
                f"free ({len(self._free)}) + used ({flagged}) != total ({n}): "
                "some page is neither free nor flagged used"
            )

    def __repr__(self) -> str:
        return (
            f"PageAllocator(num_pages={self._num_pages}, free={self.free_pages}, "
            f"used={self.used_pages})"
        )
