"""ModelRunner: one forward pass of a batch of sequences over the paged device pool.

A batch mixes sequences at any stage: a cold prefill (no prefix), an extend on top of a
cached prefix, or a single decode token. Each sequence brings the slots of *all* its tokens;
the model writes the new tokens' K/V into the last ``extend_len`` of them and reads the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hicache.config import AttentionKind, KVSpec
from hicache.engine.models import AttentionContext, DecoderConfig, DecoderLM
from hicache.memory import DevicePool

__all__ = ["ForwardBatch", "ModelRunner", "kv_spec_from_hf_config"]


def kv_spec_from_hf_config(hf_config: Any, dtype: str) -> KVSpec:
    """The pool's per-token KV shape for a Hugging Face config (MHA/GQA families only)."""
    cfg = DecoderConfig.from_hf(hf_config)
    return KVSpec(
        num_layers=cfg.num_layers,
        attention=AttentionKind.MHA,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        dtype=dtype,
    )


@dataclass(frozen=True)
class ForwardBatch:
    """The new tokens of ``num_seqs`` sequences, concatenated in sequence order.

    ``input_ids``/``positions`` are ``(T,)`` int64 with ``T = sum(extend_lens)``;
    ``seq_slots[i]`` is a 1-D int64 tensor of sequence ``i``'s slots, prefix first, so its
    last ``extend_lens[i]`` entries receive the new K/V. ``layer_wait(layer)``, if given, is
    called once per layer, in order, before that layer's prefix K/V is read from the pool.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    extend_lens: list[int]
    seq_slots: list[torch.Tensor]
    layer_wait: Callable[[int], None] | None = None

    def __post_init__(self) -> None:
        t = self.input_ids.shape[0] if self.input_ids.dim() == 1 else -1
        if t < 1:
            raise ValueError(
                f"input_ids must be a non-empty 1-D tensor, got {self.input_ids.shape}"
            )
        if tuple(self.positions.shape) != (t,):
            raise ValueError(f"positions shape {tuple(self.positions.shape)} != ({t},)")
        if len(self.extend_lens) != len(self.seq_slots) or not self.extend_lens:
            raise ValueError(
                f"extend_lens ({len(self.extend_lens)}) and seq_slots ({len(self.seq_slots)}) "
                "must be non-empty and of equal length"
            )
        if sum(self.extend_lens) != t:
            raise ValueError(f"sum(extend_lens)={sum(self.extend_lens)} != len(input_ids)={t}")
        for i, (n, slots) in enumerate(zip(self.extend_lens, self.seq_slots, strict=True)):
            if slots.dim() != 1 or not 1 <= n <= slots.shape[0]:
                raise ValueError(
                    f"sequence {i}: extend_len={n} must be in [1, len(seq_slots)="
                    f"{slots.shape[0] if slots.dim() == 1 else slots.shape}]"
                )

    @property
    def num_seqs(self) -> int:
        return len(self.extend_lens)


class ModelRunner:
    """Runs a :class:`DecoderLM` whose KV cache is ``device_pool``.

    The pool's spec must match the model (layers, KV heads, head_dim); the model's dtype
    may differ from the pool's (K/V are cast on write and read).
    """

    def __init__(self, model: DecoderLM, device_pool: DevicePool) -> None:
        cfg, spec = model.config, device_pool.spec
        want = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
        have = (spec.num_layers, spec.num_kv_heads, spec.head_dim)
        if spec.attention is not AttentionKind.MHA or want != have:
            raise ValueError(
                f"device pool (layers, kv_heads, head_dim)={have} ({spec.attention.value}) "
                f"does not fit the model's {want} (mha)"
            )
        if device_pool.device != model.device:
            raise ValueError(f"pool on {device_pool.device} but model on {model.device}")
        self.model = model
        self.pool = device_pool

    @property
    def device(self) -> torch.device:
        return self.model.device

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        *,
        all_logits: bool = False,
        logit_rows: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Logits in fp32: ``(num_seqs, vocab)`` of each sequence's last token, or
        ``(T, vocab)`` for every new token when ``all_logits``, or ``(len(logit_rows),
        vocab)`` for exactly the new tokens ``logit_rows`` (indices into the batch's ``T``
        tokens, in the order given) — what prompt log probabilities need without paying
        the vocabulary projection for every token. ``all_logits`` and ``logit_rows`` are
        exclusive; a row outside ``[0, T)`` raises ValueError."""
        if logit_rows is not None:
            t = batch.input_ids.shape[0]
            if all_logits:
                raise ValueError("all_logits and logit_rows are exclusive")
            if not all(0 <= r < t for r in logit_rows):
                raise ValueError(f"logit_rows must lie in [0, {t}), got {list(logit_rows)}")
        ctx = AttentionContext.build(
            self.pool, batch.seq_slots, batch.extend_lens, batch.layer_wait
        )
        input_ids = batch.input_ids.to(self.device, torch.int64)
        positions = batch.positions.to(self.device, torch.int64)
        hidden = self.model(input_ids, positions, ctx)
        if logit_rows is not None:
            hidden = hidden[torch.tensor(list(logit_rows), device=self.device, dtype=torch.int64)]
        elif not all_logits:
            last = torch.tensor(batch.extend_lens, device=self.device).cumsum(0) - 1
            hidden = hidden[last]
        return self.model.compute_logits(hidden)
