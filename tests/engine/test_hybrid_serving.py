"""The hybrid families served through :class:`Engine` (tiny random models, CPU, fp32).

* Greedy generation equals transformers' greedy ``generate`` for Gemma 3, GPT-OSS,
  Qwen3-Next and Nemotron-H.
* Attention-only hybrids (Gemma 3, GPT-OSS: global layers in the full pool, sliding-window
  layers in the cache's SWA pools, which keep only each sequence's window) reuse
  prefixes: the same prompt again hits L1, then L2 after forced eviction, then a file L3
  after ``flush_cache`` (the window before the boundary comes back as ``"swa"`` records
  with the full pages), with identical tokens every time; a second engine on the same
  file L3 hits the first one's records.
* Models with recurrent layers (Qwen3-Next, Nemotron-H) resume a cached prefix only from a
  state snapshot the cache took at the prompt's last page boundary: the same prompt again
  resumes there from L1, from L2 after forced eviction, and from a file L3 after
  ``flush_cache`` (the snapshot is an L3 record too), with identical tokens.
  Concurrent requests on a small L1, with retractions, still give each prompt's exact
  output, and every recurrent state is dropped afterwards.
* A request's end commits the state after the last page it computed (a follow-up turn
  resumes there), and a second engine on the same file L3 resumes from the first one's
  snapshot records.
* An L1 state pool too small for ``max_running_requests`` is refused at start.
* Every pool is back to idle afterwards (no request held, integrity clean).
"""

from __future__ import annotations

import math
import threading
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache.cache.components import SwaStore
from hicache.cache.report import cache_stats
from hicache.config import CacheConfig
from hicache.engine.front.engine import Engine, EngineConfig
from hicache.engine.sampling import SamplingParams
from hicache.engine.step.scheduler import SchedulerConfig
from hicache.memory import DevicePool
from hicache.runner.loader import LoadedHybridModel, load_model
from hicache.runner.model_runner import ForwardBatch, ModelRunner
from hicache.runner.models.config import UnsupportedModelError
from hicache.tree.components import Tier
from tests.helpers.numerics import order_bound
from tests.helpers.tier_walk import (
    assert_hits_storage,
    assert_idle,
    count_retractions,
    demote_all,
    run_all,
    walk_tiers,
)
from tests.runner.models.hybrid_fixtures import HYBRID, hf_twin, hybrid_model, prompt

PAGE = 4
ATTENTION_ONLY = ("tiny-random-gemma3", "tiny-random-gpt-oss")
RECURRENT = ("tiny-random-qwen3-next", "tiny-random-nemotron-h")
PROMPT_LEN = 33  # prompt[:-1] is matched: 8 whole pages
MATCHED = 32
NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def make_engine(
    name: str, *, storage: Path | None = None, chunked_prefill_size: int = 16, **cache_cfg: object
) -> Engine:
    cfg: dict[str, object] = dict(
        page_size=PAGE,
        device_tokens=256,
        hicache_ratio=4.0,
        load_back_threshold=0,
        max_mamba_cache_size=16,  # >= max_running_requests + 1: full reuse
    )
    cfg.update(cache_cfg)
    config = EngineConfig(
        model_path=name,
        dtype="float32",
        device="cpu",
        cache=CacheConfig(**cfg),  # type: ignore[arg-type]
        scheduler=SchedulerConfig(
            max_running_requests=8, chunked_prefill_size=chunked_prefill_size
        ),
        context_length=128,
        storage_backend="file" if storage is not None else None,
        storage_extra_config=(
            {"file_path": str(storage), "prefetch_threshold": 8} if storage is not None else {}
        ),
    )
    return Engine(config, loaded=hybrid_model(name)).start()


@cache
def _hf_greedy(name: str, ids: tuple[int, ...], n: int) -> tuple[int, ...]:
    with torch.no_grad():
        out = hf_twin(name).generate(
            torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False
        )
    return tuple(out[0, len(ids) :].tolist())


def hf_greedy(name: str, ids: list[int], n: int = NEW_TOKENS) -> list[int]:
    """transformers' greedy continuation of ``ids`` (exactly ``n`` tokens, EOS ignored)."""
    return list(_hf_greedy(name, tuple(ids), n))


def test_load_model_serves_hybrid_checkpoints_and_refuses_llama_as_hybrid() -> None:
    loaded = load_model("tiny-random-qwen3-next", dtype="float32")
    assert isinstance(loaded, LoadedHybridModel)
    assert loaded.model.state_specs()
    from hicache.runner.loader import load_hybrid_model

    with pytest.raises(UnsupportedModelError, match="not a hybrid family"):
        load_hybrid_model("tiny-random-llama", dtype="float32")


@pytest.mark.parametrize("name", HYBRID)
def test_greedy_through_engine_equals_transformers(name: str) -> None:
    ids = prompt(name, PROMPT_LEN).tolist()
    want = hf_greedy(name, ids)
    with make_engine(name) as engine:
        assert engine.core.scheduler.resumable_prefix
        cfg = hybrid_model(name).model.config
        if name in ATTENTION_ONLY:  # sliding layers in the SWA pools, global in the full
            assert engine.core.cache.context.spec.num_layers == len(cfg.global_layers)
            swa = engine.core.cache.stores.of_type(SwaStore)
            assert swa is not None
            assert swa.spec.kv.num_layers == len(cfg.sliding_layers)
            assert engine.core.cache.stores.names == ["swa", "logprob"]  # + scoring entries
        else:
            assert engine.core.cache.context.spec.num_layers == len(cfg.kv_layers)
            assert engine.core.cache.stores.of_type(SwaStore) is None
        out = engine.generate(ids, GREEDY, timeout=60)
        assert out.error is None and out.output_ids == want
        again = engine.generate(ids, GREEDY, timeout=60)
        assert again.output_ids == want
        assert again.cached.total == MATCHED  # a snapshot at the last boundary (recurrent)
        assert_idle(engine)


@pytest.mark.parametrize("name", HYBRID)
def test_hybrid_hits_l1_l2_and_file_l3(name: str, tmp_path: Path) -> None:
    ids = prompt(name, PROMPT_LEN).tolist()
    want = hf_greedy(name, ids)
    with make_engine(name, storage=tmp_path) as engine:
        # from L3: a recurrent model's snapshot at the prompt's last page boundary comes
        # back with its pages (a "mamba" record), an SWA model's window before it (its
        # "swa" records): the prefill resumes there
        walk_tiers(engine, ids, GREEDY, want, MATCHED)


@pytest.mark.parametrize("name", HYBRID)
def test_concurrent_requests_stay_exact(name: str) -> None:
    """Six requests on a small L1 (each needs 6 pages for its prompt, 8 at the end); the
    attention-only ones retract one another; every output equals transformers'. (Their
    shared 12 tokens are no boundary: the sliding layers' pages of it fall out of the
    window and are tombstoned.)"""
    shared = prompt(name, 12).tolist()
    prompts = [shared + prompt(name, 10, offset=20 + 7 * i).tolist() for i in range(6)]
    want = [hf_greedy(name, p) for p in prompts]
    # attention-only: a 7-page SWA pool, the least one request needs (window 2 pages, a
    # 16-token chunk 4, one more), so sliding-window pages force the retractions
    with make_engine(name, device_tokens=14 * PAGE, swa_full_tokens_ratio=0.5) as engine:
        retracted = count_retractions(engine)
        assert run_all(engine, prompts, GREEDY) == want
        if name in ATTENTION_ONLY:
            assert retracted, "the small L1 should have forced a retraction"
        assert_idle(engine)


@pytest.mark.parametrize("name", RECURRENT)
def test_a_retracted_recurrent_request_resumes_from_its_snapshot(name: str) -> None:
    """Retract a recurrent request mid-decode: it is re-admitted at its own snapshot
    boundary (the state comes back from the cache) and still ends with transformers'
    tokens."""
    ids = prompt(name, PROMPT_LEN).tolist()
    want = hf_greedy(name, ids)
    with make_engine(name) as engine:
        two = threading.Event()
        final: list[object] = []

        def cb(out) -> None:  # type: ignore[no-untyped-def]
            if len(out.output_ids) >= 2:
                two.set()
            if out.finished:
                final.append(out)

        rid = engine.submit(ids, GREEDY, cb)
        assert two.wait(60)

        def retract() -> int:
            for req in list(engine.core.scheduler.running):
                if req.rid == rid:
                    engine.core.scheduler._retract(req)
            return sum(r.retracted for r in engine.core.scheduler.waiting)

        assert engine.call(retract).result(timeout=30) == 1
        for _ in range(600):
            if final:
                break
            threading.Event().wait(0.05)
        (out,) = final
        assert out.error is None and out.output_ids == want  # type: ignore[attr-defined]
        assert_idle(engine)


def test_runner_refuses_to_resume_a_recurrent_sequence_it_holds_no_state_for() -> None:
    name = "tiny-random-nemotron-h"
    model = hybrid_model(name).model
    runner = ModelRunner(model, DevicePool(model.config.kv_spec("float32"), 8, PAGE))
    assert not runner.resumable_prefix and runner.recurrent and runner.states is not None
    ids = prompt(name, 9)
    slots = torch.arange(9)

    def batch(start: int, end: int, key: str) -> ForwardBatch:
        return ForwardBatch(
            input_ids=ids[start:end],
            positions=torch.arange(start, end),
            extend_lens=[end - start],
            seq_slots=[slots[:end]],
            seq_ids=[key],
        )

    with pytest.raises(ValueError, match="no state"):
        runner.forward(batch(4, 9, "a"))  # a prefix the cache served: no state for it
    with pytest.raises(ValueError, match="seq_ids"):
        runner.forward(ForwardBatch(input_ids=ids, positions=torch.arange(9), extend_lens=[9],
                                    seq_slots=[slots]))  # fmt: skip
    full = runner.forward(batch(0, 9, "a"))
    runner.drop_state("a")
    runner.forward(batch(0, 4, "a"))
    assert runner.states.tokens("a") == 4
    with pytest.raises(ValueError, match="a state of 4 positions"):
        runner.forward(batch(5, 9, "a"))
    resumed = runner.forward(batch(4, 9, "a"))
    # chunked (4 + 5) against whole: the hybrid logits' order bound (test_hybrid_models)
    bound = order_bound(128, full.abs().max().item())
    assert torch.allclose(resumed, full, rtol=0, atol=bound)
    runner.drop_state("a")
    assert len(runner.states) == 0


@pytest.mark.parametrize("name", RECURRENT)
def test_a_shared_prefix_resumes_from_an_interval_snapshot(name: str) -> None:
    """Snapshots every ``mamba_track_interval`` tokens: two prompts that share their first
    16 tokens only (a system prompt), the second resumes at 16 from the first's snapshot
    and still gives transformers' tokens."""
    shared = prompt(name, 16).tolist()
    first = shared + prompt(name, 9, offset=40).tolist()
    second = shared + prompt(name, 9, offset=70).tolist()
    with make_engine(name, mamba_track_interval=2 * PAGE) as engine:
        a = engine.generate(first, GREEDY, timeout=60)
        assert a.output_ids == hf_greedy(name, first)
        b = engine.generate(second, GREEDY, timeout=60)
        assert b.cached.device == 16 and b.output_ids == hf_greedy(name, second)
        assert_idle(engine)


@pytest.mark.parametrize("name", RECURRENT)
def test_a_follow_up_turn_resumes_from_the_request_end_snapshot(name: str) -> None:
    """33 prompt tokens + 8 generated: the request computed 40 positions (its last token
    is never run), a page boundary, so its end commits that state; the next turn
    (prompt + output + more) resumes at 40, past the prompt's snapshot at 32."""
    ids = prompt(name, PROMPT_LEN).tolist()
    with make_engine(name) as engine:
        first = engine.generate(ids, GREEDY, timeout=60)
        assert first.output_ids == hf_greedy(name, ids)
        turn = ids + first.output_ids + prompt(name, 6, offset=60).tolist()
        second = engine.generate(turn, GREEDY, timeout=60)
        assert second.cached.device == PROMPT_LEN + NEW_TOKENS - 1 == 40
        assert second.output_ids == hf_greedy(name, turn)
        assert_idle(engine)


@pytest.mark.parametrize("name", RECURRENT)
def test_a_second_engine_resumes_from_the_shared_file_l3(name: str, tmp_path: Path) -> None:
    ids = prompt(name, PROMPT_LEN).tolist()
    want = hf_greedy(name, ids)
    with make_engine(name, storage=tmp_path) as engine:
        assert engine.generate(ids, GREEDY, timeout=60).output_ids == want
        engine.call(lambda: engine.core.cache.sync(wait=True)).result(
            timeout=60
        )  # pages and snapshots in L3
        written = cache_stats(engine.core.cache).counters["l3_backup_snapshots_total"]
        assert written >= 2  # the prompt's (32) and the request end's (40)
    with make_engine(name, storage=tmp_path) as other:
        assert_hits_storage(other, ids, GREEDY, want, MATCHED)


@pytest.mark.parametrize("name", ATTENTION_ONLY)
def test_a_second_engine_hits_the_windows_in_the_shared_file_l3(name: str, tmp_path: Path) -> None:
    ids = prompt(name, PROMPT_LEN).tolist()
    want = hf_greedy(name, ids)
    with make_engine(name, storage=tmp_path) as engine:
        assert engine.generate(ids, GREEDY, timeout=60).output_ids == want
        engine.call(lambda: engine.core.cache.sync(wait=True)).result(
            timeout=60
        )  # pages and windows in L3
        counters = cache_stats(engine.core.cache).counters
        assert counters["l3_backup_swa_pages_total"] > 0
        assert counters["l3_backup_swa_pages_failed_total"] == 0
    with make_engine(name, storage=tmp_path) as other:
        out = other.generate(ids, GREEDY, timeout=60)
        assert out.cached.storage == MATCHED and out.output_ids == want
        swa = other.core.cache.stores.of_type(SwaStore)
        assert swa is not None
        window = -(-swa.window // PAGE)
        got = cache_stats(other.core.cache).counters["prefetch_component_records_total"]
        assert got == min(window, MATCHED // PAGE)  # the boundary's window, no more
        assert_idle(other)


def test_a_state_pool_too_small_for_one_request_is_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One slot cannot hold a resumed snapshot and a new one: refused with the numbers.
    Fewer slots than the running requests can pin is served (reuse degrades) with a
    warning that names the flags."""
    name = "tiny-random-qwen3-next"
    with pytest.raises(ValueError, match=r"holds 1 snapshot slot\(s\).*one request needs 2"
                       r".*--max-mamba-cache-size >= 2"):  # fmt: skip
        make_engine(name, max_mamba_cache_size=1)
    with pytest.raises(ValueError, match=r"--mamba-full-memory-ratio 0.001 x the \d+ B L1"):
        make_engine(name, max_mamba_cache_size=0, mamba_full_memory_ratio=0.001)
    with (
        caplog.at_level("WARNING", logger="hicache.cache"),
        make_engine(name, max_mamba_cache_size=4) as engine,
    ):
        ids = prompt(name, PROMPT_LEN).tolist()
        assert engine.generate(ids, GREEDY, timeout=60).output_ids == hf_greedy(name, ids)
    assert (
        "--max-running-requests 8" in caplog.text and "--max-mamba-cache-size >= 9" in caplog.text
    )


@pytest.mark.parametrize("name", ATTENTION_ONLY)
def test_sliding_layers_hold_only_the_window_while_the_full_pool_grows(name: str) -> None:
    """A 33-token prompt and 40 new tokens: every forward, the request's SWA pages stay
    within :func:`request_pages` while its full pages grow to the whole sequence; the
    tokens are transformers'. The stats report the SWA bytes per cached token."""
    from hicache.cache.components.swa import request_pages

    ids = prompt(name, PROMPT_LEN).tolist()
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with make_engine(name) as engine:
        swa = engine.core.cache.stores.of_type(SwaStore)
        assert swa is not None
        bound = request_pages(swa.window, 16, PAGE)
        seen: list[tuple[int, int]] = []
        run = engine.core.scheduler._run

        def recording(batch):  # type: ignore[no-untyped-def]
            for req in (chunk.req for chunk in batch):
                table = swa.table(req.cache)
                assert table is not None
                seen.append((len(table.pages), len(req.cache.pages)))
            run(batch)

        engine.core.scheduler._run = recording  # type: ignore[method-assign]
        out = engine.generate(ids, params, timeout=60)
        assert out.error is None and out.output_ids == hf_greedy(name, ids, 40)
        assert max(s for s, _ in seen) <= bound < max(f for _, f in seen)
        assert max(f for _, f in seen) == math.ceil((PROMPT_LEN + 39) / PAGE)

        def usage() -> dict[str, float]:
            return {
                c.name: c.bytes_per_cached_token for c in cache_stats(engine.core.cache).components
            }

        per_token = engine.call(usage).result(timeout=30)
        assert per_token["full"] == engine.core.cache.context.spec.token_bytes
        # the prompt's pages (committed with each prefill chunk) and the final window; the
        # decoded positions between are tombstones
        assert 0 < per_token["swa"] < swa.spec.kv.token_bytes
        assert engine.call(
            lambda: engine.core.cache.full.pages.tree.component_stats("swa").tombstones
        ).result(timeout=30)
        assert_idle(engine)


@pytest.mark.parametrize("name", ATTENTION_ONLY)
def test_a_window_evicted_from_l1_comes_back_from_l2(name: str) -> None:
    """Evict only the SWA pages of the cached prompt from L1 (its full KV stays): the same
    prompt loads the window back from L2 and gives transformers' tokens."""
    ids = prompt(name, PROMPT_LEN).tolist()
    want = hf_greedy(name, ids)
    with make_engine(name) as engine:
        assert engine.generate(ids, GREEDY, timeout=60).output_ids == want

        def swa_in(tier: Tier) -> int:
            return len(engine.core.cache.full.pages.tree.component_ids("swa", tier))

        def evict_windows() -> int:
            cache = engine.core.cache
            cache.sync(wait=True)
            swa = cache.stores.of_type(SwaStore)
            assert swa is not None
            freed = 0
            for node in list(cache.full.pages.tree.component_eviction_order("swa", Tier.DEVICE)):
                ids_ = cache.full.pages.tree.evict_component("swa", node, Tier.DEVICE)
                swa.free(Tier.DEVICE, ids_)
                freed += len(ids_)
            return freed

        assert engine.call(evict_windows).result(timeout=30) > 0
        assert engine.call(lambda: swa_in(Tier.DEVICE)).result(timeout=30) == 0
        again = engine.generate(ids, GREEDY, timeout=60)
        # the full KV was in L1 (counted as L1 hits); only the window was copied back
        assert again.cached.device == MATCHED and again.output_ids == want
        assert engine.call(lambda: swa_in(Tier.DEVICE)).result(timeout=30) > 0
        assert_idle(engine)


def test_an_swa_pool_too_small_for_one_window_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match=r"swa_full_tokens_ratio=0\.1.*needs 7"):
        make_engine("tiny-random-gemma3", swa_full_tokens_ratio=0.1)


@pytest.mark.parametrize("name", RECURRENT)
def test_a_mark_keeps_the_state_inside_a_forward(name: str) -> None:
    """A forward of 9 tokens with a mark after 4 keeps the state a forward ending at 4
    would leave (and the same logits as without the mark); it is taken once."""
    model = hybrid_model(name).model
    runner = ModelRunner(model, DevicePool(model.config.kv_spec("float32"), 8, PAGE))
    ids, slots = prompt(name, 9), torch.arange(9)

    def batch(end: int, key: str, keep: list[tuple[int, ...]] | None = None) -> ForwardBatch:
        return ForwardBatch(
            input_ids=ids[:end],
            positions=torch.arange(end),
            extend_lens=[end],
            seq_slots=[slots[:end]],
            seq_ids=[key],
            keep=keep,
        )

    runner.forward(batch(4, "short", [(4,)]))  # the state after the forward
    short = runner.take_extras("short")
    assert short is not None and [s.tokens for s in short.states] == [4]
    want = short.states[0].tensors
    plain = runner.forward(batch(9, "plain"))
    assert runner.take_extras("plain") is None  # nothing asked, nothing kept
    marked = runner.forward(batch(9, "marked", [(4, 9)]))
    # chunking differs only in fp32 order: within the hybrid logits' order bound (|z| <= 8.3:
    # order_bound(128, 8.3) = 1.3e-4; here 1e-4 + 1e-5 |z|, measured 1.8e-5)
    assert torch.allclose(marked, plain, atol=1e-4)
    got = runner.take_extras("marked")
    assert got is not None and [s.tokens for s in got.states] == [4, 9]
    for a, b in zip(got.states[0].tensors, want, strict=True):
        # the state after 4 tokens, kept mid-forward against a forward ending there: the
        # same recurrence steps, in another chunk (measured 3.5e-6 against 1e-5 + 1e-5 |s|)
        assert torch.allclose(a, b, atol=1e-5)
    assert runner.states is not None and runner.states.tokens("marked") == 9
    for a, b in zip(got.states[1].tensors, runner.states.export("marked")[1], strict=True):
        assert torch.equal(a, b)
    assert runner.take_extras("marked") is None
    with pytest.raises(
        ValueError, match=r"keep=\(10,\) must be distinct ascending offsets in \[1, 9\]"
    ):
        batch(9, "x", [(10,)])
    with pytest.raises(ValueError, match="one at most"):
        runner.forward(batch(9, "x", [(2, 4)]))
    for key in ("short", "plain", "marked"):
        runner.drop_state(key)
    assert runner.states is not None and len(runner.states) == 0


@pytest.mark.parametrize("name", RECURRENT)
def test_a_prompt_is_one_forward_with_its_snapshot_taken_inside(name: str) -> None:
    """A 33-token prompt (chunk 64): one prefill forward marks the snapshot at 32 instead of
    two forwards split there; the same prompt again resumes at 32 with the same tokens."""
    ids = prompt(name, PROMPT_LEN).tolist()
    with make_engine(name, chunked_prefill_size=64) as engine:
        prefills: list[list[int]] = []
        forward = engine.core.scheduler.runner.forward

        def counting(fb, **kw):  # type: ignore[no-untyped-def]
            if any(n > 1 for n in fb.extend_lens):
                prefills.append(list(fb.extend_lens))
            return forward(fb, **kw)

        engine.core.scheduler.runner.forward = counting  # type: ignore[method-assign]
        first = engine.generate(ids, GREEDY, timeout=60)
        assert prefills == [[PROMPT_LEN]] and first.output_ids == hf_greedy(name, ids)
        again = engine.generate(ids, GREEDY, timeout=60)
        assert again.cached.device == MATCHED and again.output_ids == first.output_ids
        assert_idle(engine)


def test_a_corrupt_snapshot_record_is_healed_by_the_recompute(tmp_path: Path) -> None:
    """Qwen3-Next: the L3 state snapshot at the prompt's last page boundary (a ``mamba``
    component record) has a flipped byte. The next request misses it (no usable L3 hit:
    the boundary needs it) and recomputes; the backup of the recomputed snapshot replaces
    the bad record (it used to be skipped as present), so the request after hits L3 for
    the whole prefix and reads no bad record."""
    name = "tiny-random-qwen3-next"
    ids = prompt(name, PROMPT_LEN).tolist()
    want = hf_greedy(name, ids)
    with make_engine(name, storage=tmp_path) as engine:

        def only_in_l3() -> None:
            engine.call(lambda: engine.core.cache.sync(wait=True)).result(
                timeout=60
            )  # every backup reaches L3
            assert engine.flush_cache()  # L1 and L2 emptied

        assert engine.generate(ids, GREEDY, timeout=60).output_ids == want
        only_in_l3()
        l3 = engine.core.cache.l3.attached
        assert l3 is not None
        key = l3.keys.of(b"".join(t.to_bytes(4, "little") for t in ids[:MATCHED]), "", "mamba")[-1]
        path = l3.controller.storage.path_of(key.key)  # type: ignore[attr-defined]
        data = bytearray(path.read_bytes())
        data[-3] ^= 0xFF
        path.write_bytes(bytes(data))
        before = cache_stats(engine.core.cache).storage
        missed = engine.generate(ids, GREEDY, timeout=60)
        assert missed.cached.storage < MATCHED and missed.output_ids == want
        only_in_l3()
        mid = cache_stats(engine.core.cache).storage
        assert mid.miss("corrupt") == before.miss("corrupt") + 1
        healed = engine.generate(ids, GREEDY, timeout=60)
        assert healed.cached.storage == MATCHED and healed.output_ids == want
        after = cache_stats(engine.core.cache).storage
        assert after.miss("corrupt") == mid.miss("corrupt")
        assert after.repaired == before.repaired + 1
        assert_idle(engine)


class FailingLoadCopies:
    """Wraps the transfer engine's copier: every L2 -> L1 load raises before its first
    layer is copied while ``on`` (a hybrid's full-KV pool may have a single layer, after
    which a failure would change nothing); backups pass through."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.on = False
        self.fired = threading.Event()

    def load_layers(self, *args: Any) -> None:
        if self.on:
            self.fired.set()
            raise RuntimeError("injected copy failure before layer 0")
        self.inner.load_layers(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.parametrize("name", HYBRID)
def test_a_failed_load_back_recomputes_with_transformers_tokens(name: str) -> None:
    """Every L2 -> L1 load of the full KV fails (the injected copy failure): a request
    whose prefix is in L2 only recomputes it instead of failing, and gives transformers'
    tokens; every pool is idle afterwards."""
    ids = prompt(name, PROMPT_LEN).tolist()
    want = hf_greedy(name, ids)
    with make_engine(name) as engine:
        assert engine.generate(ids, GREEDY, timeout=60).output_ids == want
        assert demote_all(engine) > 0
        assert engine.core.cache.full.pages.host_pool is not None
        transfer = engine.core.cache.full.pages.host.controller._engine
        copies = FailingLoadCopies(transfer.copier)
        transfer.copier = copies  # type: ignore[assignment]
        copies.on = True
        out = engine.generate(ids, GREEDY, timeout=60)
        assert copies.fired.is_set()
        assert out.error is None and out.output_ids == want and out.cached.host == 0
        assert cache_stats(engine.core.cache).counters["load_fallbacks_total"] == 1
        copies.on = False
        assert_idle(engine)
