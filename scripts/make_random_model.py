"""Build a random-weight Llama-shaped model into a local Hugging Face directory.

The GPU check (``scripts/gpu-check.sh``) serves a 1B Llama-shaped model that is built on
the GPU machine itself (nothing can be downloaded there): hidden 2048, 16 layers, 32 heads,
8 KV heads, intermediate 8192, tied embeddings, with the SmolLM2 tokenizer (vocab 49152),
about 1.07 B parameters. ``--tiny`` builds the same shape family at test size (hidden 64,
2 layers, 4 heads, 2 KV heads) for the CPU smoke run and the unit test.

Weights are seeded (``--seed``) and drawn on ``--device`` (a 1B model in fp32 on a GPU
takes about a second), then saved as ``model.safetensors`` in ``--dtype``, together with
the tokenizer files from ``--tokenizer``. Usage::

    python scripts/make_random_model.py --tokenizer TOKDIR --out DIR [--tiny]
        [--dtype bfloat16] [--device cuda] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

SHAPES: dict[str, dict[str, Any]] = {
    "1b": dict(
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=8192,
    ),
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
    ),
}
"""Model shapes by name (``--tiny`` picks ``tiny``)."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
"""Files copied from the tokenizer directory (the ones that exist)."""


def build(
    tokenizer_dir: Path,
    out: Path,
    *,
    shape: str = "1b",
    dtype: str = "bfloat16",
    device: str = "cpu",
    seed: int = 0,
    max_positions: int = 8192,
) -> dict[str, Any]:
    """Write the model to ``out`` (created; must not exist or be empty) and return a
    summary: parameter count, seconds, dtype, shape."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.02,
        **SHAPES[shape],
    )
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        if torch.device(device).type == "cuda":
            torch.cuda.manual_seed(seed)
        model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty")
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    params = sum(p.numel() for p in model.parameters())
    summary = {
        "shape": shape,
        **SHAPES[shape],
        "vocab_size": config.vocab_size,
        "params": params,
        "dtype": dtype,
        "device": device,
        "seconds": round(time.perf_counter() - t0, 2),
        "out": str(out),
    }
    (out / "random_model.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", type=Path, required=True, help="dir with tokenizer.json")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tiny", action="store_true", help="test-size shape")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    summary = build(
        args.tokenizer,
        args.out,
        shape="tiny" if args.tiny else "1b",
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
    )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
