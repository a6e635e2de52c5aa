"""ModelRunner: one forward pass of a batch of sequences over the paged device pool.

A batch mixes cold prefills, extends over a cached prefix and single decode tokens; each
sequence brings the slots of *all* its tokens, and the model writes the new tokens' K/V
into the last ``extend_len`` of them and reads the rest. Models: any
:class:`~hicache.runner.models.cached.CachedModel` (the runner names no model family and
no component); component pools come by name (``pools``), with each sequence's slots there
(:attr:`ForwardBatch.pool_slots`). Recurrent state per sequence (keyed by
:attr:`ForwardBatch.seq_ids`) is kept until :meth:`ModelRunner.drop_state`; copies at the
planned offsets (:attr:`ForwardBatch.keep`) go out once as opaque
:class:`~hicache.extras.SequenceExtras` (:meth:`take_extras`) and come back through
:meth:`resume`; such a model has ``resumable_prefix`` False. Decode-only batches of a model
that declares ``supports_decode_graphs`` may replay CUDA graphs (:meth:`use_decode_graphs`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from hicache.extras import KeptState, SequenceExtras
from hicache.heads import HeadSplit
from hicache.memory import DevicePool
from hicache.runner.decode_graphs import DecodeGraphs
from hicache.runner.kernels import AttentionBackend, resolve_backend
from hicache.runner.models import DecoderConfig
from hicache.runner.models.attention import AttentionContext
from hicache.runner.models.cached import BoundPools, CachedModel
from hicache.runner.models.registry import (
    HYBRID_FAMILIES,
    check_tensor_parallel,
    hybrid_config_from_hf,
)
from hicache.runner.recurrent_states import RecurrentStates
from hicache.spec import AttentionKind, CacheSpec, KVSpec

__all__ = ["ForwardBatch", "ModelRunner", "cache_spec_of", "kv_spec_from_hf_config"]


def cache_spec_of(model: CachedModel, dtype: str) -> CacheSpec:
    """What ``model`` caches per token, for the cache (:meth:`CachedModel.cache_spec`):
    the full KV (every layer of a Llama-style model; a hybrid's attention layers, its
    global ones only when its sliding layers get their own pools) and a spec per extra
    component (the sliding-window layers' K/V, the recurrent layers' state snapshots,
    DeepSeek-V3.2's indexer keys). ``dtype``: the KV dtype. A tensor-parallel rank's model
    caches its own K/V heads only (:attr:`DecoderLM.num_kv_heads`): its pools hold those."""
    return model.cache_spec(dtype)


def kv_spec_from_hf_config(hf_config: Any, dtype: str, tp_size: int = 1) -> KVSpec:
    """The pool's per-token KV shape for a Hugging Face config: every layer of a Llama-style
    family, the attention layers only of a hybrid one (see :meth:`HybridConfig.kv_spec`).
    ``tp_size``: the tensor-parallel ranks; each rank's pool holds ``num_kv_heads /
    tp_size`` heads, or 1 when they are replicated (:class:`~hicache.heads.HeadSplit`; a
    hybrid's too; an MLA latent whole); refused as
    :func:`~hicache.runner.models.registry.check_tensor_parallel` refuses it."""
    if tp_size != 1:
        check_tensor_parallel(hf_config, tp_size)
    if getattr(hf_config, "model_type", None) in HYBRID_FAMILIES:
        hybrid = hybrid_config_from_hf(hf_config)
        spec = hybrid.kv_spec(dtype)
        if tp_size == 1 or spec.attention is not AttentionKind.MHA:
            return spec  # MLA: every rank holds the whole latent
        heads = HeadSplit(hybrid.num_heads, hybrid.num_kv_heads, tp_size).local_kv_heads
        return replace(spec, num_kv_heads=heads)
    cfg = DecoderConfig.from_hf(hf_config)
    return KVSpec(
        num_layers=cfg.num_layers,
        attention=AttentionKind.MHA,
        num_kv_heads=HeadSplit(cfg.num_heads, cfg.num_kv_heads, tp_size).local_kv_heads,
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
    pool. ``seq_ids[i]`` names sequence ``i``'s carried state in the runner (the request
    id; distinct within a batch); required by models with recurrent layers, unused by
    others. ``pool_slots[name][i]`` (a runner given pool ``name``): sequence ``i``'s slots
    in that pool for its *last* ``len(pool_slots[name][i])`` positions (at least its new
    tokens; for the sliding-window pool the window before them too; earlier positions are
    absent). ``keep[i]`` (the cache's plan): offsets ``k`` (``1 <= k <= extend_lens[i]``,
    ascending) after whose ``k``-th new token sequence ``i``'s extras are kept, taken once
    with :meth:`ModelRunner.take_extras`; models with recurrent layers keep the state there
    (one offset inside the forward at most, besides its end), others nothing.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    extend_lens: list[int]
    seq_slots: list[torch.Tensor]
    layer_wait: Callable[[int], None] | None = None
    seq_ids: Sequence[str] | None = None
    pool_slots: Mapping[str, list[torch.Tensor]] | None = None
    keep: Sequence[tuple[int, ...]] | None = None

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
        if self.keep is not None:
            if len(self.keep) != len(self.extend_lens):
                raise ValueError(
                    f"keep has {len(self.keep)} entries for {len(self.extend_lens)} sequences"
                )
            for i, (k, n) in enumerate(zip(self.keep, self.extend_lens, strict=True)):
                if list(k) != sorted(set(k)) or any(not 1 <= x <= n for x in k):
                    raise ValueError(
                        f"sequence {i}: keep={tuple(k)} must be distinct ascending offsets"
                        f" in [1, {n}]"
                    )
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
        for name, table in (self.pool_slots or {}).items():
            if len(table) != len(self.extend_lens):
                raise ValueError(
                    f"pool_slots[{name!r}] has {len(table)} entries for"
                    f" {len(self.extend_lens)} sequences"
                )
            for i, (n, s, full) in enumerate(
                zip(self.extend_lens, table, self.seq_slots, strict=True)
            ):
                if s.dim() != 1 or not n <= s.shape[0] <= full.shape[0]:
                    raise ValueError(
                        f"sequence {i}: pool_slots[{name!r}] must cover its {n} new tokens and"
                        f" at most its {full.shape[0]} positions, got {tuple(s.shape)}"
                    )

    @property
    def num_seqs(self) -> int:
        return len(self.extend_lens)

    @property
    def prefix_lens(self) -> list[int]:
        """Per sequence, the positions already computed before this batch's new tokens."""
        return [s.shape[0] - n for s, n in zip(self.seq_slots, self.extend_lens, strict=True)]


class ModelRunner:
    """Runs a :class:`~hicache.runner.models.cached.CachedModel` whose full KV cache is
    ``device_pool``.

    The model checks the pools (:meth:`CachedModel.bind_pools`): the pool's spec must
    match its full KV (layers, KV heads, head_dim; for a hybrid, its attention layers, or
    its global ones when it is given its sliding layers' pool); the model's dtype may
    differ from the pool's (K/V are cast on write and read). ``pools``: the cache's
    component pools the model reads and writes, by component name
    (``cache.stores.runner_pools()``); a pool the model has no use for is refused. ``states``
    holds the running sequences' recurrent state (None for a model without recurrent
    layers).
    """

    def __init__(
        self,
        model: CachedModel,
        device_pool: DevicePool,
        pools: Mapping[str, DevicePool] | None = None,
        *,
        attention_backend: AttentionBackend | str = AttentionBackend.AUTO,
    ) -> None:
        self.bound: BoundPools = model.bind_pools(device_pool, pools or {})
        """The pools the model was bound to (its forwards' attention inputs come from it)."""
        self.model = model
        self.pool = device_pool
        self.attention_backend = resolve_backend(attention_backend, device_pool.device)
        """The concrete decode-attention backend (``sdpa`` or ``triton``)."""
        specs = model.state_specs()
        self.states: RecurrentStates | None = (
            RecurrentStates(specs, dtype=model.dtype, device=model.device) if specs else None
        )
        self.decode_graphs: DecodeGraphs | None = None
        """Serves decode-only batches when set (:meth:`use_decode_graphs`)."""
        self._extras: dict[str, SequenceExtras] = {}
        """What the last forwards kept per sequence, until :meth:`take_extras`."""

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

    def resume(self, seq_id: str, extras: SequenceExtras) -> None:
        """Start ``seq_id`` from what the cache handed its request at admission (the state
        after its cached prefix, in the cache's canonical tensors,
        :mod:`hicache.runner.recurrent_states`). ValueError for a model that carries no
        state."""
        if self.states is None:
            raise ValueError("the model has no recurrent layers to resume")
        if not extras.states:
            return
        state = extras.states[-1]
        self.states.put(seq_id, state.tokens, state.tensors)

    def carried_state(self, seq_id: str) -> KeptState | None:
        """A copy of the state ``seq_id`` carries now (after its first ``tokens``
        positions, canonical tensors), or None when it carries none: what a prefill
        instance sends its decode side, which :meth:`resume` s from it."""
        if self.states is None or seq_id not in self.states:
            return None
        tokens, tensors = self.states.export(seq_id)
        return KeptState(tokens, tuple(tensors))

    def take_extras(self, seq_id: str) -> SequenceExtras | None:
        """What the last forward kept of ``seq_id`` at its :attr:`ForwardBatch.keep`
        offsets (for the cache, untouched by the caller), once; None when nothing was."""
        return self._extras.pop(seq_id, None)

    @property
    def pools(self) -> Mapping[str, DevicePool]:
        """The component pools the model reads and writes, by component name."""
        return self.bound.components

    @property
    def swa_pool(self) -> DevicePool | None:
        """The sliding layers' own pool (None: every attention layer is in :attr:`pool`)."""
        return self.bound.window_pool

    def drop_state(self, seq_id: str) -> None:
        """Forget what is carried for ``seq_id`` (its request ended, or was retracted and
        will start again from position 0 or a cached prefix): its recurrent state and any
        extras not taken. A no-op for models without recurrent layers."""
        self._extras.pop(seq_id, None)
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
        ctx = self.bound.attention_context(
            batch.seq_slots,
            batch.extend_lens,
            batch.layer_wait,
            batch.pool_slots,
            kernels=self.attention_backend is AttentionBackend.TRITON,
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
        if self.states is None:
            hidden = self.model.forward_batch(input_ids, positions, ctx).hidden
        else:
            hidden = self._forward_recurrent(self.states, batch, input_ids, positions, ctx)
        if not all_logits:
            hidden = hidden[picked]
        return self.model.compute_logits(hidden)

    def _forward_recurrent(
        self,
        carried: RecurrentStates,
        batch: ForwardBatch,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: AttentionContext,
    ) -> torch.Tensor:
        """The hidden states ``(T, hidden)`` of a forward carrying recurrent state."""
        if batch.seq_ids is None:
            raise ValueError("a model with recurrent layers needs ForwardBatch.seq_ids")
        prefix = batch.prefix_lens
        keep = batch.keep or [()] * batch.num_seqs
        marks: list[int | None] = []
        for i, (k, n) in enumerate(zip(keep, batch.extend_lens, strict=True)):
            inside = [x for x in k if x < n]
            if len(inside) > 1:
                raise ValueError(
                    f"sequence {i}: keep={tuple(k)} has {len(inside)} offsets inside the"
                    " forward; the model keeps its state at one at most"
                )
            marks.append(inside[0] if inside else None)
        states = carried.gather(batch.seq_ids, prefix)
        out = self.model.forward_batch(
            input_ids, positions, ctx, states, marks if any(marks) else ()
        )
        ends = [p + n for p, n in zip(prefix, batch.extend_lens, strict=True)]
        carried.scatter(batch.seq_ids, ends, out.states)
        for i, (key, k, n) in enumerate(zip(batch.seq_ids, keep, batch.extend_lens, strict=True)):
            kept: list[KeptState] = []
            mark = marks[i]
            if mark is not None:
                at = {layer: rows[i] for layer, rows in out.marked.items()}
                carried.keep_mark(key, prefix[i] + mark, at)
                marked = carried.take_mark(key)
                assert marked is not None
                kept.append(KeptState(marked[0], tuple(marked[1])))
            if n in k:
                tokens, tensors = carried.export(key)
                kept.append(KeptState(tokens, tuple(tensors)))
            if kept:
                self._extras[key] = SequenceExtras(tuple(kept))
        return out.hidden
