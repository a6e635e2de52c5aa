"""The common frame of the hybrid families (Gemma 3, GPT-OSS, Qwen3-Next, Nemotron-H).

A :class:`HybridLM` stacks layers of several kinds (``HybridConfig.layer_kinds``):
``full_attention`` / ``sliding_attention`` keep K/V in the paged pool (pool layer = rank
among attention layers, :attr:`HybridConfig.kv_layers`; with a separate SWA pool,
:attr:`HybridConfig.swa_split`, rank among the layers of its kind,
:meth:`HybridConfig.split_index`), ``linear_attention`` (Mamba2, Gated DeltaNet) carries a
:class:`~hicache.runner.models.recurrent.RecurrentState` between forwards, ``mlp`` / ``moe``
have no state. :meth:`HybridLM.run`: embed, the position encoding once, each layer as
``layer(x, rope, ctx, rctx)``, the final norm; a family overrides ``embed`` / ``rope`` /
``body``. ``forward(input_ids, positions, ctx, states)`` -> ``ModelOutput``;
:meth:`HybridLM.cache_spec`: full KV (global layers only under ``swa_split``), ``"swa"``,
``"mamba"``, each when present. Checkpoint tensors load by Hugging Face names; per-expert
``...experts.{e}.{proj}.weight`` into row ``e`` of the stacked parameter. Tensor
parallelism (when :meth:`HybridConfig.check_tensor_parallel` allows): ``docs/architecture.md``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch
from torch import nn

from hicache.heads import HeadSplit
from hicache.memory import DevicePool
from hicache.runner.models.attention import AttentionContext
from hicache.runner.models.cached import (
    BoundPools,
    CachedModel,
    ModelOutput,
    check_kv_pool,
    refuse_unused_pools,
)
from hicache.runner.models.config import UnsupportedModelError, check_split
from hicache.runner.models.decoder import WeightLoadError
from hicache.runner.models.recurrent import (
    RecurrentContext,
    RecurrentState,
    StateSpec,
    cache_state_spec,
)
from hicache.runner.models.rope import RotaryEmbedding
from hicache.runner.parallel import (
    ParallelLMHead,
    Split,
    TPGroup,
    VocabParallelEmbedding,
    gather_logits,
    row_pieces,
    shard_dims,
)
from hicache.spec import AttentionKind, CacheSpec, ComponentSpec, KVSpec, SlidingWindowSpec

__all__ = [
    "ATTENTION_KINDS",
    "LAYER_KINDS",
    "HybridBody",
    "HybridConfig",
    "HybridLM",
    "LayerStack",
]

ATTENTION_KINDS: tuple[str, ...] = ("full_attention", "sliding_attention")
LAYER_KINDS: tuple[str, ...] = (*ATTENTION_KINDS, "linear_attention", "mlp", "moe")
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight$")


@dataclass(frozen=True, kw_only=True)
class HybridConfig:
    """What every hybrid family shares. ``layer_kinds[i]`` is one of :data:`LAYER_KINDS`;
    attention layers have ``num_heads`` query and ``num_kv_heads`` K/V heads of ``head_dim``."""

    family: str
    vocab_size: int
    hidden_size: int
    layer_kinds: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_heads", "num_kv_heads", "head_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}={v!r} is invalid; must be an int >= 1")
        bad = sorted(set(self.layer_kinds) - set(LAYER_KINDS))
        if bad or not self.layer_kinds:
            raise ValueError(f"layer_kinds has {bad or 'no layers'}; allowed: {LAYER_KINDS}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps={self.rms_norm_eps!r} is invalid; must be > 0")

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    def check_tensor_parallel(self, size: int) -> None:
        """Refuse to split the model over ``size`` > 1 ranks when it cannot be:
        UnsupportedModelError naming the family by default (no sharded model); a family
        that splits overrides this with its own checks (ValueError naming the numbers)."""
        if size > 1:
            raise UnsupportedModelError(
                f"tensor parallelism is not supported for model_type={self.family!r}"
                f" (tensor-parallel size {size}); serve it with tensor-parallel size 1"
            )

    def check_attention_split(self, size: int, sizes: Sequence[tuple[str, int]] = ()) -> None:
        """The checks of a family whose attention heads split over ``size`` ranks
        (:class:`~hicache.heads.HeadSplit`: ValueError naming the head counts when ``size``
        divides neither way) and whose ``sizes`` (``(config field, value)``: MLP and
        expert columns) it divides (:func:`~hicache.runner.models.config.check_split`).
        More ranks than K/V heads replicate them. A model without attention layers has no
        heads to check."""
        if self.kv_layers:
            HeadSplit(self.num_heads, self.num_kv_heads, size)
        check_split(size, sizes, self.family)

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """Model layer ids of the attention layers; pool layer ``j`` is ``kv_layers[j]``."""
        return tuple(i for i, k in enumerate(self.layer_kinds) if k in ATTENTION_KINDS)

    def kv_index(self, layer_id: int) -> int:
        """The pool layer of attention layer ``layer_id``."""
        return self.kv_layers.index(layer_id)

    @property
    def window(self) -> int | None:
        """Sliding window of the ``sliding_attention`` layers in tokens (None: none)."""
        return None

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        """Model layer ids of the sliding-window attention layers."""
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == "sliding_attention")

    @property
    def global_layers(self) -> tuple[int, ...]:
        """Model layer ids of the full (global) attention layers."""
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == "full_attention")

    @property
    def swa_split(self) -> bool:
        """Whether the cache keeps the sliding layers in their own (SWA) pools: the model
        has a window, sliding layers and at least one global layer (whose pool is the
        full one)."""
        return self.window is not None and bool(self.sliding_layers) and bool(self.global_layers)

    def split_index(self, layer_id: int) -> int:
        """The pool layer of attention layer ``layer_id`` when :attr:`swa_split`: its rank
        among the sliding layers (SWA pool) or among the global layers (full pool)."""
        if layer_id in self.sliding_layers:
            return self.sliding_layers.index(layer_id)
        return self.global_layers.index(layer_id)

    def _spec(self, layers: int, dtype: str) -> KVSpec:
        return KVSpec(
            num_layers=layers,
            attention=AttentionKind.MHA,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=dtype,
        )

    def kv_spec(self, dtype: str) -> KVSpec:
        """The device pool's per-token shape: one pool layer per attention layer."""
        return self._spec(len(self.kv_layers), dtype)

    def full_kv_spec(self, dtype: str) -> KVSpec:
        """The full pool's per-token shape as the cache builds it: the global layers only
        when :attr:`swa_split`, else every attention layer (:meth:`kv_spec`)."""
        if self.swa_split:
            return self._spec(len(self.global_layers), dtype)
        return self.kv_spec(dtype)

    def swa_spec(self, dtype: str) -> SlidingWindowSpec | None:
        """The SWA pools' shape and window when :attr:`swa_split`, else None."""
        if not self.swa_split or self.window is None:
            return None
        return SlidingWindowSpec(kv=self._spec(len(self.sliding_layers), dtype), window=self.window)


class LayerStack(Protocol):
    """A hybrid's body as :meth:`HybridLM.run` uses it: the token embedding, the decoder
    layers (in order) and the final norm."""

    @property
    def embed_tokens(self) -> nn.Embedding | VocabParallelEmbedding: ...

    @property
    def layers(self) -> nn.ModuleList: ...

    @property
    def norm(self) -> nn.Module: ...


class HybridBody(nn.Module):
    """``model.*`` in the checkpoints of Gemma 3, GPT-OSS, Qwen3-Next and DeepSeek: the
    token embedding (``embed``; default vocab-parallel over ``tp``, the whole table with
    one rank), the decoder layers (in order) and the final norm."""

    def __init__(
        self,
        cfg: HybridConfig,
        layers: Iterable[nn.Module],
        norm: nn.Module,
        embed: nn.Embedding | VocabParallelEmbedding | None = None,
        *,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens: nn.Embedding | VocabParallelEmbedding = (
            VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp=tp or TPGroup.single())
            if embed is None
            else embed
        )
        self.layers = nn.ModuleList(layers)
        self.norm = norm


SWA = SlidingWindowSpec.name
"""The component of the sliding layers' own pool (``"swa"``)."""


class HybridLM(nn.Module, CachedModel):
    """Base of the hybrid models: subclasses build the modules (the body in ``model``, a
    :class:`HybridBody`, unless they override :meth:`body`; ``rotary`` unless they
    override :meth:`rope`) and the frame runs them (:meth:`run`). ``tp``: the
    tensor-parallel group this model is a rank of (one rank by default; see the module doc)."""

    config: HybridConfig
    model: HybridBody
    rotary: RotaryEmbedding

    def __init__(self, cfg: HybridConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp or TPGroup.single()

    @classmethod
    def build(cls, cfg: HybridConfig, tp: TPGroup | None = None) -> HybridLM:
        """The model of ``cfg`` on this rank of ``tp`` (default one rank). More than one rank
        is checked first (:meth:`HybridConfig.check_tensor_parallel`: a family that does not
        split refuses with UnsupportedModelError naming its ``model_type``); a family that
        splits takes ``tp`` as its constructor's second argument."""
        if tp is None or tp.size == 1:
            return cls(cfg)
        cfg.check_tensor_parallel(tp.size)
        return cls(cfg, tp)

    def after_cast(self) -> None:
        """Put back what the reference keeps in another dtype than the model's, after the
        model was cast to its dtype (nothing by default)."""

    # --- the frame and its hooks ----------------------------------------------------
    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: AttentionContext,
        rctx: RecurrentContext,
    ) -> torch.Tensor:
        """``input_ids``/``positions (T,)`` -> final hidden states ``(T, hidden)``: the
        embeddings, then every layer ``layer(x, rope, ctx, rctx)`` with the position
        encoding computed once, then the final norm."""
        body = self.body()
        x = self.embed(input_ids)
        rope = self.rope(positions, x.dtype)
        for layer in body.layers:
            x = layer(x, rope, ctx, rctx)
        out: torch.Tensor = body.norm(x)
        return out

    def body(self) -> LayerStack:
        """The embedding, the layers and the final norm (``model``)."""
        return self.model

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids (T,)`` -> the first layer's input ``(T, hidden)``."""
        x: torch.Tensor = self.input_embeddings()(input_ids)
        return x

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> object:
        """The position encoding every layer gets, computed once per forward: the rotary
        ``(cos, sin)`` of ``positions`` in ``dtype`` (a family may give its layers
        something else, or None)."""
        return self.rotary(positions, dtype)

    def input_embeddings(self) -> nn.Embedding | VocabParallelEmbedding:
        """The token embedding: ``weight (vocab, hidden)``, or this rank's ``(padded vocab
        / size, hidden)`` rows of it under tensor parallelism."""
        return self.body().embed_tokens

    def output_weight(self) -> torch.Tensor:
        """``(vocab, hidden)`` projection to logits (this rank's ``(padded vocab / size,
        hidden)`` rows under tensor parallelism): ``lm_head``, or the input embeddings when
        the config ties them."""
        head = self.lm_head
        return self.input_embeddings().weight if head is None else head.weight

    def _build_head(self) -> None:
        """The untied ``lm_head``, vocab-parallel over :attr:`tp` (``None`` when tied to the
        input embeddings); call from ``__init__`` after the embeddings exist."""
        cfg = self.config
        self.lm_head: ParallelLMHead | None = None
        if not cfg.tie_word_embeddings:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp=self.tp)

    @property
    def heads(self) -> HeadSplit:
        """The attention heads this rank holds (of :attr:`tp`)."""
        cfg = self.config
        return HeadSplit(cfg.num_heads, cfg.num_kv_heads, self.tp.size, self.tp.rank)

    @property
    def num_kv_heads(self) -> int:
        """The K/V heads this rank computes and caches (:attr:`HeadSplit.local_kv_heads
        <hicache.heads.HeadSplit.local_kv_heads>`): the head count of its MHA pools."""
        return self.heads.local_kv_heads

    def _local(self, spec: KVSpec) -> KVSpec:
        """``spec`` (the config's, every K/V head) as this rank holds it: an MHA pool keeps
        :attr:`num_kv_heads` heads; an MLA latent is whole on every rank."""
        if spec.attention is not AttentionKind.MHA or self.tp.size == 1:
            return spec
        return replace(spec, num_kv_heads=self.num_kv_heads)

    def split_params(self) -> dict[str, int]:
        """The parameters this rank holds a slice of besides the parallel layers'
        (:func:`~hicache.runner.parallel.shard_dims`): name -> the dimension along which
        it holds its contiguous ``1 / size`` (a stacked expert parameter ``(E, ...)``: a
        per-expert checkpoint tensor is cut along that dimension less one). By default
        those every submodule names in a ``tp_split_dims()`` method (its own parameter
        names -> dims); empty with one rank."""
        out: dict[str, int] = {}
        if self.tp.size == 1:
            return out
        for prefix, module in self.named_modules():
            dims = getattr(module, "tp_split_dims", None)
            if module is not self and callable(dims):
                base = f"{prefix}." if prefix else ""
                out.update({base + name: dim for name, dim in dims().items()})
        return out

    def recurrent_state(self) -> StateSpec | None:
        """The per-sequence state shapes of every ``linear_attention`` layer (Mamba2,
        Gated DeltaNet); None for a model without recurrent layers."""
        return None

    def state_specs(self) -> dict[int, StateSpec]:
        """Per recurrent layer id, its per-sequence state shapes (empty when none)."""
        spec = self.recurrent_state()
        if spec is None:
            return {}
        kinds = self.config.layer_kinds
        return {i: spec for i, kind in enumerate(kinds) if kind == "linear_attention"}

    def skip_tensor(self, name: str) -> bool:
        """Checkpoint tensors that are not parameters (rotary caches, MTP heads ...)."""
        return (
            name.endswith("rotary_emb.inv_freq")
            or name.startswith("mtp.")
            or (name == "lm_head.weight" and self.config.tie_word_embeddings)
        )

    # --- shared ---------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.input_embeddings().weight.dtype

    @property
    def device(self) -> torch.device:
        return self.input_embeddings().weight.device

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: AttentionContext,
        states: Mapping[int, RecurrentState] | None = None,
        marks: Sequence[int | None] = (),
    ) -> ModelOutput:
        """One forward over the batch described by ``ctx`` (see the module doc); ``marks``:
        see :class:`RecurrentContext`."""
        rctx = RecurrentContext(
            extend_lens=list(ctx.extend_lens),
            states=states or {},
            new_states={},
            dtype=self.dtype,
            device=self.device,
            marks=marks,
        )
        hidden = self.run(input_ids, positions, ctx, rctx)
        return ModelOutput(hidden=hidden, states=rctx.new_states, marked=rctx.marked)

    def forward_batch(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: AttentionContext,
        states: Mapping[int, RecurrentState] | None = None,
        marks: Sequence[int | None] = (),
    ) -> ModelOutput:
        out: ModelOutput = self(input_ids, positions, ctx, states, marks)
        return out

    # --- what it caches, and its pools ----------------------------------------------
    def cache_spec(self, dtype: str) -> CacheSpec:
        """The full KV (:meth:`HybridConfig.full_kv_spec`), then the sliding layers' spec
        (:meth:`HybridConfig.swa_spec`) and the recurrent layers' snapshots
        (:func:`~hicache.runner.models.recurrent.cache_state_spec`, in the model dtype),
        each when the model has them."""
        components: list[ComponentSpec] = []
        swa = self._swa_spec(dtype)
        if swa is not None:
            components.append(swa)
        specs = self.state_specs()
        if specs:
            components.append(cache_state_spec(specs, self.dtype))
        return CacheSpec(
            kv=self._local(self.config.full_kv_spec(dtype)), components=tuple(components)
        )

    def _swa_spec(self, dtype: str) -> SlidingWindowSpec | None:
        """The config's SWA spec with this rank's K/V heads (:meth:`_local`)."""
        swa = self.config.swa_spec(dtype)
        return None if swa is None else replace(swa, kv=self._local(swa.kv))

    def pool_components(self) -> tuple[str, ...]:
        """The components whose L1 pools the model reads and writes itself: the sliding
        layers' (``"swa"``, optional: without it they stay in the full pool) when
        :attr:`HybridConfig.swa_split`."""
        return (SWA,) if self.config.swa_split else ()

    def bind_pools(self, kv_pool: DevicePool, pools: Mapping[str, DevicePool]) -> BoundPools:
        """``kv_pool`` holds every attention layer (:meth:`HybridConfig.kv_spec`), or the
        global layers only (:meth:`HybridConfig.full_kv_spec`) when ``pools`` has the
        sliding layers' own pool (``"swa"``: same device and page size, one pool layer per
        sliding layer)."""
        refuse_unused_pools(type(self).__name__, pools, self.pool_components())
        window = pools.get(SWA)
        if window is not None:
            self._check_window_pool(window, kv_pool)
        full = self.config.full_kv_spec if window is not None else self.config.kv_spec
        check_kv_pool(kv_pool, self._local(full(kv_pool.spec.dtype)), self.device)
        if window is None:
            return BoundPools(kv_pool)
        return BoundPools(kv_pool, {SWA: window}, SWA)

    def _check_window_pool(self, window: DevicePool, kv_pool: DevicePool) -> None:
        """Raise ValueError unless ``window`` fits the model's sliding layers."""
        want = self._swa_spec(window.spec.dtype)
        assert want is not None  # pool_components() offered it
        have = window.spec
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
        if window.device != kv_pool.device or window.page_size != kv_pool.page_size:
            raise ValueError("the SWA pool must share the full pool's device and page size")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden (N, hidden)`` -> the full logits ``(N, vocab)`` in fp32 on every rank
        (each rank's vocabulary rows gathered, :func:`~hicache.runner.parallel.gather_logits`;
        ``F.linear(hidden, weight).float()`` with one rank)."""
        return gather_logits(hidden, self.output_weight(), self.config.vocab_size, self.tp)

    def zero_states(self, num_seqs: int) -> dict[int, RecurrentState]:
        """States of ``num_seqs`` fresh sequences, for every recurrent layer."""
        return {
            i: RecurrentState.zeros(s, num_seqs, dtype=self.dtype, device=self.device)
            for i, s in self.state_specs().items()
        }

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy full-size checkpoint tensors into the parameters (casting dtype), each cut
        to this rank's slice first (:meth:`_sharded`); every parameter (and every expert
        row) must be covered. Raises :class:`WeightLoadError` otherwise."""
        self._load(self._sharded(tensors))

    def _sharded(
        self, tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``tensors`` with each split one cut to this rank's slice: the parallel layers'
        (:func:`~hicache.runner.parallel.shard_dims`, vocabulary rows padded) and
        :meth:`split_params` (a per-expert tensor of a stacked parameter along its dim less
        one), and the row pieces a module declares for fused projections
        (:func:`~hicache.runner.parallel.row_pieces`; a per-expert tensor by its stacked
        parameter's name); the others whole. A split tensor's *full* shape is checked first
        (:class:`WeightLoadError` naming it), so a checkpoint of another size does not load
        silently as a slice. With one rank, ``tensors`` unchanged."""
        tp = self.tp
        if tp.size == 1:
            yield from tensors
            return
        params = dict(self.named_parameters())
        cuts: dict[str, Split] = shard_dims(self)
        cuts.update({name: Split(dim) for name, dim in self.split_params().items()})
        pieces = row_pieces(self)
        for name, tensor in tensors:
            target, cut, expert = name, cuts.get(name), False
            if cut is None and (m := _EXPERT.match(name)):
                target = f"{m.group(1)}.{m.group(3)}"
                cut, expert = cuts.get(target), True
            if cut is None:
                spec = pieces.get(target)
                yield name, tensor if spec is None else spec.cut(tensor)
                continue
            dim = cut.dim - 1 if expert else cut.dim
            want = list(params[target].shape[1:] if expert else params[target].shape)
            want[dim] = cut.full if cut.full is not None else want[dim] * tp.size
            if list(tensor.shape) != want:
                raise WeightLoadError(
                    f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape"
                    f" {tuple(want)} (the full tensor, before this rank's slice)"
                )
            yield name, tp.shard(tensor, dim, cut.padded, cut.rows)

    def _load(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy ``tensors`` (this rank's slices) into the parameters; see :meth:`load_weights`."""
        params = dict(self.named_parameters())
        whole: set[str] = set()
        rows: dict[str, set[int]] = {}
        unexpected: list[str] = []
        for name, tensor in tensors:
            if self.skip_tensor(name):
                continue
            target, row = name, None
            match = _EXPERT.match(name)
            if match and name not in params:
                target, row = f"{match.group(1)}.{match.group(3)}", int(match.group(2))
            param = params.get(target)
            if param is None or (row is not None and row >= param.shape[0]):
                unexpected.append(name)
                continue
            dest = param if row is None else param[row]
            if tuple(tensor.shape) != tuple(dest.shape):
                raise WeightLoadError(
                    f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape "
                    f"{tuple(dest.shape)}"
                )
            with torch.no_grad():
                dest.copy_(tensor)
            if row is None:
                whole.add(target)
            else:
                rows.setdefault(target, set()).add(row)
        missing = sorted(
            n
            for n, p in params.items()
            if n not in whole and len(rows.get(n, ())) < (p.shape[0] if n in rows else 1)
        )
        if unexpected or missing:
            raise WeightLoadError(
                f"checkpoint does not match the {self.config.family} model: "
                f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}"
            )
