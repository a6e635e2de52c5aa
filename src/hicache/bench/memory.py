"""``hicache bench memory``: does the server give memory back after a peak?

Starts ``hicache serve`` (extra ``--serve-flag`` values go to it), warms it up and reads its
resident set (``VmRSS``): *post-start*. Then ``--rounds`` bursts of ``--concurrency``
``/v1/completions`` requests (``n``, ``logprobs``, half streamed) while a sampler reads the
RSS every :data:`SAMPLE_S` (the round's *peak*); then *idle-after* (``--idle-wait`` s later,
past the engine's first trim) and *late* (``--late-read`` s later, past its follow-up trim).
Units: MiB (2**20 bytes); *kept* = late - post-start, what the peak left behind. Linux only
(``/proc``). To compare two builds, run the same command under each (the server is a
subprocess of the same Python and environment). The method in full:
``docs/benchmarks/memory.md``.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from hicache.bench.report import print_table, write_json
from hicache.bench.serverproc import ServerProcess

SAMPLE_S = 0.02
"""Seconds between two RSS samples during a burst."""
PROMPT = (
    "Hierarchical caches keep the key and value tensors of shared prefixes in GPU memory, "
    "host memory and remote storage, so that a long conversation does not pay for its "
    "prefill twice. Tell me about it:"
)


def rss_mib(pid: int) -> float:
    """Resident set size of process ``pid`` in MiB (``VmRSS`` of ``/proc/PID/status``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"/proc/{pid}/status has no VmRSS line")


class RssSampler:
    """Samples ``pid``'s RSS every ``period_s`` on a thread between ``start()`` and
    ``stop()``, which returns the highest sample (MiB)."""

    def __init__(self, pid: int, period_s: float = SAMPLE_S) -> None:
        self.pid = pid
        self.period_s = period_s
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_mib(self.pid))
            self._stop.wait(self.period_s)

    def start(self) -> RssSampler:
        self.peak = rss_mib(self.pid)
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> float:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self.peak = max(self.peak, rss_mib(self.pid))
        return self.peak


@dataclass(frozen=True)
class Round:
    """One burst: RSS (MiB) post-start, at the peak and after ``idle_wait_s`` of idle."""

    round: int
    post_start_mib: float
    peak_mib: float
    idle_after_mib: float
    late_mib: float
    burst_s: float
    completion_tokens: int

    @property
    def kept_mib(self) -> float:
        return self.late_mib - self.post_start_mib


def _one(client: httpx.Client, url: str, body: dict[str, object], stream: bool) -> int:
    """Send one completion; the completion tokens it got (raises on an error status)."""
    payload = {**body, "stream": stream}
    if not stream:
        r = client.post(f"{url}/v1/completions", json=payload)
        r.raise_for_status()
        return int(r.json()["usage"]["completion_tokens"])
    tokens = 0
    with client.stream("POST", f"{url}/v1/completions", json=payload) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                for c in chunk.get("choices", []):
                    lp = c.get("logprobs") or {}
                    tokens += len(lp.get("tokens") or [])
    return tokens


def run(
    flags: Sequence[str],
    *,
    rounds: int,
    concurrency: int,
    n: int,
    logprobs: int,
    max_tokens: int,
    idle_wait_s: float,
    late_read_s: float,
) -> list[Round]:
    body: dict[str, object] = {
        "prompt": PROMPT,
        "n": n,
        "logprobs": logprobs,
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "ignore_eos": True,
    }
    out: list[Round] = []
    with ServerProcess(flags) as server, httpx.Client(timeout=600.0) as client:
        assert server.proc is not None
        pid = server.proc.pid
        _one(client, server.url, {"prompt": PROMPT, "max_tokens": 4}, stream=False)
        time.sleep(idle_wait_s)
        post_start = rss_mib(pid)
        for i in range(rounds):
            sampler = RssSampler(pid).start()
            t0 = time.perf_counter()
            with ThreadPoolExecutor(concurrency) as pool:
                futures = [
                    pool.submit(_one, client, server.url, body, j % 2 == 1)
                    for j in range(concurrency)
                ]
                tokens = sum(f.result() for f in futures)
            burst = time.perf_counter() - t0
            time.sleep(idle_wait_s)
            peak = sampler.stop()
            idle_after = rss_mib(pid)
            time.sleep(max(0.0, late_read_s - idle_wait_s))
            out.append(Round(i + 1, post_start, peak, idle_after, rss_mib(pid), burst, tokens))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hicache bench memory", description=__doc__)
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=2, help="requests per burst")
    parser.add_argument("--n", type=int, default=64, help="choices per request")
    parser.add_argument("--logprobs", type=int, default=20, help="top logprobs per token")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--idle-wait", type=float, default=3.0, help="seconds idle, first read")
    parser.add_argument("--late-read", type=float, default=14.0, help="seconds idle, last read")
    parser.add_argument(
        "--serve-flag",
        action="append",
        default=[],
        metavar="FLAG",
        help="a flag for hicache serve (repeat; e.g. --serve-flag=--model-path=tiny-random-llama)",
    )
    args = parser.parse_args(argv)
    flags = ["--device", "cpu", *args.serve_flag]
    rounds = run(
        flags,
        rounds=args.rounds,
        concurrency=args.concurrency,
        n=args.n,
        logprobs=args.logprobs,
        max_tokens=args.max_tokens,
        idle_wait_s=args.idle_wait,
        late_read_s=args.late_read,
    )
    print_table(
        f"Server RSS (MiB), bursts of {args.concurrency} x (n={args.n}, logprobs={args.logprobs},"
        f" max_tokens={args.max_tokens}); reads {args.idle_wait:g} s and {args.late_read:g} s after",
        ["round", "post-start", "peak", "idle-after", "late", "kept", "burst s", "tokens"],
        [
            [
                str(r.round),
                f"{r.post_start_mib:.0f}",
                f"{r.peak_mib:.0f}",
                f"{r.idle_after_mib:.0f}",
                f"{r.late_mib:.0f}",
                f"{r.kept_mib:+.0f}",
                f"{r.burst_s:.1f}",
                str(r.completion_tokens),
            ]
            for r in rounds
        ],
    )
    if args.json:
        write_json(
            args.json,
            {"flags": flags, "rounds": [asdict(r) | {"kept_mib": r.kept_mib} for r in rounds]},
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
