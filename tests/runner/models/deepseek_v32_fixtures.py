"""A tiny random DeepSeek-V3.2 checkpoint (written once, then reused), its engine and
transformers copies, prompts and the reference logits / greedy tokens.

DeepSeek-V3's shape of the DeepSeek fixtures (q LoRA, sigmoid router with a random bias
and group top-k, interleaved RoPE on the MLA), with a DSA indexer of 16 heads of 16 values
keeping ``index_topk = 6`` tokens per query: prompts of 15 to 30 tokens really run sparse
(16 heads: an exactly-zero score, where ties at the top-k boundary would be broken
arbitrarily by transformers' ``torch.topk``, practically never happens).
Norm weights (the indexer's LayerNorm included) and the router bias are randomized so a
comparison of logits notices one that is ignored.
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from hicache.runner.checkpoints import materialize, models_dir
from hicache.runner.loader import LoadedHybridModel, load_model
from tests.runner.models.deepseek_fixtures import write_seeded

SEED = 8642
VERSION = 2
TOPK = 6


def _config(vocab_size: int) -> Any:
    from transformers import DeepseekV32Config

    return DeepseekV32Config(
        vocab_size=vocab_size, hidden_size=48, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
        q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
        n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
        norm_topk_prob=True, routed_scaling_factor=2.5, first_k_dense_replace=1,
        index_n_heads=16, index_head_dim=16, index_topk=TOPK, max_position_embeddings=2048,
        initializer_range=0.1, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
        pad_token_id=None,
    )  # fmt: skip


def _init(name: str, p: torch.nn.Parameter) -> None:
    """Norm weights ``N(1, 0.2)`` and biases ``N(0, 0.2)``; the indexer's other weights
    ``N(0, 0.3)``, scores spread wide enough to rank tokens."""
    if name.endswith("norm.weight"):
        p.normal_(1.0, 0.2)
    elif name.endswith("norm.bias"):
        p.normal_(0.0, 0.2)
    elif ".indexer." in name:
        p.normal_(0.0, 0.3)


def _write(tmp: Path) -> None:
    write_seeded(tmp, _config, SEED, _init)


@cache
def checkpoint() -> Path:
    """The directory of the tiny DeepSeek-V3.2 (:data:`VERSION` names its config)."""
    out = models_dir() / f"tiny-random-deepseek-v32-v{VERSION}"
    return materialize(out, _write)


@cache
def v32_model() -> LoadedHybridModel:
    """The engine's fp32 CPU copy, loaded once."""
    loaded = load_model(str(checkpoint()), dtype="float32", device="cpu")
    assert isinstance(loaded, LoadedHybridModel)
    return loaded


@cache
def hf_twin() -> Any:
    """transformers' model over the same directory, fp32, eval."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        checkpoint(), dtype=torch.float32, local_files_only=True
    ).eval()


def prompt(n: int, offset: int = 0) -> list[int]:
    """``n`` real token ids, starting ``offset`` tokens into a fixed text."""
    text = (
        "Sparse attention scores every cached token with a small indexer and attends to "
        "the best few, so the indexer keys of every page must be cached with the KV. " * 4
    )
    ids = v32_model().tokenizer(text)["input_ids"][offset : offset + n]
    assert len(ids) == n
    return list(ids)


@cache
def _hf_logits(ids: tuple[int, ...]) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = hf_twin()(torch.tensor([ids])).logits[0].float()
    return out


def hf_logits(ids: list[int]) -> torch.Tensor:
    """transformers' logits at every position of ``ids``: ``(n, vocab)``."""
    return _hf_logits(tuple(ids))


@cache
def _hf_greedy(ids: tuple[int, ...], n: int) -> tuple[int, ...]:
    with torch.no_grad():
        out = hf_twin().generate(
            torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False
        )
    return tuple(out[0, len(ids) :].tolist())


def hf_greedy(ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of ``ids`` (exactly ``n`` tokens)."""
    return list(_hf_greedy(tuple(ids), n))
