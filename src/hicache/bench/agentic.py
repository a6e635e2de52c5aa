"""``hicache bench agentic``: agent sessions over HTTP, under each cache config side by side.

The trace (:mod:`hicache.bench.agentic_trace`) is replayed through ``/generate`` with token
ids: every session's turn sends its history (the shared system prompt, its task, tool
results and the model's own answers, ``ignore_eos``) plus the next tool result after the
tool's pause; subagents fork from their parent's history; one-off long prompts (no session)
arrive on their own schedule. Configs (:data:`AGENTIC_CONFIGS`): ``l1``, ``l1_l2``, ``l3``
(write_through), ``watermark``, ``hints`` (the ``l3`` server with session retention; the
client sends ``session_id`` / ``parent_session_id`` and closes each session at its end),
``hints_restore`` (also ``POST /hicache/prefetch`` of the next prompt ``--restore-lead``
seconds before each tool returns). A config whose flags or routes the server lacks is
reported as skipped. Settings (``--setting``): ``slow-l3`` (memory L3 whose reads sleep
``--slow-l3-read-s``, more than recomputing a session's tail), ``file-l3``, ``no-pressure``
(L1+L2 hold the working set). Units: TTFT in s (client side), tokens, bytes. The shape
on this CPU, the method and figures: ``docs/benchmarks/agentic.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx

from hicache.bench.agentic_trace import SessionTrace, Trace, TraceShape, make_trace
from hicache.bench.httpclient import TIERS, RequestRecord, stream_generate
from hicache.bench.plot import plot_setups
from hicache.bench.report import write_json
from hicache.bench.results import percentile
from hicache.bench.runner import (
    TOKEN_HI,
    TOKEN_LO,
    ConfigRun,
    RepeatedRuns,
    Session,
    Workload,
    add_common_args,
    parse_with_preset,
    round_to_pages,
    run_repeated,
)
from hicache.bench.serverproc import ConfigSkippedError, ServerError, ServerProcess

__all__ = ["AGENTIC_CONFIGS", "PRESETS", "SETTINGS", "ConfigFigures", "main"]

AGENTIC_CONFIGS: tuple[str, ...] = ("l1", "l1_l2", "l3", "watermark", "hints", "hints_restore")
"""The configs, from the radix cache alone to hints with client-issued restores."""

SETTINGS: tuple[str, ...] = ("slow-l3", "file-l3", "no-pressure")

HINTED = ("hints", "hints_restore")
"""Configs whose client sends session hints (and closes sessions)."""

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        model_path="tiny-random-llama", sessions=3, turns="3,4", subagent_turns="2,2",
        system_tokens=64, task_tokens=32, tool_tokens="48,96", output_length=4,
        pause_median=0.1, pause_sigma=0.5, pause_min=0.02, pause_max=0.3, start_spread=0.2,
        oneoffs=3, oneoff_tokens="128,256", oneoff_rate=5.0, restore_lead=0.05,
        slow_l3_read_s=0.2, repeats=1,
    ),
    "default-model": dict(
        model_path="SmolLM2-135M-Instruct", sessions=5, turns="4,5", subagent_turns="2,3",
        system_tokens=256, task_tokens=64, tool_tokens="64,128", output_length=4,
        pause_median=4.0, pause_sigma=0.5, pause_min=1.0, pause_max=10.0, start_spread=6.0,
        oneoffs=5, oneoff_tokens="384,512", oneoff_rate=0.15, restore_lead=0.2,
        slow_l3_read_s=2.5, repeats=1,
    ),
}  # fmt: skip
"""``--preset`` defaults (explicit flags win); ``tiny`` (the tiny random model, for tests)
is the default; ``default-model`` is the documented shape on a 2-core CPU."""

PREFETCH_THRESHOLD = 64
"""L3 hits shorter than this (tokens) are recomputed: the default 256 scaled down with
the trace (a turn adds 64-160 tokens here, hundreds to thousands in the field)."""

PRESSURE_FRACTION = 0.33
"""Under pressure (``slow-l3``, ``file-l3``), L2 holds this share of the working set."""


# ---------------------------------------------------------------------------- servers


@dataclass(frozen=True, kw_only=True)
class AgenticSpec:
    """What every config's server shares (tokens; ``l2_ratio``: L2 = ratio x L1)."""

    model_path: str | None
    page_size: int
    l1_tokens: int
    l2_ratio: float
    setting: str
    slow_l3_read_s: float
    session_ttl_ms: int
    extra_flags: tuple[str, ...] = ()
    startup_timeout_s: float = 300.0

    def flags(self, name: str, l3_dir: str) -> list[str]:
        """The ``hicache serve`` flags of config ``name`` (``l3_dir``: the file L3's root)."""
        flags = ["--page-size", str(self.page_size), "--max-total-tokens", str(self.l1_tokens)]
        if self.model_path is not None:
            flags = ["--model-path", self.model_path, *flags]
        if name != "l1":
            flags += ["--enable-hierarchical-cache", "--hicache-ratio", f"{self.l2_ratio:g}"]
        if name not in ("l1", "l1_l2"):
            if self.setting == "slow-l3":  # the read is waited for, not timed out
                wait = self.slow_l3_read_s + 2.0
                extra: dict[str, Any] = {
                    "get_delay_s": self.slow_l3_read_s,
                    "prefetch_timeout_base": wait,
                }
                flags += ["--hicache-storage-backend", "memory"]
            else:
                extra = {"file_path": l3_dir}
                flags += ["--hicache-storage-backend", "file"]
            extra["prefetch_threshold"] = PREFETCH_THRESHOLD
            flags += ["--hicache-storage-backend-extra-config", json.dumps(extra)]
        if name == "watermark":
            flags += ["--hicache-write-policy", "watermark"]
            flags += ["--hicache-write-back-threshold", "0.8"]
        if name in HINTED:
            flags += ["--hicache-session-ratio", "0.5"]
            flags += ["--hicache-session-ttl-ms", str(self.session_ttl_ms)]
        return [*flags, *self.extra_flags]


REJECTED_FLAG_SIGNS = ("unrecognized arguments", "invalid choice")
"""What ``hicache serve``'s log says when it does not know a flag or a value."""


@contextmanager
def agentic_server(name: str, spec: AgenticSpec) -> Iterator[ServerProcess]:
    """The server of config ``name`` (:data:`AGENTIC_CONFIGS`), with a fresh file-L3 dir;
    ConfigSkippedError when the server rejects the config's flags, or (``hints_restore``)
    has no ``POST /hicache/prefetch``."""
    with ExitStack() as stack:
        root = tempfile.mkdtemp(prefix="hicache-bench-agentic-l3-")
        stack.callback(shutil.rmtree, root, True)
        server = ServerProcess(spec.flags(name, root), startup_timeout_s=spec.startup_timeout_s)
        try:
            stack.enter_context(server)
        except ServerError as exc:
            signs = [line for line in str(exc).splitlines() if any(s in line for s in
                     REJECTED_FLAG_SIGNS)]  # fmt: skip
            if signs:
                raise ConfigSkippedError(f"the server rejects its flags: {signs[-1]}") from None
            raise
        missing = _missing_routes(name, server.url)
        if missing is None:
            yield server
            return
    raise ConfigSkippedError(missing)  # after a clean stop: no log dump


def _missing_routes(name: str, url: str) -> str | None:
    """Why config ``name`` cannot run on the server at ``url`` (a route it needs answers
    404 / 405), or None."""
    if name != "hints_restore":
        return None
    r = httpx.post(f"{url}/hicache/prefetch", json={"input_ids": [TOKEN_LO]})
    if r.status_code in (404, 405):
        return f"the server has no POST /hicache/prefetch ({r.status_code})"
    return None


# ---------------------------------------------------------------------------- the client


@dataclass
class Ledger:
    """What one run's client counted beside its requests."""

    bound_tokens: int = 0
    """Tokens a perfect cache computes: each turn's new tokens, each one-off whole."""
    restores: int = 0
    restores_refused: int = 0
    """Restores answered with an error (429 over the bound, 4xx, 5xx)."""
    refusals: dict[str, str] = field(default_factory=dict)
    """The first answer of each refused status code (``"429"`` -> its body)."""


@dataclass
class Client:
    """Replays ``trace`` for one config; records go to ``groups[0]`` (session turns) and
    ``groups[1]`` (one-offs)."""

    trace: Trace
    session: Session
    hints: bool
    restore_lead_s: float | None
    """Seconds before a tool returns that a restore is sent; None: no restores."""
    tag: str
    """Unique per run: session ids are ``{tag}-{index}``."""
    ledger: Ledger = field(default_factory=Ledger)
    groups: list[list[RequestRecord]] = field(default_factory=lambda: [[], []])

    def sid(self, s: SessionTrace) -> str:
        return f"{self.tag}-{s.index}"

    def fields(self, s: SessionTrace) -> dict[str, Any]:
        if not self.hints:
            return {}
        out = {"session_id": self.sid(s)}
        if s.parent is not None:
            out["parent_session_id"] = self.sid(self.trace.sessions[s.parent])
        return out

    async def send(self, prompt: list[int], reusable: int, group: int, who: int,
                   fields: Mapping[str, Any]) -> list[int]:  # fmt: skip
        """One request; returns its output ids."""
        rec = await stream_generate(
            self.session.client, self.session.url, prompt, self.trace.shape.output_tokens,
            group=group, client_id=who, ignore_eos=True, fields=fields,
        )  # fmt: skip
        self.ledger.bound_tokens += len(prompt) - reusable
        self.groups[group].append(rec)
        self.session.progress.update()
        return list(rec.output_ids)

    async def restore(self, s: SessionTrace, prompt: list[int], ttl_s: float) -> None:
        body = {"input_ids": prompt, "session_id": self.sid(s), "ttl_ms": int(ttl_s * 1e3)}
        r = await self.session.client.post(f"{self.session.url}/hicache/prefetch", json=body)
        self.ledger.restores += 1
        if r.status_code >= 400:
            self.ledger.restores_refused += 1
            self.ledger.refusals.setdefault(str(r.status_code), r.text[:300])

    async def tool_pause(self, s: SessionTrace, pause_s: float, prompt: list[int]) -> None:
        """Wait out a tool's ``pause_s``; with restores, restore ``prompt`` (the next
        turn's) ``restore_lead_s`` before the pause ends."""
        lead = self.restore_lead_s
        if lead is None or not self.hints:
            await asyncio.sleep(pause_s)
            return
        await asyncio.sleep(max(0.0, pause_s - lead))
        await self.restore(s, prompt, lead + 2.0)
        await asyncio.sleep(min(lead, pause_s))

    async def run_session(self, s: SessionTrace, prefix: list[int]) -> None:
        """Every turn of ``s`` after ``prefix`` (the system prompt, or the parent's
        history); its subagents start after their fork turn; closed at the end."""
        subs = self.trace.subagents_of(s.index)
        children: list[asyncio.Task[None]] = []
        history, reusable = prefix + list(s.task), len(prefix)
        for turn in range(s.turns):
            if turn:
                history = history + list(s.tools[turn - 1])
                await self.tool_pause(s, s.pauses_s[turn - 1], history)
            out = await self.send(history, reusable, 0, s.index, self.fields(s))
            history += out
            reusable = len(history)
            for sub in subs:
                if sub.fork_turn == turn:
                    children.append(asyncio.create_task(self.run_session(sub, list(history))))
        await asyncio.gather(*children)
        if self.hints:
            await self.session.client.delete(f"{self.session.url}/hicache/sessions/{self.sid(s)}")

    async def run(self) -> list[list[RequestRecord]]:
        t0 = time.perf_counter()
        system = list(self.trace.system)

        async def root(s: SessionTrace) -> None:
            await asyncio.sleep(s.start_s)
            await self.run_session(s, system)

        async def oneoff(i: int) -> None:
            o = self.trace.oneoffs[i]
            await asyncio.sleep(max(0.0, o.at_s - (time.perf_counter() - t0)))
            await self.send(list(o.ids), 0, 1, -1 - i, {})

        await asyncio.gather(
            *(root(s) for s in self.trace.roots),
            *(oneoff(i) for i in range(len(self.trace.oneoffs))),
        )
        return self.groups


# ---------------------------------------------------------------------------- figures


L3_READ, L3_WRITTEN = "hicache_l3_read_bytes_total", "hicache_l3_written_bytes_total"
RESTORED = "hicache_restore_tokens_total"
"""Tokens restores read from L3 into L2."""
YIELDS, DEMOTIONS = "hicache_session_yields_total", "hicache_session_demotions_total"
"""Sessions unpinned from L2 for an allocation / past their share of L2."""


@dataclass(frozen=True)
class ConfigFigures:
    """One config's figures over its runs (TTFT in s, bytes, tokens)."""

    name: str
    session_ttft: tuple[float, float, float]
    """p50, p90, p99 of the session turns (subagents included)."""
    oneoff_ttft: tuple[float, float, float]
    requests_per_s: float
    hit_share: dict[str, float]
    """Prompt tokens served by each tier (:data:`TIERS`) over all prompt tokens."""
    computed_tokens: int
    bound_tokens: int
    l3_written_bytes: float | None
    l3_read_bytes: float | None
    protection_yields: float | None
    demotions: float | None
    restores: int
    restores_refused: int
    restored_tokens: float | None
    refusals: dict[str, str]

    @classmethod
    def of(cls, name: str, runs: Sequence[ConfigRun], ledgers: Sequence[Ledger]) -> ConfigFigures:
        sess = [r for run in runs for r in run.groups[0]]
        one = [r for run in runs for r in run.groups[1]]
        every = sess + one
        prompt = sum(r.prompt_tokens for r in every)

        def pcts(rs: Sequence[RequestRecord]) -> tuple[float, float, float]:
            xs = [r.ttft_s for r in rs]
            return percentile(xs, 50), percentile(xs, 90), percentile(xs, 99)

        def counter(key: str) -> float | None:
            vals = [run.counters[key] for run in runs if key in run.counters]
            return sum(vals) if vals else None

        wall = sum(run.wall_s for run in runs)
        return cls(
            name,
            pcts(sess),
            pcts(one),
            len(every) / wall if wall > 0 else 0.0,
            {t: sum(r.cached[t] for r in every) / prompt if prompt else 0.0 for t in TIERS},
            sum(r.prompt_tokens - sum(r.cached.values()) for r in every),
            sum(x.bound_tokens for x in ledgers),
            counter(L3_WRITTEN),
            counter(L3_READ),
            counter(YIELDS),
            counter(DEMOTIONS),
            sum(x.restores for x in ledgers),
            sum(x.restores_refused for x in ledgers),
            counter(RESTORED),
            {k: v for x in ledgers for k, v in x.refusals.items()},
        )

    @property
    def computed_ratio(self) -> float | None:
        """Prompt tokens computed over what a perfect cache computes; None without a bound."""
        return self.computed_tokens / self.bound_tokens if self.bound_tokens else None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 1e3:.0f}"


def _num(x: float | None, scale: float = 1.0, fmt: str = ".1f") -> str:
    return "-" if x is None else f"{x / scale:{fmt}}"


def markdown_table(figs: Sequence[ConfigFigures], problems: Mapping[str, str]) -> str:
    """The per-config table (markdown), skipped / failed configs as a row with the reason."""
    head = ("| config | session TTFT p50 / p90 / p99 ms | one-off p50 / p90 / p99 ms | req/s |"
            " hit L1 / L2 / L3 | computed / all-hit bound | L3 MB written / read |"
            " protection yields / demotions | restores (refused), tokens restored |")  # fmt: skip
    lines = [head, "|" + "---|" * 9]
    for f in figs:
        s, o, h = f.session_ttft, f.oneoff_ttft, f.hit_share
        ratio = f.computed_ratio if f.computed_ratio is not None else float("nan")
        lines.append(
            f"| {f.name} | {' / '.join(map(_ms, s))} | {' / '.join(map(_ms, o))} |"
            f" {f.requests_per_s:.2f} | {h['device']:.0%} / {h['host']:.0%} /"
            f" {h['storage']:.0%} | {f.computed_tokens} / {f.bound_tokens} = {ratio:.2f}x |"
            f" {_num(f.l3_written_bytes, 1e6)} / {_num(f.l3_read_bytes, 1e6)} |"
            f" {_num(f.protection_yields, fmt='.0f')} / {_num(f.demotions, fmt='.0f')} |"
            f" {f.restores} ({f.restores_refused}), {_num(f.restored_tokens, fmt='.0f')} |"
        )
    lines += [f"| {n} | {why} |" + " |" * 7 for n, why in problems.items()]
    return "\n".join(lines)


def targets(figs: Mapping[str, ConfigFigures], setting: str) -> list[str]:
    """The issue's targets against ``l3`` (the same server without hints), as lines."""
    base = figs.get("l3")
    out: list[str] = []
    if base is None:
        return ["targets: no l3 run to compare with"]

    def line(what: str, got: float, limit: float) -> str:
        return f"{what}: {got:.2f} (target <= {limit:g}) {'met' if got <= limit else 'MISSED'}"

    if setting == "no-pressure" and "hints" in figs:
        out.append(line("hints p50 / l3 p50", figs["hints"].session_ttft[0] /
                        base.session_ttft[0], 1.05))  # fmt: skip
    if setting != "no-pressure" and "hints_restore" in figs:
        f = figs["hints_restore"]
        out.append(
            line("hints_restore p99 / l3 p99", f.session_ttft[2] / base.session_ttft[2], 0.5)
        )
        out.append(
            line("hints_restore p50 / l3 p50", f.session_ttft[0] / base.session_ttft[0], 1.0)
        )
        out.append(line("hints_restore one-off p50 / l3 one-off p50",
                        f.oneoff_ttft[0] / base.oneoff_ttft[0], 1.2))  # fmt: skip
    return out or ["targets: the hinted configs did not run"]


def plot(path: str, title: str, figs: Sequence[ConfigFigures]) -> None:
    panels: dict[str, dict[str, float | None]] = {
        "session TTFT p50 (ms)": {f.name: f.session_ttft[0] * 1e3 for f in figs},
        "session TTFT p99 (ms)": {f.name: f.session_ttft[2] * 1e3 for f in figs},
        "one-off TTFT p50 (ms)": {f.name: f.oneoff_ttft[0] * 1e3 for f in figs},
        "computed / all-hit bound": {f.name: f.computed_ratio for f in figs},
    }
    plot_setups(path, title=title, panels=panels)


# ---------------------------------------------------------------------------- main


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    return int(lo), int(hi or lo)


def shape_of(args: argparse.Namespace) -> TraceShape:
    return TraceShape(
        sessions=args.sessions, turns=_range(args.turns),
        subagent_turns=_range(args.subagent_turns), system_tokens=args.system_tokens,
        task_tokens=args.task_tokens, tool_tokens=_range(args.tool_tokens),
        output_tokens=args.output_length, pause_median_s=args.pause_median,
        pause_sigma=args.pause_sigma, pause_min_s=args.pause_min, pause_max_s=args.pause_max,
        start_spread_s=args.start_spread, subagent_share=args.subagent_share,
        oneoffs=args.oneoffs, oneoff_tokens=_range(args.oneoff_tokens),
        oneoff_rate=args.oneoff_rate,
    )  # fmt: skip


def tier_tokens(trace: Trace, setting: str, page_size: int) -> tuple[int, float]:
    """(L1 tokens, L2 ratio): L2 holds :data:`PRESSURE_FRACTION` of the working set under
    pressure, 1.5 x it in ``no-pressure``; L1 = L2 / 3, at least the longest context and
    four pages (L2 at least twice L1)."""
    ws = trace.working_set_tokens()
    l2 = ws * (1.5 if setting == "no-pressure" else PRESSURE_FRACTION)
    l1 = max(
        round_to_pages(l2 / 3, page_size),
        round_to_pages(trace.longest_context() + 4 * page_size, page_size),
    )
    return l1, max(2.0, round(l2 / l1, 2))


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 when every config ran or was skipped, 1 on a failure."""
    p = argparse.ArgumentParser(
        prog="hicache bench agentic",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_common_args(p, tuple(PRESETS))
    p.set_defaults(configs=",".join(AGENTIC_CONFIGS))
    p.add_argument("--setting", choices=SETTINGS, default="slow-l3", help="L3 kind, pressure")
    p.add_argument("--sessions", type=int, help="root sessions")
    p.add_argument("--turns", help="turns of a root session: LOW,HIGH")
    p.add_argument("--subagent-turns", help="turns of a subagent: LOW,HIGH")
    p.add_argument("--subagent-share", type=float, default=0.44, help="roots that fork one")
    p.add_argument("--system-tokens", type=int, help="the shared system prompt")
    p.add_argument("--task-tokens", type=int, help="a session's first user message")
    p.add_argument("--tool-tokens", help="a tool result: LOW,HIGH tokens")
    p.add_argument("--pause-median", type=float, help="tool pause median, s (log-normal)")
    p.add_argument("--pause-sigma", type=float, help="tool pause log-normal sigma")
    p.add_argument("--pause-min", type=float, help="tool pause clipped below, s")
    p.add_argument("--pause-max", type=float, help="tool pause clipped above, s")
    p.add_argument("--start-spread", type=float, help="root sessions start within this, s")
    p.add_argument("--oneoffs", type=int, help="one-off prompts (no session)")
    p.add_argument("--oneoff-tokens", help="a one-off prompt: LOW,HIGH tokens")
    p.add_argument("--oneoff-rate", type=float, help="one-offs per s (Poisson)")
    p.add_argument(
        "--restore-lead", type=float, help="restore sent this long before a tool returns, s"
    )
    p.add_argument("--slow-l3-read-s", type=float, help="slow-l3: each L3 read sleeps this, s")
    p.add_argument("--repeats", type=int, help="repetitions (configs alternated)")
    args = parse_with_preset(p, argv, PRESETS)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in AGENTIC_CONFIGS]
    if bad or not configs:
        p.error(f"--configs={args.configs!r}: choose from {','.join(AGENTIC_CONFIGS)}")
    if args.url and len(configs) != 1:
        p.error("--url serves one config: name it in --configs")
    try:
        shape = shape_of(args)
    except ValueError as exc:
        p.error(str(exc))
    if args.repeats < 1 or args.restore_lead < 0 or args.slow_l3_read_s < 0:
        p.error("--repeats must be >= 1; --restore-lead and --slow-l3-read-s >= 0")
    first = make_trace(shape, args.seed, 0, (TOKEN_LO, TOKEN_HI))
    l1, ratio = tier_tokens(first, args.setting, args.page_size)
    l1, ratio = args.l1_tokens or l1, args.hicache_ratio or ratio
    spec = AgenticSpec(
        model_path=args.model_path, page_size=args.page_size, l1_tokens=l1, l2_ratio=ratio,
        setting=args.setting, slow_l3_read_s=args.slow_l3_read_s,
        session_ttl_ms=int(max(10.0, 4 * args.pause_max) * 1e3),
        extra_flags=tuple(shlex.split(args.server_args)), startup_timeout_s=args.startup_timeout,
    )  # fmt: skip
    ws = first.working_set_tokens()
    subs = len(first.sessions) - len(first.roots)
    print(
        f"agentic ({args.setting}): {shape.sessions} sessions ({subs} fork a subagent),"
        f" {first.requests()} requests, working set {ws} tokens; L1 {l1} tokens, L2 ="
        f" {ratio:g} x L1 ({l1 * ratio / ws:.0%} of the working set); model"
        f" {args.model_path}; {args.repeats} repetition(s)",
        file=sys.stderr,
    )
    ledgers: dict[str, list[Ledger]] = {c: [] for c in configs}

    def workload_for(rep: int, name: str) -> Workload:
        trace = make_trace(shape, args.seed, rep, (TOKEN_LO, TOKEN_HI))

        async def run(s: Session) -> list[list[RequestRecord]]:
            lead = args.restore_lead if name == "hints_restore" else None
            client = Client(trace, s, name in HINTED, lead, f"r{rep}-{name}")
            ledgers[name].append(client.ledger)
            return await client.run()

        return run

    rr: RepeatedRuns = run_repeated(
        configs,
        lambda name: agentic_server(name, spec),
        workload_for,
        repeats=args.repeats,
        total_requests=first.requests(),
        parallel=len(first.sessions) + len(first.oneoffs),
        url=args.url,
        timeout_s=args.request_timeout,
        api="generate",
    )
    figs = {n: ConfigFigures.of(n, rr.of(n), ledgers[n]) for n in configs if rr.of(n)}
    title = (f"agentic, {args.setting}: {shape.sessions} sessions, working set {ws} tokens,"
             f" L1+L2 {l1 * (1 + ratio):.0f} tokens; {args.model_path}")  # fmt: skip
    print(f"\n### {title}\n")
    print(markdown_table(list(figs.values()), rr.problems))
    target_lines = targets(figs, args.setting)
    for line in target_lines:
        print(f"- {line}")
    for f in figs.values():
        for code, body in f.refusals.items():
            print(f"- {f.name}: restores refused with {code}, e.g. {body}")
    doc = {
        "setting": args.setting,
        "shape": shape.__dict__,
        "working_set_tokens": ws,
        "l1_tokens": l1,
        "l2_ratio": ratio,
        "slow_l3_read_s": args.slow_l3_read_s if args.setting == "slow-l3" else None,
        "restore_lead_s": args.restore_lead,
        "order": [list(o) for o in rr.order],
        "configs": {n: f.to_json() for n, f in figs.items()},
        "server_flags": {n: rr.of(n)[0].flags for n in figs},
        "problems": rr.problems,
        "targets": target_lines,
    }
    if args.json:
        write_json(args.json, doc)
    if args.plot and figs:
        plot(args.plot, title, list(figs.values()))
    return 1 if any(v.startswith("failed") for v in rr.problems.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
