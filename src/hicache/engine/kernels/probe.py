"""A once-per-device check that the Triton attention kernels run and agree with SDPA.

``attention_backend="auto"`` picks the kernels on CUDA only when this probe passes there:
a compile error, a launch failure or a wrong result on some GPU, driver or Triton version
then costs a logged warning and the SDPA path, never a failed or wrong forward.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from hicache.device_probe import DeviceProbe

__all__ = ["kernels_agree"]

log = logging.getLogger("hicache.engine")

TOLERANCE = 1e-3
"""Largest difference from SDPA accepted in the probe (fp32 inputs of unit scale)."""


def _probe(device: torch.device) -> bool:
    """Both kernels on a small random case (GQA, shuffled pages, a prefix) against SDPA."""
    from hicache.engine.kernels.decode_attention import paged_decode_attention
    from hicache.engine.kernels.extend_attention import paged_extend_attention

    gen = torch.Generator().manual_seed(0)
    page, hkv, group, dim = 4, 2, 2, 32
    k = torch.randn(16 * page, hkv, dim, generator=gen).to(device)
    v = torch.randn(16 * page, hkv, dim, generator=gen).to(device)
    table = torch.tensor([[5, 2, 9, 0]], device=device)
    slots = (table[0, :, None] * page + torch.arange(page, device=device)).reshape(-1)
    prefix, new = 6, 5
    q = torch.randn(new, hkv * group, dim, generator=gen).to(device)
    scale = dim**-0.5
    keys = slots[: prefix + new]
    mask = (
        torch.arange(prefix + new, device=device)[None, :]
        <= (prefix + torch.arange(new, device=device))[:, None]
    )
    want = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k[keys].transpose(0, 1)[None],
        v[keys].transpose(0, 1)[None],
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )[0].transpose(0, 1)
    lens = torch.tensor([prefix], device=device)
    got = paged_extend_attention(
        q, k, v, table, lens, torch.tensor([new], device=device), page_size=page, scale=scale
    )
    last = paged_decode_attention(
        q[-1:].contiguous(), k, v, table, lens + new, page_size=page, scale=scale
    )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return bool(
        (got - want).abs().max().item() < TOLERANCE
        and (last[0] - want[-1]).abs().max().item() < TOLERANCE
    )


kernels_agree = DeviceProbe("the Triton attention kernels", "SDPA", _probe, log)
"""Whether the decode and extend kernels run on a device and match SDPA there (checked
once per device)."""
