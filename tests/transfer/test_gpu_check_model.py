"""The GPU check's model builder (scripts/make_random_model.py) in its tiny CPU shape."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import torch

from hicache.runner.checkpoints import resolve_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def _script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tiny_random_model_loads_with_the_smollm2_tokenizer(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    make = _script("make_random_model")
    tok_dir = resolve_checkpoint("tiny-random-llama").path  # the real SmolLM2 tokenizer
    out = tmp_path / "model"
    assert (
        make.main(["--tokenizer", str(tok_dir), "--out", str(out), "--tiny", "--device", "cpu"])
        == 0
    )
    summary = json.loads((out / "random_model.json").read_text())
    assert summary["vocab_size"] == 49152 and summary["num_key_value_heads"] == 2
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    assert sum(p.numel() for p in model.parameters()) == summary["params"]
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) == 49152
    # the 1B shape the GPU check builds: hidden 2048, 16 layers, 32 heads, 8 KV heads
    assert make.SHAPES["1b"] == dict(
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=8192,
    )
