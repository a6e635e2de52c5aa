"""Stand-ins for scheduler tests: a model runner and a tokenizer whose outputs are known
in advance, and a scheduler built on them over a real cache.

Each sequence's last token ``t`` (or each row of ``logit_rows``) gets logits with all the
mass on ``t + 1`` (mod :data:`VOCAB`): a greedy draw is ``t + 1`` and a log probability is
exactly 0 (that id) or :data:`MISS` (any other). Every forward's ``extend_lens`` and
``logit_rows`` are recorded; prefix loads are waited for layer by layer like the model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hicache.cache import HiCache
from hicache.engine.request import Request, RequestOutput
from hicache.engine.role import Role
from hicache.engine.step.output import OutputProcessor
from hicache.engine.step.scheduler import Scheduler, SchedulerConfig
from hicache.extras import SequenceExtras
from hicache.runner.model_runner import ForwardBatch

VOCAB = 100
MISS = -1e9


class NextTokenRunner:
    """What the scheduler needs of a runner: ``device``, ``forward``, whether it resumes
    any cached prefix (yes here: a pure attention model), ``take_extras`` (nothing kept),
    ``resume`` and ``drop_state``."""

    device = torch.device("cpu")
    resumable_prefix = True

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

    def take_extras(self, seq_id: str) -> SequenceExtras | None:
        """No state carried: nothing kept."""
        return None

    def resume(self, seq_id: str, extras: SequenceExtras) -> None:
        raise ValueError("a pure attention model resumes from no state")

    def drop_state(self, seq_id: str) -> None:
        """No state carried: nothing to drop."""


class SpaceTokenizer:
    """Decodes ids as their decimal numbers joined by spaces: every text known in advance."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


def make_scheduler(
    cache: HiCache, role: Role | None = None, **config: Any
) -> tuple[Scheduler, NextTokenRunner]:
    """A scheduler over ``cache`` with a :class:`NextTokenRunner` and
    :class:`SpaceTokenizer` outputs (no end-of-sequence id, context 64), the instance's
    ``role`` (None: plain); ``config``: :class:`SchedulerConfig` fields."""
    runner = NextTokenRunner()
    output = OutputProcessor(SpaceTokenizer(), eos_token_ids=[], context_length=64)
    sched = Scheduler(cache, runner, output, SchedulerConfig(**config), role=role)  # type: ignore[arg-type]
    return sched, runner


_CLIENTS: dict[str, Callable[[RequestOutput], None]] = {}
"""``rid ->`` the callback :func:`step` hands the request's reports to (request ids are
unique in a process)."""


def client(req: Request, on_output: Callable[[RequestOutput], None]) -> Request:
    """``req``, whose reports :func:`step` hands to ``on_output`` (as rank 0's driver
    hands them to a client)."""
    _CLIENTS[req.rid] = on_output
    return req


def step(sched: Scheduler) -> bool:
    """One engine step of ``sched``, as the engine runs it: the cache's ``sync()`` (the one
    point per step where worker records are applied), then the scheduler's step; then,
    as rank 0's driver, every report made since the last step goes to its request's
    :func:`client` callback."""
    sched.cache.sync()
    busy = sched.step()
    for out in sched.ends.take().reports:
        on_output = _CLIENTS.pop(out.rid, None) if out.finished else _CLIENTS.get(out.rid)
        if on_output is not None:
            on_output(out)
    return busy


def run_until_idle(sched: Scheduler, steps: int = 100) -> None:
    """Step ``sched`` (:func:`step`) until it is idle; AssertionError after ``steps``
    steps."""
    for _ in range(steps):
        if sched.idle:
            return
        step(sched)
    raise AssertionError("the scheduler did not finish")
