"""Routing follows residency: two ``hicache serve --grpc-mode`` workers, A and B (the tiny
random Llama on CPU, a 256-token L1 that evicts, a 1024-token L2), behind the real smg in
event-driven ``cache_aware`` mode.

A prefix A holds (8 pages) and B holds the start of (4 pages) goes to A, also after A's
L1 has evicted it (A serves it from L2: its L2 hit counter grows by the prefix); once it
has left A's L2 too (A's events remove its pages), it goes to B. A worker killed while
it streams an answer is taken out of smg (removed, its KV event subscription stopped)
and B answers the prefix's next requests; one paused (SIGSTOP) is taken out too (by an
smg of that test alone, which probes with a shorter timeout), and once resumed and added
back (``POST /workers``) it is routed to by what the new subscription's snapshot says it
holds. Which worker served a request is read from the workers' own counters
(``hicache_requests_total``, cache hit tokens), what each worker holds from its own KV
event stream (:class:`hicache.bench.residency.ResidencyWatch`, the stream smg reads).
smg's warm-up slice (a share of requests sent to a worker with few pages whatever the
overlap) is turned off: here every routing is by overlap. Each test starts from flushed
workers; the pause leaves A healthy in the module's smg; the kill is last.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from hicache.bench.residency import Residency, ResidencyWatch, page_hashes
from hicache.bench.serverproc import ServerProcess
from tests.helpers.metrics import metric as server_metric
from tests.helpers.smg import Smg
from tests.router.conftest import ROUTER_KEY, StartWorker

MODEL = "tiny-random-llama"
PAGE = 16
TIERS = (
    "--page-size",
    str(PAGE),
    "--max-total-tokens",
    "256",  # L1: 16 pages
    "--enable-hierarchical-cache",
    "--hicache-ratio",
    "4",  # L2: 64 pages
)
PREFIX = list(range(2000, 2128))  # 8 pages
HASHES = page_hashes(PREFIX, PAGE)
B_PAGES = 4
"""B holds the prefix's first 4 pages: half of it, above smg's default
``--cache-threshold`` (0.3) should that apply."""
LONG = 100
"""New tokens of the stream the kill cuts: the prompt (129) and they fit A's L1."""
EVENT_MARGIN_S = 0.5
"""How long after a watch sees a batch smg is given to have applied it too (smg reads
the same hub's stream)."""
MODULE_HEALTH = ("--health-check-timeout-secs", "5", "--remove-unhealthy-workers")
"""The module's smg: a busy box must not get B removed; a killed A refuses at once."""
SECOND = list(range(3000, 3128))
"""A second 8-page prefix, given to A only while it is out of smg."""
QUICK_HEALTH = ("--health-check-timeout-secs", "1", "--remove-unhealthy-workers")
"""The pause test's smg: a probe unanswered for 1 s fails (with
``health_failure_threshold=1`` a worker is out of routing at its first failure, removed
at its fourth), where the module's smg waits 5 s so that a busy box never gets B
removed (smg removes a worker after 4 x the threshold failures in a row)."""


@pytest.fixture(scope="module")
def pair(start_worker: StartWorker) -> tuple[ServerProcess, ServerProcess]:
    return start_worker(*TIERS, grpc=True), start_worker(*TIERS, grpc=True)


@pytest.fixture(scope="module")
def smg(pair: tuple[ServerProcess, ServerProcess]) -> Iterator[Smg]:
    with _smg_of(pair, *MODULE_HEALTH, threshold=2) as router:
        yield router


@pytest.fixture(scope="module")
def quick(pair: tuple[ServerProcess, ServerProcess]) -> Iterator[Smg]:
    """The pause test's smg (:data:`QUICK_HEALTH`), started with the module's."""
    with _smg_of(pair, *QUICK_HEALTH, threshold=1) as router:
        yield router


@pytest.fixture(scope="module")
def watches(
    pair: tuple[ServerProcess, ServerProcess], smg: Smg, quick: Smg
) -> Iterator[list[ResidencyWatch]]:
    """A's and B's residency from their KV event streams."""
    started = [ResidencyWatch(w.grpc_url).start() for w in pair]
    try:
        yield started
    finally:
        for watch in started:
            watch.close()


def _subscriptions(log: str, url: str) -> int:
    """How many times smg's ``log`` shows its KV event subscription to ``url`` connected."""
    return sum("KV event stream connected" in line and url in line for line in log.splitlines())


def _subscribed(log: str, url: str) -> bool:
    return _subscriptions(log, url) > 0


@contextmanager
def _smg_of(
    pair: tuple[ServerProcess, ServerProcess], *flags: str, threshold: int
) -> Iterator[Smg]:
    """smg over ``pair`` in event-driven ``cache_aware`` mode, warm-up slice off, with
    ``flags`` and ``health_failure_threshold=threshold``; yielded once it has loaded the
    model's tokenizer and subscribed to both workers' KV events."""
    with Smg(
        worker_urls=[w.grpc_url for w in pair],
        policy="cache_aware",
        health_failure_threshold=threshold,
        extra_args=["--worker-warmup-secs", "0", "--worker-warmup-divert-every", "0", *flags],
    ) as router:
        router.wait_log(f"Successfully loaded tokenizer '{MODEL}'")
        for worker in pair:
            _wait(
                lambda w=worker: _subscribed(router.log_text(), w.grpc_url),
                30,
                f"smg subscribed to {worker.grpc_url}",
            )
        yield router


def _wait(until: Any, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not until():
        assert time.monotonic() < end, f"not reached within {timeout_s} s: {what}"
        time.sleep(0.05)


def _body(ids: list[int], **sampling: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0, **sampling},
    }


def _direct(worker: ServerProcess, ids: list[int]) -> dict[str, Any]:
    """``ids`` to the worker's own HTTP ``/generate`` (not through smg)."""
    r = httpx.post(f"{worker.url}/generate", json=_body(ids), timeout=60)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _routed(smg: Smg, ids: list[int]) -> dict[str, Any]:
    """``ids`` through smg's ``/generate`` (it answers a list of one)."""
    r = httpx.post(f"{smg.url}/generate", json=_body(ids), timeout=60)
    assert r.status_code == 200, r.text
    (answer,) = r.json()
    return dict(answer)


def _metric(worker: ServerProcess, name: str) -> float:
    """The sum of the worker's ``name`` samples (every label set) on its ``/metrics``."""
    return server_metric(worker.url, name, default=0.0)


def _served(worker: ServerProcess) -> float:
    return _metric(worker, "hicache_requests_total")


def _wait_metric(worker: ServerProcess, name: str, want: float) -> float:
    """The cache counters come from the engine's published stats: wait for them."""
    end = time.monotonic() + 10
    while (got := _metric(worker, name)) < want and time.monotonic() < end:
        time.sleep(0.05)
    return got


def _flush(pair: tuple[ServerProcess, ServerProcess], watches: list[ResidencyWatch]) -> None:
    for worker, watch in zip(pair, watches, strict=True):
        before = watch.snapshot().cleared
        r = httpx.post(
            f"{worker.url}/flush_cache",
            headers={"Authorization": f"Bearer {ROUTER_KEY}"},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        watch.wait(lambda s, n=before: s.cleared > n and not s.resident, 10, "the flush")


def _holds(n: int) -> Any:
    """A :meth:`ResidencyWatch.wait` condition: the prefix's first ``n`` pages resident."""
    return lambda s: all(h in s.resident for h in HASHES[:n])


def _seed(
    pair: tuple[ServerProcess, ServerProcess], watches: list[ResidencyWatch]
) -> tuple[ServerProcess, ServerProcess]:
    """Flushed workers; then A holds the prefix (8 pages), B its first 4, and smg
    has had time to read both from their events."""
    a, b = pair
    _flush(pair, watches)
    _direct(a, [*PREFIX, 1999])
    _direct(b, [*PREFIX[: B_PAGES * PAGE], 1998])
    watches[0].wait(_holds(8), 10, "A's pages of the prefix")
    watches[1].wait(_holds(B_PAGES), 10, "B's pages of the prefix")
    time.sleep(EVENT_MARGIN_S)
    return a, b


def _fill(worker: ServerProcess, base: int, prompts: int, tokens: int) -> None:
    """``prompts`` distinct prompts of ``tokens`` ids (sharing no page with anything
    else) straight to ``worker``."""
    for i in range(prompts):
        start = base + i * (tokens + 16)
        _direct(worker, list(range(start, start + tokens)))


def _route_and_see_who(
    smg: Smg, pair: tuple[ServerProcess, ServerProcess], ids: list[int]
) -> tuple[str, dict[str, Any]]:
    """Send ``ids`` through smg; ``("A" | "B", answer)`` from the workers' request counts
    (exactly one of them grew by one)."""
    before = [_served(w) for w in pair]
    answer = _routed(smg, ids)
    after = [_served(w) for w in pair]
    grew = [round(x - y) for x, y in zip(after, before, strict=True)]
    assert sorted(grew) == [0, 1], grew
    return ("A" if grew[0] else "B"), answer


def test_a_prefix_evicted_from_l1_but_in_l2_goes_to_its_holder(
    smg: Smg, pair: tuple[ServerProcess, ServerProcess], watches: list[ResidencyWatch]
) -> None:
    a, _ = _seed(pair, watches)
    demoted = _metric(a, "hicache_device_demoted_tokens_total")
    _fill(a, 5000, 3, 128)  # 24 more pages through a 16-page L1: the prefix leaves it
    assert _wait_metric(a, "hicache_device_demoted_tokens_total", demoted + 128) >= demoted + 128
    state = watches[0].snapshot()
    assert all(h in state.resident for h in HASHES)  # still reported: it is in L2
    host_hits = _metric(a, "hicache_host_hit_tokens_total")
    device_hits = _metric(a, "hicache_device_hit_tokens_total")
    who, answer = _route_and_see_who(smg, pair, [*PREFIX, 1997])
    assert who == "A"
    assert answer["meta_info"]["cached_tokens"] == len(PREFIX)
    # served from A's L2 (loaded back), none of it from its L1
    assert _wait_metric(a, "hicache_host_hit_tokens_total", host_hits + 128) == host_hits + 128
    assert _metric(a, "hicache_device_hit_tokens_total") == device_hits


def test_a_prefix_that_left_l2_is_preferred_no_more(
    smg: Smg, pair: tuple[ServerProcess, ServerProcess], watches: list[ResidencyWatch]
) -> None:
    _seed(pair, watches)
    who, _ = _route_and_see_who(smg, pair, [*PREFIX, 1996])
    assert who == "A"  # 8 pages against B's 4
    # 5 x 14 pages through A: past its 64-page L2, the prefix (least recent) leaves
    _fill(pair[0], 12000, 5, 224)
    gone: Residency = watches[0].wait(
        lambda s: all(h in s.removed and h not in s.resident for h in HASHES),
        20,
        "A's events removing the prefix's pages",
    )
    assert not set(HASHES) & gone.resident
    time.sleep(EVENT_MARGIN_S)
    who, answer = _route_and_see_who(smg, pair, [*PREFIX, 1995])
    assert who == "B"  # its 4 pages are now the longest overlap
    assert answer["meta_info"]["cached_tokens"] == B_PAGES * PAGE


def test_a_paused_worker_is_taken_out_and_resynced_when_added_back(
    smg: Smg,
    quick: Smg,
    pair: tuple[ServerProcess, ServerProcess],
    watches: list[ResidencyWatch],
) -> None:
    """A, holding the prefix, is paused (SIGSTOP), under the smg of this test
    (:func:`quick`, which probes with a 1 s timeout). A request with the prefix sent at
    the pause goes to A and waits there; smg removes A within seconds and stops its KV
    event subscription, and the prefix's next request is answered by B (from its 4
    pages). Resumed, A answers the request that waited: smg keeps a removed worker's
    requests in flight (had A stayed paused, smg's gRPC keepalive would have failed it
    over to B after some 40 s). A then takes a second prefix while out of smg and is
    added back (``POST /workers``): smg subscribes to its events again, and the second
    prefix goes to A, all of it cached, which smg can only know from the new
    subscription's snapshot (AllBlocksCleared, then A's residency). A is healthy in the
    module's smg at the end (paused for less time than its probes need to remove it)."""
    a, b = _seed(pair, watches)
    assert a.proc is not None
    for worker in pair:  # a busy box may have had quick take one out earlier
        if quick.worker(worker.grpc_url) is None:
            quick.add_worker(worker.grpc_url)
    quick.wait_workers(
        lambda ws: (
            sorted((w["url"], w["is_healthy"], w["status"]) for w in ws)
            == sorted((w.grpc_url, True, "ready") for w in pair)
        ),
        15,
        "A and B healthy in smg",
    )
    time.sleep(EVENT_MARGIN_S)
    served = [_served(w) for w in pair]
    waited: list[httpx.Response] = []
    first = threading.Thread(
        target=lambda: waited.append(
            httpx.post(f"{quick.url}/generate", json=_body([*PREFIX, 1993]), timeout=60)
        ),
        name="request-at-pause",
    )
    os.kill(a.proc.pid, signal.SIGSTOP)
    try:
        first.start()
        quick.wait_workers(
            lambda ws: [w["url"] for w in ws] == [b.grpc_url], 15, "A removed from smg"
        )
        _wait(
            lambda: any(
                "Stopping KV event subscription" in line and a.grpc_url in line
                for line in quick.log_text().splitlines()
            ),
            5,
            "smg stopping its subscription to A's events",
        )
        assert not waited  # still in flight on the paused A
        answer = _routed(quick, [*PREFIX, 1992])
        assert answer["meta_info"]["cached_tokens"] == B_PAGES * PAGE
        assert _served(b) == served[1] + 1
    finally:
        os.kill(a.proc.pid, signal.SIGCONT)
    first.join(60)
    assert [r.status_code for r in waited] == [200]
    assert _served(a) == served[0] + 1  # A answered it, once resumed
    assert _served(b) == served[1] + 1
    _direct(a, [*SECOND, 2999])
    watches[0].wait(
        lambda s: all(h in s.resident for h in page_hashes(SECOND, PAGE)),
        10,
        "A's events (resumed) showing the second prefix",
    )
    subscribed = _subscriptions(quick.log_text(), a.grpc_url)
    quick.add_worker(a.grpc_url)
    _wait(
        lambda: _subscriptions(quick.log_text(), a.grpc_url) > subscribed,
        15,
        "smg subscribed to A's events again",
    )
    time.sleep(EVENT_MARGIN_S)
    who, answer = _route_and_see_who(quick, pair, [*SECOND, 2998])
    assert who == "A"
    assert answer["meta_info"]["cached_tokens"] == len(SECOND)
    smg.wait_workers(
        lambda ws: any(
            w["url"] == a.grpc_url and w["is_healthy"] and w["status"] == "ready" for w in ws
        ),
        15,
        "A healthy in the module's smg",
    )


def test_a_worker_killed_mid_stream_is_taken_out(
    smg: Smg, pair: tuple[ServerProcess, ServerProcess], watches: list[ResidencyWatch]
) -> None:
    """Last in the module: A is killed. smg sends the streamed request to A (it holds the
    prefix); killed after the first chunk, the stream ends unfinished, smg removes A
    (``--remove-unhealthy-workers``) and stops its KV event subscription, and B answers
    every next request with the prefix (from its own L1 from the second on)."""
    a, b = _seed(pair, watches)
    assert a.proc is not None
    body = _body([*PREFIX, 1994], max_new_tokens=LONG, ignore_eos=True)
    events: list[dict[str, Any]] = []
    served_b = _served(b)
    with httpx.stream(
        "POST", f"{smg.url}/generate", json={**body, "stream": True}, timeout=60
    ) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                events.append(json.loads(line.removeprefix("data: ")))
                break
        os.kill(a.proc.pid, signal.SIGKILL)  # at its first token of LONG
        try:
            for line in lines:
                if line.startswith("data: {"):
                    events.append(json.loads(line.removeprefix("data: ")))
        except httpx.HTTPError:
            pass  # smg may cut the connection
    finish = [(e.get("meta_info") or {}).get("finish_reason") for e in events]
    finish = [f.get("type") if isinstance(f, dict) else f for f in finish]
    assert "length" not in finish  # it never finished
    assert sum(len(e.get("output_ids") or []) for e in events) < LONG  # smg's: new ids
    assert _served(b) == served_b  # B did not serve it
    smg.wait_workers(
        lambda ws: [w["url"] for w in ws] == [b.grpc_url], 20, "A removed from smg's workers"
    )
    smg.wait_log("Stopping KV event subscription")
    answers = [_routed(smg, [*PREFIX, 1990 + i]) for i in range(3)]
    assert _served(b) == served_b + 3
    # B held the prefix's first 4 pages; after its first answer, all 8
    assert [x["meta_info"]["cached_tokens"] for x in answers] == [64, 128, 128]
