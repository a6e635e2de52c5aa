"""Attention kernels over the paged pool (Triton), used on CUDA when Triton is installed.

Each kernel has a torch reference path in :mod:`hicache.runner.models.attention` (SDPA),
which the tests compare it against; with ``TRITON_INTERPRET=1`` the kernels also run on
CPU tensors (slowly), so they are tested on machines without a GPU.
"""

from __future__ import annotations

import importlib.util
import os
from enum import Enum

import torch

__all__ = ["AttentionBackend", "resolve_backend", "triton_available"]


class AttentionBackend(str, Enum):
    """How attention reads the pool: ``sdpa`` gathers each sequence's K/V and calls torch's
    SDPA (the reference); ``triton`` reads K/V in place through the page tables, with one
    kernel for decode (:mod:`.decode_attention`) and one for extends, prefills included
    (:mod:`.extend_attention`); ``auto`` picks ``triton`` on CUDA when Triton is installed
    and the kernels pass a probe against SDPA there (:mod:`.probe`), else ``sdpa``.
    Sliding-window layers always use SDPA."""

    AUTO = "auto"
    SDPA = "sdpa"
    TRITON = "triton"


def triton_available() -> bool:
    """Whether Triton is importable (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def resolve_backend(backend: AttentionBackend | str, device: torch.device) -> AttentionBackend:
    """The concrete backend (``sdpa`` or ``triton``) for ``device``.

    ``triton`` on a CPU device needs Triton's interpreter (``TRITON_INTERPRET=1``); raises
    ValueError naming what is missing otherwise."""
    chosen = AttentionBackend(backend)
    if chosen is AttentionBackend.AUTO:
        if device.type != "cuda" or not triton_available():
            return AttentionBackend.SDPA
        from hicache.runner.kernels.probe import kernels_agree

        return AttentionBackend.TRITON if kernels_agree(device) else AttentionBackend.SDPA
    if chosen is AttentionBackend.TRITON:
        if not triton_available():
            raise ValueError("attention_backend='triton' needs the triton package installed")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"attention_backend='triton' runs on CUDA; on {device.type} only under"
                " Triton's interpreter (TRITON_INTERPRET=1, for tests)"
            )
    return chosen
