"""Whether a tensor-parallel size fits the machine and the model, checked before any
rank process starts: CUDA devices per rank, CPU memory for every rank's process and
weights, and a model the size can split (its config read, no weight). Each refusal is a
ValueError with the numbers.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)

__all__ = [
    "RANK_PROCESS_BYTES",
    "available_memory_bytes",
    "check_cpu_ranks_fit",
    "check_tp_fits",
    "check_tp_model",
]


RANK_PROCESS_BYTES = 512 << 20
"""Memory one CPU rank process needs besides its shard of the weights (the interpreter,
torch, the tokenizer, a small model's pools): what :func:`check_tp_model` counts per rank.
A tiny model's rank peaks near 400 MiB (``docs/benchmarks/tp.md``, the stress run)."""


def check_tp_fits(tp_size: object, device: str) -> None:
    """Refuse a ``tp_size`` that is not an int >= 1, or, on CUDA, more ranks than devices
    from ``device``'s index on. ValueError with the numbers. On CPU ranks may share cores
    (each then runs one torch thread, :func:`~hicache.engine.ranks.cpu_threads_per_rank`; a warning says so):
    what bounds them there is memory, checked with the model (:func:`check_tp_model`)."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size={tp_size!r} is invalid; must be an int >= 1")
    if tp_size == 1:
        return
    dev = torch.device(device)
    if dev.type == "cuda":
        first = dev.index or 0
        count = torch.cuda.device_count()
        if first + tp_size > count:
            raise ValueError(
                f"tp_size={tp_size} is invalid; one rank per CUDA device from {dev} on needs"
                f" {first + tp_size} devices, this host has {count}"
            )


def available_memory_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_cpu_ranks_fit(tp_size: int, weights_bytes: int, available: int | None, what: str) -> None:
    """Refuse ``tp_size`` CPU ranks of a model of ``weights_bytes`` when they cannot all
    be held in ``available`` bytes (None: unknown, not checked): each rank holds its
    ``1 / tp_size`` of the weights and :data:`RANK_PROCESS_BYTES` besides. ValueError with
    the numbers. More ranks than cores only logs a warning."""
    need = tp_size * RANK_PROCESS_BYTES + weights_bytes
    if available is not None and need > available:
        mib = 1 << 20
        raise ValueError(
            f"tp_size={tp_size} is invalid for {what}: {tp_size} CPU ranks need about"
            f" {need // mib} MiB ({tp_size} x {RANK_PROCESS_BYTES // mib} MiB per process +"
            f" {weights_bytes // mib} MiB of weights), this host has {available // mib} MiB"
            " available"
        )
    cores = os.cpu_count() or 1
    if tp_size > cores:
        log.warning(
            "tp_size=%d on %d CPU cores: the ranks share cores (one torch thread each), so"
            " every collective waits for the slowest",
            tp_size,
            cores,
        )


def check_tp_model(model_path: str | None, tp_size: int, device: str = "cpu") -> None:
    """Refuse ``tp_size`` > 1 for the checkpoint at ``model_path`` when its model cannot be
    split over that many ranks (its config only is read, before any process starts): a
    family without a sharded model (the hybrids whose config refuses,
    :meth:`~hicache.runner.models.hybrid.HybridConfig.check_tensor_parallel`), query heads,
    MLP or expert sizes the size does not divide, or K/V heads it neither divides nor is a
    multiple of (K/V heads fewer than the ranks are replicated)
    (:func:`~hicache.runner.models.registry.check_tensor_parallel`);
    on a CPU ``device``, more ranks than the host's available memory holds
    (:func:`check_cpu_ranks_fit`). ValueError ``tp_size=N is invalid for MODEL: ...``
    with the numbers."""
    if tp_size == 1:
        return
    from transformers import AutoConfig

    from hicache.runner.checkpoints import resolve_checkpoint
    from hicache.runner.models.registry import check_tensor_parallel

    ckpt = resolve_checkpoint(model_path)
    hf_config = AutoConfig.from_pretrained(ckpt.path, local_files_only=True)
    try:
        check_tensor_parallel(hf_config, tp_size)
    except ValueError as exc:
        raise ValueError(f"tp_size={tp_size} is invalid for {ckpt.name}: {exc}") from None
    if torch.device(device).type != "cuda":
        weights = sum(f.stat().st_size for f in ckpt.path.glob("*.safetensors"))
        check_cpu_ranks_fit(tp_size, weights, available_memory_bytes(), ckpt.name)
