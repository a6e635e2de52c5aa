"""``hicache bench engine``: the engine's model runner next to transformers, in one run.

On the same checkpoint, dtype and device, each the best of ``--repeat``: **prefill** (one
forward of a ``--prefill-tokens`` prompt: :class:`ModelRunner` over a fresh paged L1 pool
against ``model(input_ids, use_cache=False)``) and **decode** (``--decode-seqs`` sequences
of ``--decode-context`` tokens, ``--decode-steps`` greedy steps: one runner forward per step
and ``--attention-backends`` entry, plus CUDA-graph rows with ``--cuda-graphs``, against
``generate`` with a static cache, timed as ``generate(steps + 1) - generate(1)``). The ratio
is transformers' time over ours (> 1: the engine is faster). Units: seconds, ms per decode
step (one token of every sequence), tokens/s; ``--json PATH`` writes them. The method in
full: ``docs/benchmarks/engine.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from hicache.bench.report import print_table
from hicache.engine.step.graph_setup import GraphSetup, enable_decode_graphs, probe_page_count
from hicache.memory import DevicePool
from hicache.runner.kernels import AttentionBackend, resolve_backend
from hicache.runner.loader import LoadedModel, load_model
from hicache.runner.model_runner import ForwardBatch, ModelRunner, kv_spec_from_hf_config

PAGE = 16


@dataclass(frozen=True)
class EngineRun:
    """One measurement: ours and transformers' seconds for the same work."""

    name: str
    tokens: int
    ours_s: float
    hf_s: float
    steps: int = 1
    """Forwards timed in ``ours_s`` (decode steps; 1 for the prefill)."""

    @property
    def ratio(self) -> float:
        return self.hf_s / self.ours_s

    @property
    def ms_per_step(self) -> float:
        """Our milliseconds per forward."""
        return self.ours_s * 1000 / self.steps


@dataclass(frozen=True)
class DecodeTiming:
    """:func:`decode`'s seconds, and what turning CUDA graphs on did (None: not asked)."""

    seconds: float
    graphs: GraphSetup | None = None


def _best(fn: Callable[[], object], repeat: int, sync: Callable[[], None]) -> float:
    times = []
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return min(times)


def _pool(lm: LoadedModel, tokens: int, device: str) -> DevicePool:
    spec = kv_spec_from_hf_config(lm.hf_config, lm.dtype)
    return DevicePool(spec, math.ceil(tokens / PAGE) + 1, PAGE, device)


def _slots(seq: int, length: int, pages_per_seq: int) -> torch.Tensor:
    t = torch.arange(length)
    return (seq * pages_per_seq + t // PAGE) * PAGE + t % PAGE


def prefill(lm: LoadedModel, hf: Any, n: int, repeat: int, sync: Callable[[], None]) -> EngineRun:
    device = str(lm.model.device)
    runner = ModelRunner(lm.model, _pool(lm, n, device))
    ids = torch.randint(100, int(lm.hf_config.vocab_size), (n,))
    batch = ForwardBatch(
        input_ids=ids, positions=torch.arange(n), extend_lens=[n], seq_slots=[_slots(0, n, 0)]
    )
    ours = _best(lambda: runner.forward(batch), repeat, sync)
    hf_ids = ids[None, :].to(device)
    with torch.inference_mode():
        theirs = _best(lambda: hf(hf_ids, use_cache=False), repeat, sync)
    return EngineRun("prefill", n, ours, theirs)


def decode(
    lm: LoadedModel,
    seqs: int,
    context: int,
    steps: int,
    repeat: int,
    sync: Callable[[], None],
    backend: str = "auto",
    cuda_graphs: bool = False,
) -> DecodeTiming:
    """Seconds of ``steps`` decode forwards of ``seqs`` sequences of ``context`` tokens
    (the prefill untimed), with the ``backend`` decode attention; best of ``repeat``.
    ``cuda_graphs``: the steps replay CUDA graphs when they can be used (captured and
    probed first, untimed; the pool's last pages serve as their scratch and probe pages),
    else run eagerly; :attr:`DecodeTiming.graphs` says which."""
    device = str(lm.model.device)
    per_seq = math.ceil((context + steps) / PAGE)
    used, probe = seqs * per_seq, probe_page_count(PAGE, per_seq)
    pool = _pool(lm, (used + 1 + probe) * PAGE, device)
    runner = ModelRunner(lm.model, pool, attention_backend=backend)
    setup = None
    if cuda_graphs:
        setup = enable_decode_graphs(
            runner,
            scratch_page=used,
            probe_pages=list(range(used + 1, used + 1 + probe)),
            max_bs=seqs,
            table_width=per_seq,
        )
    prompts = torch.randint(100, int(lm.hf_config.vocab_size), (seqs, context))

    def ours() -> None:
        batch = ForwardBatch(
            input_ids=prompts.reshape(-1),
            positions=torch.arange(context).repeat(seqs),
            extend_lens=[context] * seqs,
            seq_slots=[_slots(i, context, per_seq) for i in range(seqs)],
        )
        nxt = runner.forward(batch).argmax(-1).cpu()
        sync()
        t0 = time.perf_counter()
        for step in range(steps):
            pos = context + step
            batch = ForwardBatch(
                input_ids=nxt,
                positions=torch.full((seqs,), pos),
                extend_lens=[1] * seqs,
                seq_slots=[_slots(i, pos + 1, per_seq) for i in range(seqs)],
            )
            nxt = runner.forward(batch).argmax(-1).cpu()
        sync()
        timed.append(time.perf_counter() - t0)

    timed: list[float] = []
    for _ in range(repeat):
        ours()
    return DecodeTiming(min(timed), setup)


def hf_decode(
    lm: LoadedModel,
    hf: Any,
    seqs: int,
    context: int,
    steps: int,
    repeat: int,
    sync: Callable[[], None],
) -> float:
    """transformers' seconds for the same decode steps: ``generate`` with a static cache,
    ``generate(steps + 1) - generate(1)`` so its prefill cancels out."""
    device = str(lm.model.device)
    hf_ids = torch.randint(100, int(lm.hf_config.vocab_size), (seqs, context)).to(device)

    def generate(new: int) -> None:
        hf.generate(
            hf_ids,
            attention_mask=torch.ones_like(hf_ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            cache_implementation="static",
            pad_token_id=0,
        )

    with torch.inference_mode():
        generate(2)  # warm-up: builds the static cache
        full = _best(lambda: generate(steps + 1), repeat, sync)
        first = _best(lambda: generate(1), repeat, sync)
    return max(full - first, 1e-9)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hicache bench engine", description=__doc__)
    parser.add_argument("--model-path", default=None, help="default: the bundled SmolLM2-135M")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prefill-tokens", type=int, default=1024)
    parser.add_argument("--decode-seqs", type=int, default=8)
    parser.add_argument("--decode-context", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3, help="keep the fastest of N runs")
    parser.add_argument(
        "--attention-backends",
        default="auto",
        help="comma-separated decode attention backends, one decode row each (auto, sdpa, triton)",
    )
    parser.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="add a decode row replaying CUDA graphs for each backend that resolves to triton",
    )
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    lm = load_model(args.model_path, dtype=args.dtype, device=args.device)
    hf = AutoModelForCausalLM.from_pretrained(
        lm.path, dtype=getattr(torch, args.dtype), local_files_only=True
    )
    hf = hf.to(args.device).eval()
    cuda = torch.device(args.device).type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    runs = [prefill(lm, hf, args.prefill_tokens, args.repeat, sync)]
    shape = (args.decode_seqs, args.decode_context, args.decode_steps, args.repeat, sync)
    theirs = hf_decode(lm, hf, *shape)
    tokens, steps = args.decode_seqs * args.decode_steps, args.decode_steps
    graphs: dict[str, dict[str, Any]] = {}
    for backend in [b.strip() for b in args.attention_backends.split(",") if b.strip()]:
        ours = decode(lm, *shape, backend=backend)
        name = "decode" if backend == "auto" else f"decode ({backend})"
        runs.append(EngineRun(name, tokens, ours.seconds, theirs, steps))
        if not args.cuda_graphs:
            continue
        if resolve_backend(backend, lm.model.device) is not AttentionBackend.TRITON:
            print(f"decode ({backend}) with CUDA graphs: not run (graphs need triton attention)")
            continue
        with_graphs = decode(lm, *shape, backend=backend, cuda_graphs=True)
        setup = with_graphs.graphs
        assert setup is not None
        graphs[backend] = asdict(setup)
        if not setup.enabled:
            print(f"decode ({backend}) with CUDA graphs: not run ({setup.reason})")
            continue
        label = f"decode ({backend}, cuda graphs)"
        runs.append(EngineRun(label, tokens, with_graphs.seconds, theirs, steps))
    print_table(
        f"engine vs transformers: {lm.name}, {args.dtype}, {args.device} (best of {args.repeat})",
        ["phase", "tokens", "ours s", "ours ms/step", "transformers s", "ours tok/s",
         "ratio (theirs/ours)"],
        [
            [
                r.name,
                str(r.tokens),
                f"{r.ours_s:.4f}",
                f"{r.ms_per_step:.2f}",
                f"{r.hf_s:.4f}",
                f"{r.tokens / r.ours_s:.0f}",
                f"{r.ratio:.2f}x",
            ]
            for r in runs
        ],
    )  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"model": lm.name, "dtype": args.dtype, "device": args.device,
                 "runs": [{**asdict(r), "ratio": r.ratio, "ms_per_step": r.ms_per_step}
                          for r in runs],
                 "cuda_graphs": graphs},
                f,
                indent=2,
            )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
