"""Decode through static buffers per batch bucket (what a CUDA graph replays), on CPU.

On CPU nothing is captured: :meth:`DecodeGraphs.run` runs the very function a graph
records, on the same static buffers, with the Triton decode kernel in Triton's
interpreter (``TRITON_INTERPRET=1``, set by ``tests/conftest.py``). Checked here:

* buckets, and the choice of the smallest bucket that holds a batch;
* logits of a padded bucket equal the eager runner's; padding rows (and stale rows of an
  earlier, larger batch) change neither real rows nor any K/V outside the batch's own
  new slots and the scratch page; the real slots get the eager forward's K/V;
* the runner hands over exactly the batches the graphs may serve; a batch they cannot
  serve (slots not over whole pages, a sequence longer than the table) runs eagerly;
* set-up: refusals name why; a probe that disagrees turns graphs off with a warning;
  the probe compares with the SDPA forward, so a decode kernel that skips the
  cross-block rescale (the real kernel with that one line changed, called where the
  attention layers call it) turns graphs off; the probe's batch fits the page table;
  through the engine, greedy outputs are the eager ones, the scratch page is
  reserved in the cache (never a request's) and the probe's pages only for the probe;
* the flags and the config field;
* on CUDA (``gpu``): capture, replay equal to eager, bounded graph memory, and the engine
  using graphs by default.
"""

from __future__ import annotations

import argparse
import logging
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from hicache.cache import HiCache
from hicache.cache.report import check_integrity
from hicache.config import CacheConfig
from hicache.engine.front.engine import Engine, EngineConfig
from hicache.engine.request import RequestOutput
from hicache.engine.sampling import SamplingParams
from hicache.engine.step import graph_setup
from hicache.engine.step.graph_setup import (
    GraphSetup,
    enable_decode_graphs,
    enable_for_cache,
    probe_lengths,
    probe_page_count,
    probe_tolerance,
)
from hicache.engine.step.scheduler import SchedulerConfig
from hicache.memory import DevicePool
from hicache.runner import ModelRunner, kv_spec_from_hf_config
from hicache.runner.decode_graphs import DecodeGraphs, decode_buckets, table_width_for
from hicache.runner.loader import load_model
from hicache.runner.model_runner import ForwardBatch
from hicache.runner.models import DecoderLM
from hicache.runner.models.cached import CachedModel
from tests.helpers.engine_fixtures import (
    SKIPPED_RESCALE,
    broken_kernel,
    engine_model,
    prompt_ids,
    slots_for,
)

pytest.importorskip("triton")

NAME = "tiny-random-llama"
PAGE = 4
PAGES = 64
SCRATCH = PAGES - 1
WIDTH = 40
"""Page-table columns of the set-up tests: 160 keys, the probe's longest sequence."""
PROBE_PAGES = probe_page_count(PAGE, WIDTH)
"""43: the probe's longest sequence crosses two key blocks (160 keys, 40 pages)."""
TOL = 1e-4
"""fp32 logits of the same rows through a padded bucket and the eager forward: the GEMMs
run on another number of rows, for which MKL may pick another kernel and summation order,
so test_engine_model's bound on the tiny models' logits holds (``order_bound(128, 8.3)`` =
1.3e-4). Measured up to 7.2e-6 with MKL pinned to SSE4.2 or AVX2, where 1e-5 left a
margin of 1.4."""


def make_runner(backend: str = "triton", device: str = "cpu") -> ModelRunner:
    """A runner over a fresh fp32 pool of PAGES pages of PAGE tokens on ``device``."""
    lm = engine_model(NAME) if device == "cpu" else load_model(NAME, dtype="float32", device=device)
    pool = DevicePool(kv_spec_from_hf_config(lm.hf_config, "float32"), PAGES, PAGE, device)
    return ModelRunner(lm.model, pool, attention_backend=backend)


def make_graphs(
    runner: ModelRunner, max_bs: int = 8, buckets: tuple[int, ...] | None = None
) -> DecodeGraphs:
    """Static decode buffers over the runner's model and pool (8 pages per sequence)."""
    assert isinstance(runner.model, DecoderLM)
    return DecodeGraphs(
        runner.model,
        runner.pool,
        scratch_page=SCRATCH,
        max_bs=max_bs,
        table_width=8,
        buckets=buckets,
    )


def prefilled(runner: ModelRunner, lengths: list[int], seed: int = 0) -> list[torch.Tensor]:
    """Prefill sequences of ``lengths`` tokens over shuffled pages (never the scratch page);
    returns each one's slots for its next token (``length + 1`` slots). The prefill uses
    SDPA (the same K/V, without the interpreter's cost)."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(SCRATCH, generator=gen).tolist()
    prefill = ModelRunner(runner.model, runner.pool, attention_backend="sdpa")  # faster here
    out = []
    for i, n in enumerate(lengths):
        pages = [order.pop() for _ in range(-(-(n + 1) // PAGE))]
        slots = slots_for(pages, PAGE, n + 1)
        ids = prompt_ids(NAME, n + 1 + i)[i:]
        prefill.forward(
            ForwardBatch(
                input_ids=ids[:n], positions=torch.arange(n), extend_lens=[n], seq_slots=[slots[:n]]
            )
        )
        out.append(slots)
    return out


def decode_batch(slots: list[torch.Tensor], seed: int = 1) -> ForwardBatch:
    gen = torch.Generator().manual_seed(seed)
    return ForwardBatch(
        input_ids=torch.randint(0, 1000, (len(slots),), generator=gen),
        positions=torch.tensor([len(s) - 1 for s in slots]),
        extend_lens=[1] * len(slots),
        seq_slots=slots,
    )


def run(graphs: DecodeGraphs, batch: ForwardBatch) -> torch.Tensor:
    got = graphs.run(batch.input_ids, batch.positions, batch.seq_slots)
    assert got is not None
    return got


# ---------------------------------------------------------------- buckets


def test_buckets_and_the_bucket_a_batch_takes() -> None:
    assert decode_buckets(1) == (1,)
    assert decode_buckets(3) == (1, 2, 3)
    assert decode_buckets(16) == (1, 2, 4, 8, 12, 16)
    assert decode_buckets(32) == (1, 2, 4, 8, 12, 16, 24, 32)
    assert decode_buckets(36) == (1, 2, 4, 8, 12, 16, 24, 32, 36)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="max_bs"):
            decode_buckets(bad)  # type: ignore[arg-type]
    graphs = make_graphs(make_runner(), max_bs=12)
    assert [graphs.bucket_for(b) for b in (1, 2, 3, 5, 8, 9, 12, 13)] == [
        1, 2, 4, 8, 8, 12, 12, None,
    ]  # fmt: skip
    assert table_width_for(2048, 16, 1000) == 128 and table_width_for(2048, 16, 50) == 50
    with pytest.raises(ValueError, match="must be distinct, ascending"):
        make_graphs(make_runner(), max_bs=8, buckets=(1, 4, 2, 8))
    with pytest.raises(ValueError, match="not a page of the pool"):
        DecodeGraphs(engine_model(NAME).model, make_runner().pool, scratch_page=PAGES,
                     max_bs=2, table_width=4)  # fmt: skip


# ---------------------------------------------------------------- the static path


@pytest.mark.parametrize("lengths", [[6], [5, 12, 3], [7, 1, 9, 4, 13]])
def test_padded_bucket_gives_the_eager_logits(lengths: list[int]) -> None:
    """B = 1, 3, 5 sequences run as buckets 1, 4, 8 (padded): the eager runner's logits."""
    runner = make_runner()
    slots = prefilled(runner, lengths)
    batch = decode_batch(slots)
    want = runner.forward(batch)
    graphs = make_graphs(runner)
    got = run(graphs, batch)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert (got - want).abs().max().item() <= TOL
    assert graphs.replays == 1


def test_padding_writes_only_the_scratch_page_and_real_slots_get_the_eager_kv() -> None:
    runner = make_runner()
    slots = prefilled(runner, [5, 12, 3, 8])
    graphs = make_graphs(runner)
    run(graphs, decode_batch(slots, seed=2))  # 4 rows: later, stale rows of a bigger batch
    three = decode_batch(slots[:3])
    before = runner.pool.buffer.clone()
    run(graphs, three)  # bucket 4: row 3 is padding now
    after_static = runner.pool.buffer.clone()
    runner.pool.buffer.copy_(before)
    runner.forward(three)
    after_eager = runner.pool.buffer.clone()

    new = torch.stack([s[-1] for s in slots[:3]])
    scratch = torch.arange(SCRATCH * PAGE, (SCRATCH + 1) * PAGE)
    elsewhere = torch.ones(PAGES * PAGE, dtype=torch.bool)
    elsewhere[new] = False
    elsewhere[scratch] = False
    # byte for byte: nothing outside the batch's new slots and the scratch page moved
    assert torch.equal(after_static[:, :, elsewhere], before[:, :, elsewhere])
    assert torch.equal(after_eager[:, :, elsewhere], before[:, :, elsewhere])
    # the new K/V rows: the same GEMMs on another row count, as the logits (measured 2.7e-6)
    assert (after_static[:, :, new] - after_eager[:, :, new]).abs().max().item() <= TOL
    # the stale fourth row was reset to padding: one key at the scratch slot
    assert graphs.write_slots[3].item() == graphs.scratch_slot == SCRATCH * PAGE
    assert graphs.lengths[3].item() == 1
    assert not torch.equal(after_static[:, :, scratch[:1]], before[:, :, scratch[:1]])


def test_padding_rows_do_not_change_real_rows() -> None:
    """The same three sequences alone (bucket 3), padded to 4 and to 8, and after a batch
    of 8 left its rows in the buffers: the same logits."""
    runner = make_runner()
    slots = prefilled(runner, [5, 12, 3, 8, 2, 6, 9, 4])
    batch = decode_batch(slots[:3])
    alone = run(make_graphs(runner, max_bs=3), batch)
    padded = make_graphs(runner, max_bs=8, buckets=(4, 8))
    assert (run(padded, batch) - alone).abs().max().item() <= TOL
    run(padded, decode_batch(slots, seed=5))
    eight = make_graphs(runner, max_bs=8, buckets=(8,))
    run(eight, decode_batch(slots, seed=6))
    assert (run(eight, batch) - alone).abs().max().item() <= TOL


def test_a_batch_runs_in_any_bucket_that_holds_it_and_no_other() -> None:
    """The probe's forced buckets: the same logits in bucket 4 and in bucket 8; a bucket
    that is not one, or too small, is refused before anything is written."""
    runner = make_runner()
    slots = prefilled(runner, [5, 12, 3])
    batch = decode_batch(slots)
    graphs = make_graphs(runner, max_bs=8, buckets=(2, 4, 8))
    args = (batch.input_ids, batch.positions, batch.seq_slots)
    small, large = graphs.run(*args, bucket=4), graphs.run(*args, bucket=8)
    assert small is not None and large is not None
    assert (small - large).abs().max().item() <= TOL
    before = graphs.replays
    for bad in (2, 3, 16):
        with pytest.raises(ValueError, match=f"bucket={bad}"):
            graphs.run(*args, bucket=bad)
    assert graphs.replays == before


def test_batches_the_graphs_cannot_serve_are_refused() -> None:
    runner = make_runner()
    graphs = make_graphs(runner, max_bs=2)
    ok = slots_for([3, 7], PAGE, 6)
    assert run(graphs, decode_batch([ok])).shape[0] == 1
    shifted = ok + 1  # does not start a page
    torn = torch.cat((ok[:4], ok[5:6]))  # skips a slot inside its page
    too_long = slots_for(list(range(9)), PAGE, 9 * PAGE)  # 9 pages > table_width 8
    for bad in ([shifted], [torn], [too_long], [ok, ok + 8, ok + 16]):
        b = decode_batch(bad)
        assert graphs.run(b.input_ids, b.positions, b.seq_slots) is None
    assert graphs.replays == 1


def test_the_runner_hands_over_only_decode_batches_the_graphs_fit() -> None:
    runner = make_runner()
    slots = prefilled(runner, [5, 12, 3])
    graphs = make_graphs(runner, max_bs=2)
    runner.use_decode_graphs(graphs)
    two = decode_batch(slots[:2])
    eager = ModelRunner(runner.model, runner.pool, attention_backend="triton")
    assert (runner.forward(two) - eager.forward(two)).abs().max().item() <= TOL
    assert graphs.replays == 1
    runner.forward(decode_batch(slots))  # 3 > max_bs
    runner.forward(two, all_logits=True)
    runner.forward(two, logit_rows=[1])
    runner.forward(ForwardBatch(**{**vars(two), "layer_wait": lambda layer: None}))
    mixed = ForwardBatch(
        input_ids=torch.tensor([1, 2, 3]),
        positions=torch.tensor([5, 12, 13]),
        extend_lens=[1, 2],
        seq_slots=[slots[0], slots[1]],
    )
    runner.forward(mixed)
    assert graphs.replays == 1
    runner.use_decode_graphs(None)
    runner.forward(two)
    assert graphs.replays == 1
    with pytest.raises(ValueError, match="another model or pool"):
        make_runner().use_decode_graphs(graphs)
    sdpa = ModelRunner(runner.model, runner.pool, attention_backend="sdpa")
    with pytest.raises(ValueError, match="attention_backend='triton'"):
        sdpa.use_decode_graphs(graphs)


# ---------------------------------------------------------------- set-up and probe


def probe_on_cpu(runner: ModelRunner) -> GraphSetup:
    """:func:`enable_decode_graphs` in the CPU test mode (no capture; static buffers and
    the probe against the SDPA forward), buckets up to 4, the probe on pages
    ``[0, PROBE_PAGES)``."""
    return enable_decode_graphs(
        runner,
        scratch_page=SCRATCH,
        probe_pages=list(range(PROBE_PAGES)),
        max_bs=4,
        table_width=WIDTH,
        capture=False,
    )


def test_setup_refuses_clearly_and_keeps_the_runner_eager() -> None:
    probe = list(range(PROBE_PAGES))
    kw = dict(scratch_page=SCRATCH, probe_pages=probe, max_bs=4, table_width=WIDTH)
    sdpa = make_runner("sdpa")
    got = enable_decode_graphs(sdpa, capture=False, **kw)  # type: ignore[arg-type]
    assert not got.enabled and got.reason is not None and "'sdpa'" in got.reason
    cpu = make_runner()
    got = enable_decode_graphs(cpu, capture=True, **kw)  # type: ignore[arg-type]
    assert not got.enabled and got.reason == "the device is cpu, not CUDA"
    kw["probe_pages"] = probe[:2]
    got = enable_decode_graphs(cpu, capture=False, **kw)  # type: ignore[arg-type]
    assert not got.enabled and got.reason is not None and "probe needs 43" in got.reason
    assert sdpa.decode_graphs is None and cpu.decode_graphs is None
    hybrid = engine_model("tiny-random-gemma3")
    pool = DevicePool(kv_spec_from_hf_config(hybrid.hf_config, "float32"), PAGES, PAGE)
    runner = ModelRunner(hybrid.model, pool, attention_backend="triton")
    kw["probe_pages"] = probe
    got = enable_decode_graphs(runner, capture=False, **kw)  # type: ignore[arg-type]
    assert not got.enabled and got.reason is not None and "hybrid" in got.reason


def test_only_the_plain_decoder_declares_decode_graphs() -> None:
    """The graphs' gates read the model's declaration
    (:attr:`CachedModel.supports_decode_graphs`): every family is a subclass of the
    contract, and the plain decoder alone declares it."""

    def families(cls: type[CachedModel]) -> list[type[CachedModel]]:
        return [f for s in cls.__subclasses__() for f in (s, *families(s))]

    found = families(CachedModel)
    assert len(found) >= 8, [f.__name__ for f in found]
    assert [f for f in found if f.supports_decode_graphs] == [DecoderLM]


def test_a_probe_that_disagrees_turns_graphs_off_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    step = DecodeGraphs._step

    def wrong(self: DecodeGraphs, bs: int) -> None:
        step(self, bs)
        self.logits[1:bs] += 1.0  # what a stale buffer or a wrong table would do to a row

    monkeypatch.setattr(DecodeGraphs, "_step", wrong)
    runner = make_runner()
    with caplog.at_level(logging.WARNING, logger="hicache.engine"):
        got = probe_on_cpu(runner)
    assert not got.enabled and runner.decode_graphs is None
    assert got.probe_error is not None and got.probe_error > probe_tolerance(torch.float32)
    assert "CUDA graphs for decode are off: the probe's logits differ" in caplog.text


def test_the_probe_compares_with_sdpa_so_a_wrong_kernel_turns_graphs_off(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The decode kernel without the cross-block rescale, where the attention layers call
    it: the eager Triton forward runs it too and agrees with the replay, SDPA does not."""
    from hicache.runner.kernels import decode_attention

    broken = broken_kernel(decode_attention, *SKIPPED_RESCALE, tmp_path)
    monkeypatch.setattr(decode_attention, "paged_decode_attention", broken.paged_decode_attention)
    runner = make_runner()
    with caplog.at_level(logging.WARNING, logger="hicache.engine"):
        got = probe_on_cpu(runner)
    assert not got.enabled and runner.decode_graphs is None
    assert got.probe_error is not None and 1e-2 < got.probe_error < float("inf")
    assert "the probe's logits differ from the SDPA forward's" in caplog.text
    monkeypatch.undo()  # the real kernel: the same probe passes
    runner = make_runner()
    got = probe_on_cpu(runner)
    assert got.enabled and got.probe_error is not None
    assert got.probe_error <= probe_tolerance(torch.float32)


def test_the_probe_batch_crosses_key_blocks_and_fits_the_table() -> None:
    assert probe_lengths(4, WIDTH) == (160, 5, 1) and PROBE_PAGES == 43
    assert probe_lengths(64, 100) == (160, 65, 1) and probe_page_count(64, 100) == 6
    assert probe_lengths(1, 1000) == (160, 2, 1)
    assert probe_lengths(128, 10) == (320, 129, 1)  # 2.5 pages
    assert probe_lengths(4, 8) == (32, 5, 1)  # the longest a graph of 8 pages serves
    assert probe_lengths(4, 1) == (4, 4, 1) and probe_page_count(4, 1) == 3


def generate_together(
    engine: Engine, prompts: list[list[int]], params: SamplingParams
) -> list[list[int]]:
    """Submit every prompt at once (so their decodes share batches); their outputs."""
    done: list[Future[list[int]]] = []
    for p in prompts:
        fut: Future[list[int]] = Future()

        def on_output(out: RequestOutput, fut: Future[list[int]] = fut) -> None:
            if out.finished and not fut.done():
                fut.set_result(list(out.output_ids))

        engine.submit(p, params, on_output)
        done.append(fut)
    return [f.result(timeout=300) for f in done]


def test_engine_greedy_through_static_decode_equals_eager(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine with the static decode path attached as it attaches graphs (scratch
    page reserved in its cache, the probe on pages reserved there for its duration)
    generates what it does without."""
    seen: list[tuple[list[int], list[int]]] = []
    probe = graph_setup._probe

    def recorded(runner: ModelRunner, graphs: DecodeGraphs, pages: list[int]) -> float:
        seen.append((list(pages), cache.full.pages.reserved))
        return probe(runner, graphs, pages)

    monkeypatch.setattr(graph_setup, "_probe", recorded)
    prompts = [prompt_ids(NAME, n).tolist() for n in (11, 20, 7)]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    config = EngineConfig(
        model_path=NAME,
        dtype="float32",
        device="cpu",
        cache=CacheConfig(page_size=PAGE, device_tokens=256),
        attention_backend="triton",
        scheduler=SchedulerConfig(max_running_requests=4),
    )
    outputs = []
    for static in (False, True):
        with Engine(config, loaded=engine_model(NAME)).start() as engine:
            assert engine.core.decode_graphs is None  # CPU: not tried at start
            runner = engine.core.scheduler.runner
            cache = engine.core.cache
            if static:

                def attach(runner: ModelRunner = runner, cache: HiCache = cache) -> GraphSetup:
                    return enable_for_cache(
                        runner, cache, max_bs=4, context_length=256, capture=False
                    )

                setup = engine.call(attach).result(timeout=120)
                assert setup.enabled and setup.buckets == (1, 2, 4)
                (scratch,) = cache.full.pages.reserved
                # the probe ran on 43 pages reserved (with the scratch page) for its
                # duration; they came back after it
                ((pages, reserved),) = seen
                assert len(pages) == 43 and sorted(reserved) == sorted([scratch, *pages])
                assert cache.full.pages.device_pool.allocator.used_pages == 1
            outputs.append(generate_together(engine, prompts, params))
            if static:
                graphs = runner.decode_graphs
                assert graphs is not None and graphs.replays >= 3
                assert scratch not in engine.call(cache.full.pages.tree.device_page_ids).result(
                    timeout=30
                )
                engine.call(lambda c=cache: check_integrity(c)).result(timeout=30)
    assert outputs[0] == outputs[1]


# ---------------------------------------------------------------- flags and config


def test_the_flag_and_the_config_field() -> None:
    from hicache.server.args import add_engine_args, engine_config_from_args, flag_message

    p = argparse.ArgumentParser()
    add_engine_args(p)
    cpu = ["--device", "cpu"]
    assert engine_config_from_args(p.parse_args(cpu)).cuda_graph_max_bs is None
    got = engine_config_from_args(p.parse_args([*cpu, "--cuda-graph-max-bs", "8"]))
    assert got.cuda_graph_max_bs == 8
    off = [*cpu, "--cuda-graph-max-bs", "8", "--disable-cuda-graph"]
    assert engine_config_from_args(p.parse_args(off)).cuda_graph_max_bs == 0
    with pytest.raises(ValueError) as err:
        engine_config_from_args(p.parse_args([*cpu, "--cuda-graph-max-bs", "-1"]))
    assert (
        flag_message(err.value) == "--cuda-graph-max-bs -1 is invalid; must be an int >= 0 (0: off)"
    )
    for bad in (-1, True, 1.5, "8"):
        with pytest.raises(ValueError, match=r"cuda_graph_max_bs=.* is invalid"):
            EngineConfig(device="cpu", cuda_graph_max_bs=bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------- CUDA


@pytest.mark.gpu
def test_captured_graphs_replay_the_eager_logits_in_bounded_memory() -> None:
    runner = make_runner(device="cuda")
    setup = enable_decode_graphs(
        runner,
        scratch_page=SCRATCH,
        probe_pages=list(range(PROBE_PAGES)),
        max_bs=8,
        table_width=WIDTH,
    )
    assert setup.enabled and setup.captured, setup.reason
    assert setup.graph_bytes < 256 * 2**20  # a 3-layer model: a few MiB of intermediates
    graphs = runner.decode_graphs
    assert graphs is not None and graphs.captured
    slots = prefilled(runner, [5, 12, 3, 8, 30])
    eager = ModelRunner(runner.model, runner.pool, attention_backend="triton")
    for n in (1, 3, 5, 2):
        batch = decode_batch(slots[:n], seed=n)
        want = eager.forward(batch)
        before = graphs.replays
        got = runner.forward(batch)
        assert graphs.replays == before + 1
        assert (got - want).abs().max().item() <= 1e-3


@pytest.mark.gpu
def test_the_engine_uses_graphs_on_cuda_by_default() -> None:
    prompts = [prompt_ids(NAME, n).tolist() for n in (11, 20, 7)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = []
    for max_bs in (None, 0):
        config = EngineConfig(
            model_path=NAME,
            dtype="float32",
            device="cuda",
            cache=CacheConfig(page_size=PAGE, device_tokens=1024),
            cuda_graph_max_bs=max_bs,
        )
        with Engine(config).start() as engine:
            setup = engine.core.decode_graphs
            if max_bs is None:
                assert setup is not None and setup.enabled and setup.captured, setup
                assert setup.buckets[-1] == 32
            else:
                assert setup is None
            outputs.append([engine.generate(p, params, timeout=120).output_ids for p in prompts])
    assert outputs[0] == outputs[1]
