"""Shared helpers for engine tests: tiny models, their transformers twins, slot layouts,
random pools, and the attention kernels with one deliberate bug (:func:`broken_kernel`).

Models come from the hicache model cache (``$HICACHE_CACHE_DIR``, default
``~/.cache/hicache``); the first use on a machine converts the bundled SmolLM2 GGUF (~20 s).
"""

from __future__ import annotations

import importlib.util
import inspect
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from hicache.memory import DevicePool
from hicache.runner import LoadedModel, ModelRunner, kv_spec_from_hf_config, load_model
from hicache.runner.model_runner import ForwardBatch

TINY = ("tiny-random-llama", "tiny-random-qwen2", "tiny-random-qwen3")


@cache
def engine_model(name: str | None) -> LoadedModel:
    """The engine's fp32 CPU copy of ``name`` (None = the default model), loaded once."""
    return load_model(name, dtype="float32", device="cpu")


@cache
def hf_model(name: str | None) -> Any:
    """transformers' ``AutoModelForCausalLM`` over the same directory, fp32, eval."""
    from transformers import AutoModelForCausalLM

    path = engine_model(name).path
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    return model.eval()


def make_runner(name: str | None, num_pages: int = 32, page_size: int = 4) -> ModelRunner:
    """A runner over a fresh fp32 CPU pool."""
    lm = engine_model(name)
    pool = DevicePool(kv_spec_from_hf_config(lm.hf_config, "float32"), num_pages, page_size)
    return ModelRunner(lm.model, pool)


def slots_for(pages: Sequence[int], page_size: int, num_tokens: int) -> torch.Tensor:
    """Slots of tokens ``0 .. num_tokens-1`` laid over ``pages`` in order: ``(num_tokens,)``."""
    t = torch.arange(num_tokens)
    return torch.tensor(pages, dtype=torch.int64)[t // page_size] * page_size + t % page_size


def paged_batch(
    ids: Sequence[Sequence[int]],
    starts: Sequence[int],
    pages: Sequence[Sequence[int]],
    page_size: int,
) -> ForwardBatch:
    """One forward batch of ``len(ids)`` sequences: sequence ``i`` computes tokens
    ``ids[i]`` at positions ``starts[i] ..``, its slots laid over ``pages[i]`` (its cached
    ``starts[i]`` tokens before them, see :func:`slots_for`)."""
    lens = [len(t) for t in ids]
    return ForwardBatch(
        input_ids=torch.tensor([i for t in ids for i in t]),
        positions=torch.cat([torch.arange(a, a + n) for a, n in zip(starts, lens, strict=True)]),
        extend_lens=lens,
        seq_slots=[
            slots_for(p, page_size, a + n) for p, a, n in zip(pages, starts, lens, strict=True)
        ],
    )


@dataclass(frozen=True)
class RandomPool:
    """One random pool layer and queries for the attention kernel tests: ``q (rows, Hkv *
    group, D)``, ``k``/``v (pages * page_size, Hkv, D)``, ``table (B, W)`` each sequence's
    pages (shuffled over the pool), ``slots[i]`` sequence ``i``'s slots over them."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    table: torch.Tensor
    slots: list[torch.Tensor]


def random_pool(
    lengths: Sequence[int],
    *,
    queries: int,
    page_size: int,
    group: int,
    dim: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
    hkv: int = 2,
    spare_pages: int = 0,
) -> RandomPool:
    """Sequences of ``lengths`` tokens on shuffled pages of a random pool (``spare_pages``
    more than they need), and ``queries`` random query rows; drawn from one generator
    seeded with ``seed`` (K, V, q, then the page order)."""
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-n // page_size) for n in lengths)
    pages = len(lengths) * width + spare_pages
    k = torch.randn(pages * page_size, hkv, dim, generator=gen).to(device, dtype)
    v = torch.randn(pages * page_size, hkv, dim, generator=gen).to(device, dtype)
    q = torch.randn(queries, hkv * group, dim, generator=gen).to(device, dtype)
    order = torch.randperm(pages, generator=gen)
    table = torch.stack([order[i * width : (i + 1) * width] for i in range(len(lengths))])
    slots = [slots_for(table[i].tolist(), page_size, n).to(device) for i, n in enumerate(lengths)]
    return RandomPool(q, k, v, table.to(device), slots)


def hf_greedy_ids(name: str | None, ids: Sequence[int], n: int) -> list[int]:
    """transformers' greedy continuation of ``ids`` by :func:`hf_model` ``(name)``:
    exactly ``n`` new token ids (EOS does not stop it)."""
    with torch.no_grad():
        out = hf_model(name).generate(
            torch.tensor([list(ids)]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.int64),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
        )
    return list(out[0, len(ids) :].tolist())


def prompt_ids(name: str | None, n: int) -> torch.Tensor:
    """``n`` real token ids of an English prompt (int64 ``(n,)``)."""
    text = (
        "Hierarchical caches keep the key and value tensors of shared prefixes in GPU memory, "
        "host memory and remote storage, so that a long conversation does not pay for its "
        "prefill twice. " * 4
    )
    ids = engine_model(name).tokenizer(text)["input_ids"][:n]
    assert len(ids) == n
    return torch.tensor(ids, dtype=torch.int64)


@torch.no_grad()
def hf_logits(name: str | None, ids: torch.Tensor) -> torch.Tensor:
    """transformers' logits for every position of ``ids (n,)``: ``(n, vocab)`` fp32."""
    logits: torch.Tensor = hf_model(name)(ids[None]).logits[0]
    return logits.float()


def broken_kernel(module: ModuleType, old: str, new: str, directory: Path) -> ModuleType:
    """A copy of the kernel module ``module`` (e.g. :mod:`hicache.runner.kernels.decode_attention`)
    with the one occurrence of ``old`` in its source replaced by ``new``: the real kernel
    and wrapper with one deliberate bug. Written to ``directory`` and imported from there
    (Triton reads a kernel's source from its file). ValueError when ``old`` does not occur
    exactly once (the kernel changed: the bug must be restated)."""
    source = inspect.getsource(module)
    if source.count(old) != 1:
        raise ValueError(f"{old!r} occurs {source.count(old)} times in {module.__name__}")
    name = f"broken_{module.__name__.rsplit('.', 1)[-1]}_{abs(hash((old, new))):x}"
    path = directory / f"{name}.py"
    path.write_text(source.replace(old, new))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    broken = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(broken)
    return broken


SKIPPED_RESCALE = ("acc = acc * alpha[:, None] + tl.dot(", "acc = acc + tl.dot(")
"""A realistic online-softmax bug for :func:`broken_kernel` (the decode and extend kernels
both hold the line once): the accumulator is not rescaled when a later key block raises
the running max. Invisible while every sequence fits one key block (the first block's
rescale multiplies a zero accumulator)."""

SKIPPED_NORMALIZER_RESCALE = ("l_i = l_i * alpha + tl.sum(p, 1)", "l_i = l_i + tl.sum(p, 1)")
"""The same bug in the softmax's normalizer instead of its accumulator."""
