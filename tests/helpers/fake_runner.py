"""A stand-in for the model runner in scheduler tests: outputs known in advance.

Each sequence's last token ``t`` (or each row of ``logit_rows``) gets logits with all the
mass on ``t + 1`` (mod :data:`VOCAB`): a greedy draw is ``t + 1`` and a log probability is
exactly 0 (that id) or :data:`MISS` (any other). Every forward's ``extend_lens`` and
``logit_rows`` are recorded; prefix loads are waited for layer by layer like the model.
"""

from __future__ import annotations

import torch

from hicache.engine.runner import ForwardBatch

VOCAB = 100
MISS = -1e9


class NextTokenRunner:
    """What the scheduler needs of a runner: ``device``, ``forward``, the recurrent-state
    capability (none here: a pure attention model) and ``drop_state``."""

    device = torch.device("cpu")
    resumable_prefix = True
    recurrent = False

    def __init__(self, num_layers: int = 2) -> None:
        self.num_layers = num_layers
        self.batches: list[list[int]] = []
        self.logit_rows: list[list[int] | None] = []

    def forward(self, batch: ForwardBatch, *, logit_rows: list[int] | None = None) -> torch.Tensor:
        self.batches.append(list(batch.extend_lens))
        self.logit_rows.append(None if logit_rows is None else list(logit_rows))
        if batch.layer_wait is not None:
            for layer in range(self.num_layers):
                batch.layer_wait(layer)
        if logit_rows is None:
            logit_rows = (torch.tensor(batch.extend_lens).cumsum(0) - 1).tolist()
        picked = batch.input_ids[logit_rows]
        logits = torch.full((len(logit_rows), VOCAB), MISS)
        logits[torch.arange(len(logit_rows)), (picked + 1) % VOCAB] = 0.0
        return logits

    def drop_state(self, seq_id: str) -> None:
        """No recurrent layers: nothing to drop."""
