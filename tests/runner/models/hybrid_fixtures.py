"""Tiny hybrid models (engine copy and transformers twin) and a driver for paged forwards."""

from __future__ import annotations

import os
from collections.abc import Mapping
from functools import cache
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from hicache.memory import DevicePool
from hicache.runner.checkpoints import TINY_HYBRID_MODELS
from hicache.runner.loader import LoadedHybridModel, load_hybrid_model
from hicache.runner.models import AttentionContext
from hicache.runner.models.cached import ModelOutput
from hicache.runner.models.recurrent import RecurrentState

HYBRID = TINY_HYBRID_MODELS
PAGE = 4


@cache
def hybrid_model(name: str) -> LoadedHybridModel:
    """The engine's fp32 CPU copy of a tiny hybrid model, loaded once."""
    return load_hybrid_model(name, dtype="float32", device="cpu")


@cache
def hf_twin(name: str) -> Any:
    """transformers' model over the same directory, fp32, eval."""
    from transformers import AutoModelForCausalLM

    path = hybrid_model(name).path
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, local_files_only=True
    ).eval()


def prompt(name: str, n: int, offset: int = 0) -> torch.Tensor:
    """``n`` real token ids (int64 ``(n,)``), starting ``offset`` tokens into the text."""
    text = (
        "Hierarchical caches keep the key and value tensors of shared prefixes in GPU memory, "
        "host memory and remote storage, so that a long conversation does not pay for its "
        "prefill twice. " * 4
    )
    ids = hybrid_model(name).tokenizer(text)["input_ids"][offset : offset + n]
    assert len(ids) == n
    return torch.tensor(ids, dtype=torch.int64)


@cache
def _hf_logits_cached(name: str, ids: tuple[int, ...]) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = hf_twin(name)(torch.tensor([ids])).logits[0].float()
    return out


def hf_logits(name: str, ids: torch.Tensor) -> torch.Tensor:
    """transformers' logits at every position of ``ids (n,)``: ``(n, vocab)``."""
    return _hf_logits_cached(name, tuple(ids.tolist()))


def new_pool(name: str, num_pages: int = 32) -> DevicePool:
    return DevicePool(hybrid_model(name).model.config.kv_spec("float32"), num_pages, PAGE)


def slots_for(pages: list[int], n: int) -> torch.Tensor:
    """Slots of positions ``0 .. n-1`` laid over ``pages`` in order."""
    t = torch.arange(n)
    return torch.tensor(pages, dtype=torch.int64)[t // PAGE] * PAGE + t % PAGE


@torch.no_grad()
def step(
    name: str,
    pool: DevicePool,
    ids: list[torch.Tensor],
    starts: list[int],
    slots: list[torch.Tensor],
    states: Mapping[int, RecurrentState] | None,
) -> tuple[torch.Tensor, ModelOutput]:
    """One forward of several sequences: sequence ``i`` adds ``ids[i]`` at ``starts[i]``;
    ``slots[i]`` covers its positions ``0 .. starts[i] + len(ids[i]) - 1``. Returns the
    logits of every new token ``(T, vocab)`` and the output."""
    model = hybrid_model(name).model
    lens = [len(t) for t in ids]
    ctx = AttentionContext.build(
        pool, [s[: a + n] for s, a, n in zip(slots, starts, lens, strict=True)], lens
    )
    positions = torch.cat([torch.arange(a, a + n) for a, n in zip(starts, lens, strict=True)])
    out = model(torch.cat(ids), positions, ctx, states)
    return model.compute_logits(out.hidden), out
