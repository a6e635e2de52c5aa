"""``hicache bench pd``: prefill/decode disaggregation and SGLang's router, on one machine.

Each setup (fresh ``hicache serve`` subprocesses, :mod:`hicache.bench.serverproc`; smg,
:mod:`hicache.bench.smgproc`) is warmed up, sent its workload through ``POST /generate``
(``input_ids``, streamed, greedy, ``ignore_eos``: exactly ``--max-tokens`` tokens) and
stopped before the next starts: one setup under load at a time; a failed setup is
reported and the others go on; ``--time-limit`` (default 170 s) bounds the bench.
Workloads: multi-turn with real outputs (setups ``plain``, ``pd``, ``pd_offload``) and
shared prefix (``plain``, ``smg_round_robin``, ``smg_cache_aware``).
Figures per setup (client side): mean TTFT and inter-token latency (s), hit rate (prompt
tokens from any tier / prompt tokens; through PD the prefill's), requests/s, each as a
ratio to ``plain`` in the same run, ``same outputs`` (requests whose tokens equal
``plain``'s) and, multi-turn, ``next turn``: turns (sent the moment the previous answer
ended) that took the previous answer's pages from the cache, of those whose previous
answer filled a page. The setups and workloads in full: ``docs/benchmarks/pd.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from hicache.bench.httpclient import RequestRecord, flush_cache, server_ttft, stream_generate
from hicache.bench.plot import plot_setups, print_table
from hicache.bench.runner import TOKEN_HI, TOKEN_LO, bench_client, warm_up
from hicache.bench.serverproc import ADMIN_KEY, ServerError, ServerProcess
from hicache.bench.smgproc import Smg, SmgError
from hicache.config import DEFAULT_ANNOUNCED_WAIT_S
from hicache.services.process import free_port

__all__ = [
    "MULTITURN_SETUPS",
    "SHARED_PREFIX_SETUPS",
    "PdBenchSpec",
    "PdReport",
    "SetupResult",
    "TimeLimitError",
    "main",
    "run",
]

MULTITURN_SETUPS: tuple[str, ...] = ("plain", "pd", "pd_offload")
"""The setups that run the multi-turn workload, in order (``plain`` is the baseline)."""
SHARED_PREFIX_SETUPS: tuple[str, ...] = ("plain", "smg_round_robin", "smg_cache_aware")
"""The setups that run the shared-prefix workload, in order (``plain`` is the baseline)."""
TRANSFERS: tuple[str, ...] = ("mooncake", "nixl")
WRITE_POLICIES: tuple[str, ...] = ("write_back", "write_through")


@dataclass(frozen=True, kw_only=True)
class PdBenchSpec:
    """The bench's sizes (tokens, requests) and its servers' model; validated."""

    model_path: str = "tiny-random-llama"
    device: str = "cpu"
    page_size: int = 8
    conversations: int = 4
    turns: int = 4
    user_tokens: int = 64
    max_tokens: int = 16
    clients: int = 4
    """Requests in flight at most (both workloads)."""
    tenants: int = 3
    """Odd by default: round-robin over two instances then sends each tenant to both
    (with an even count, tenant after tenant in turn, it would pin each to one)."""
    prefix_tokens: int = 256
    questions: int = 6
    question_tokens: int = 32
    transfer: str = "mooncake"
    plain_tp: int = 1
    """``--tp-size`` of ``plain``."""
    prefill_tp: int = 1
    """``--tp-size`` of the prefill instance of ``pd`` and ``pd_offload``."""
    decode_tp: int = 1
    """``--tp-size`` of their decode instance."""
    prefill_write_policy: str = "write_back"
    """``--hicache-write-policy`` of ``plain`` and of the prefill instances."""
    announced_wait_s: float = DEFAULT_ANNOUNCED_WAIT_S
    """Every L3's ``announced_wait_s``: a lookup's longest wait for an announced page
    (0: none, the race of a next turn with its answer's write left open)."""
    prefetch_threshold: int | None = None
    """Every L3's ``prefetch_threshold`` (tokens an L3 hit must bring to be read); None:
    unset, so each instance's measured rates decide (:mod:`hicache.cache.l3.worth`)."""
    seed: int = 0
    startup_timeout_s: float = 120.0
    request_timeout_s: float = 30.0
    workload_timeout_s: float = 60.0
    """Bound on one setup's workload (all its requests), seconds."""
    time_limit_s: float = 170.0
    """Bound on the whole bench (s): every start and workload is cut to what is left, and
    setups that find none left are reported as not run."""

    def __post_init__(self) -> None:
        sizes = {
            "page_size": self.page_size,
            "conversations": self.conversations,
            "turns": self.turns,
            "user_tokens": self.user_tokens,
            "max_tokens": self.max_tokens,
            "clients": self.clients,
            "tenants": self.tenants,
            "prefix_tokens": self.prefix_tokens,
            "questions": self.questions,
            "question_tokens": self.question_tokens,
            "plain_tp": self.plain_tp,
            "prefill_tp": self.prefill_tp,
            "decode_tp": self.decode_tp,
        }
        bad = {k: v for k, v in sizes.items() if v < 1}
        if bad:
            raise ValueError(f"these sizes must be >= 1: {bad}")
        if self.turns < 2:
            raise ValueError(f"turns={self.turns}: the hit rate is over turns >= 2; give >= 2")
        if self.prefill_write_policy not in WRITE_POLICIES:
            raise ValueError(
                f"prefill_write_policy={self.prefill_write_policy!r}: choose from"
                f" {', '.join(WRITE_POLICIES)}"
            )
        if self.transfer not in TRANSFERS:
            raise ValueError(f"transfer={self.transfer!r}: choose from {', '.join(TRANSFERS)}")
        timeouts = (self.startup_timeout_s, self.request_timeout_s, self.workload_timeout_s,
                    self.time_limit_s)  # fmt: skip
        if min(timeouts) <= 0:
            raise ValueError("the timeouts must be > 0 s")
        if self.prefetch_threshold is not None and self.prefetch_threshold < 0:
            raise ValueError(f"prefetch_threshold={self.prefetch_threshold!r}: must be >= 0")
        if not self.announced_wait_s >= 0:
            raise ValueError(f"announced_wait_s={self.announced_wait_s!r}: must be >= 0 s")

    def base_flags(self) -> list[str]:
        """What every server gets: model, device, page size."""
        return ["--model-path", self.model_path, "--device", self.device,
                "--page-size", str(self.page_size)]  # fmt: skip


@dataclass(frozen=True)
class SetupResult:
    """One setup's run of one workload. Times in seconds."""

    setup: str
    workload: str
    """``"multiturn"`` or ``"shared-prefix"``."""
    servers: str
    """What ran, in words (for the table)."""
    records: list[RequestRecord]
    wall_s: float
    hit_from_group: int
    """Requests of ``group >= hit_from_group`` count in :attr:`hit_rate` (1 for the
    multi-turn workload: turns >= 2)."""
    split: tuple[int, ...] = ()
    """Behind smg in regular mode: the requests each instance served during the
    workload (from its ``hicache_ttft_seconds_count``); empty otherwise."""
    page_size: int = 0
    """Tokens per page of the servers (0: no next-turn figure)."""

    def next_turn_hits(self) -> tuple[int, int] | None:
        """Multi-turn: (turns that took the previous answer's pages from the cache,
        turns whose previous answer filled a page), over turns >= 2; None for the other
        workload. The previous answer's pages end at the last whole page of the previous
        prompt and output less its last token (which has no KV yet); a turn hits them
        when its cached prompt tokens reach that far."""
        if self.workload != "multiturn" or self.page_size < 1:
            return None
        ps = self.page_size
        by_turn = {(r.client, r.group): r for r in self.records}
        hits = turns = 0
        for r in self.records:
            prev = by_turn.get((r.client, r.group - 1))
            if r.group < 1 or prev is None:
                continue
            answer_end = (prev.prompt_tokens + prev.output_tokens - 1) // ps * ps
            if answer_end <= prev.prompt_tokens // ps * ps:
                continue  # the answer filled no page of its own
            turns += 1
            hits += sum(r.cached.values()) >= answer_end
        return hits, turns

    @property
    def ttft_mean_s(self) -> float:
        return sum(r.ttft_s for r in self.records) / len(self.records)

    @property
    def itl_mean_s(self) -> float | None:
        """Mean over requests of their mean inter-token latency; None when none has one."""
        itls = [r.itl_s for r in self.records if r.itl_s is not None]
        return sum(itls) / len(itls) if itls else None

    @property
    def hit_rate(self) -> float:
        """Cached prompt tokens (any tier) / prompt tokens, over the counted requests."""
        counted = [r for r in self.records if r.group >= self.hit_from_group]
        prompt = sum(r.prompt_tokens for r in counted)
        return sum(sum(r.cached.values()) for r in counted) / prompt if prompt else 0.0

    @property
    def req_per_s(self) -> float:
        return len(self.records) / self.wall_s if self.wall_s > 0 else 0.0

    def outputs(self) -> dict[tuple[int, int], tuple[int, ...]]:
        """``(client, group)`` -> the tokens generated."""
        return {(r.client, r.group): r.output_ids for r in self.records}

    def summary(self) -> dict[str, Any]:
        return {
            "setup": self.setup,
            "workload": self.workload,
            "servers": self.servers,
            "requests": len(self.records),
            "ttft_mean_s": self.ttft_mean_s,
            "itl_mean_s": self.itl_mean_s,
            "hit_rate": self.hit_rate,
            "req_per_s": self.req_per_s,
            "wall_s": self.wall_s,
            "prompt_tokens": sum(r.prompt_tokens for r in self.records),
            "output_tokens": sum(r.output_tokens for r in self.records),
            "split": list(self.split),
            "next_turn_hits": None if (n := self.next_turn_hits()) is None else list(n),
        }


@dataclass
class PdReport:
    """Everything :func:`run` measured: results by workload and setup, what failed."""

    spec: PdBenchSpec
    results: dict[str, dict[str, SetupResult]] = field(default_factory=dict)
    problems: dict[str, str] = field(default_factory=dict)
    """``"workload/setup"`` -> why it has no result."""

    def add(self, result: SetupResult) -> None:
        self.results.setdefault(result.workload, {})[result.setup] = result

    def same_outputs(self, workload: str, setup: str) -> tuple[int, int] | None:
        """(requests whose output equals ``plain``'s for the same client and group,
        requests compared); None without both runs."""
        runs = self.results.get(workload, {})
        if setup not in runs or "plain" not in runs:
            return None
        base, got = runs["plain"].outputs(), runs[setup].outputs()
        keys = sorted(base.keys() & got.keys())
        return sum(base[k] == got[k] for k in keys), len(keys)

    def rows(self) -> list[dict[str, Any]]:
        """One row per run: its summary, its ratios to ``plain`` and the output check."""
        out = []
        for workload, runs in self.results.items():
            base = runs.get("plain")
            for name, res in runs.items():
                row = res.summary()
                if base is not None:
                    row["ttft_ratio"] = res.ttft_mean_s / base.ttft_mean_s
                    b_itl, itl = base.itl_mean_s, res.itl_mean_s
                    row["itl_ratio"] = itl / b_itl if itl is not None and b_itl else None
                    row["req_per_s_ratio"] = (
                        res.req_per_s / base.req_per_s if base.req_per_s else None
                    )
                same = self.same_outputs(workload, name)
                row["same_outputs"] = None if same is None else list(same)
                out.append(row)
        return out

    def doc(self) -> dict[str, Any]:
        return {"spec": asdict(self.spec), "rows": self.rows(), "problems": self.problems}


# ---------------------------------------------------------------------------- workloads

Workload = Callable[[httpx.AsyncClient, str], Awaitable[tuple[list[RequestRecord], float]]]
"""Sends one workload to a URL; returns its requests and its wall time (s)."""


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(n)]


def multiturn_workload(spec: PdBenchSpec) -> Workload:
    """The multi-turn workload (module docstring): each request's ``client`` is its
    conversation, its ``group`` its turn (from 0)."""
    rng = random.Random(f"pd/multiturn/{spec.seed}")
    users = [[_ids(rng, spec.user_tokens) for _ in range(spec.turns)]
             for _ in range(spec.conversations)]  # fmt: skip

    async def run(client: httpx.AsyncClient, url: str) -> tuple[list[RequestRecord], float]:
        sem = asyncio.Semaphore(spec.clients)
        records: list[RequestRecord] = []

        async def conversation(c: int) -> None:
            history: list[int] = []
            for t in range(spec.turns):
                prompt = history + users[c][t]
                async with sem:
                    rec = await stream_generate(
                        client, url, prompt, spec.max_tokens, group=t, client_id=c,
                        ignore_eos=True,
                    )  # fmt: skip
                records.append(rec)
                history = prompt + list(rec.output_ids)

        t0 = time.perf_counter()
        await asyncio.gather(*(conversation(c) for c in range(spec.conversations)))
        return records, time.perf_counter() - t0

    return run


def shared_prefix_workload(spec: PdBenchSpec) -> Workload:
    """The shared-prefix workload (module docstring): ``client`` is the tenant, ``group``
    the question's index; question q of every tenant is sent before question q + 1."""
    rng = random.Random(f"pd/shared-prefix/{spec.seed}")
    prefixes = [_ids(rng, spec.prefix_tokens) for _ in range(spec.tenants)]
    order = [(t, q, prefixes[t] + _ids(rng, spec.question_tokens))
             for q in range(spec.questions) for t in range(spec.tenants)]  # fmt: skip

    async def run(client: httpx.AsyncClient, url: str) -> tuple[list[RequestRecord], float]:
        queue: asyncio.Queue[tuple[int, int, list[int]]] = asyncio.Queue()
        for item in order:
            queue.put_nowait(item)
        records: list[RequestRecord] = []

        async def worker() -> None:
            while not queue.empty():
                t, q, prompt = queue.get_nowait()
                records.append(
                    await stream_generate(
                        client,
                        url,
                        prompt,
                        spec.max_tokens,
                        group=q,
                        client_id=t,
                        ignore_eos=True,
                    )
                )

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(spec.clients)))
        return records, time.perf_counter() - t0

    return run


# ---------------------------------------------------------------------------- setups


@dataclass(frozen=True)
class _Target:
    """A started setup: the URL the clients send to and what to flush before a run."""

    url: str
    servers: str
    flush_urls: tuple[str, ...]
    split_urls: tuple[str, ...] = ()
    """Instances whose share of the requests is reported (:attr:`SetupResult.split`)."""


def _l3_flags(root: str, announced_wait_s: float, prefetch_threshold: int | None) -> list[str]:
    """L1 + L2 + the file L3 in ``root``; an L2 hit of one page is loaded (the default,
    10 tokens, is past a turn's few output tokens); an L3 hit is read when the measured
    rates say so, or when it brings ``prefetch_threshold`` tokens if that is set; lookups
    wait ``announced_wait_s`` at most for announced pages."""
    doc: dict[str, Any] = {"file_path": root, "announced_wait_s": announced_wait_s}
    if prefetch_threshold is not None:
        doc["prefetch_threshold"] = prefetch_threshold
    extra = json.dumps(doc)
    return ["--enable-hierarchical-cache", "--hicache-load-back-threshold", "1",
            "--hicache-storage-backend", "file",
            "--hicache-storage-backend-extra-config", extra]  # fmt: skip


class TimeLimitError(RuntimeError):
    """The bench's ``--time-limit`` ran out before a setup could start."""


@dataclass(frozen=True)
class _Deadline:
    """The bench's end (``time.monotonic`` seconds)."""

    end: float

    def left(self, cap: float) -> float:
        """Seconds left, at most ``cap``; TimeLimitError when none (under one second)."""
        left = self.end - time.monotonic()
        if left < 1.0:
            raise TimeLimitError("the time limit (--time-limit) was reached before it ran")
        return min(cap, left)


class _Setups:
    """Starts the setups' processes inside ``stack`` (all stopped when it closes), each
    start bounded by the deadline."""

    def __init__(self, spec: PdBenchSpec, stack: ExitStack, deadline: _Deadline) -> None:
        self.spec = spec
        self.stack = stack
        self.deadline = deadline

    def _dir(self) -> str:
        root = tempfile.mkdtemp(prefix="hicache-bench-pd-l3-")
        self.stack.callback(shutil.rmtree, root, True)
        return root

    def server(self, *flags: str) -> ServerProcess:
        sp = ServerProcess(
            [*self.spec.base_flags(), *flags],
            startup_timeout_s=self.deadline.left(self.spec.startup_timeout_s),
        )
        return self.stack.enter_context(sp)

    def smg(self, **kwargs: Any) -> Smg:
        timeout = self.deadline.left(self.spec.startup_timeout_s)
        smg = Smg(api_key=ADMIN_KEY, log_level="info", startup_timeout_s=timeout, **kwargs)
        return self.stack.enter_context(smg)

    def l3(self, root: str) -> list[str]:
        return _l3_flags(root, self.spec.announced_wait_s, self.spec.prefetch_threshold)

    def plain(self) -> _Target:
        policy = self.spec.prefill_write_policy
        tp = ["--tp-size", str(self.spec.plain_tp)]
        s = self.server(*self.l3(self._dir()), "--hicache-write-policy", policy, *tp)
        what = f"1 instance at TP {self.spec.plain_tp}, L1+L2+L3 file, {policy}"
        return _Target(s.url, what, (s.url,))

    def pd(self, offload: bool) -> _Target:
        root = self._dir()
        bootstrap = free_port()
        transfer = ["--disaggregation-transfer-backend", self.spec.transfer]
        prefill = self.server(
            *self.l3(root),
            "--hicache-write-policy",
            self.spec.prefill_write_policy,
            "--disaggregation-mode",
            "prefill",
            "--disaggregation-bootstrap-port",
            str(bootstrap),
            "--tp-size",
            str(self.spec.prefill_tp),
            *transfer,
        )
        decode_flags = ["--disaggregation-mode", "decode", *transfer]
        decode_flags += ["--tp-size", str(self.spec.decode_tp)]
        if offload:
            decode_flags += [*self.l3(root), "--disaggregation-decode-enable-offload-kvcache"]
        decode = self.server(*decode_flags)
        smg = self.smg(prefill=[(prefill.url, bootstrap)], decode=[decode.url],
                       policy="round_robin")  # fmt: skip
        what = f"smg + prefill (TP {self.spec.prefill_tp}, {self.spec.prefill_write_policy},"
        what += f" L3 file) + decode (TP {self.spec.decode_tp}),"
        what += f" {self.spec.transfer}"
        what += ", decode offload to the shared L3" if offload else ", decode writes nothing"
        return _Target(smg.url, what, (smg.url,))

    def pair(self) -> tuple[ServerProcess, ServerProcess]:
        return self.server(), self.server()

    def behind_smg(self, pair: Sequence[ServerProcess], policy: str) -> _Target:
        smg = self.smg(worker_urls=[s.url for s in pair], policy=policy)
        urls = tuple(s.url for s in pair)
        return _Target(smg.url, f"smg {policy} + 2 instances, L1 only", urls, urls)


async def _measure(
    spec: PdBenchSpec, target: _Target, workload: Workload, setup: str, kind: str
) -> SetupResult:
    """Warm up (two requests: a PD pair's first transfer sets up connections), flush,
    run ``workload`` within ``spec.workload_timeout_s``, flush again."""
    async with bench_client(spec.clients, spec.request_timeout_s) as client:
        for _ in range(2):
            await warm_up(client, target.url, "generate")
        for url in target.flush_urls:
            await flush_cache(client, url)
        before = [(await server_ttft(client, u))[1] for u in target.split_urls]
        records, wall = await asyncio.wait_for(
            workload(client, target.url), timeout=spec.workload_timeout_s
        )
        after = [(await server_ttft(client, u))[1] for u in target.split_urls]
        for url in target.flush_urls:
            await flush_cache(client, url)
    hit_from = 1 if kind == "multiturn" else 0
    split = tuple(a - b for a, b in zip(after, before, strict=True))
    return SetupResult(
        setup, kind, target.servers, records, wall, hit_from, split, page_size=spec.page_size
    )


_FAILURES = (
    ServerError,
    SmgError,
    TimeLimitError,
    httpx.HTTPError,
    asyncio.TimeoutError,
    OSError,
)


@contextmanager
def _attempt(report: PdReport, key: str) -> Iterator[None]:
    """Record a failure of the block under ``key`` (printed) and go on."""
    try:
        yield
    except _FAILURES as exc:
        why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        report.problems[key] = why
        print(f"{key}: failed: {why}", file=sys.stderr)


def run(spec: PdBenchSpec, *, setups: Sequence[str] | None = None) -> PdReport:
    """Run the setups (default all; names from :data:`MULTITURN_SETUPS` and
    ``smg_round_robin`` / ``smg_cache_aware``) one after the other; every process is
    stopped before the next setup starts and whatever happens."""
    wanted = set(setups or (*MULTITURN_SETUPS, *SHARED_PREFIX_SETUPS))
    known = {*MULTITURN_SETUPS, *SHARED_PREFIX_SETUPS}
    if wanted - known:
        raise ValueError(f"setups {sorted(wanted - known)} are unknown; choose from {known}")
    report = PdReport(spec)
    mt, sp = multiturn_workload(spec), shared_prefix_workload(spec)
    deadline = _Deadline(time.monotonic() + spec.time_limit_s)

    def measure(target: _Target, workload: Workload, setup: str, kind: str) -> None:
        with _attempt(report, f"{kind}/{setup}"):
            print(f"pd bench: {kind} on {setup} ({target.servers})", file=sys.stderr)
            limit = deadline.left(spec.workload_timeout_s + spec.request_timeout_s)
            whole = _measure(spec, target, workload, setup, kind)  # warm-ups and flushes too
            report.add(asyncio.run(asyncio.wait_for(whole, timeout=limit)))

    if "plain" in wanted:
        with _attempt(report, "plain"), ExitStack() as stack:
            target = _Setups(spec, stack, deadline).plain()
            measure(target, mt, "plain", "multiturn")
            measure(target, sp, "plain", "shared-prefix")
    for name, offload in (("pd", False), ("pd_offload", True)):
        if name in wanted:
            with _attempt(report, f"multiturn/{name}"), ExitStack() as stack:
                measure(_Setups(spec, stack, deadline).pd(offload), mt, name, "multiturn")
    policies = [p for p in ("round_robin", "cache_aware") if f"smg_{p}" in wanted]
    if policies:
        with _attempt(report, "shared-prefix/smg"), ExitStack() as stack:
            pair = _Setups(spec, stack, deadline).pair()
            for policy in policies:
                with ExitStack() as inner:
                    target = _Setups(spec, inner, deadline).behind_smg(pair, policy)
                    measure(target, sp, f"smg_{policy}", "shared-prefix")
    return report


# ---------------------------------------------------------------------------- output


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def print_report(report: PdReport) -> None:
    """The table: one row per workload and setup."""
    rows = []
    for r in report.rows():
        same = r["same_outputs"]
        rows.append([
            r["workload"], r["setup"], str(r["requests"]),
            _ms(r["ttft_mean_s"]), _x(r.get("ttft_ratio")),
            _ms(r["itl_mean_s"]), _x(r.get("itl_ratio")),
            f"{r['hit_rate'] * 100:.1f}", f"{r['req_per_s']:.1f}", _x(r.get("req_per_s_ratio")),
            "-" if same is None or r["setup"] == "plain" else f"{same[0]}/{same[1]}",
            "/".join(map(str, r["split"])) or "-",
            "-" if (n := r["next_turn_hits"]) is None else f"{n[0]}/{n[1]}",
        ])  # fmt: skip
    s = report.spec
    print_table(
        f"pd bench: {s.model_path} on {s.device}, page {s.page_size}; multiturn"
        f" {s.conversations} conversations x {s.turns} turns of {s.user_tokens} + {s.max_tokens}"
        f" tokens; shared-prefix {s.tenants} tenants x {s.questions} questions,"
        f" prefix {s.prefix_tokens} + {s.question_tokens}; {s.clients} in flight;"
        f" prefill/plain {s.prefill_write_policy}, transfer {s.transfer}; TP plain"
        f" {s.plain_tp}, prefill {s.prefill_tp}, decode {s.decode_tp};"
        f" announced_wait_s {s.announced_wait_s:g}; prefetch_threshold"
        f" {'rates' if s.prefetch_threshold is None else s.prefetch_threshold};"
        " ratios against plain in this run; hit % over turns >= 2 (multiturn)",
        ["workload", "setup", "requests", "TTFT ms", "TTFT x", "ITL ms", "ITL x",
         "hit %", "req/s", "req/s x", "same outputs", "split", "next turn"],
        rows,
    )  # fmt: skip
    legend = {r["setup"]: r["servers"] for r in report.rows()}
    for name, what in legend.items():
        print(f"  {name}: {what}")
    for key, why in report.problems.items():
        print(f"{key}: {why}")


def plot_report(report: PdReport, path: str) -> None:
    """Four panels of bars (TTFT, ITL, hit rate, requests/s), one bar per run."""
    rows = report.rows()
    short = {"multiturn": "mt", "shared-prefix": "sp"}
    label = [f"{r['setup']} [{short.get(r['workload'], r['workload'])}]" for r in rows]

    def panel(key: str, scale: float) -> dict[str, float | None]:
        return {
            n: None if r[key] is None else r[key] * scale for n, r in zip(label, rows, strict=True)
        }

    plot_setups(
        path,
        title=f"hicache bench pd ({report.spec.model_path}, {report.spec.device})",
        panels={
            "mean TTFT (ms)": panel("ttft_mean_s", 1e3),
            "mean ITL (ms)": panel("itl_mean_s", 1e3),
            "hit rate (%)": panel("hit_rate", 100.0),
            "requests/s": panel("req_per_s", 1.0),
        },
    )


def _parser() -> argparse.ArgumentParser:
    d = PdBenchSpec()
    p = argparse.ArgumentParser(
        prog="hicache bench pd",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model-path", default=d.model_path)
    p.add_argument("--device", default=d.device)
    p.add_argument("--page-size", type=int, default=d.page_size, help="tokens per KV page")
    p.add_argument("--conversations", type=int, default=d.conversations)
    p.add_argument("--turns", type=int, default=d.turns, help="turns per conversation (>= 2)")
    p.add_argument("--user-tokens", type=int, default=d.user_tokens, help="new ids per turn")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="tokens per answer")
    p.add_argument("--clients", type=int, default=d.clients, help="requests in flight at most")
    p.add_argument("--tenants", type=int, default=d.tenants)
    p.add_argument("--prefix-tokens", type=int, default=d.prefix_tokens)
    p.add_argument("--questions", type=int, default=d.questions, help="per tenant")
    p.add_argument("--question-tokens", type=int, default=d.question_tokens)
    p.add_argument("--transfer", choices=TRANSFERS, default=d.transfer, help="PD KV transfer")
    p.add_argument("--plain-tp", type=int, default=d.plain_tp, help="--tp-size of plain")
    p.add_argument("--prefill-tp", type=int, default=d.prefill_tp, help="of the PD prefill")
    p.add_argument("--decode-tp", type=int, default=d.decode_tp, help="of the PD decode")
    p.add_argument(
        "--prefill-write-policy",
        choices=WRITE_POLICIES,
        default=d.prefill_write_policy,
        help="of plain and the prefill instances",
    )
    p.add_argument(
        "--announced-wait",
        type=float,
        default=d.announced_wait_s,
        help="every L3's announced_wait_s, s (0: lookups never wait for announced pages)",
    )
    p.add_argument(
        "--prefetch-threshold",
        type=int,
        default=d.prefetch_threshold,
        help="every L3's prefetch_threshold, tokens (default unset: the measured rates"
        " decide whether an L3 hit is read)",
    )
    p.add_argument(
        "--setups",
        default=",".join(dict.fromkeys((*MULTITURN_SETUPS, *SHARED_PREFIX_SETUPS))),
        help="comma list of setups to run",
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--startup-timeout", type=float, default=d.startup_timeout_s, help="s")
    p.add_argument("--request-timeout", type=float, default=d.request_timeout_s, help="s")
    p.add_argument("--workload-timeout", type=float, default=d.workload_timeout_s, help="s")
    p.add_argument(
        "--time-limit", type=float, default=d.time_limit_s, help="whole bench, s (cuts starts)"
    )
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG plot (needs matplotlib)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the bench; 0 when every setup ran, 1 when one failed, 2 on bad flags."""
    p = _parser()
    a = p.parse_args(argv)
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    try:
        spec = PdBenchSpec(
            model_path=a.model_path, device=a.device, page_size=a.page_size,
            conversations=a.conversations, turns=a.turns, user_tokens=a.user_tokens,
            max_tokens=a.max_tokens, clients=a.clients, tenants=a.tenants,
            prefix_tokens=a.prefix_tokens, questions=a.questions,
            question_tokens=a.question_tokens, transfer=a.transfer, plain_tp=a.plain_tp,
            prefill_tp=a.prefill_tp, decode_tp=a.decode_tp,
            prefill_write_policy=a.prefill_write_policy, seed=a.seed,
            announced_wait_s=a.announced_wait,
            prefetch_threshold=a.prefetch_threshold,
            startup_timeout_s=a.startup_timeout, request_timeout_s=a.request_timeout,
            workload_timeout_s=a.workload_timeout, time_limit_s=a.time_limit,
        )  # fmt: skip
        setups = [s.strip() for s in a.setups.split(",") if s.strip()]
        t0 = time.perf_counter()
        report = run(spec, setups=setups)
    except ValueError as exc:
        p.error(str(exc))
    print_report(report)
    print(f"pd bench: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    if a.json:
        Path(a.json).write_text(json.dumps(report.doc(), indent=2) + "\n")
    if a.plot and report.results:
        plot_report(report, a.plot)
    return 1 if report.problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
