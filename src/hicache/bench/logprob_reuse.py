"""``hicache bench logprob-reuse``: a multiple-choice log-likelihood workload with the cache
on and off (issue 27).

lm-eval's multiple-choice tasks send one request per choice, ``context + choice``, reading
the choice's prompt logprobs (``logprob_start_len = len(context)``, ``max_tokens=1``;
``--echo``: every position, as ``local-completions`` asks). Two
engines in process: **on** (the radix cache) and **off** (``disable_radix_cache``), over
``--questions`` contexts of about ``--context`` tokens with ``--choices`` answers each, one
request at a time, alternating for ``--rounds`` rounds (each "on" round starts cold).
Reported per mode (medians): wall and CPU time (s), prompt tokens computed and cached; and
between modes: the largest log-likelihood and logprob differences and whether every
question picks the same choice. The method in full: ``docs/benchmarks/logprob-reuse.md``.
"""

from __future__ import annotations

import argparse
import math
import resource
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from hicache.bench.plot import print_table
from hicache.bench.report import write_json

__all__ = ["ModeRun", "main", "workload"]

MODES = ("on", "off")
ANSWERS = (
    " the device tier, in accelerator memory",
    " the host tier, in pinned RAM",
    " the storage tier, shared by every instance",
    " none of them: it is recomputed",
)


@dataclass
class ModeRun:
    """One pass over the workload: ``wall_s`` seconds, ``cpu_s`` CPU seconds of the
    process (user + system, every thread); prompt tokens in all, ``computed``
    (prefilled) and ``cached`` (served by the cache); per request the choice tokens'
    logprobs (``logprobs[i]``) in workload order."""

    mode: str
    wall_s: float
    cpu_s: float
    prompt_tokens: int
    computed: int
    cached: int
    logprobs: list[list[float]] = field(default_factory=list)


def workload(
    tokenizer: Any, questions: int, context: int, choices: int
) -> list[tuple[list[int], list[int]]]:
    """``questions * choices`` pairs ``(context ids, choice ids)``: each question's context
    is ``context`` tokens of its own text; the choices are ``ANSWERS`` (cycled, each
    numbered)."""
    out: list[tuple[list[int], list[int]]] = []
    for q in range(questions):
        text = " ".join(
            f"Passage {q}.{i}: a hierarchical cache keeps the key and value tensors of page"
            f" {q * 31 + i * 7} in one of three tiers, and a request that shares its prefix"
            " reads them back instead of computing them."
            for i in range(context // 20 + 2)
        )
        ctx = [int(t) for t in tokenizer.encode(text, add_special_tokens=False)][:context]
        ctx += [
            int(t)
            for t in tokenizer.encode(
                " Question: which tier holds it? Answer:", add_special_tokens=False
            )
        ]
        for c in range(choices):
            answer = f"{ANSWERS[c % len(ANSWERS)]} ({c})"
            out.append((ctx, [int(t) for t in tokenizer.encode(answer, add_special_tokens=False)]))
    return out


def run_mode(
    engine: Any, mode: str, pairs: list[tuple[list[int], list[int]]], *, echo: bool = False
) -> ModeRun:
    """Score every pair once, one request at a time; ``mode`` names the engine. ``echo``:
    every prompt position scored with one alternative (no ``logprob_start_len``: OpenAI's
    ``echo`` + ``logprobs=1``, as lm-eval's ``local-completions`` asks)."""
    from hicache.engine.sampling import SamplingParams

    if mode == "on" and not engine.flush_cache():
        raise RuntimeError("the cache could not be emptied before the round")
    run = ModeRun(mode, 0.0, 0.0, 0, 0, 0)
    c0 = _cpu_s()
    t0 = time.perf_counter()
    for ctx, choice in pairs:
        params = SamplingParams(
            temperature=0,
            max_tokens=1,
            prompt_logprobs=1 if echo else 0,
            logprob_start_len=0 if echo else len(ctx),
        )
        out = engine.generate(ctx + choice, params, timeout=600)
        if out.error is not None or out.prompt_logprobs is None:
            raise RuntimeError(f"a request failed: {out.error}")
        got = out.prompt_logprobs[len(ctx) :]
        if any(g is None for g in got):
            raise RuntimeError("a choice token was not scored")
        run.logprobs.append([g.logprob for g in got if g is not None])
        run.prompt_tokens += out.prompt_tokens
        run.cached += out.cached.total
    run.wall_s = time.perf_counter() - t0
    run.cpu_s = _cpu_s() - c0
    run.computed = run.prompt_tokens - run.cached
    return run


def _cpu_s() -> float:
    """CPU seconds of this process so far (user + system, every thread)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def compare(on: ModeRun, off: ModeRun, choices: int) -> dict[str, Any]:
    """How far the modes' numbers are apart: the largest token logprob and choice
    log-likelihood differences, and whether each question picks the same choice."""
    tok = max(
        (
            abs(a - b)
            for x, y in zip(on.logprobs, off.logprobs, strict=True)
            for a, b in zip(x, y, strict=False)
        ),
        default=0.0,
    )
    ll_on = [math.fsum(x) for x in on.logprobs]
    ll_off = [math.fsum(x) for x in off.logprobs]
    ll = max((abs(a - b) for a, b in zip(ll_on, ll_off, strict=True)), default=0.0)

    def picks(lls: list[float]) -> list[int]:
        groups = [lls[i : i + choices] for i in range(0, len(lls), choices)]
        return [max(range(len(g)), key=g.__getitem__) for g in groups]

    return {
        "max_token_logprob_diff": tok,
        "max_loglikelihood_diff": ll,
        "same_picks": picks(ll_on) == picks(ll_off),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hicache bench logprob-reuse", description=__doc__)
    p.add_argument("--model-path", default=None, help="default: SmolLM2-135M")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--questions", type=int, default=16)
    p.add_argument("--choices", type=int, default=4)
    p.add_argument("--context", type=int, default=300, help="context tokens (about)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--rounds", type=int, default=3, help="alternating on/off rounds")
    p.add_argument(
        "--echo",
        action="store_true",
        help="score every prompt position, no logprob_start_len (lm-eval's local-completions)",
    )
    p.add_argument(
        "--prompt-logprobs-top",
        type=int,
        default=1,
        help="the on engine's scoring entries (alternatives kept per position; -1: none)",
    )
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    args = p.parse_args(argv)
    for name in ("questions", "choices", "context", "page_size", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be at least 1")

    from hicache.config import CacheConfig
    from hicache.engine.front.engine import Engine, EngineConfig
    from hicache.engine.step.scheduler import SchedulerConfig

    def config(off: bool) -> EngineConfig:
        kwargs: dict[str, Any] = {}
        if args.device is not None:
            kwargs["device"] = args.device
        return EngineConfig(
            model_path=args.model_path,
            dtype=args.dtype,
            cache=CacheConfig(page_size=args.page_size, device_tokens=16384, hicache_ratio=2.0),
            scheduler=SchedulerConfig(disable_radix_cache=off),
            prompt_logprobs_top=None if args.prompt_logprobs_top < 0 else args.prompt_logprobs_top,
            **kwargs,
        )

    runs: dict[str, list[ModeRun]] = {m: [] for m in MODES}
    with Engine(config(False)) as on_engine, Engine(config(True)) as off_engine:
        engines = {"on": on_engine, "off": off_engine}
        pairs = workload(on_engine.model.tokenizer, args.questions, args.context, args.choices)
        run_mode(on_engine, "on", pairs[: args.choices], echo=args.echo)  # warm-up
        run_mode(off_engine, "off", pairs[: args.choices], echo=args.echo)
        for r in range(args.rounds):
            order = MODES if r % 2 == 0 else MODES[::-1]
            for mode in order:
                runs[mode].append(run_mode(engines[mode], mode, pairs, echo=args.echo))
    diffs = [compare(a, b, args.choices) for a, b in zip(runs["on"], runs["off"], strict=True)]
    summary = {
        m: {
            "wall_s": statistics.median(r.wall_s for r in runs[m]),
            "cpu_s": statistics.median(r.cpu_s for r in runs[m]),
            "prompt_tokens": runs[m][0].prompt_tokens,
            "computed": statistics.median(r.computed for r in runs[m]),
            "cached": statistics.median(r.cached for r in runs[m]),
        }
        for m in MODES
    }
    on, off = summary["on"], summary["off"]
    saved = {
        "computed_ratio": off["computed"] / max(1, on["computed"]),
        "wall_ratio": off["wall_s"] / on["wall_s"],
        "wall_saved_pct": 100 * (1 - on["wall_s"] / off["wall_s"]),
        "cpu_ratio": off["cpu_s"] / on["cpu_s"],
    }
    same = {
        "max_token_logprob_diff": max(d["max_token_logprob_diff"] for d in diffs),
        "max_loglikelihood_diff": max(d["max_loglikelihood_diff"] for d in diffs),
        "same_picks": all(d["same_picks"] for d in diffs),
    }
    print_table(
        f"Multiple choice: {args.questions} questions x {args.choices} choices, context"
        f" ~{len(pairs[0][0])} tokens, page {args.page_size},"
        f" {'echo (every position)' if args.echo else 'from the choice'}, scoring entries"
        f" {args.prompt_logprobs_top if args.prompt_logprobs_top >= 0 else 'off'};"
        f" medians of {args.rounds} rounds",
        ["cache", "wall s", "CPU s", "prompt tokens", "computed", "cached"],
        [
            [
                m,
                f"{s['wall_s']:.2f}",
                f"{s['cpu_s']:.2f}",
                str(s["prompt_tokens"]),
                f"{s['computed']:.0f}",
                f"{s['cached']:.0f}",
            ]
            for m, s in summary.items()
        ],
    )
    print(
        f"off/on: computed tokens {saved['computed_ratio']:.2f}x, wall time"
        f" {saved['wall_ratio']:.2f}x ({saved['wall_saved_pct']:.0f}% saved), CPU time"
        f" {saved['cpu_ratio']:.2f}x; max |d logprob|"
        f" {same['max_token_logprob_diff']:.2e}, max |d loglikelihood|"
        f" {same['max_loglikelihood_diff']:.2e}, same picks: {same['same_picks']}"
    )
    if args.json:
        write_json(
            args.json,
            {
                "config": vars(args),
                "summary": summary,
                "saved": saved,
                "same": same,
                "rounds": [
                    {k: v for k, v in asdict(r).items() if k != "logprobs"}
                    for m in MODES
                    for r in runs[m]
                ],
            },
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
