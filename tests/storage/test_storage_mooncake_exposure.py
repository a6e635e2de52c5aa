"""Where the Mooncake transfer engine inside a client listens, and what a peer can read.

This Mooncake version (mooncake-transfer-engine-non-cuda 0.3.x) listens on all interfaces
for its handshake and data ports whatever ``local_hostname`` says, so the backend registers
nothing of the process but the L2 host pool and its own zeroed record staging, warns at
start naming the ports, and a peer that reaches them can read only that (docs/security.md).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import torch

from hicache.config import MemLayout
from hicache.keys import Namespace, page_keys
from hicache.memory import HostPool
from hicache.services.mooncake_process import MooncakeProcess
from hicache.spec import KVSpec
from hicache.storage import StorageOptions, create_storage
from hicache.storage.arena import ArenaPool
from hicache.storage.backends.mooncake import MooncakeStorage
from hicache.storage.backends.mooncake_net import tcp_listeners

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16")
NS = Namespace.for_spec(
    SPEC, model="m", weights_fingerprint="exposure", layout="page_first", page_size=4
)

PEER = """
import json, sys, torch
from mooncake.engine import TransferEngine
targets, reads = json.loads(sys.argv[1])
te = TransferEngine()
assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
buf = torch.zeros(4096, dtype=torch.uint8)
assert te.register_memory(buf.data_ptr(), buf.numel()) == 0
out = {}
for name, addr, n in reads:
    got = None
    for target in targets:
        buf.zero_()
        if te.transfer_sync_read(target, buf.data_ptr(), addr, n) == 0:
            got = buf[:n].tolist()
            break
    out[name] = got
print(json.dumps(out))
"""


def test_arenas_are_zeroed_not_recycled_heap() -> None:
    """Registered staging must not show a peer what the process kept there before."""
    pool = ArenaPool(lambda t: True)
    for _ in range(20):  # dirty the allocator's free lists with same-sized blocks
        torch.full((4096,), 0xAB, dtype=torch.uint8)
    arena = pool.take(100)
    assert arena is not None
    assert torch.count_nonzero(arena.tensor) == 0


def test_listeners_are_reported_and_peers_read_only_registered_memory(
    mooncake_service: MooncakeProcess, caplog: pytest.LogCaptureFixture
) -> None:
    st = create_storage(
        "mooncake",
        namespace=NS,
        extra_config={**mooncake_service.extra_config, "zero_copy_min_bytes": 0},
        options=StorageOptions(timeout_s=5.0),
    )
    assert isinstance(st, MooncakeStorage)
    secret = torch.full((4096,), 0x5A, dtype=torch.uint8)  # never registered
    src = HostPool(SPEC, 4, 4, MemLayout.PAGE_FIRST, pin_memory=False)
    src.buffer.view(torch.uint8).fill_(0x33)
    with caplog.at_level(logging.WARNING, logger="hicache.storage"), st:
        keys = page_keys(NS, list(range(8)))
        assert st.batch_set(keys, src, [0, 1]).all_ok
        listeners = st.listeners
        assert listeners, "the transfer engine opened no listener?"
        assert set(listeners) <= set(tcp_listeners())
        exposed = [x for x in listeners if not x.loopback_only]
        warned = [
            r.getMessage() for r in caplog.records if "transfer engine listens" in r.getMessage()
        ]
        assert bool(warned) == bool(exposed)
        for x in exposed:
            assert x.address in warned[0]
        # registered: the host pool's buffer and staging arenas, nothing else
        ranges = st.registered_ranges()
        pool_ptr = src.buffer.data_ptr()
        assert ranges[pool_ptr] == src.buffer.numel() * src.buffer.element_size()
        secret_ptr = secret.data_ptr()
        assert not any(p <= secret_ptr < p + n for p, n in ranges.items())
        targets = [f"127.0.0.1:{x.port}" for x in listeners]
        reads = [["secret", secret_ptr, 64], ["pool", pool_ptr, 64]]
        out = subprocess.run(
            [sys.executable, "-c", PEER, json.dumps([targets, reads])],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["secret"] is None  # refused: not within any registered buffer
    assert got["pool"] == [0x33] * 64  # the L2 pool is readable: documented


def test_small_pages_are_staged_and_leave_the_pool_unregistered(
    mooncake_service: MooncakeProcess,
) -> None:
    """Pages under ``zero_copy_min_bytes`` (default 256 KiB; these are 512 B) go through
    the staging arenas, one slice per record: the pool is never registered, and the pages
    come back byte for byte."""
    st, src, dst = storage_and_pools(NS, mooncake_service.extra_config)
    with st:
        keys = page_keys(NS, list(range(1000, 1016)))
        assert st.batch_set(keys, src, [0, 1, 2, 3]).all_ok
        assert st.batch_get(keys, dst, [3, 2, 1, 0]) == [True] * 4
        ranges = st.registered_ranges()
        assert src.buffer.data_ptr() not in ranges and dst.buffer.data_ptr() not in ranges
    for page, back in zip([0, 1, 2, 3], [3, 2, 1, 0], strict=True):
        for a, b in zip(src.page_view(page), dst.page_view(back), strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("group", [2, 1], ids=["rank-heads", "per-head"])
def test_head_records_of_a_ranks_heads_move_in_place(
    mooncake_service: MooncakeProcess, group: int
) -> None:
    """Head records whose group is the rank's heads (the default) are the page records'
    bytes and move zero-copy: the host pools are registered, the pages come back byte for
    byte. One record per K/V head (a finer group) is staged: the pools stay unregistered."""
    from hicache.heads import HeadSplit

    ns = Namespace.for_spec(
        SPEC,
        model="m",
        weights_fingerprint="heads-in-place",
        layout="page_first",
        page_size=4,
        head_records=True,
        head_group=group,
    )
    extra = {**mooncake_service.extra_config, "zero_copy_min_bytes": 0}
    st, src, dst = storage_and_pools(ns, extra)
    with st:
        st.use_heads(HeadSplit(SPEC.heads, SPEC.heads))
        keys = page_keys(ns, list(range(2000, 2016)))
        assert st.batch_set(keys, src, [0, 1, 2, 3]).all_ok
        assert st.batch_get(keys, dst, [3, 2, 1, 0]) == [True] * 4
        ranges = st.registered_ranges()
        in_place = src.buffer.data_ptr() in ranges and dst.buffer.data_ptr() in ranges
        assert in_place == (group == SPEC.heads)
        assert st.stats().set_pages == 4 * SPEC.heads // group  # records
    for page, back in zip([0, 1, 2, 3], [3, 2, 1, 0], strict=True):
        for a, b in zip(src.page_view(page), dst.page_view(back), strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def storage_and_pools(
    ns: Namespace, extra: dict[str, object]
) -> tuple[MooncakeStorage, HostPool, HostPool]:
    """An unstarted Mooncake backend under ``ns`` (``extra`` its config), a 4-page source
    pool of random bytes and an empty destination pool."""
    st = create_storage(
        "mooncake", namespace=ns, extra_config=extra, options=StorageOptions(timeout_s=5.0)
    )
    assert isinstance(st, MooncakeStorage)
    src = HostPool(SPEC, 4, 4, MemLayout.PAGE_FIRST, pin_memory=False)
    dst = HostPool(SPEC, 4, 4, MemLayout.PAGE_FIRST, pin_memory=False)
    raw = src.buffer.view(torch.uint8).view(-1)
    raw.copy_(torch.randint(0, 256, (raw.numel(),), dtype=torch.uint8))
    return st, src, dst
