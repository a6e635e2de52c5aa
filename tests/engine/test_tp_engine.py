"""The engine as N rank processes (``tp_size`` 2, gloo, CPU), on tiny random models.

* greedy generation at TP 2 equals TP 1 and transformers' (Llama, Qwen3), also for a batch
  of concurrent requests sharing prefixes, and seeded sampling is rank 0's on every rank;
* a rank killed while serving makes the engine unhealthy with the rank named, the request
  in flight ends with that error, and nothing hangs (close returns);
* a bad ``tp_size`` (one that cannot split the heads even replicating the K/V ones) is
  refused with the numbers; a rank that does not join in time, or
  dies first, fails the start with one line naming it.

Each test starts real processes (a TP 2 start is ~15 s on 2 cores): few of them.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache.cache.report import cache_stats
from hicache.config import CacheConfig
from hicache.controller.rank_group import LocalOnlyError
from hicache.engine import ranks as ranks_module
from hicache.engine.front.engine import Engine, EngineConfig
from hicache.engine.ranks import RankProcesses, RankStartError, leave_group
from hicache.engine.request import OutputCallback, RequestOutput
from hicache.engine.sampling import SamplingParams
from hicache.engine.session import SessionHint
from hicache.engine.step.scheduler import SchedulerConfig
from hicache.engine.step_inputs import NewRequest
from hicache.engine.tp_fit import RANK_PROCESS_BYTES, check_cpu_ranks_fit, check_tp_model
from tests.helpers import rank_targets
from tests.helpers.engine_fixtures import engine_model, hf_greedy_ids

NEW = 6
PAGE = 4
pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="TP 2 needs 2 CPU cores")


def config(name: str, tp: int, **kw: object) -> EngineConfig:
    kw.setdefault("dist_init_timeout_s", 120.0)
    return EngineConfig(
        model_path=name,
        dtype="float32",
        device="cpu",
        # L1 of 16 pages: the concurrent batch (6 x 5-6 pages) retracts and evicts to L2
        # (whose copies complete on each rank in its own time: the cache agrees on them)
        cache=CacheConfig(page_size=PAGE, device_tokens=64, hicache_ratio=4.0),
        scheduler=SchedulerConfig(max_running_requests=8, chunked_prefill_size=32),
        context_length=128,
        tp_size=tp,
        **kw,
    )


def greedy(n: int = NEW) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@cache
def hf_greedy(name: str, ids: tuple[int, ...], n: int = NEW) -> list[int]:
    return hf_greedy_ids(name, ids, n)


def prompts(name: str) -> list[list[int]]:
    """Prompts sharing prefixes: two families of three (a common 13-token start each)."""
    vocab = int(engine_model(name).hf_config.vocab_size)
    gen = torch.Generator().manual_seed(7)
    heads = [torch.randint(0, vocab, (13,), generator=gen).tolist() for _ in range(2)]
    tails = [torch.randint(0, vocab, (3 + i,), generator=gen).tolist() for i in range(3)]
    return [h + t for h in heads for t in tails]


def run_batch(engine: Engine, batch: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Submit every prompt at once; their final token ids, in order."""
    done = [threading.Event() for _ in batch]
    outs: list[RequestOutput | None] = [None] * len(batch)

    def on_output(i: int) -> OutputCallback:
        def record(out: RequestOutput) -> None:
            if out.finished:
                outs[i] = out
                done[i].set()

        return record

    for i, ids in enumerate(batch):
        engine.submit(ids, params, on_output(i))
    for ev in done:
        assert ev.wait(120), "a request did not finish"
    got = []
    for out in outs:
        assert out is not None and out.error is None, out
        got.append(out.output_ids)
    return got


def quiet_digests(engine: Engine, timeout_s: float = 60.0) -> list[str]:
    """The ranks' digests once rank 0's cache has no copy in flight: the L1 -> L2 backups
    a batch leaves behind complete (and change the tree alike on every rank) over the
    next steps, so only a quiet digest can show that a later call changed nothing."""
    deadline = time.monotonic() + timeout_s
    while engine.call(
        lambda: (
            engine.core.cache.full.pages.host_pool is not None
            and engine.core.cache.full.pages.host.busy
        )
    ).result(timeout=30):
        assert time.monotonic() < deadline, f"copies still in flight after {timeout_s} s"
        time.sleep(0.02)
    return engine.rank_digests()


@pytest.fixture(scope="module", params=["tiny-random-llama", "tiny-random-qwen3"])
def tp2(request: pytest.FixtureRequest) -> Iterator[tuple[str, Engine]]:
    name = str(request.param)
    with Engine(config(name, 2)) as engine:
        yield name, engine


def test_tp2_greedy_equals_tp1_and_transformers(tp2: tuple[str, Engine]) -> None:
    name, engine = tp2
    assert engine.ranks is not None and sorted(engine.ranks.pids) == [1]
    model = engine.model.model  # rank 0's shard: half the K/V heads (2 of the model's 4 or 2)
    assert model.tp.size == 2 and model.tp.rank == 0
    assert model.num_kv_heads == model.config.num_kv_heads // 2
    batch = prompts(name)
    want = [hf_greedy(name, tuple(ids)) for ids in batch]
    with Engine(config(name, 1), loaded=engine_model(name)) as tp1:
        one_by_one = [tp1.generate(ids, greedy()).output_ids for ids in batch]
    assert one_by_one == want
    assert [engine.generate(ids, greedy()).output_ids for ids in batch] == want
    # concurrent, sharing prefixes (now cached from the runs above, and cold after a flush)
    assert run_batch(engine, batch, greedy()) == want
    assert engine.flush_cache()
    assert run_batch(engine, batch, greedy()) == want
    digests = quiet_digests(engine)
    assert len(digests) == 2 and digests[0] == digests[1]
    # a cache call that needs the ranks to agree, run on rank 0 alone, fails at once
    # (it used to block rank 0 in a collective no follower joins, for its full timeout)
    with pytest.raises(LocalOnlyError, match=r"inside Engine\.call"):
        engine.call(lambda: engine.core.cache.sync(wait=True)).result(timeout=30)
    assert (
        engine.call(lambda: cache_stats(engine.core.cache)).result(timeout=30).device_total_tokens
        > 0
    )  # reads
    assert engine.rank_digests() == digests
    assert engine.health().healthy


def test_tp2_sampling_follows_rank_0(tp2: tuple[str, Engine]) -> None:
    """Seeded sampling: every rank takes rank 0's tokens, so the sequence is TP 1's."""
    name, engine = tp2
    ids = prompts(name)[0]
    params = SamplingParams(temperature=1.0, max_tokens=NEW, seed=11, ignore_eos=True)
    with Engine(config(name, 1), loaded=engine_model(name)) as tp1:
        want = tp1.generate(ids, params).output_ids
    assert engine.generate(ids, params).output_ids == want
    # a client whose callback raises: rank 0 aborts its request through the next step's
    # inputs, so every rank ends it at the same step
    seen: list[RequestOutput] = []
    ended = threading.Event()

    def broken(out: RequestOutput) -> None:
        seen.append(out)
        if out.finished:
            ended.set()
        raise RuntimeError("the client is gone")

    engine.submit(ids, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), broken)
    assert ended.wait(60)
    assert seen[-1].finish_reason is not None and seen[-1].finish_reason.value == "abort"
    assert len(seen[-1].output_ids) < 50
    digests = engine.rank_digests()
    assert digests[0] == digests[1]
    # the process group is per process: a second TP engine here is refused, this one goes on
    with pytest.raises(RankStartError, match="one engine with tp_size > 1 per process"):
        Engine(config(name, 2)).start()
    assert engine.generate(ids, params).output_ids == want
    # unseeded: each rank's generator differs, so only rank 0's tokens keep the ranks equal
    # (the tree and every request's tokens, compared by digest after each batch)
    unseeded = SamplingParams(temperature=1.0, max_tokens=NEW, ignore_eos=True)
    for _ in range(2):
        run_batch(engine, prompts(name), unseeded)
        digests = engine.rank_digests()
        assert digests[0] == digests[1]
    assert engine.health().healthy


def run_session_batch(engine: Engine, name: str, ttl_ms: int | None = None) -> None:
    """The prompts as six sessions' turns (the second of each family a subagent of the
    first), all at once."""
    batch = prompts(name)
    done = [threading.Event() for _ in batch]
    for i, ids in enumerate(batch):
        parent = f"s{i - 1}" if i % 3 == 1 else None
        hint = SessionHint(f"s{i}", parent, ttl_ms)
        engine.submit(
            ids, greedy(), lambda out, ev=done[i]: out.finished and ev.set(), session=hint
        )
    for ev in done:
        assert ev.wait(120), "a request did not finish"


def kept_sessions(engine: Engine) -> list[tuple[str, str, int]]:
    views = engine.call(lambda: engine.core.cache.sessions.views()).result(timeout=30)
    return [(v.session_id, v.state.value, v.pinned_tokens) for v in views]


def test_tp2_sessions_are_kept_and_end_alike_on_every_rank(tp2: tuple[str, Engine]) -> None:
    """Session pins depend on the tree and the order of the ends, never on a rank's clock:
    the ranks' digests (sessions and pins included) stay equal through keeping, closing
    and expiry (rank 0's clock, broadcast)."""
    name, engine = tp2
    assert engine.flush_cache()
    run_session_batch(engine, name)
    digests = quiet_digests(engine)
    assert digests[0] == digests[1]
    kept = kept_sessions(engine)
    assert sorted(s for s, _, _ in kept) == [f"s{i}" for i in range(6)]
    assert all(st == "kept" and pinned > 0 for _, st, pinned in kept)
    assert engine.close_session("s0") and not engine.close_session("s0")
    digests = engine.rank_digests()
    assert digests[0] == digests[1]
    run_session_batch(engine, name, ttl_ms=50)  # every session again, now with a short TTL
    deadline = time.monotonic() + 30
    while kept_sessions(engine):
        assert time.monotonic() < deadline, "the sessions outlived their TTL"
        time.sleep(0.05)
    digests = quiet_digests(engine)
    assert digests[0] == digests[1]
    pins = engine.call(
        lambda: [n.host_ref for n in engine.core.cache.full.pages.tree.iter_nodes()]
    ).result(timeout=30)
    assert not any(pins)


def test_the_ranks_end_on_close_or_on_a_death(tp2: tuple[str, Engine]) -> None:
    """The last test of each TP 2 engine (pytest runs a module fixture's tests in file
    order): the Llama engine's rank 0 fails a step on its own (:func:`rank_0_fails`), the
    Qwen3 engine loses rank 1 to a kill while a request runs (:func:`rank_killed`)."""
    name, engine = tp2
    if name == "tiny-random-qwen3":
        rank_killed(name, engine)
    else:
        rank_0_fails(name, engine)


def rank_0_fails(name: str, engine: Engine) -> None:
    """A scheduler step that raises on rank 0 alone: no rank may go on alone, so rank 0
    stops its follower at once (not at the collective timeout) and leaves the group, the
    engine is unhealthy naming rank 0, and close returns."""
    assert engine.ranks is not None
    procs = list(engine.ranks._procs.values())

    def boom() -> bool:
        raise RuntimeError("a bug on rank 0")

    started = time.monotonic()
    try:
        engine.call(lambda: setattr(engine.core.scheduler, "step", boom)).result(timeout=30)
        while engine.health().healthy and time.monotonic() - started < 30:
            time.sleep(0.05)
        # unhealthy from the failure on, naming rank 0, before it has stopped its follower
        reason = engine.health().reason
        assert reason is not None and "rank 0 stopped: RuntimeError: a bug on rank 0" in reason
        while engine.rank_failure is None and time.monotonic() - started < 30:
            assert not engine.health().healthy
            time.sleep(0.05)
        assert engine.rank_failure is not None and engine.rank_failure.startswith("rank 0")
        for proc in procs:
            proc.join(timeout=30)
        assert [p.exitcode for p in procs] == [-signal.SIGTERM]  # stopped by rank 0
        assert time.monotonic() - started < 30
        with pytest.raises(RuntimeError, match="rank 0 stopped"):
            engine.submit(prompts(name)[0], greedy())
    finally:
        engine.close(timeout=20)
        assert time.monotonic() - started < 40


def rank_killed(name: str, engine: Engine) -> None:
    """Kill rank 1 mid-request: the engine turns unhealthy naming the rank (and its pid),
    the request ends with that error, new requests are refused, close returns."""
    try:
        assert engine.ranks is not None
        pid = engine.ranks.pids[1]
        first = threading.Event()
        final: list[RequestOutput] = []

        def on_output(out: RequestOutput) -> None:
            first.set()
            if out.finished:
                final.append(out)

        ids = prompts(name)[0]
        engine.submit(
            ids, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), on_output
        )
        assert first.wait(60)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while engine.health().healthy and time.monotonic() < deadline:
            time.sleep(0.05)
        health = engine.health()
        assert not health.healthy and health.reason is not None
        assert "rank 1" in health.reason and str(pid) in health.reason, health.reason
        assert engine.rank_failure is not None and "rank 1" in engine.rank_failure
        while not final and time.monotonic() < deadline:
            time.sleep(0.05)
        assert final and final[0].error is not None and "rank 1" in final[0].error, final
        with pytest.raises(RuntimeError, match="rank 1"):
            engine.submit(ids, greedy())
    finally:
        started = time.monotonic()
        engine.close(timeout=20)
        assert time.monotonic() - started < 20


def test_bad_tp_size_is_refused_with_the_numbers() -> None:
    # tiny-random-llama: 4 attention heads, 2 KV heads
    with pytest.raises(
        ValueError, match=r"^tp_size=3 is invalid for tiny-random-llama: .*num_attention_heads=4"
    ):
        check_tp_model("tiny-random-llama", 3)
    with pytest.raises(
        ValueError, match=r"^tp_size=8 .*size 8 cannot split num_attention_heads=4, num_key_v"
    ):
        check_tp_model("tiny-random-llama", 8)
    check_tp_model("tiny-random-llama", 2)  # fits
    check_tp_model("tiny-random-llama", 4)  # fits: each of the 2 K/V heads on two ranks
    check_tp_model("tiny-random-gemma3", 2)  # a hybrid that splits: 2 K/V heads
    check_tp_model("tiny-random-gemma3", 4)  # its 2 K/V heads replicated
    with pytest.raises(ValueError, match=r"^tp_size=8 .*size 8 cannot split num_attention_h"):
        check_tp_model("tiny-random-gemma3", 8)
    with pytest.raises(ValueError, match="every rank loads its own shard"):
        Engine(config("tiny-random-llama", 2), loaded=engine_model("tiny-random-llama")).start()
    mib = 1 << 20  # CPU ranks may share cores; memory bounds them
    check_cpu_ranks_fit(4, 10 * mib, 4 * RANK_PROCESS_BYTES + 10 * mib, "m")
    with pytest.raises(
        ValueError,
        match=r"tp_size=4 is invalid for m: 4 CPU ranks need about 2058 MiB .* has 2057 MiB",
    ):
        check_cpu_ranks_fit(4, 10 * mib, 4 * RANK_PROCESS_BYTES + 9 * mib, "m")
    check_cpu_ranks_fit(64, 10 * mib, None, "m")  # unknown memory: not checked
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="tp_size"):
            config("tiny-random-llama", bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dist_init_timeout_s"):
        config("tiny-random-llama", 1, dist_init_timeout_s=0)


def test_a_rank_that_does_not_join_fails_the_start_naming_it() -> None:
    ranks = RankProcesses(2, rank_targets.never_joins, None, init_timeout_s=3.0)
    started = time.monotonic()
    with pytest.raises(RankStartError) as err:
        ranks.start()
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("rank 1 did not join the process group within 3 s"), message
    assert time.monotonic() - started < 60
    assert all(not p.is_alive() for p in ranks._procs.values())


def test_a_rank_that_dies_before_joining_is_named() -> None:
    ranks = RankProcesses(2, rank_targets.exits_at_once, None, init_timeout_s=30.0)
    with pytest.raises(RankStartError, match=r"^rank 1 \(pid \d+\) exited with code 3 before"):
        ranks.start()


def test_a_rendezvous_port_taken_after_it_was_picked_does_not_fail_the_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 0 binds its rendezvous store at a port the system picks as it binds, and keeps
    it: a port picked first and bound later could be taken in between (here: by a socket
    already listening on the port the old way picked), which failed the start after 5 s
    as "rank 1 did not join", rank 0's own error dropped."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    monkeypatch.setattr(ranks_module, "free_port", lambda: port, raising=False)
    ranks = RankProcesses(2, rank_targets.joins_and_gathers, None, init_timeout_s=30.0)
    try:
        channel = ranks.start()
        assert channel.gather("rank 0") == ["rank 0", "rank 1"]
    finally:
        ranks.close(timeout=10)
        leave_group()
        taken.close()


def test_rank_0s_own_join_failure_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's join fails on its own (not at the join timeout): the line names rank 0's
    error, not a follower that "did not join within 30 s"."""

    def fails(setup: Any, store: Any = None) -> Any:
        raise RuntimeError("EADDRINUSE: address already in use")

    monkeypatch.setattr(ranks_module, "join_group", fails)
    ranks = RankProcesses(2, rank_targets.joins_and_gathers, None, init_timeout_s=30.0)
    started = time.monotonic()
    with pytest.raises(RankStartError) as err:
        ranks.start()
    message = str(err.value)
    assert message.startswith("rank 0 could not join the process group: RuntimeError:"), message
    assert "EADDRINUSE" in message and "within 30 s" not in message, message
    assert time.monotonic() - started < 20


def test_step_records_pickle_and_rebuild_the_params() -> None:
    import pickle

    params = SamplingParams(temperature=0.7, top_k=5, logit_bias={"3": 1.5}, stop=["x"], seed=9)
    rec = NewRequest.of(
        rid="r",
        prompt_ids=[1, 2],
        params=params,
        cache_salt="s",
        priority=2,
        group="g",
        arrival=1.0,
    )
    back = pickle.loads(pickle.dumps(rec))
    assert back == rec and back.sampling == params and back.prompt_ids == (1, 2)


def test_tp2_l3_head_records_and_runtime_attach(tmp_path: Path) -> None:
    """File L3 at TP 2: each rank writes the records of its K/V head (one per page and
    head, under the namespace every TP size shares); after
    ``flush_cache`` the replay is served from L3 with transformers' output; a detach and
    a runtime attach (step-input records, applied by every rank) serve it again."""
    name = "tiny-random-llama"
    extra = {"file_path": str(tmp_path), "prefetch_threshold": 8}
    ids = prompts(name)[0] * 3  # 48 tokens: 12 pages; 47 matched
    want = hf_greedy(name, tuple(ids))
    with Engine(config(name, 2, storage_backend="file", storage_extra_config=extra)) as engine:
        assert engine.generate(ids, greedy()).output_ids == want
        assert engine.flush_cache()
        replay = engine.generate(ids, greedy())
        assert replay.output_ids == want
        assert replay.cached.storage == 44 and replay.cached.device == 0
        assert engine.detach_storage()
        engine.attach_storage("file", extra)
        assert engine.flush_cache()
        again = engine.generate(ids, greedy())
        assert again.output_ids == want and again.cached.storage == 44
        digests = engine.rank_digests()
        assert digests[0] == digests[1]
        with pytest.raises(RuntimeError, match="attached"):
            engine.attach_storage("file", extra)  # refused on rank 0 and on rank 1 alike
        assert engine.generate(ids, greedy()).output_ids == want
        assert engine.ranks is not None
        procs = list(engine.ranks._procs.values())
        closing = time.monotonic()
    # close: every follower stops on the broadcast stop, exit code 0, at once
    assert time.monotonic() - closing < 15
    assert [p.exitcode for p in procs] == [0]
    assert engine.rank_failure is None
    records = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert records and len(records) % 2 == 0  # both heads of every page
