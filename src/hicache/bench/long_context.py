"""``hicache bench long-context``: long shared documents, many questions (the LooGLE pattern).

``--num-docs`` documents of ``--context-length`` ids are asked ``--questions-per-doc``
questions of ``--question-length`` ids (prompt = document + question, seeded ids in ``[1000,
30000)``, greedy, streamed), in ``--order interleave`` (question 1 of every document, then
2, ...) or ``doc`` order, ``--max-parallel`` in flight (``--request-rate``: Poisson, req/s).
Phase 1 on an empty cache, then ``POST /flush_cache`` (L1 and L2 emptied, L3 kept), then
phase 2 with the same requests. L1 holds about a quarter of the working set (at least
one request), L2 all of it with 50% to spare. TTFT (s), throughput (tokens/s) and hit
rates as in :mod:`hicache.bench.multiturn`, per config and phase. The method:
``docs/benchmarks/serving.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from typing import Any

from hicache.bench.httpclient import RequestRecord, stream_completion
from hicache.bench.results import report_runs
from hicache.bench.runner import (
    TOKEN_HI,
    TOKEN_LO,
    Pacer,
    Session,
    Workload,
    add_common_args,
    parse_with_preset,
    run_configs,
    server_spec,
    tier_sizes,
)
from hicache.bench.serverproc import parse_configs

__all__ = ["PRESETS", "Questions", "main"]

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        model_path="tiny-random-llama", num_docs=16, questions_per_doc=4, context_length=1536,
        question_length=64, output_length=16, max_parallel=4,
    ),
    "default-model": dict(
        model_path="SmolLM2-135M-Instruct", num_docs=4, questions_per_doc=3,
        context_length=2048, question_length=64, output_length=8, max_parallel=2,
    ),
    "gpu": dict(
        model_path="SmolLM2-135M-Instruct", num_docs=64, questions_per_doc=8,
        context_length=6144, question_length=128, output_length=32, max_parallel=32,
    ),
}  # fmt: skip
"""``--preset`` defaults (explicit flags win). ``tiny`` is the default."""


class Questions:
    """The documents, the questions and the order they are asked in (token ids)."""

    def __init__(
        self, docs: int, per_doc: int, context_len: int, question_len: int, seed: int
    ) -> None:
        rng = random.Random(seed)

        def ids(n: int) -> list[int]:
            return [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(n)]

        self.docs = [ids(context_len) for _ in range(docs)]
        self.questions = [[ids(question_len) for _ in range(per_doc)] for _ in range(docs)]

    def order(self, how: str) -> list[tuple[int, int]]:
        """``(doc, question)`` pairs: ``doc`` = doc-major, ``interleave`` = question-major."""
        nd, nq = len(self.docs), len(self.questions[0])
        if how == "doc":
            return [(d, q) for d in range(nd) for q in range(nq)]
        return [(d, q) for q in range(nq) for d in range(nd)]

    def prompt(self, doc: int, question: int) -> list[int]:
        return self.docs[doc] + self.questions[doc][question]


def long_context_workload(qs: Questions, args: argparse.Namespace) -> Workload:
    """Phase 1, flush, phase 2 (see the module docstring)."""
    order = qs.order(args.order)

    async def phase(s: Session, index: int) -> list[RequestRecord]:
        sem = asyncio.Semaphore(args.max_parallel)
        pacer = Pacer(args.request_rate, args.seed + 1 + index)
        out: list[RequestRecord] = []

        async def one(d: int, q: int) -> None:
            await pacer.wait()
            async with sem:
                rec = await stream_completion(
                    s.client, s.url, qs.prompt(d, q), args.output_length, group=index, client_id=d
                )
            out.append(rec)
            s.progress.update()

        await asyncio.gather(*(one(d, q) for d, q in order))
        return out

    async def run(s: Session) -> list[list[RequestRecord]]:
        first = await phase(s, 0)
        await s.flush()
        return [first, await phase(s, 1)]

    return run


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 when every config ran, 1 when one failed, 2 on bad flags."""
    p = argparse.ArgumentParser(
        prog="hicache bench long-context",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_common_args(p)
    p.add_argument("--num-docs", type=int, help="documents")
    p.add_argument("--questions-per-doc", type=int, help="questions asked of each document")
    p.add_argument("--context-length", type=int, help="tokens per document")
    p.add_argument("--question-length", type=int, help="tokens per question")
    p.add_argument("--order", choices=("interleave", "doc"), default="interleave")
    args = parse_with_preset(p, argv, PRESETS)
    try:
        configs = parse_configs(args.configs)
    except ValueError as exc:
        p.error(str(exc))
    sizes = (args.num_docs, args.questions_per_doc, args.context_length, args.question_length,
             args.output_length, args.max_parallel)  # fmt: skip
    if min(sizes) < 1:
        p.error("document, question, output sizes and --max-parallel must be >= 1")
    if args.url and len(configs) != 1:
        configs = ["external"]
    requests = args.num_docs * args.questions_per_doc
    request_len = args.context_length + args.question_length + args.output_length
    working_set = args.num_docs * args.context_length + requests * (
        args.question_length + args.output_length
    )
    l1, ratio = tier_sizes(args, working_set, request_len + args.page_size)
    qs = Questions(
        args.num_docs, args.questions_per_doc, args.context_length, args.question_length, args.seed
    )
    print(
        f"long-context: {args.num_docs} docs x {args.questions_per_doc} questions, context"
        f" {args.context_length} tokens, working set {working_set} tokens; L1 {l1} tokens,"
        f" L2 = {ratio:g} x L1; model {args.model_path}",
        file=sys.stderr,
    )
    runs, problems = run_configs(
        configs,
        server_spec(args, l1, ratio),
        long_context_workload(qs, args),
        total_requests=2 * requests,
        parallel=args.max_parallel,
        url=args.url,
        timeout_s=args.request_timeout,
    )
    keys = "num_docs questions_per_doc context_length question_length output_length order"
    title = (
        f"long-context: {args.num_docs} docs x {args.questions_per_doc} questions,"
        f" {args.context_length}+{args.question_length}+{args.output_length} tokens,"
        f" L1 {l1} tokens (phase 2 after /flush_cache)"
    )
    return report_runs(
        args,
        runs,
        problems,
        group_key="phases",
        workload_keys=keys.split(),
        l1=l1,
        ratio=ratio,
        working_set=working_set,
        title=title,
    )


if __name__ == "__main__":
    raise SystemExit(main())
