"""The live recurrent state of each running sequence, kept by the runner between forwards.

One state per running sequence (:mod:`hicache.runner.models.recurrent`), keyed by the
scheduler's request id: created at the sequence's first forward from zeros (position 0) or
put from a cached snapshot (:meth:`RecurrentStates.put`) where the cache served a prefix
ending at a snapshot boundary; advanced after every forward that succeeds; dropped when the
request ends, is aborted or retracted (it restarts from its deepest cached snapshot, or
from 0 and zeros). Invariant: an entry covers exactly its sequence's first ``tokens``
positions, so a forward must start at ``tokens`` (resume) or 0 (restart); any other start
(a prefix served without its snapshot) is refused with ValueError. Shapes of the canonical
form snapshots travel in (:meth:`export` / :meth:`put`, wrapped as
:class:`~hicache.extras.KeptState`; :func:`~hicache.runner.models.recurrent.cache_state_spec`):
``conv (1, L, C, K-1)`` in the model dtype and ``ssm (1, L, ...)`` in fp32, ``L`` the
recurrent layers in layer order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from hicache.runner.models.recurrent import RecurrentState, StateSpec

__all__ = ["RecurrentStates"]


@dataclass(frozen=True)
class _Entry:
    """``states[layer]`` (batch 1) after the sequence's first ``tokens`` positions."""

    tokens: int
    states: dict[int, RecurrentState]


class RecurrentStates:
    """Per-sequence recurrent state of a model whose recurrent layers are ``specs``
    (``{layer_id: StateSpec}``, as :meth:`CachedModel.state_specs` returns); ``conv`` states
    are ``dtype`` on ``device``, ``ssm`` states fp32 (see :class:`RecurrentState`)."""

    def __init__(
        self, specs: Mapping[int, StateSpec], *, dtype: torch.dtype, device: torch.device
    ) -> None:
        if not specs:
            raise ValueError("RecurrentStates needs at least one recurrent layer spec")
        self.specs = dict(specs)
        self.dtype = dtype
        self.device = device
        self._entries: dict[str, _Entry] = {}
        self._marks: dict[str, _Entry] = {}
        """States at a mark inside a sequence's last forward (see :meth:`keep_mark`)."""

    def __len__(self) -> int:
        """Sequences holding a state or a mark."""
        return len(self._entries.keys() | self._marks.keys())

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def tokens(self, key: str) -> int | None:
        """Positions the state of ``key`` covers, or None when it has none."""
        entry = self._entries.get(key)
        return None if entry is None else entry.tokens

    @property
    def nbytes(self) -> int:
        """Bytes of the states held (views of a shared batch tensor counted per row)."""
        total = 0
        for entry in self._entries.values():
            for s in entry.states.values():
                total += s.conv.numel() * s.conv.element_size()
                total += s.ssm.numel() * s.ssm.element_size()
        return total

    def gather(
        self, keys: Sequence[str], prefix_lens: Sequence[int]
    ) -> dict[int, RecurrentState] | None:
        """The input states of a batch: row ``i`` is sequence ``keys[i]``'s state after its
        first ``prefix_lens[i]`` positions; zeros when ``prefix_lens[i] == 0``. None when
        every sequence starts from zeros (the model's default). Raises ValueError, changing
        nothing, when a sequence's prefix is not what its state covers."""
        if len(keys) != len(prefix_lens):
            raise ValueError(f"{len(keys)} keys but {len(prefix_lens)} prefix lengths")
        rows: list[_Entry | None] = []
        for key, prefix in zip(keys, prefix_lens, strict=True):
            if prefix == 0:
                rows.append(None)
                continue
            entry = self._entries.get(key)
            if entry is None or entry.tokens != prefix:
                have = "no state" if entry is None else f"a state of {entry.tokens} positions"
                raise ValueError(
                    f"sequence {key!r} resumes at position {prefix} but the runner holds {have}:"
                    " a recurrent model can resume only its own running state or a snapshot"
                    " the cache handed it (ModelRunner.resume)"
                )
            rows.append(entry)
        if all(r is None for r in rows):
            return None
        out: dict[int, RecurrentState] = {}
        for layer, spec in self.specs.items():
            zero: RecurrentState | None = None
            parts: list[RecurrentState] = []
            for r in rows:
                if r is not None:
                    parts.append(r.states[layer])
                    continue
                if zero is None:
                    zero = RecurrentState.zeros(spec, 1, dtype=self.dtype, device=self.device)
                parts.append(zero)
            out[layer] = RecurrentState.stack(parts)
        return out

    def scatter(
        self, keys: Sequence[str], tokens: Sequence[int], states: Mapping[int, RecurrentState]
    ) -> None:
        """Keep row ``i`` of every layer of ``states`` (a forward's output, batch order) as
        the state of ``keys[i]`` covering its first ``tokens[i]`` positions."""
        if set(states) != set(self.specs):
            raise ValueError(
                f"states of layers {sorted(states)}; the model's recurrent layers are"
                f" {sorted(self.specs)}"
            )
        for layer, s in states.items():
            if s.batch != len(keys):
                raise ValueError(f"layer {layer}: state batch {s.batch} != {len(keys)} sequences")
        for i, (key, n) in enumerate(zip(keys, tokens, strict=True)):
            rows = slice(i, i + 1)
            self._entries[key] = _Entry(n, {layer: s.select(rows) for layer, s in states.items()})

    def keep_mark(self, key: str, tokens: int, states: Mapping[int, RecurrentState]) -> None:
        """Keep ``states`` (batch 1, every recurrent layer) as ``key``'s state after its first
        ``tokens`` positions, a point inside its last forward, until :meth:`take_mark`."""
        if set(states) != set(self.specs):
            raise ValueError(f"a mark of layers {sorted(states)}; expected {sorted(self.specs)}")
        self._marks[key] = _Entry(tokens, dict(states))

    def take_mark(self, key: str) -> tuple[int, list[torch.Tensor]] | None:
        """The state kept at ``key``'s mark (positions covered, canonical tensors), once;
        None when there is none."""
        entry = self._marks.pop(key, None)
        return None if entry is None else (entry.tokens, _canonical(self.specs, entry))

    def put(self, key: str, tokens: int, data: Sequence[torch.Tensor]) -> None:
        """Set the state of ``key`` to a snapshot covering its first ``tokens`` positions
        (canonical ``[conv (1, L, ...), ssm (1, L, ...)]``, see the module docstring)."""
        conv, ssm = data
        layers = sorted(self.specs)
        if conv.shape[:2] != (1, len(layers)) or ssm.shape[:2] != (1, len(layers)):
            raise ValueError(
                f"a snapshot of {tuple(conv.shape)} / {tuple(ssm.shape)} does not fit"
                f" {len(layers)} recurrent layers"
            )
        conv = conv.to(self.device, self.dtype)
        ssm = ssm.to(self.device, torch.float32)
        states = {
            layer: RecurrentState(conv=conv[:, i].clone(), ssm=ssm[:, i].clone())
            for i, layer in enumerate(layers)
        }
        self._entries[key] = _Entry(tokens, states)

    def export(self, key: str) -> tuple[int, list[torch.Tensor]]:
        """The positions the state of ``key`` covers and its canonical tensors (copies)."""
        entry = self._entries[key]
        return entry.tokens, _canonical(self.specs, entry)

    def drop(self, key: str) -> bool:
        """Forget the state of ``key`` (and any mark); False when it had none."""
        self._marks.pop(key, None)
        return self._entries.pop(key, None) is not None


def _canonical(specs: Mapping[int, StateSpec], entry: _Entry) -> list[torch.Tensor]:
    """``entry``'s states as the canonical ``[conv (1, L, ...), ssm (1, L, ...)]`` (new
    tensors), layers in id order."""
    layers = sorted(specs)
    conv = torch.stack([entry.states[i].conv for i in layers], dim=1)
    ssm = torch.stack([entry.states[i].ssm for i in layers], dim=1)
    return [conv, ssm]
