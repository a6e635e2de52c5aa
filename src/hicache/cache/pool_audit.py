"""One pool's audit: its use as a :class:`~hicache.metrics.ComponentUsage`, and the check
that each of its used pages (or slots) is owned exactly once.

Every store's pools report and check through these (the full KV's in
:mod:`hicache.cache.report`, the component stores' in
:class:`~hicache.cache.components.base.ComponentStore`). Read-only: nothing changes.
"""

from __future__ import annotations

from hicache.memory import PageAllocator
from hicache.metrics import ComponentUsage


def component_usage(
    name: str,
    device: PageAllocator,
    host: PageAllocator | None,
    unit_bytes: int,
    cached_tokens: int,
) -> ComponentUsage:
    """:class:`ComponentUsage` of one component's pools; ``cached_tokens``: tokens whose
    full KV is in L1."""
    used = device.used_pages
    return ComponentUsage(
        name=name,
        device_used=used,
        device_total=device.num_pages,
        host_used=0 if host is None else host.used_pages,
        host_total=0 if host is None else host.num_pages,
        unit_bytes=unit_bytes,
        bytes_per_cached_token=used * unit_bytes / cached_tokens if cached_tokens else 0.0,
    )


def check_owned(tier: str, alloc: PageAllocator, owned: list[int]) -> None:
    """Every used page of ``alloc`` is in ``owned`` exactly once, and nothing more."""
    alloc.check_integrity()
    assert len(set(owned)) == len(owned), f"an {tier} page is owned twice"
    assert all(alloc.is_used(p) for p in owned), f"a free {tier} page is owned"
    assert len(owned) == alloc.used_pages, (
        f"{alloc.used_pages} {tier} pages used, {len(owned)} owned: leak"
    )
