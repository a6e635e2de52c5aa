"""``hicache bench multiturn``: multi-turn conversations over HTTP, under each cache config.

``--num-clients`` conversations of ``--num-rounds`` rounds; round r sends the conversation
so far plus ``--request-length`` token ids (uniform in ``[1000, 30000)``, no shared prefix)
and appends a synthetic assistant turn of ``--output-length`` ids (``--real-output``: the
model's own ids). Each config (``no_cache``, ``l1``, ``l1_l2``, ``l1_l2_l3_file``,
``l1_l2_l3_mooncake``; ``NAME@tpN`` with ``--tp-size``) has its own ``hicache serve``, the
same L1 (a quarter of the working set, in whole pages) and an L2 holding it all.
Invariants: every config (and every run with the same ``--seed``) sends identical prompts;
each run starts and ends with ``POST /flush_cache``; ratios are taken against
``--baseline`` within one repetition only (``--repeats``, alternating order).
Units: TTFT in s (client side, to the first SSE event), throughput in tokens/s over a
run's wall time, server CPU in s (``/proc``). The method, figures and JSON are in
``docs/benchmarks/serving.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from dataclasses import dataclass
from typing import Any

from hicache.bench.httpclient import APIS, RequestRecord, stream_completion, stream_request
from hicache.bench.results import pool_runs, repeats_doc, report_runs, summarize
from hicache.bench.runner import (
    TOKEN_HI,
    TOKEN_LO,
    ConfigRun,
    Pacer,
    Session,
    Workload,
    add_common_args,
    parse_with_preset,
    run_configs,
    run_repeated,
    server_spec,
    tier_sizes,
)
from hicache.bench.serverproc import config_server, parse_configs, parse_tp_sizes, with_tp

__all__ = [
    "ConfigRun",
    "RequestRecord",
    "Session",
    "main",
    "run_configs",
    "stream_completion",
    "summarize",
]

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        model_path="tiny-random-llama", num_clients=32, num_rounds=8, request_length=192,
        output_length=16, max_parallel=4,
    ),
    "default-model": dict(
        model_path="SmolLM2-135M-Instruct", num_clients=8, num_rounds=4, request_length=256,
        output_length=16, max_parallel=2,
    ),
    "gpu": dict(
        model_path="SmolLM2-135M-Instruct", num_clients=128, num_rounds=6, request_length=512,
        output_length=64, max_parallel=32,
    ),
    "sglang-headline": dict(
        model_path="SmolLM2-135M-Instruct", num_clients=8, num_rounds=10, request_length=256,
        output_length=1, max_parallel=4, real_output=True,
    ),
}  # fmt: skip
"""``--preset`` defaults (explicit flags win). ``tiny`` is the default. ``sglang-headline``
is the shape SGLang's HiCache headline was measured on (many rounds of one long
conversation, one output token, the model's own output appended), scaled to a CPU."""


@dataclass(frozen=True)
class Conversations:
    """Every client's user turns and synthetic assistant turns (token ids)."""

    user: list[list[list[int]]]
    """``user[client][round]``: ``request_length`` ids."""
    assistant: list[list[list[int]]]
    """``assistant[client][round]``: ``output_length`` ids appended to the history."""

    @classmethod
    def make(
        cls,
        clients: int,
        rounds: int,
        request_len: int,
        output_len: int,
        seed: int,
        repetition: int = 0,
    ) -> Conversations:
        """Deterministic in (``seed``, ``repetition``); two repetitions share no prefix."""
        rng = random.Random(f"multiturn/{seed}/{repetition}")

        def ids(n: int) -> list[int]:
            return [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(n)]

        user = [[ids(request_len) for _ in range(rounds)] for _ in range(clients)]
        assistant = [[ids(output_len) for _ in range(rounds)] for _ in range(clients)]
        return cls(user, assistant)

    def prompt(self, client: int, rnd: int) -> list[int]:
        """History of rounds ``< rnd`` (user + synthetic assistant) + user turn ``rnd``."""
        out: list[int] = []
        for i in range(rnd):
            out += self.user[client][i] + self.assistant[client][i]
        return out + self.user[client][rnd]


def multiturn_workload(conv: Conversations, args: argparse.Namespace) -> Workload:
    """The rounds of every client (see the module docstring for the schedule)."""
    clients, rounds = len(conv.user), len(conv.user[0])
    barrier = bool(args.barrier or args.flush_between_rounds)

    async def run(s: Session) -> list[list[RequestRecord]]:
        sem = asyncio.Semaphore(args.max_parallel or clients)
        pacer = Pacer(args.request_rate, args.seed + 1)
        groups: list[list[RequestRecord]] = [[] for _ in range(rounds)]

        history: list[list[int]] = [[] for _ in range(clients)]  # --real-output only

        async def one(c: int, r: int) -> None:
            await pacer.wait()
            prompt = history[c] + conv.user[c][r] if args.real_output else conv.prompt(c, r)
            async with sem:
                rec = await stream_request(
                    args.api,
                    s.client,
                    s.url,
                    prompt,
                    args.output_length,
                    group=r,
                    client_id=c,
                )
            history[c] = prompt + list(rec.output_ids)
            groups[r].append(rec)
            s.progress.update()

        if barrier:
            for r in range(rounds):
                await asyncio.gather(*(one(c, r) for c in range(clients)))
                if args.flush_between_rounds and r < rounds - 1:
                    await s.flush()
        else:

            async def client_loop(c: int) -> None:
                for r in range(rounds):
                    await one(c, r)

            await asyncio.gather(*(client_loop(c) for c in range(clients)))
        return groups

    return run


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 when every config ran, 1 when one failed, 2 on bad flags."""
    p = argparse.ArgumentParser(
        prog="hicache bench multiturn",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_common_args(p, tuple(PRESETS))
    p.add_argument("--num-clients", type=int, help="concurrent conversations")
    p.add_argument("--num-rounds", type=int, help="rounds per conversation")
    p.add_argument("--request-length", type=int, help="new user tokens per round")
    p.add_argument("--barrier", action="store_true", help="all clients finish a round first")
    p.add_argument(
        "--flush-between-rounds", action="store_true", help="POST /flush_cache after each round"
    )
    p.add_argument("--repeats", type=int, default=5, help="repetitions of the workload (>= 1)")
    p.add_argument(
        "--api",
        choices=APIS,
        default=None,
        help="send requests to /v1/completions (prompt ids; the default) or to SGLang's"
        " /generate (input_ids; what SGLang's router smg forwards: use it with --url SMG_URL;"
        " the default with --real-output)",
    )
    p.add_argument(
        "--real-output",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="append the model's own output ids to the history (default: synthetic ids;"
        " on in the sglang-headline preset)",
    )
    p.add_argument("--baseline", help="config the others are compared with (default l1)")
    args = parse_with_preset(p, argv, PRESETS)
    try:
        configs = with_tp(parse_configs(args.configs), parse_tp_sizes(args.tp_size))
    except ValueError as exc:
        p.error(str(exc))
    if min(args.num_clients, args.num_rounds, args.request_length, args.output_length) < 1:
        p.error("--num-clients, --num-rounds, --request-length and --output-length must be >= 1")
    if args.repeats < 1:
        p.error(f"--repeats={args.repeats} must be >= 1")
    if args.real_output and args.api == "completions":
        p.error("--real-output needs the output ids, which only --api generate returns")
    args.api = args.api or ("generate" if args.real_output else "completions")
    if args.baseline is not None and args.baseline not in configs:
        p.error(f"--baseline={args.baseline!r} is not one of --configs={','.join(configs)}")
    if args.url and len(configs) != 1:
        configs = ["external"]
    baseline = args.baseline or ("l1" if "l1" in configs else configs[0])
    args.baseline = baseline if len(configs) > 1 else None
    final_len = args.num_rounds * (args.request_length + args.output_length)
    working_set = args.num_clients * final_len
    l1, ratio = tier_sizes(args, working_set, final_len + args.page_size)
    spec = server_spec(args, l1, ratio)
    print(
        f"multiturn: {args.num_clients} clients x {args.num_rounds} rounds, final conversation"
        f" {final_len} tokens, working set {working_set} tokens; L1 {l1} tokens, L2 = {ratio:g}"
        f" x L1; model {args.model_path}; {args.repeats} repetitions",
        file=sys.stderr,
    )

    def workload_for(rep: int, _name: str) -> Workload:
        conv = Conversations.make(args.num_clients, args.num_rounds, args.request_length,
                                  args.output_length, args.seed, rep)  # fmt: skip
        return multiturn_workload(conv, args)

    rr = run_repeated(
        configs,
        lambda name: config_server(name, spec),
        workload_for,
        repeats=args.repeats,
        total_requests=args.num_clients * args.num_rounds,
        parallel=args.max_parallel or args.num_clients,
        url=args.url,
        timeout_s=args.request_timeout,
        api=args.api,
    )
    runs = [pool_runs(rr.of(n)) for n in configs if rr.of(n)]
    keys = ("num_clients num_rounds request_length output_length barrier flush_between_rounds"
            " repeats baseline real_output api")  # fmt: skip
    title = (
        f"multiturn: {args.num_clients} clients x {args.num_rounds} rounds,"
        f" {args.request_length}+{args.output_length} tokens/round"
        f" ({'real' if args.real_output else 'synthetic'} output in the history), L1 {l1} tokens,"
        f" {args.repeats} repetitions pooled"
    )
    return report_runs(
        args,
        runs,
        rr.problems,
        group_key="rounds",
        workload_keys=keys.split(),
        l1=l1,
        ratio=ratio,
        working_set=working_set,
        title=title,
        extra=repeats_doc(rr, args.baseline),
    )


if __name__ == "__main__":
    raise SystemExit(main())
