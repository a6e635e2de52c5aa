"""What a model caches, and the pools it reads and writes: the contract between a model
family and the runner (and, through the runner's caller, the cache).

Every model the runner serves is a :class:`CachedModel`: :meth:`~CachedModel.cache_spec`
declares what it caches per token (the full KV and one :class:`~hicache.spec.ComponentSpec`
per extra component; the cache builds a store per component); :meth:`~CachedModel.bind_pools`
checks the pools it is given by name against that spec (ValueError for one it has no use
for) and returns the :class:`BoundPools` every forward's
:class:`~hicache.runner.models.attention.AttentionContext` is built from;
:meth:`~CachedModel.state_specs` lists its per-sequence recurrent state;
:meth:`~CachedModel.forward_batch` and :meth:`~CachedModel.compute_logits` run it;
:attr:`~CachedModel.supports_decode_graphs` says whether decode batches may replay CUDA
graphs. Invariant: the runner calls nothing else, so it names no model family and no
component.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import torch

from hicache.memory import DevicePool
from hicache.runner.models.attention import AttentionContext, SlidingKV
from hicache.runner.models.recurrent import RecurrentState, StateSpec
from hicache.spec import CacheSpec, KVSpec

__all__ = [
    "BoundPools",
    "CachedModel",
    "ModelOutput",
    "ModelShape",
    "check_kv_pool",
    "refuse_unused_pools",
]


class ModelShape(Protocol):
    """What every family's config tells about itself (its ``config`` attribute)."""

    @property
    def family(self) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def num_layers(self) -> int: ...


@dataclass(frozen=True)
class ModelOutput:
    """``hidden (T, hidden)`` final hidden states; ``states`` every recurrent layer's state
    after the batch (``B = num_seqs`` rows, batch order), keyed by model layer id (empty
    for a model without recurrent layers); ``marked[layer][i]`` sequence ``i``'s state at
    its mark (batch 1; see :class:`~hicache.runner.models.recurrent.RecurrentContext`),
    for the sequences given one."""

    hidden: torch.Tensor
    states: dict[int, RecurrentState] = field(default_factory=dict)
    marked: dict[int, dict[int, RecurrentState]] = field(default_factory=dict)


@dataclass(frozen=True)
class BoundPools:
    """The pools a model was bound to (:meth:`CachedModel.bind_pools`).

    ``kv``: the full KV's L1 pool. ``components``: the component pools the model reads and
    writes itself, by component name (those given; the model checked each). ``window``:
    the component whose pool the sliding-window layers read and write (their slots come
    in ``ForwardBatch.pool_slots[window]``); None when every attention layer is in ``kv``.
    """

    kv: DevicePool
    components: Mapping[str, DevicePool] = field(default_factory=dict)
    window: str | None = None

    def __post_init__(self) -> None:
        if self.window is not None and self.window not in self.components:
            raise ValueError(f"window={self.window!r} names no bound pool")

    @property
    def window_pool(self) -> DevicePool | None:
        """The sliding layers' own pool (None: every attention layer is in :attr:`kv`)."""
        return None if self.window is None else self.components[self.window]

    def attention_context(
        self,
        seq_slots: list[torch.Tensor],
        extend_lens: list[int],
        layer_wait: Callable[[int], None] | None,
        pool_slots: Mapping[str, list[torch.Tensor]] | None,
        *,
        kernels: bool,
    ) -> AttentionContext:
        """The attention inputs of one forward over these pools: ``seq_slots`` in
        :attr:`kv`, and with a :attr:`window` pool the sliding layers' slots
        ``pool_slots[window]`` in it (ValueError when absent). ``kernels``: attend with
        the Triton decode and extend kernels."""
        swa = None
        if self.window is not None:
            table = (pool_slots or {}).get(self.window)
            if table is None:
                raise ValueError(
                    f"a runner with an SWA pool needs ForwardBatch.pool_slots[{self.window!r}]"
                )
            swa = SlidingKV.build(self.components[self.window], table, extend_lens)
        return AttentionContext.build(
            self.kv,
            seq_slots,
            extend_lens,
            layer_wait,
            swa,
            decode_kernel=kernels,
            extend_kernel=kernels,
        )


def refuse_unused_pools(model: str, pools: Mapping[str, DevicePool], uses: Sequence[str]) -> None:
    """ValueError naming the pools of ``pools`` that ``model`` (its class name) does not
    read or write (``uses``: the components whose pools it does)."""
    unused = sorted(set(pools) - set(uses))
    if unused:
        has = f"pools of {sorted(uses)} only" if uses else "no component pool"
        raise ValueError(
            f"the runner uses no pool of component(s) {unused}: {model} reads and writes {has}"
        )


def check_kv_pool(pool: DevicePool, want: KVSpec, device: torch.device) -> None:
    """ValueError unless ``pool`` has ``want``'s attention kind, layers, heads and width
    (its dtype may differ: K/V are cast on write and read) and lives on ``device``."""
    spec = pool.spec
    kind = want.attention
    shape = (want.num_layers, want.heads, want.dim)
    have = (spec.num_layers, spec.heads, spec.dim)
    if spec.attention is not kind or shape != have:
        raise ValueError(
            f"device pool (layers, heads, dim)={have} ({spec.attention.value}) "
            f"does not fit the model's {shape} ({kind.value})"
        )
    if pool.device != device:
        raise ValueError(f"pool on {pool.device} but model on {device}")


class CachedModel(ABC):
    """The runner's view of a model (see the module doc); mixed into each family's
    ``nn.Module``."""

    config: ModelShape

    supports_decode_graphs: ClassVar[bool] = False
    """Whether decode-only batches may run through CUDA graphs
    (:class:`~hicache.runner.decode_graphs.DecodeGraphs`): the forward reads and writes the
    full KV's pool only, through the attention context alone (no component pool, no
    state carried between forwards). The plain decoder declares it; the hybrids do not."""

    @property
    @abstractmethod
    def dtype(self) -> torch.dtype:
        """The weights' dtype (hidden states and ``conv`` states are in it)."""

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    @abstractmethod
    def cache_spec(self, dtype: str) -> CacheSpec:
        """What the model caches per token, for the cache (``dtype``: the KV dtype): the
        full KV and a spec per extra component. A tensor-parallel rank's model caches its
        own K/V heads only: its pools hold those."""

    @abstractmethod
    def bind_pools(self, kv_pool: DevicePool, pools: Mapping[str, DevicePool]) -> BoundPools:
        """Check ``kv_pool`` (the full KV's L1 pool) and ``pools`` (component pools by
        name) against :meth:`cache_spec` and the model's device, and bind them. ValueError
        naming what does not fit, a pool the model has no use for, or one it needs and
        did not get."""

    def state_specs(self) -> dict[int, StateSpec]:
        """Per recurrent layer id, its per-sequence state shapes (empty when none)."""
        return {}

    @abstractmethod
    def forward_batch(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: AttentionContext,
        states: Mapping[int, RecurrentState] | None = None,
        marks: Sequence[int | None] = (),
    ) -> ModelOutput:
        """One forward: ``input_ids``/``positions (T,)`` int64 over the batch ``ctx``
        describes; ``states``: each recurrent layer's state before the new tokens (absent
        ones start from zeros), ``marks``: where to keep it inside the forward (see
        :class:`~hicache.runner.models.recurrent.RecurrentContext`)."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden (N, hidden)`` -> logits ``(N, vocab)`` in fp32 (full on every rank)."""
