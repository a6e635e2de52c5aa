"""Greedy continuations of chat prompts: the engine against transformers, fp32 and bf16.

For each of :data:`PROMPTS` (rendered with the model's chat template) both run greedy
decoding of ``--max-tokens`` tokens (EOS ignored, so every run has the same length):
transformers' ``generate`` in fp32 (the reference) and bf16, and the engine
(:class:`hicache.engine.front.engine.Engine`) in fp32 and bf16, on ``--device``.

In bf16 a greedy continuation can leave the fp32 one without a defect (a near tie flips),
so the check is relative: the engine in bf16 must agree with the fp32 reference on at
least as many prompts as transformers' own bf16 does, and the engine in fp32 on all but
at most ``--fp32-slack`` prompts. Writes the continuations and counts as JSON
(``--json``); exit status 0 when both hold, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

PROMPTS: tuple[str, ...] = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 50.",
    "How do I reverse a list in Python?",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
    "Give me a short recipe for pancakes.",
    "Summarize the plot of Romeo and Juliet in one sentence.",
)
"""Nine chat prompts (one user turn each)."""


def _encode(tokenizer: Any, prompt: str) -> list[int]:
    msgs = [{"role": "user", "content": prompt}]
    ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def hf_greedy(
    model_dir: Path, dtype: str, device: str, prompts: list[list[int]], n: int
) -> list[list[int]]:
    """transformers' greedy continuations (``n`` new tokens each, EOS ignored)."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model = model.to(device)
    model.eval()
    outs = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids], device=device)
            y = model.generate(
                x, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
            )
            outs.append(y[0, len(ids) :].tolist())
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return outs


def engine_greedy(
    model_dir: Path, dtype: str, device: str, prompts: list[list[int]], n: int
) -> list[list[int]]:
    """The engine's greedy continuations, all prompts submitted at once (one batch)."""
    from concurrent.futures import ThreadPoolExecutor

    from hicache.engine.front.engine import Engine, EngineConfig
    from hicache.engine.sampling import SamplingParams

    engine = Engine(EngineConfig(model_path=str(model_dir), dtype=dtype, device=device)).start()
    try:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        with ThreadPoolExecutor(len(prompts)) as ex:
            futs = [ex.submit(engine.generate, ids, params) for ids in prompts]
            return [list(f.result().output_ids) for f in futs]
    finally:
        engine.close()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", type=Path, required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--fp32-slack", type=int, default=1)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model_path, local_files_only=True)
    prompts = [_encode(tok, s) for s in PROMPTS]
    t0 = time.perf_counter()
    runs = {
        "hf_fp32": hf_greedy(args.model_path, "float32", args.device, prompts, args.max_tokens),
        "hf_bf16": hf_greedy(args.model_path, "bfloat16", args.device, prompts, args.max_tokens),
        "engine_fp32": engine_greedy(
            args.model_path, "float32", args.device, prompts, args.max_tokens
        ),
        "engine_bf16": engine_greedy(
            args.model_path, "bfloat16", args.device, prompts, args.max_tokens
        ),
    }
    ref = runs["hf_fp32"]
    agree = {k: sum(a == b for a, b in zip(v, ref, strict=True)) for k, v in runs.items()}
    ok = (
        agree["engine_bf16"] >= agree["hf_bf16"]
        and agree["engine_fp32"] >= len(prompts) - args.fp32_slack
    )
    result = {
        "device": args.device,
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "agree_with_hf_fp32": agree,
        "ok": ok,
        "seconds": round(time.perf_counter() - t0, 1),
        "continuations": runs,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "continuations"}))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
