"""Tiny random DeepSeek-V2/V3 checkpoints (written once, then reused), their engine and
transformers copies, prompts and the reference logits / greedy tokens.

Each variant switches on the features under test at sizes where a forward takes
milliseconds: V2 with and without q LoRA, greedy and group-limited greedy routing; V3
with its sigmoid router (random score-correction bias, groups), YaRN RoPE with
``mscale``/``mscale_all_dim``, and the non-interleaved rope layout. Norm weights and
the biases are randomized (transformers initializes them to 1 and 0) so a test
comparing logits notices when one is ignored. The tokenizer is the tiny Llama's (the
bundled SmolLM2 one).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from hicache.runner.checkpoints import materialize, models_dir, resolve_checkpoint
from hicache.runner.loader import LoadedHybridModel, load_model

SEED = 4321
VERSION = 2

VARIANTS: tuple[str, ...] = ("v2-lite", "v2-qlora-grouped", "v3", "v3-yarn")
"""``v2-lite``: no q LoRA, greedy softmax router (DeepSeek-V2-Lite's shape);
``v2-qlora-grouped``: q LoRA, group-limited greedy, tied embeddings; ``v3``: q LoRA,
sigmoid router with bias and group top-k, ``norm_topk_prob``, interleaved RoPE;
``v3-yarn``: no q LoRA, YaRN with mscale, rope not interleaved, one group, attention
biases."""


def _config(variant: str, vocab_size: int) -> Any:
    from transformers import DeepseekV2Config, DeepseekV3Config

    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=48,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=12,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        max_position_embeddings=2048,
        initializer_range=0.1,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=None,
    )
    if variant == "v2-lite":
        return DeepseekV2Config(
            q_lora_rank=None, n_routed_experts=4, topk_method="greedy", **common
        )
    if variant == "v2-qlora-grouped":
        return DeepseekV2Config(
            q_lora_rank=24,
            n_routed_experts=8,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=1.5,
            tie_word_embeddings=True,
            **common,
        )
    if variant == "v3":
        return DeepseekV3Config(
            q_lora_rank=24,
            n_routed_experts=8,
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            rope_interleave=True,
            **common,
        )
    if variant == "v3-yarn":
        return DeepseekV3Config(
            q_lora_rank=None,
            n_routed_experts=4,
            n_group=1,
            topk_group=1,
            norm_topk_prob=False,
            routed_scaling_factor=1.0,
            rope_interleave=False,
            attention_bias=True,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "original_max_position_embeddings": 256,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 0.9,
                "mscale_all_dim": 0.8,
            },
            **common,
        )
    raise ValueError(f"unknown DeepSeek variant {variant!r}; choose one of {VARIANTS}")


def write_seeded(
    tmp: Path,
    config_of: Callable[[int], Any],
    seed: int,
    init: Callable[[str, torch.nn.Parameter], None],
) -> None:
    """Write into ``tmp`` a random DeepSeek checkpoint of ``config_of(vocab size)`` with
    tiny-random-llama's tokenizer: transformers' init under ``seed``, then ``init(name,
    parameter)`` on every parameter and the routers' score-correction bias drawn from
    ``N(0, 0.2)`` (transformers zeroes it), all inside a forked RNG."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        resolve_checkpoint("tiny-random-llama").path, local_files_only=True
    )
    config = config_of(len(tokenizer))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                init(name, p)
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.normal_(0.0, 0.2)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)


def _init(name: str, p: torch.nn.Parameter) -> None:
    """Norm weights ``N(1, 0.2)``, biases ``N(0, 0.2)`` (transformers makes them 1 and 0)."""
    if name.endswith("norm.weight"):
        p.normal_(1.0, 0.2)
    elif name.endswith(".bias"):
        p.normal_(0.0, 0.2)


def _write(variant: str, tmp: Path) -> None:
    write_seeded(tmp, lambda vocab: _config(variant, vocab), SEED, _init)


@cache
def checkpoint(variant: str) -> Path:
    """The directory of tiny DeepSeek ``variant`` (written on first use, then reused;
    :data:`VERSION` names the fixture's configs, bump it when they change)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown DeepSeek variant {variant!r}; choose one of {VARIANTS}")
    out = models_dir() / f"tiny-random-deepseek-{variant}-v{VERSION}"
    return materialize(out, lambda tmp: _write(variant, tmp))


@cache
def deepseek_model(variant: str) -> LoadedHybridModel:
    """The engine's fp32 CPU copy of tiny DeepSeek ``variant``, loaded once."""
    loaded = load_model(str(checkpoint(variant)), dtype="float32", device="cpu")
    assert isinstance(loaded, LoadedHybridModel)
    return loaded


@cache
def hf_twin(variant: str) -> Any:
    """transformers' model over the same directory, fp32, eval."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        checkpoint(variant), dtype=torch.float32, local_files_only=True
    ).eval()


def prompt(variant: str, n: int, offset: int = 0) -> list[int]:
    """``n`` real token ids, starting ``offset`` tokens into a fixed text."""
    text = (
        "Multi-head latent attention keeps one compressed latent per token and layer, "
        "so every tensor-parallel rank stores the same bytes and one of them writes. " * 4
    )
    ids = deepseek_model(variant).tokenizer(text)["input_ids"][offset : offset + n]
    assert len(ids) == n
    return list(ids)


@cache
def _hf_logits(variant: str, ids: tuple[int, ...]) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = hf_twin(variant)(torch.tensor([ids])).logits[0].float()
    return out


def hf_logits(variant: str, ids: list[int]) -> torch.Tensor:
    """transformers' logits at every position of ``ids``: ``(n, vocab)``."""
    return _hf_logits(variant, tuple(ids))


@cache
def _hf_greedy(variant: str, ids: tuple[int, ...], n: int) -> tuple[int, ...]:
    with torch.no_grad():
        out = hf_twin(variant).generate(
            torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False
        )
    return tuple(out[0, len(ids) :].tolist())


def hf_greedy(variant: str, ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of ``ids`` (exactly ``n`` tokens)."""
    return list(_hf_greedy(variant, tuple(ids), n))
