"""Scoring entries (prompt logprobs) as a component store: tiny sizes, exact state, bytes.

Pages of 2 tokens, 2 alternatives kept per slot. A scoring request's "forward" is
:func:`compute`: the record of each prompt position as a function of the prefix (what a
model's logits would give), put in the handle's :class:`ScoreLog` as the engine does. The
cache writes them into its pool at the commit, backs them up, loads them back and writes
them to L3 with the full KV; a later scoring request's admission hands back the records
of every position its hit serves, byte-equal.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from hicache.cache import HiCache, ScoreAsk
from hicache.cache.components import LogprobStore
from hicache.cache.components.logprob import LOGPROB, decode_row, encode_rows
from hicache.cache.report import check_integrity
from hicache.config import CacheConfig, MemLayout, PrefetchConfig
from hicache.keys import Namespace, page_keys
from hicache.logprob import TokenLogprob
from hicache.memory.layout import gather_pages
from hicache.spec import CacheSpec, KVSpec, LogprobSpec
from hicache.storage.backends.memory import MemoryStore
from hicache.tree.components import Tier
from tests.helpers.kvdata import wait_ready
from tests.helpers.l3_cache import attach_recording
from tests.helpers.recording_storage import RecordingStorage

FULL = KVSpec(num_layers=1, num_kv_heads=1, head_dim=2, dtype="float32")
TOP = 2
SPEC = LogprobSpec(top=TOP)
PAGE = 2
PROMPT = list(range(100, 117))  # 17 tokens: 8 whole pages before the last token
ASK = ScoreAsk(start=1, top=1)


def config(**kw: object) -> CacheConfig:
    args: dict[str, object] = dict(
        page_size=PAGE, device_tokens=32, hicache_ratio=2.0, load_back_threshold=0
    )
    args.update(kw)
    return CacheConfig(**args)  # type: ignore[arg-type]


def make(**kw: object) -> HiCache:
    return HiCache(config(**kw), CacheSpec(kv=FULL, components=(SPEC,))).start()


@pytest.fixture
def cache() -> Iterator[HiCache]:
    with make() as c:
        yield c


def store_of(cache: HiCache) -> LogprobStore:
    s = cache.stores.of_type(LogprobStore)
    assert s is not None
    return s


def record(tokens: list[int], pos: int) -> TokenLogprob:
    """Prompt token ``pos``'s record: alternatives from the prefix before it, its own
    logprob from the token too (fp32 values)."""
    base = sum(tokens[:pos])
    ids = [500 + base % 50, 600 + base % 7]
    values = [-0.25 - pos / 64, -1.5 - pos / 32]
    lp = array("f", [-(tokens[pos] % 13) / 4 - 0.125])[0]
    return TokenLogprob(tokens[pos], lp, array("i", ids).tobytes(), array("f", values).tobytes())


def serve(cache: HiCache, tokens: list[int], *, scores: ScoreAsk | None = ASK) -> int:
    """Admit ``tokens`` as a scoring request, check the records its hit handed back,
    "compute" the rest in chunks of 6, commit after each, release; returns the hit."""
    req = cache.open(tokens, scores=scores, max_prefix=0 if scores else None)
    wait_ready(cache, req)
    assert cache.admit(req, tokens)
    hit = req.prefix_tokens
    log = req.scores
    if scores is not None:
        assert log is not None
        want = list(range(scores.start, hit + 1))
        assert sorted(log.records) == want
        for p, rec in log.records.items():
            assert rec == record(tokens, p), p
    pos = hit
    while pos < len(tokens):
        end = min(pos + 6, len(tokens))
        assert cache.grow(req, end, computed=pos)
        cache.commit(req, tokens[:end])  # the scheduler commits before the records...
        if log is not None:  # ...which the next commit writes
            for p in range(max(pos + 1, log.ask.start), min(end + 1, len(tokens))):
                log.records.setdefault(p, record(tokens, p))
        pos = end
        cache.sync(wait=True)  # an engine's next step: the chunk's L2 and L3 writes land
        check_integrity(cache)
    cache.release(req, tokens)
    cache.sync(wait=True)
    check_integrity(cache)
    return hit


def marked(cache: HiCache, tokens: list[int], tier: Tier) -> list[int]:
    """The pages of ``tokens``' path whose entries the tree holds in ``tier``."""
    tree = cache.full.pages.tree
    last = tree.match_full(tokens).last_host_node
    comp = tree.component(LOGPROB)
    out: list[int] = []
    for n in tree.path_tail(last, tree.depth_pages(last)):
        ids = comp.get(n, tier)
        out += [] if ids is None else list(ids)
    return out


def digest(buffer: torch.Tensor, layout: MemLayout, pages: list[int]) -> str:
    data = gather_pages(buffer, layout, torch.tensor(pages, dtype=torch.int64), PAGE)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()


def test_the_spec_sizes_one_fp32_row_per_token() -> None:
    assert SPEC.width == 2 + 2 * TOP and SPEC.kv.token_bytes == 4 * SPEC.width
    with pytest.raises(ValueError, match="top"):
        LogprobSpec(top=-1)


def test_a_scoring_request_reuses_the_records_of_a_cached_prefix(cache: HiCache) -> None:
    assert serve(cache, PROMPT) == 0
    assert len(marked(cache, PROMPT, Tier.DEVICE)) == 8  # every page before the last token
    assert serve(cache, PROMPT) == 16  # records of positions 1..16 handed back


def test_entries_never_cut_a_plain_requests_match(cache: HiCache) -> None:
    assert serve(cache, PROMPT, scores=None) == 0
    assert marked(cache, PROMPT, Tier.DEVICE) == []
    req = cache.open(PROMPT)
    assert cache.admit(req, PROMPT) and req.prefix_tokens == 16
    cache.release(req)
    # a scoring request finds no entries: it recomputes (and then leaves them)
    assert serve(cache, PROMPT) == 0
    assert len(marked(cache, PROMPT, Tier.DEVICE)) == 8
    assert serve(cache, PROMPT) == 16


def test_a_request_asking_more_alternatives_than_kept_recomputes(cache: HiCache) -> None:
    assert serve(cache, PROMPT) == 0
    req = cache.open(PROMPT, scores=ScoreAsk(start=1, top=TOP + 1), max_prefix=0)
    assert req.scores is None and req.max_prefix == 0
    assert cache.admit(req, PROMPT) and req.prefix_tokens == 0
    cache.release(req)


def test_the_last_entry_of_a_hit_must_serve_the_next_token(cache: HiCache) -> None:
    assert serve(cache, PROMPT) == 0
    other = [*PROMPT[:8], 999, *PROMPT[9:]]  # diverges at page 4's first token
    # slot 7's entry names PROMPT[8]; 999 is no alternative there: a page less
    assert serve(cache, other) == 6
    base = sum(PROMPT[:8])
    alt = [*PROMPT[:8], 500 + base % 50, *PROMPT[9:]]  # the first alternative at slot 7
    req = cache.open(alt, scores=ASK)
    assert cache.admit(req, alt) and req.prefix_tokens == 8
    assert req.scores is not None
    rec = req.scores.records[8]
    assert rec.token_id == alt[8] and rec.logprob == rec.top[0][1]
    cache.release(req)


def test_scoring_from_a_later_start_needs_no_entries_before_it(cache: HiCache) -> None:
    assert serve(cache, PROMPT, scores=None) == 0
    # positions 11.. scored: the logits of 10.. are needed, pages from 5 on
    assert serve(cache, PROMPT, scores=ScoreAsk(start=11, top=1)) == 10
    assert serve(cache, PROMPT, scores=ScoreAsk(start=11, top=1)) == 16


LAYOUTS = [MemLayout.LAYER_FIRST, MemLayout.PAGE_FIRST, MemLayout.PAGE_FIRST_DIRECT]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_entries_survive_device_host_device(layout: MemLayout) -> None:
    with make(mem_layout=layout) as cache:
        s = store_of(cache)
        serve(cache, PROMPT)
        dev = marked(cache, PROMPT, Tier.DEVICE)
        before = digest(s.device_pool.buffer, MemLayout.LAYER_FIRST, dev)
        assert s.host_pool is not None
        host = marked(cache, PROMPT, Tier.HOST)
        assert len(host) == 8 and digest(s.host_pool.buffer, layout, host) == before
        cache.full.pages.evict_device(cache.full.pages.device_pool.num_pages)  # L2 only
        s.device_pool.buffer.zero_()  # nothing left in L1 to be read by mistake
        assert serve(cache, PROMPT) == 16  # records checked equal inside
        after = digest(
            s.device_pool.buffer, MemLayout.LAYER_FIRST, marked(cache, PROMPT, Tier.DEVICE)
        )
        assert after == before


def namespace(layout: MemLayout) -> Namespace:
    """What :func:`attach_recording` keys a cache of ``layout`` under."""
    return Namespace.for_spec(
        FULL, model="m", weights_fingerprint="w", layout=layout, page_size=PAGE
    )


def attach(cache: HiCache, store: MemoryStore, layout: MemLayout) -> RecordingStorage:
    assert cache.context.config.mem_layout == layout
    return attach_recording(cache, store, LOGPROB)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_entries_survive_host_l3_host(layout: MemLayout) -> None:
    store = MemoryStore()
    with make(mem_layout=layout) as cache:
        attach(cache, store, layout)
        serve(cache, PROMPT)
        s = store_of(cache)
        assert s.host_pool is not None
        before = digest(s.host_pool.buffer, layout, marked(cache, PROMPT, Tier.HOST))
        cache.sync(wait=True)
        assert cache.full.pages.counters.l3_backup_logprob_pages_total == 8
        assert cache.full.pages.counters.l3_backup_logprob_pages_failed_total == 0
    keys = page_keys(namespace(layout).with_component(LOGPROB), PROMPT, PAGE)
    assert [store.contains(k.key) for k in keys] == [True] * 8
    with make(mem_layout=layout) as cold:  # a second server over the same L3
        storage = attach(cold, store, layout)
        assert serve(cold, PROMPT) == 16  # records checked equal inside
        assert storage.read() == (8, 8)  # every page and its entries' record
        s2 = store_of(cold)
        assert s2.host_pool is not None
        after = digest(s2.host_pool.buffer, layout, marked(cold, PROMPT, Tier.HOST))
        assert after == before


def test_a_plain_prefetch_is_not_cut_by_missing_entries() -> None:
    store = MemoryStore()
    layout = MemLayout.PAGE_FIRST
    with make(mem_layout=layout) as cache:
        attach(cache, store, layout)
        serve(cache, PROMPT, scores=None)  # no entries anywhere
        cache.sync(wait=True)
    with make(mem_layout=layout) as cold:
        storage = attach(cold, store, layout)
        req = cold.open(PROMPT)
        wait_ready(cold, req)
        assert cold.admit(req, PROMPT) and req.cached.storage == 16
        assert storage.read() == (8, 0)
        cold.release(req)


def test_a_row_round_trips_its_record_bit_for_bit() -> None:
    recs = [record(PROMPT, p) for p in range(1, 5)]
    rows = encode_rows(recs, TOP)
    assert rows.shape == (4, SPEC.width) and rows.dtype == np.float32
    for rec, row in zip(recs, rows, strict=True):
        assert decode_row(row, rec.token_id, TOP) == rec
        other = rec.top[1][0]  # another token: its logprob is its alternative's
        got = decode_row(row, other, TOP)
        assert got is not None and got.logprob == rec.top[1][1] and got.top == rec.top
        assert decode_row(row, 99_999, TOP) is None


def test_entries_are_whole_records_under_head_records() -> None:
    """An engine's MHA namespace splits page records per K/V head; the entries have no
    heads: one whole record per page (keyed per rank), and a cold server reads them."""
    from hicache.heads import HeadSplit
    from hicache.storage.backends.memory import MemoryStorage

    kv = KVSpec(num_layers=1, num_kv_heads=2, head_dim=2, dtype="float32")
    ns = Namespace.for_spec(
        kv,
        model="m",
        weights_fingerprint="w",
        layout=MemLayout.PAGE_FIRST,
        page_size=PAGE,
        head_records=True,
    )
    store = MemoryStore()

    def build() -> HiCache:
        c = HiCache(
            config(mem_layout=MemLayout.PAGE_FIRST), CacheSpec(kv=kv, components=(SPEC,))
        ).start()
        storage = MemoryStorage(ns, store=store)
        storage.use_heads(HeadSplit(2, 2))
        c.l3.attach(storage, ns, PrefetchConfig(policy="wait_complete", prefetch_threshold=0))
        return c

    with build() as cache:
        serve(cache, PROMPT)
        cache.sync(wait=True)
        assert cache.full.pages.counters.l3_backup_logprob_pages_total == 8
        assert cache.full.pages.counters.l3_backup_logprob_pages_failed_total == 0
    with build() as cold:
        assert serve(cold, PROMPT) == 16  # records checked equal inside
    with build() as plain:  # a request that does not score reads no entry
        req = plain.open(PROMPT)
        wait_ready(plain, req)
        assert plain.admit(req, PROMPT) and req.cached.storage == 16
        assert marked(plain, PROMPT, Tier.HOST) == []
        plain.release(req)
