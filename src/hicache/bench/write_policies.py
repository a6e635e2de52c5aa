"""``hicache bench write-policies``: what each write policy makes of L1+L2+L3, in-process.

One :class:`~hicache.cache.HiCache` per policy (``write_through``,
``write_through_selective``, ``write_back``, ``watermark``) over a ``file`` L3 with a size
cap, driven through the request verbs with no model (an agentic-shaped trace: sessions
sharing a system prompt, each turn a tool result plus the previous answer, interleaved
with unique one-off prompts; ``--seed`` fixes it, so every policy serves the same
requests; ``watermark:0.5`` names a high mark). Per policy: the L3 record bytes written per request served, the distinct
tokens each tier holds and their union (each page once: the tree's pages by their L3
keys, and the L3 directory's records), sampled every ``--sample-every`` requests (mean and
end), the tokens served from each tier and those lost to every tier by L2 eviction.
Policies run in rotated order on each of ``--repeats`` rounds. Units: tokens, bytes.
Method and figures: ``docs/benchmarks/write-policies.md``.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hicache.bench.plot import plot_setups
from hicache.bench.report import print_table, write_json
from hicache.cache import HiCache
from hicache.cache.l3.keys import TierKeys
from hicache.cache.report import cache_stats
from hicache.config import CacheConfig, IOBackend, PrefetchConfig, PrefetchPolicy, WritePolicy
from hicache.keys import Namespace
from hicache.spec import KVSpec
from hicache.storage.backends.file import TMP_SUFFIX
from hicache.storage.registry import create_storage

__all__ = ["PolicyRun", "Trace", "main", "make_trace", "run_policy"]

SPEC = KVSpec(num_layers=4, num_kv_heads=1, head_dim=64, dtype="float16")
"""1 KiB of KV per token (K and V, 4 layers, 1 head of 64, fp16)."""
POLICIES = tuple(p.value for p in WritePolicy)
VOCAB = 32000


@dataclass(frozen=True)
class Trace:
    """The requests (token ids), in order, and how many of them are one-offs."""

    requests: list[list[int]]
    one_offs: int


def make_trace(
    *,
    sessions: int,
    turns: int,
    system: int,
    tool: int,
    answer: int,
    one_off: int,
    one_off_share: float,
    seed: int,
) -> Trace:
    """Sessions of ``turns`` turns over a shared ``system`` prompt, visited in a random
    interleaving; turn t sends the history plus a ``tool`` result, then the history grows
    by an ``answer`` (computed by the next turn). After each turn, with probability
    ``one_off_share``, a unique prompt of ``one_off`` tokens."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(VOCAB) for _ in range(n)]

    prompt = ids(system)
    history = [list(prompt) for _ in range(sessions)]
    left = [turns] * sessions
    out: list[list[int]] = []
    ones = 0
    while any(left):
        s = rng.choice([i for i, n in enumerate(left) if n])
        left[s] -= 1
        history[s] += ids(tool)
        out.append(list(history[s]))
        history[s] += ids(answer)
        if rng.random() < one_off_share:
            out.append(ids(one_off))
            ones += 1
    return Trace(out, ones)


@dataclass
class PolicyRun:
    """One policy's figures over one trace (tokens unless named; bytes as written)."""

    policy: str
    requests: int
    l3_bytes_written: int
    l3_bytes_per_request: float
    l3_records_written: int
    device_tokens: float
    host_tokens: float
    l3_tokens: float
    union_tokens: float
    end_union_tokens: int
    device_hit_tokens: int
    host_hit_tokens: int
    storage_hit_tokens: int
    computed_tokens: int
    lost_tokens: int
    wall_s: float
    samples: list[dict[str, int]] = field(default_factory=list)


def parse_policy(name: str, threshold: float) -> tuple[WritePolicy, float]:
    """``POLICY`` or ``watermark:THRESHOLD`` -> (policy, high mark); ValueError for an
    unknown policy."""
    policy, _, mark = name.partition(":")
    return WritePolicy(policy), float(mark) if mark else threshold


def run_policy(name: str, trace: Trace, args: argparse.Namespace, root: Path) -> PolicyRun:
    """Serve ``trace`` on a fresh cache with policy ``name`` (:func:`parse_policy`) over
    a fresh capped L3 in ``root``; sample the tiers every ``args.sample_every`` requests."""
    ps = args.page_size
    policy, threshold = parse_policy(name, args.threshold)
    cfg = CacheConfig(
        page_size=ps,
        device_tokens=args.device_tokens,
        hicache_ratio=args.hicache_ratio,
        load_back_threshold=0,
        write_policy=policy,
        write_back_threshold=threshold,
        io_backend=IOBackend.DIRECT,
    )
    cap = args.l3_tokens * SPEC.token_bytes
    ns = Namespace.for_spec(
        SPEC, model="bench", weights_fingerprint="w", layout=cfg.mem_layout, page_size=ps
    )
    storage = create_storage(
        "file", namespace=ns, extra_config={"file_path": str(root), "max_bytes": cap}
    )
    samples: list[dict[str, int]] = []
    start = time.perf_counter()
    with HiCache(cfg, SPEC).start() as cache:
        prefetch = PrefetchConfig(policy=PrefetchPolicy.WAIT_COMPLETE, prefetch_threshold=0)
        tier = cache.l3.attach(storage, ns, prefetch)
        for i, tokens in enumerate(trace.requests):
            _serve(cache, tokens, args.steps_per_request, args.step_ms / 1000)
            if (i + 1) % args.sample_every == 0 or i + 1 == len(trace.requests):
                samples.append(_sample(cache, root, tier.keys, ps))
        cache.sync(wait=True)
        wall = time.perf_counter() - start
        s = cache_stats(cache)
        written = s.storage.bytes_written
        records = s.storage.set_written
        c = s.counters
    n = len(trace.requests)

    def mean(key: str) -> float:
        return statistics.fmean(x[key] for x in samples)

    hits = c["device_hit_tokens_total"] + c["host_hit_tokens_total"]
    return PolicyRun(
        policy=name,
        requests=n,
        l3_bytes_written=written,
        l3_bytes_per_request=written / n,
        l3_records_written=records,
        device_tokens=mean("device"),
        host_tokens=mean("host"),
        l3_tokens=mean("l3"),
        union_tokens=mean("union"),
        end_union_tokens=samples[-1]["union"],
        device_hit_tokens=c["device_hit_tokens_total"],
        host_hit_tokens=c["host_hit_tokens_total"],
        storage_hit_tokens=c["storage_hit_tokens_total"],
        computed_tokens=c["query_tokens_total"] - hits - c["storage_hit_tokens_total"],
        lost_tokens=c["l3_unstored_evicted_tokens_total"],
        wall_s=wall,
        samples=samples,
    )


def _serve(cache: HiCache, tokens: list[int], steps: int, step_s: float) -> None:
    """One request as an engine runs it, with no model: a step's sync, open (with its L3
    prefetch), wait for it, admit (load back), wait for the layers, ``steps`` more steps
    of ``step_s`` seconds each (its decode: the copies and writes in flight go on
    meanwhile), release keeping its KV."""
    cache.sync()
    req = cache.open(tokens, compute_last=False)
    while not cache.ready(req):
        time.sleep(0.0002)
        cache.sync()
    if not cache.admit(req, tokens):
        cache.release(req)
        return
    for layer in range(SPEC.num_layers):
        req.wait_layer(layer, 30.0)
    for _ in range(steps):
        time.sleep(step_s)
        cache.sync()
    cache.release(req, tokens)


def _sample(cache: HiCache, root: Path, keys: TierKeys, page_size: int) -> dict[str, int]:
    """Distinct tokens per tier and in their union, each page once: L1 and L2 the tree's
    pages, L3 the records in its directory (one per page: a per-rank namespace), the
    union the tree's page keys and the L3 records together."""
    tree = cache.full.pages.tree
    in_tree: set[str] = set()
    device = host = 0
    for n in tree.iter_nodes():
        k = tree.num_pages(n)
        device += k if n.device is not None else 0
        host += k if n.host is not None else 0
        path = keys.of(tree.path_key(n), n.tenant)
        in_tree.update(key.key for key in path[len(path) - k :])
    l3 = {
        e.name
        for sub in os.scandir(root)
        if sub.is_dir()
        for e in os.scandir(sub.path)
        if not e.name.endswith(TMP_SUFFIX)
    }
    return {
        "device": device * page_size,
        "host": host * page_size,
        "l3": len(l3) * page_size,
        "union": len(in_tree | l3) * page_size,
    }


def _rows(runs: Sequence[PolicyRun]) -> list[list[str]]:
    return [
        [
            r.policy,
            f"{r.l3_bytes_per_request / 1024:.0f}",
            f"{r.device_tokens:.0f}",
            f"{r.host_tokens:.0f}",
            f"{r.l3_tokens:.0f}",
            f"{r.union_tokens:.0f}",
            f"{r.end_union_tokens}",
            f"{r.device_hit_tokens + r.host_hit_tokens}",
            f"{r.storage_hit_tokens}",
            f"{r.computed_tokens}",
            f"{r.lost_tokens}",
        ]
        for r in runs
    ]


COLUMNS = [
    "policy",
    "L3 KiB/req",
    "L1 tok",
    "L2 tok",
    "L3 tok",
    "union tok",
    "union end",
    "L1+L2 hit",
    "L3 hit",
    "computed",
    "lost",
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hicache bench write-policies", description=__doc__)
    p.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help="comma-separated; watermark:0.5 sets its high mark (else --threshold)",
    )
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--device-tokens", type=int, default=2048, help="L1 size")
    p.add_argument("--hicache-ratio", type=float, default=4.0, help="L2 = ratio x L1")
    p.add_argument("--l3-tokens", type=int, default=12288, help="L3 cap in tokens of KV")
    p.add_argument("--threshold", type=float, default=0.8, help="watermark's high mark")
    p.add_argument("--sessions", type=int, default=12)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system", type=int, default=256, help="shared system prompt tokens")
    p.add_argument("--tool", type=int, default=160, help="tool result tokens per turn")
    p.add_argument("--answer", type=int, default=48, help="answer tokens per turn")
    p.add_argument("--one-off", type=int, default=512, help="tokens of a one-off prompt")
    p.add_argument("--one-off-share", type=float, default=0.5)
    p.add_argument("--steps-per-request", type=int, default=4, help="syncs per request")
    p.add_argument("--step-ms", type=float, default=5.0, help="a step's time (a forward)")
    p.add_argument("--sample-every", type=int, default=8, help="requests between samples")
    p.add_argument("--repeats", type=int, default=2, help="rounds, policy order rotated")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of the rounds' means")
    args = p.parse_args(argv)
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    for x in policies:
        parse_policy(x, args.threshold)  # ValueError naming an unknown policy
    trace = make_trace(
        sessions=args.sessions,
        turns=args.turns,
        system=args.system,
        tool=args.tool,
        answer=args.answer,
        one_off=args.one_off,
        one_off_share=args.one_off_share,
        seed=args.seed,
    )
    total = sum(len(r) for r in trace.requests)
    print(
        f"{len(trace.requests)} requests ({trace.one_offs} one-offs), {total} prompt tokens;"
        f" L1 {args.device_tokens}, L2 {int(args.device_tokens * args.hicache_ratio)},"
        f" L3 cap {args.l3_tokens} tokens; page {args.page_size}"
    )
    rounds: list[list[PolicyRun]] = []
    for rep in range(args.repeats):
        order = policies[rep % len(policies) :] + policies[: rep % len(policies)]
        runs = {}
        for policy in order:
            with tempfile.TemporaryDirectory(prefix="hicache-wp-") as d:
                runs[policy] = run_policy(policy, trace, args, Path(d))
        rounds.append([runs[x] for x in policies])
        print_table(f"round {rep + 1} (order {', '.join(order)})", COLUMNS, _rows(rounds[-1]))
    if args.json:
        write_json(
            args.json,
            {
                "args": vars(args),
                "requests": len(trace.requests),
                "one_offs": trace.one_offs,
                "prompt_tokens": total,
                "rounds": [[asdict(r) for r in rr] for rr in rounds],
            },
        )
    if args.plot:
        plot_setups(
            args.plot,
            title=f"write policies: {len(trace.requests)} requests, rounds' mean",
            panels=_panels(policies, rounds),
        )
    return 0


def _panels(
    policies: Sequence[str], rounds: Sequence[Sequence[PolicyRun]]
) -> dict[str, dict[str, float | None]]:
    """The plot's panels: per policy, the rounds' mean of three figures."""

    def mean(i: int, f: str) -> float:
        return statistics.fmean(float(getattr(rr[i], f)) for rr in rounds)

    figures = {
        "L3 KiB written per request": ("l3_bytes_per_request", 1 / 1024),
        "distinct tokens, L1+L2+L3 (mean)": ("union_tokens", 1.0),
        "prompt tokens computed": ("computed_tokens", 1.0),
    }
    return {
        label: {p: mean(i, f) * scale for i, p in enumerate(policies)}
        for label, (f, scale) in figures.items()
    }


if __name__ == "__main__":
    raise SystemExit(main())
