"""What the model-level tensor-parallel tests share: full checkpoint tensors as a loader
reads them, and paged batches over fixed page lists (page size 4)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from hicache.runner.model_runner import ForwardBatch

PAGE = 4


def checkpoint_tensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the ``*.safetensors`` files in ``path``, full size, by name."""
    from safetensors import safe_open

    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, st.get_tensor(name)


def paged_slots(pages: list[int], n: int) -> torch.Tensor:
    """Slots ``(n,)`` of positions ``0 .. n-1`` laid over ``pages`` in order."""
    t = torch.arange(n)
    return torch.tensor(pages, dtype=torch.int64)[t // PAGE] * PAGE + t % PAGE


def paged_batch(ids: list[list[int]], starts: list[int], pages: list[list[int]]) -> ForwardBatch:
    """One forward of sequences ``ids[i]`` at positions ``starts[i]..``, each over its
    ``pages[i]``."""
    lens = [len(t) for t in ids]
    return ForwardBatch(
        input_ids=torch.tensor([i for t in ids for i in t]),
        positions=torch.cat([torch.arange(a, a + n) for a, n in zip(starts, lens, strict=True)]),
        extend_lens=lens,
        seq_slots=[paged_slots(p, a + n) for p, a, n in zip(pages, starts, lens, strict=True)],
    )
