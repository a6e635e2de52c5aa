"""``hicache bench detok``: what turning tokens into text costs the engine per decode step.

``--requests`` requests each receive ``--tokens`` output ids, one per step, as in a decode
batch; each step does what the scheduler does for every request: the token checks, the
text (detokenization and a stop-string search: every request has one stop string that
never occurs) and the report (:class:`~hicache.engine.step.output.OutputProcessor`). Outputs
are the SmolLM2 tokenizer's ids of English text with some multi-byte characters, each
request its own slice. Decoding ``full`` (every output id again at each step: the engine
before incremental detokenization) against ``incremental`` (a window of a few ids).
Figures are ms of CPU per step for the whole batch, the mean over the run and over its
first and last 64 steps, best of ``--repeat``.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass
from typing import Any

from hicache.bench.report import print_table, write_json

TEXT = (
    "Hierarchical caches keep the key and value tensors of shared prefixes in GPU memory, "
    "host memory and remote storage, so that a long conversation does not pay for its "
    "prefill twice. Les caches hiérarchiques gardent les préfixes partagés; 分层缓存 "
    "保存共享前缀 🙂. Each tier is larger and slower than the one before it.\n\n"
)
WINDOW = 64
"""Steps averaged at the start and at the end of a run."""


@dataclass(frozen=True)
class DetokRun:
    mode: str
    requests: int
    tokens: int
    step_ms_mean: float
    step_ms_first: float
    step_ms_last: float

    @property
    def us_per_token(self) -> float:
        return self.step_ms_mean * 1e3 / self.requests


def outputs(tokenizer: Any, requests: int, tokens: int) -> list[list[int]]:
    """``requests`` id lists of ``tokens`` ids each, from different offsets of the text."""
    text = TEXT * (tokens // 40 + requests)
    ids = [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]
    return [ids[7 * i : 7 * i + tokens] for i in range(requests)]


def run_one(tokenizer: Any, seqs: list[list[int]], incremental: bool) -> list[float]:
    """Seconds per step over the batch, every step."""
    from hicache.engine.request import Request
    from hicache.engine.sampling import SamplingParams
    from hicache.engine.step.output import OutputProcessor

    tokens = len(seqs[0])
    processor = OutputProcessor(tokenizer, [], 1 << 20, incremental=incremental)
    params = SamplingParams(max_tokens=tokens, stop=["<never seen>"])
    reqs = [Request([1, 2, 3], params) for _ in seqs]
    steps: list[float] = []
    for step in range(tokens):
        t0 = time.perf_counter()
        for req, seq in zip(reqs, seqs, strict=True):
            req.output_ids.append(seq[step])
            processor.check_token(req)
            processor.update_text(req)
            processor.report(req)
        steps.append(time.perf_counter() - t0)
    for req, seq in zip(reqs, seqs, strict=True):  # the work was the real thing
        if req.text != tokenizer.decode(seq, skip_special_tokens=True):
            raise AssertionError(f"{req.rid}: the text is not the full decode")
    return steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hicache bench detok", description=__doc__)
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=512, help="output ids per request")
    parser.add_argument("--repeat", type=int, default=3, help="keep the fastest of N runs")
    parser.add_argument("--model", default=None, help="whose tokenizer (default SmolLM2)")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from hicache.runner.checkpoints import resolve_checkpoint

    path = resolve_checkpoint(args.model).path
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    seqs = outputs(tokenizer, args.requests, args.tokens)
    runs: list[DetokRun] = []
    for mode in ("full", "incremental"):
        trials = [run_one(tokenizer, seqs, mode == "incremental") for _ in range(args.repeat)]
        best = min(trials, key=sum)
        w = min(WINDOW, len(best))
        runs.append(
            DetokRun(
                mode=mode,
                requests=args.requests,
                tokens=args.tokens,
                step_ms_mean=sum(best) / len(best) * 1e3,
                step_ms_first=sum(best[:w]) / w * 1e3,
                step_ms_last=sum(best[-w:]) / w * 1e3,
            )
        )
    print_table(
        f"Output processing, {args.requests} requests x {args.tokens} tokens: ms per step",
        ["decode", "mean", f"first {WINDOW}", f"last {WINDOW}", "µs per token"],
        [
            [
                r.mode,
                f"{r.step_ms_mean:.3f}",
                f"{r.step_ms_first:.3f}",
                f"{r.step_ms_last:.3f}",
                f"{r.us_per_token:.1f}",
            ]
            for r in runs
        ],
    )
    if args.json:
        write_json(args.json, {"runs": [asdict(r) for r in runs]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
