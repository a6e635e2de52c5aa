"""Recurrent layer state and how it is carried between forwards (Mamba2, Gated DeltaNet).

Recurrent layers keep no cache of their own: each forward receives, per recurrent layer,
the state *before* the batch's new tokens and returns the state *after* them. Shapes:
:class:`RecurrentState` ``(conv, ssm)`` for ``B`` sequences in batch order, ``conv (B, C,
K-1)`` the last ``K-1`` inputs of the depthwise causal conv (oldest first, model dtype),
``ssm`` fp32 ``(B, H, P, N)`` for Mamba2 (heads, head dim, state size) or ``(B, H, Dk, Dv)``
for Gated DeltaNet; a fresh sequence starts from :meth:`RecurrentState.zeros`.
:class:`StateSpec` gives the shapes per layer (``model.state_specs()``) so a state pool can
allocate before any forward; :meth:`RecurrentState.stack` / :meth:`~RecurrentState.select`
build a batch from snapshots and split it back. ``forward(input_ids, positions, ctx,
states: Mapping[layer_id, RecurrentState])`` (absent layers start from zeros) returns
``ModelOutput`` with ``hidden`` and every recurrent layer's ``states`` (``B`` rows).
Invariants: inputs are never modified in place; recurrent layers take no KV pool memory
(attention layers' pool layer is their rank among attention layers).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from hicache.spec import SnapshotSpec, StateTensor

__all__ = [
    "RecurrentContext",
    "RecurrentState",
    "StateSpec",
    "cache_state_spec",
    "causal_conv",
]


@dataclass(frozen=True)
class StateSpec:
    """Per-sequence state shapes of one recurrent layer: ``conv (C, K-1)``, ``ssm`` 3-D."""

    conv: tuple[int, int]
    ssm: tuple[int, int, int]

    def bytes_per_sequence(self, conv_dtype: torch.dtype) -> int:
        """Bytes one sequence's state takes (ssm in fp32)."""
        conv = self.conv[0] * self.conv[1] * torch.empty((), dtype=conv_dtype).element_size()
        return conv + self.ssm[0] * self.ssm[1] * self.ssm[2] * 4


_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def cache_state_spec(specs: Mapping[int, StateSpec], dtype: torch.dtype) -> SnapshotSpec:
    """The cache's per-slot shape of a model's recurrent state: every recurrent layer's
    ``conv`` (in ``dtype``) and ``ssm`` (fp32). The layers must share their shapes (true of
    every supported family); ValueError otherwise."""
    shapes = {(s.conv, s.ssm) for s in specs.values()}
    if len(shapes) != 1:
        raise ValueError(f"recurrent layers of different state shapes: {sorted(shapes)}")
    ((conv, ssm),) = shapes
    return SnapshotSpec(
        num_layers=len(specs),
        tensors=(
            StateTensor(name="conv", shape=tuple(conv), dtype=_DTYPE_NAMES[dtype]),
            StateTensor(name="ssm", shape=tuple(ssm), dtype="float32"),
        ),
    )


@dataclass(frozen=True)
class RecurrentState:
    """One recurrent layer's state for ``B`` sequences: ``conv (B, C, K-1)``, ``ssm (B, ...)``."""

    conv: torch.Tensor
    ssm: torch.Tensor

    def __post_init__(self) -> None:
        if self.conv.dim() != 3 or self.ssm.dim() != 4 or self.conv.shape[0] != self.ssm.shape[0]:
            raise ValueError(
                f"RecurrentState needs conv (B, C, K-1) and ssm (B, H, *, *) with the same B, "
                f"got {tuple(self.conv.shape)} and {tuple(self.ssm.shape)}"
            )

    @property
    def batch(self) -> int:
        return int(self.conv.shape[0])

    @classmethod
    def zeros(
        cls, spec: StateSpec, batch: int, *, dtype: torch.dtype, device: torch.device | str
    ) -> RecurrentState:
        """The state of ``batch`` sequences that have seen no token."""
        return cls(
            conv=torch.zeros((batch, *spec.conv), dtype=dtype, device=device),
            ssm=torch.zeros((batch, *spec.ssm), dtype=torch.float32, device=device),
        )

    @classmethod
    def stack(cls, states: Sequence[RecurrentState]) -> RecurrentState:
        """Concatenate batches (e.g. per-sequence snapshots) in order."""
        return cls(conv=torch.cat([s.conv for s in states]), ssm=torch.cat([s.ssm for s in states]))

    def select(self, rows: slice | Sequence[int]) -> RecurrentState:
        """Rows ``rows`` as a new state (copies for a list, views for a slice)."""
        if isinstance(rows, slice):
            return RecurrentState(conv=self.conv[rows], ssm=self.ssm[rows])
        index = torch.tensor(list(rows), dtype=torch.int64, device=self.conv.device)
        return RecurrentState(conv=self.conv[index], ssm=self.ssm[index])


def causal_conv(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of new inputs after ``state``, then SiLU.

    ``x (B, C, T)`` new inputs, ``state (B, C, K-1)`` the previous ones, ``weight (C, 1, K)``.
    Returns ``(silu(out) (B, C, T), new_state (B, C, K-1))``; a zero state equals left
    zero padding, so a prefill and any split of it into chunks agree.
    """
    window = weight.shape[-1] - 1
    full = torch.cat((state.to(x.dtype), x), dim=-1)
    out = F.conv1d(full, weight.to(x.dtype), bias, groups=x.shape[1])
    return F.silu(out), full[:, :, full.shape[-1] - window :]


StepFn = Callable[[torch.Tensor, RecurrentState], tuple[torch.Tensor, RecurrentState]]


@dataclass
class RecurrentContext:
    """What recurrent layers need from a forward: the batch's segmentation and states.

    ``extend_lens[i]`` new tokens of sequence ``i`` (concatenated in order in ``x``);
    ``states`` the input per layer id (absent = zeros); ``new_states`` is filled by the
    layers as they run. ``dtype``/``device`` are the model's (for zero states).
    ``marks[i]`` (optional, ``0 < marks[i] < extend_lens[i]``): also keep sequence ``i``'s
    state after its first ``marks[i]`` new tokens, in ``marked[layer_id][i]`` (a snapshot
    boundary inside a prefill chunk, taken without ending the forward there).
    """

    extend_lens: list[int]
    states: Mapping[int, RecurrentState]
    new_states: dict[int, RecurrentState]
    dtype: torch.dtype
    device: torch.device
    marks: Sequence[int | None] = ()
    marked: dict[int, dict[int, RecurrentState]] = field(default_factory=dict)

    def run(self, layer_id: int, spec: StateSpec, x: torch.Tensor, step: StepFn) -> torch.Tensor:
        """Apply ``step(x_b (B, n, ...), state_b) -> (y_b (B, n, ...), state_b')``.

        ``x (T, ...)``. A batch of single-token sequences runs as one call with ``B =
        num_seqs``; otherwise each sequence runs alone (``B = 1``). Records the new state of
        layer ``layer_id`` and returns ``y (T, ...)``.
        """
        num = len(self.extend_lens)
        state = self.states.get(layer_id)
        if state is None:
            state = RecurrentState.zeros(spec, num, dtype=self.dtype, device=self.device)
        elif state.batch != num:
            raise ValueError(f"layer {layer_id}: state batch {state.batch} != {num} sequences")
        if all(n == 1 for n in self.extend_lens):
            y, new = step(x[:, None], state)
            self.new_states[layer_id] = new
            return y[:, 0]
        outs, news = [], []
        start = 0
        for i, n in enumerate(self.extend_lens):
            xi, si = x[None, start : start + n], state.select(slice(i, i + 1))
            mark = self.marks[i] if self.marks else None
            if mark:  # two steps: the state between them is the mark's
                head, mid = step(xi[:, :mark], si)
                tail, new = step(xi[:, mark:], mid)
                self.marked.setdefault(layer_id, {})[i] = mid
                y = torch.cat((head, tail), dim=1)
            else:
                y, new = step(xi, si)
            outs.append(y[0])
            news.append(new)
            start += n
        self.new_states[layer_id] = RecurrentState.stack(news)
        return torch.cat(outs)
