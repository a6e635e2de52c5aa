"""ModelRunner: one forward pass of a batch of sequences over the paged device pool.

A batch mixes sequences at any stage: a cold prefill (no prefix), an extend on top of a
cached prefix, or a single decode token. Each sequence brings the slots of *all* its tokens;
the model writes the new tokens' K/V into the last ``extend_len`` of them and reads the rest.

Models: a Llama-style :class:`DecoderLM`, or a :class:`HybridLM` (Gemma 3, GPT-OSS,
Qwen3-Next, Nemotron-H) whose attention layers alone use the pool (one pool layer per
attention layer, :meth:`HybridConfig.kv_spec`). Given an SWA pool (the cache's
sliding-window tier), a hybrid's sliding layers use it and the full pool holds its global
layers only (:meth:`HybridConfig.full_kv_spec`, :meth:`HybridConfig.swa_spec`); each
sequence then also brings its SWA slots (:attr:`ForwardBatch.swa_slots`). A hybrid with recurrent layers (Mamba2,
Gated DeltaNet) also carries a state per sequence from forward to forward; the runner keeps
it (:class:`~hicache.engine.recurrent_states.RecurrentStates`, keyed by
:attr:`ForwardBatch.seq_ids`) until :meth:`ModelRunner.drop_state`. Such a model cannot
resume from a prefix whose K/V the cache served (the cache keeps no state snapshot yet):
:attr:`ModelRunner.resumable_prefix` is False and its caller must not match prefixes.

Decode-only batches of a plain :class:`DecoderLM` may run through CUDA graphs
(:class:`~hicache.engine.decode_graphs.DecodeGraphs`, attached with
:meth:`ModelRunner.use_decode_graphs` once they passed their probe,
:mod:`hicache.engine.graph_setup`); every other batch runs eagerly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hicache.config import AttentionKind, KVSpec
from hicache.engine.decode_graphs import DecodeGraphs
from hicache.engine.kernels import AttentionBackend, resolve_backend
from hicache.engine.models import AttentionContext, DecoderConfig, DecoderLM
from hicache.engine.models.attention import SlidingKV
from hicache.engine.models.hybrid import HybridLM
from hicache.engine.models.registry import HYBRID_FAMILIES, hybrid_config_from_hf
from hicache.engine.recurrent_states import RecurrentStates
from hicache.memory import DevicePool

__all__ = ["ForwardBatch", "ModelRunner", "kv_spec_from_hf_config"]


def kv_spec_from_hf_config(hf_config: Any, dtype: str) -> KVSpec:
    """The pool's per-token KV shape for a Hugging Face config: every layer of a Llama-style
    family, the attention layers only of a hybrid one (see :meth:`HybridConfig.kv_spec`)."""
    if getattr(hf_config, "model_type", None) in HYBRID_FAMILIES:
        return hybrid_config_from_hf(hf_config).kv_spec(dtype)
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
    called once per pool layer, in order, before that layer's prefix K/V is read from the
    pool. ``seq_ids[i]`` names sequence ``i``'s recurrent state in the runner (the request
    id; distinct within a batch); required by models with recurrent layers, unused by
    others. ``swa_slots[i]`` (a runner with an SWA pool only): sequence ``i``'s slots in
    the SWA pool for its *last* ``len(swa_slots[i])`` positions (at least its new tokens
    and the window before them; earlier positions are absent). ``state_marks[i]`` (models
    with recurrent layers): also keep sequence ``i``'s state after its first
    ``state_marks[i]`` new tokens (``0 < mark < extend_lens[i]``; None: no mark), taken
    once with :meth:`ModelRunner.take_mark`: a snapshot inside a prefill chunk without
    ending the forward there.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    extend_lens: list[int]
    seq_slots: list[torch.Tensor]
    layer_wait: Callable[[int], None] | None = None
    seq_ids: Sequence[str] | None = None
    swa_slots: list[torch.Tensor] | None = None
    state_marks: Sequence[int | None] | None = None

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
        if self.state_marks is not None:
            if len(self.state_marks) != len(self.extend_lens):
                raise ValueError(
                    f"state_marks has {len(self.state_marks)} entries for"
                    f" {len(self.extend_lens)} sequences"
                )
            for i, (m, n) in enumerate(zip(self.state_marks, self.extend_lens, strict=True)):
                if m is not None and not 0 < m < n:
                    raise ValueError(f"sequence {i}: state_marks={m} must lie in (0, {n})")
        for i, (n, slots) in enumerate(zip(self.extend_lens, self.seq_slots, strict=True)):
            if slots.dim() != 1 or not 1 <= n <= slots.shape[0]:
                raise ValueError(
                    f"sequence {i}: extend_len={n} must be in [1, len(seq_slots)="
                    f"{slots.shape[0] if slots.dim() == 1 else slots.shape}]"
                )
        if self.seq_ids is not None:
            if len(self.seq_ids) != len(self.extend_lens):
                raise ValueError(
                    f"seq_ids has {len(self.seq_ids)} entries for {len(self.extend_lens)} sequences"
                )
            if len(set(self.seq_ids)) != len(self.seq_ids):
                raise ValueError(f"seq_ids must be distinct, got {list(self.seq_ids)}")
        if self.swa_slots is not None:
            if len(self.swa_slots) != len(self.extend_lens):
                raise ValueError(
                    f"swa_slots has {len(self.swa_slots)} entries for"
                    f" {len(self.extend_lens)} sequences"
                )
            for i, (n, s, full) in enumerate(
                zip(self.extend_lens, self.swa_slots, self.seq_slots, strict=True)
            ):
                if s.dim() != 1 or not n <= s.shape[0] <= full.shape[0]:
                    raise ValueError(
                        f"sequence {i}: swa_slots must cover its {n} new tokens and at most"
                        f" its {full.shape[0]} positions, got {tuple(s.shape)}"
                    )

    @property
    def num_seqs(self) -> int:
        return len(self.extend_lens)

    @property
    def prefix_lens(self) -> list[int]:
        """Per sequence, the positions already computed before this batch's new tokens."""
        return [s.shape[0] - n for s, n in zip(self.seq_slots, self.extend_lens, strict=True)]


class ModelRunner:
    """Runs a :class:`DecoderLM` or :class:`HybridLM` whose KV cache is ``device_pool``.

    The pool's spec must match the model (layers, KV heads, head_dim; for a hybrid, its
    attention layers); the model's dtype may differ from the pool's (K/V are cast on write
    and read). ``swa_pool``: the sliding layers' own pool (a hybrid with
    :attr:`HybridConfig.swa_split` only); ``device_pool`` then holds the global layers.
    ``states`` holds the running sequences' recurrent state (None for a model without
    recurrent layers).
    """

    def __init__(
        self,
        model: DecoderLM | HybridLM,
        device_pool: DevicePool,
        swa_pool: DevicePool | None = None,
        *,
        attention_backend: AttentionBackend | str = AttentionBackend.AUTO,
    ) -> None:
        spec = device_pool.spec
        if swa_pool is not None:
            _check_swa_pool(model, swa_pool, device_pool)
        if isinstance(model, HybridLM):
            full = model.config.full_kv_spec if swa_pool is not None else model.config.kv_spec
            kv = full(spec.dtype)
            want = (kv.num_layers, kv.num_kv_heads, kv.head_dim)
        else:
            cfg = model.config
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
        self.swa_pool = swa_pool
        self.attention_backend = resolve_backend(attention_backend, device_pool.device)
        """The concrete decode-attention backend (``sdpa`` or ``triton``)."""
        specs = model.state_specs() if isinstance(model, HybridLM) else {}
        self.states: RecurrentStates | None = (
            RecurrentStates(specs, dtype=model.dtype, device=model.device) if specs else None
        )
        self.decode_graphs: DecodeGraphs | None = None
        """Serves decode-only batches when set (:meth:`use_decode_graphs`)."""

    def use_decode_graphs(self, graphs: DecodeGraphs | None) -> None:
        """Serve decode-only batches through ``graphs`` (None: eagerly again): those without
        ``layer_wait``, ``all_logits`` or ``logit_rows`` and of at most ``graphs.max_bs``
        sequences, whose sequences fit its page table (:meth:`DecodeGraphs.run`). The
        graphs must be built over this runner's model and pool, with the Triton backend
        (the graphs' attention) and no SWA pool; ValueError otherwise."""
        if graphs is not None:
            if graphs.model is not self.model or graphs.pool is not self.pool:
                raise ValueError("the decode graphs were built over another model or pool")
            if self.attention_backend is not AttentionBackend.TRITON or self.swa_pool is not None:
                raise ValueError(
                    "decode graphs need attention_backend='triton' and no SWA pool, not"
                    f" {self.attention_backend.value!r}"
                    + (" with an SWA pool" if self.swa_pool is not None else "")
                )
        self.decode_graphs = graphs

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def resumable_prefix(self) -> bool:
        """Whether a sequence may start from any prefix whose K/V the cache served. False
        for a model with recurrent layers: it resumes only where the cache also holds a
        state snapshot (a cache built with ``state=``), else from position 0."""
        return self.states is None

    @property
    def recurrent(self) -> bool:
        """Whether the model has recurrent layers (state carried between forwards)."""
        return self.states is not None

    def seed_state(self, seq_id: str, tokens: int, data: Sequence[torch.Tensor]) -> None:
        """Start ``seq_id`` from a cached state snapshot covering its first ``tokens``
        positions (the cache's canonical tensors, :mod:`hicache.engine.recurrent_states`)."""
        if self.states is None:
            raise ValueError("the model has no recurrent layers to seed")
        self.states.put(seq_id, tokens, data)

    def snapshot_state(self, seq_id: str) -> tuple[int, list[torch.Tensor]]:
        """The positions ``seq_id``'s state covers and the state as canonical tensors."""
        if self.states is None:
            raise ValueError("the model has no recurrent layers to snapshot")
        return self.states.export(seq_id)

    def take_mark(self, seq_id: str) -> tuple[int, list[torch.Tensor]] | None:
        """The state ``seq_id`` had at its mark in the last forward (positions covered,
        canonical tensors), once; None when it was given none."""
        return None if self.states is None else self.states.take_mark(seq_id)

    def drop_state(self, seq_id: str) -> None:
        """Forget the recurrent state of ``seq_id`` (its request ended, or was retracted and
        will start again from position 0). A no-op for models without recurrent layers."""
        if self.states is not None:
            self.states.drop(seq_id)

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
        exclusive; a row outside ``[0, T)`` raises ValueError.

        A model with recurrent layers resumes each sequence from its state in
        :attr:`states` (zeros for a sequence starting at position 0) and keeps the state
        after the new tokens there; a sequence starting anywhere else than 0 or where its
        state ends raises ValueError before anything runs.

        A decode-only batch runs through :attr:`decode_graphs` when they are set and the
        batch fits them (see :meth:`use_decode_graphs`), with the same result."""
        graphs = self.decode_graphs
        if (
            graphs is not None
            and not all_logits
            and logit_rows is None
            and batch.layer_wait is None
            and batch.input_ids.shape[0] == batch.num_seqs  # one new token each
            and batch.num_seqs <= graphs.max_bs
        ):
            logits = graphs.run(batch.input_ids, batch.positions, batch.seq_slots)
            if logits is not None:
                return logits
        if logit_rows is not None:
            t = batch.input_ids.shape[0]
            if all_logits:
                raise ValueError("all_logits and logit_rows are exclusive")
            if not all(0 <= r < t for r in logit_rows):
                raise ValueError(f"logit_rows must lie in [0, {t}), got {list(logit_rows)}")
        swa = None
        if self.swa_pool is not None:
            if batch.swa_slots is None:
                raise ValueError("a runner with an SWA pool needs ForwardBatch.swa_slots")
            swa = SlidingKV.build(self.swa_pool, batch.swa_slots, batch.extend_lens)
        ctx = AttentionContext.build(
            self.pool,
            batch.seq_slots,
            batch.extend_lens,
            batch.layer_wait,
            swa,
            decode_kernel=self.attention_backend is AttentionBackend.TRITON,
            extend_kernel=self.attention_backend is AttentionBackend.TRITON,
        )
        # every host input in one copy, before the forward: a blocking copy after it would
        # make the host wait for the whole forward on CUDA (no overlap of the CPU's work)
        t = batch.input_ids.shape[0]
        if logit_rows is not None:
            rows = torch.tensor(list(logit_rows), dtype=torch.int64)
        elif not all_logits:
            rows = torch.tensor(batch.extend_lens, dtype=torch.int64).cumsum(0) - 1
        else:
            rows = torch.empty(0, dtype=torch.int64)
        host = torch.cat((batch.input_ids.to(torch.int64), batch.positions.to(torch.int64), rows))
        inputs = host.to(self.device)
        input_ids, positions, picked = inputs[:t], inputs[t : 2 * t], inputs[2 * t :]
        if isinstance(self.model, HybridLM):
            hidden = self._forward_hybrid(self.model, batch, input_ids, positions, ctx)
        else:
            hidden = self.model(input_ids, positions, ctx)
        if not all_logits:
            hidden = hidden[picked]
        return self.model.compute_logits(hidden)

    def _forward_hybrid(
        self,
        model: HybridLM,
        batch: ForwardBatch,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: AttentionContext,
    ) -> torch.Tensor:
        """The hidden states ``(T, hidden)`` of a hybrid forward, carrying recurrent state."""
        if self.states is None:
            return model(input_ids, positions, ctx).hidden
        if batch.seq_ids is None:
            raise ValueError("a model with recurrent layers needs ForwardBatch.seq_ids")
        prefix = batch.prefix_lens
        states = self.states.gather(batch.seq_ids, prefix)
        marks = batch.state_marks or ()
        out = model(input_ids, positions, ctx, states, marks)
        ends = [p + n for p, n in zip(prefix, batch.extend_lens, strict=True)]
        self.states.scatter(batch.seq_ids, ends, out.states)
        for i, mark in enumerate(marks):
            if mark is not None:
                at = {layer: got[i] for layer, got in out.marked.items()}
                self.states.keep_mark(batch.seq_ids[i], prefix[i] + mark, at)
        return out.hidden


def _check_swa_pool(model: DecoderLM | HybridLM, swa_pool: DevicePool, pool: DevicePool) -> None:
    """Raise ValueError unless ``swa_pool`` fits the model's sliding layers."""
    if not isinstance(model, HybridLM) or not model.config.swa_split:
        raise ValueError("an SWA pool needs a hybrid model with sliding and global layers")
    want = model.config.swa_spec(swa_pool.spec.dtype)
    assert want is not None
    have = swa_pool.spec
    if (have.num_layers, have.num_kv_heads, have.head_dim) != (
        want.kv.num_layers,
        want.kv.num_kv_heads,
        want.kv.head_dim,
    ):
        raise ValueError(
            f"SWA pool (layers, kv_heads, head_dim)=({have.num_layers}, {have.num_kv_heads},"
            f" {have.head_dim}) does not fit the model's sliding layers"
            f" ({want.kv.num_layers}, {want.kv.num_kv_heads}, {want.kv.head_dim})"
        )
    if swa_pool.device != pool.device or swa_pool.page_size != pool.page_size:
        raise ValueError("the SWA pool must share the full pool's device and page size")
