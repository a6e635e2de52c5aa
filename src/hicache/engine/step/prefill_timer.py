"""How fast this rank prefills: :class:`PrefillTimer` times the forwards that prefill.

A forward with a prefill chunk (more than one new position, or a request's first) is one
observation of :class:`~hicache.rates.Throughput`: every token it computed (decode tokens
of the batch included) over its seconds. A forward that waited for a load back is not
timed (it measures the load, not the compute). On CUDA the forward is timed by two events
on the current stream and read once they have passed (never waited for); on a CPU it is
the forward's wall time. Engine thread only.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from hicache.engine.step.batch import Chunk
from hicache.rates import MAX_TOKENS_PER_SECOND, RateFit, Throughput

__all__ = ["PrefillTimer", "prefill_tokens"]

_MAX_PENDING = 64
"""CUDA timings kept until their events have passed; older ones are dropped."""


def prefill_tokens(batch: Sequence[Chunk]) -> int | None:
    """The tokens a forward of ``batch`` computes when it prefills (a chunk of more than
    one position, or of a request with no output yet); None when it only decodes."""
    if any(c.tokens > 1 or not c.req.output_ids for c in batch):
        return sum(c.tokens for c in batch)
    return None


class PrefillTimer:
    """Prefill tokens per second of this rank's own forwards (see the module docstring).
    ``device``: where the forwards run."""

    def __init__(self, device: torch.device) -> None:
        self.meter = Throughput(max_per_second=MAX_TOKENS_PER_SECOND)
        """Tokens computed by the timed forwards, and their seconds."""
        self._cuda = device.type == "cuda"
        self._pending: deque[tuple[int, Any, Any]] = deque(maxlen=_MAX_PENDING)

    @contextmanager
    def forward(self, tokens: int | None) -> Iterator[None]:
        """Time the forward run inside, of ``tokens`` tokens (None: not timed). A forward
        that raises is not observed."""
        if tokens is None:
            yield
            return
        if self._cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._pending.append((tokens, start, end))
            self._harvest()
            return
        began = time.perf_counter()
        yield
        self.meter.observe(tokens, time.perf_counter() - began)

    def _harvest(self) -> None:
        """Observe the CUDA timings whose events have passed, oldest first."""
        while self._pending and self._pending[0][2].query():
            tokens, start, end = self._pending.popleft()
            self.meter.observe(tokens, start.elapsed_time(end) / 1e3)

    def rate(self) -> RateFit | None:
        """Prefill tokens per second of the forwards timed so far (None: none yet)."""
        if self._cuda:
            self._harvest()
        return self.meter.estimate()
