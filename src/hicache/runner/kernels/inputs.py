"""What every attention kernel asks of its inputs (checked before a launch; no Triton
import, so the checks cost nothing where Triton is absent)."""

from __future__ import annotations

import torch

__all__ = ["check_pool_inputs"]


def check_pool_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Raise ValueError unless ``q (rows, Hq, D)`` can attend over one pool layer
    ``k_cache``/``v_cache (S, Hkv, D)`` in the kernels: ``Hq`` a multiple of ``Hkv``, the
    same ``D``, K and V alike, every last dimension contiguous."""
    hq, dim = q.shape[1], q.shape[2]
    hkv = k_cache.shape[1]
    if hq % hkv or k_cache.shape[2] != dim or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"q {tuple(q.shape)} does not fit k/v {tuple(k_cache.shape)} / "
            f"{tuple(v_cache.shape)}: Hq must be a multiple of Hkv and D equal"
        )
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q, k_cache and v_cache need a contiguous last dimension")
