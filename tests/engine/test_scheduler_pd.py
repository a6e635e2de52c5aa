"""The scheduler of a decode instance under memory pressure: a real cache (8 L1 pages of
4 tokens), the fake next-token runner, and the real :class:`DecodeRole` with a receiver
that records registrations (the test delivers each room's pages itself, as the
receiver's ``PagesArrived``).

- parked requests hold pages that will be freed: a request that does not fit waits for
  them (queued), it is not refused, and a running request that cannot grow while only
  parked ones hold L1 is retracted to wait, not aborted;
- a decode request retracted after its pages arrived resumes from what the cache kept
  of it, with no second registration (its room is spent);
- a request refused for memory is told the real shortfall;
- what a room brings besides the pages (the first token's logprob, the prompt's) is the
  answer's, and a request with prompt logprobs still promises its cached prefix.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hicache.cache import HiCache
from hicache.cache.report import check_integrity
from hicache.config import CacheConfig
from hicache.disagg.config import Bootstrap
from hicache.disagg.layout import InstanceLayout, RankTarget, Registration, StoreLayout
from hicache.disagg.pages import PoolGeometry
from hicache.engine.request import FinishReason, Request, RequestOutput
from hicache.engine.roles.decode import DecodeRole
from hicache.engine.sampling import SamplingParams
from hicache.engine.step.scheduler import Scheduler
from hicache.engine.step_inputs import PagesArrived
from hicache.logprob import TokenLogprob
from hicache.spec import AttentionKind, KVSpec
from tests.helpers.fake_runner import client, make_scheduler, step

SPEC = KVSpec(num_layers=2, num_kv_heads=1, head_dim=2, dtype="float32")
PAGE = 4


class Receiver:
    """Records each registration (``expected``: rid -> how many times)."""

    def __init__(self) -> None:
        self.expected: dict[str, int] = {}
        self.registrations: dict[str, Registration] = {}

    def expect(self, rid: str, host: str, port: int, registration: Registration) -> None:
        self.expected[rid] = self.expected.get(rid, 0) + 1
        self.registrations[rid] = registration

    def abort(self, rid: str, why: str) -> None:
        pass

    def forget(self, rid: str) -> None:
        pass

    def close(self) -> None:
        pass


class Transport:
    endpoint = "127.0.0.1:1"

    def close(self) -> None:
        pass


@pytest.fixture
def cache() -> Iterator[HiCache]:
    cfg = CacheConfig(page_size=PAGE, device_tokens=8 * PAGE, hicache_ratio=2.0)
    with HiCache(cfg, SPEC) as c:
        yield c


def decode_scheduler(cache: HiCache) -> tuple[Scheduler, Receiver]:
    receiver = Receiver()
    geometry = {"full": PoolGeometry.of(cache.full.pages.device_pool)}
    layout = InstanceLayout(
        model="fake",
        fingerprint="fake",
        page_size=PAGE,
        tp_size=1,
        mla=cache.context.spec.attention is AttentionKind.MLA,
        transfer_backend="mooncake",
        stores=tuple(
            StoreLayout(n, g.num_kv, g.layers, g.row_bytes, g.dtype) for n, g in geometry.items()
        ),
    )
    ranks = (RankTarget("fake:1", {n: g.to_dict() for n, g in geometry.items()}),)
    role = DecodeRole(cache, receiver, Transport(), layout, ranks)  # type: ignore[arg-type]
    sched, _ = make_scheduler(cache, role=role)
    return sched, receiver


def request(prompt: list[int], room: int, max_tokens: int) -> tuple[Request, list[RequestOutput]]:
    outs: list[RequestOutput] = []
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    req = client(Request(prompt, params, bootstrap=Bootstrap("127.0.0.1", 9, room)), outs.append)
    return req, outs


def arrive(sched: Scheduler, req: Request) -> None:
    """``req``'s room succeeded: its prompt's pages landed, with the prefill's first token
    (the fake model's: the prompt's last token + 1)."""
    sched.pages_arrived(PagesArrived(rid=req.rid, first_token=req.prompt_ids[-1] + 1))


def steps(sched: Scheduler, n: int = 20) -> None:
    for _ in range(n):
        step(sched)


def run(sched: Scheduler, receiver: Receiver, n: int = 200) -> None:
    """Step until idle, delivering the pages of every registered, parked request."""
    for _ in range(n):
        if sched.idle:
            return
        step(sched)
        for req in list(sched.ends.parked.values()):
            if req.rid in receiver.expected:
                arrive(sched, req)
    raise AssertionError(f"not idle: {sched.waiting}, {sched.running}, {sched.ends.parked}")


def want(prompt: list[int], n: int) -> list[int]:
    return [(prompt[-1] + 1 + i) % 100 for i in range(n)]


def test_a_request_that_does_not_fit_waits_for_parked_requests(cache: HiCache) -> None:
    """Two parked requests hold all 8 pages: a third waits for them, and runs once they
    have ended (the old scheduler refused it: nothing was running)."""
    sched, receiver = decode_scheduler(cache)
    a, a_outs = request(list(range(1, 14)), 1, 3)  # 13 tokens: 4 pages each
    b, b_outs = request(list(range(20, 33)), 2, 3)
    c, c_outs = request(list(range(40, 53)), 3, 3)
    for r in (a, b, c):
        sched.add(r)
    steps(sched, 5)
    assert set(sched.ends.parked) == {a.rid, b.rid}
    assert list(sched.waiting) == [c] and not c_outs  # queued, not refused
    run(sched, receiver)
    for r, outs in ((a, a_outs), (b, b_outs), (c, c_outs)):
        assert outs[-1].error is None, outs[-1].error
        assert outs[-1].finish_reason is FinishReason.LENGTH
        assert r.output_ids == want(r.prompt_ids, 3)
    assert receiver.expected == {a.rid: 1, b.rid: 1, c.rid: 1}
    assert not cache.admitted
    check_integrity(cache)


def test_a_running_request_that_cannot_grow_waits_for_parked_ones(cache: HiCache) -> None:
    """One request runs, another is parked, together all 8 pages: the running one's next
    page is retracted to wait (its KV kept), not aborted, and both answer in full."""
    sched, receiver = decode_scheduler(cache)
    a, a_outs = request(list(range(1, 14)), 1, 8)  # grows past 16 tokens: a 5th page
    sched.add(a)
    steps(sched, 2)
    arrive(sched, a)
    b, b_outs = request(list(range(20, 33)), 2, 3)
    sched.add(b)
    steps(sched, 8)
    assert b.rid in sched.ends.parked
    assert a.retracted == 1 and a in sched.waiting  # waits, not ended
    run(sched, receiver)
    assert a_outs[-1].error is None and a.output_ids == want(a.prompt_ids, 8)
    assert b_outs[-1].error is None and b.output_ids == want(b.prompt_ids, 3)
    check_integrity(cache)


def test_a_retracted_decode_request_resumes_without_registering_again(
    cache: HiCache,
) -> None:
    """Both requests' pages arrive, then each wants a 5th page of a full L1: one is
    retracted; admitted again it resumes from its cached KV (recomputing what was evicted)
    with no second registration of its spent room."""
    sched, receiver = decode_scheduler(cache)
    a, a_outs = request(list(range(1, 14)), 1, 8)
    b, b_outs = request(list(range(20, 33)), 2, 8)
    sched.add(a)
    sched.add(b)
    steps(sched, 2)
    arrive(sched, a)
    arrive(sched, b)
    run(sched, receiver)
    assert a.retracted + b.retracted >= 1
    assert receiver.expected == {a.rid: 1, b.rid: 1}
    assert a_outs[-1].error is None and a.output_ids == want(a.prompt_ids, 8)
    assert b_outs[-1].error is None and b.output_ids == want(b.prompt_ids, 8)
    check_integrity(cache)


def test_the_prefills_logprobs_are_the_decode_requests(cache: HiCache) -> None:
    """What the room brings besides the pages: the first token's logprob is the answer's
    first, the prompt logprobs are the answer's; a request with prompt logprobs promises
    its own cached prefix all the same (its prompt is not computed here); a room without
    the logprob asked ends its request with an error, its pages freed."""
    sched, receiver = decode_scheduler(cache)
    prompt = list(range(1, 14))
    a, _ = request(prompt, 1, 2)
    sched.add(a)
    steps(sched, 2)
    arrive(sched, a)
    run(sched, receiver)
    params = SamplingParams(temperature=0.0, max_tokens=2, logprobs=1, prompt_logprobs=1)
    b_outs: list[RequestOutput] = []
    b = client(Request(prompt, params, bootstrap=Bootstrap("127.0.0.1", 9, 2)), b_outs.append)
    sched.add(b)
    steps(sched, 2)
    assert receiver.registrations[b.rid].skip_pages == 3  # a's 3 whole pages, cached here
    first = TokenLogprob.of(14, -0.5, [(14, -0.5)])
    scored = (None, *(TokenLogprob.of(t, -1.0, [(t, -1.0)]) for t in prompt[1:]))
    item = PagesArrived(rid=b.rid, first_token=14, first_logprob=first, prompt_logprobs=scored)
    sched.pages_arrived(item)
    run(sched, receiver)
    out = b_outs[-1]
    assert out.error is None and out.logprobs is not None and out.logprobs[0] == first
    assert len(out.logprobs) == 2 and out.prompt_logprobs == list(scored)
    c_outs: list[RequestOutput] = []
    c = client(Request(prompt, params, bootstrap=Bootstrap("127.0.0.1", 9, 3)), c_outs.append)
    sched.add(c)
    steps(sched, 2)
    arrive(sched, c)  # the prefill's first token, without its logprob
    steps(sched, 2)
    assert c_outs[-1].error == "the prefill instance sent no logprob for the first token"
    assert sched.idle and not cache.admitted
    check_integrity(cache)


def test_a_refusal_names_the_shortfall(cache: HiCache) -> None:
    sched, _ = make_scheduler(cache)
    outs: list[RequestOutput] = []
    sched.add(client(Request(list(range(1, 40)), SamplingParams(max_tokens=1)), outs.append))
    steps(sched, 2)
    assert outs[-1].error == (
        "the request needs 10 KV pages (39 tokens) but the device cache has 8 pages in all"
        " (--max-total-tokens); no running or parked request holds pages that would be freed"
    )
    held = cache.full.pages.reserve(6)  # held outside the tree: 2 pages left
    assert held is not None
    outs.clear()
    sched.add(client(Request(list(range(1, 14)), SamplingParams(max_tokens=1)), outs.append))
    steps(sched, 2)
    assert outs[-1].error == (
        "the request needs 4 KV pages (13 tokens) but the device cache cannot make room now:"
        " of its 8 pages 2 are free, 6 held outside the tree (reserved, or loads in flight)"
        " and 0 cached by the tree, of which 0 evictable; no running or parked request"
        " holds pages that would be freed"
    )
    cache.full.pages.unreserve(held)
    check_integrity(cache)
