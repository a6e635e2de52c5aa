"""One generation request and what it reports back.

A request's KV lives in L1 pages that its cache handle (``cache``, an opaque
:class:`~hicache.cache.CacheRequest`) holds; the first ``kv_len`` token positions hold
computed K/V. The scheduler never sees nodes or page ids beyond the handle's slots.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hicache.cache import CachedTokens, CacheRequest
from hicache.disagg.config import Bootstrap
from hicache.engine.admission import QueueSlot
from hicache.engine.detokenize import IncrementalText
from hicache.engine.logits import TokenLogprob
from hicache.engine.sampling import SamplingParams
from hicache.engine.session import SessionHint

__all__ = [
    "CachedTokens",
    "FinishReason",
    "OutputCallback",
    "Request",
    "RequestOutput",
    "TokenLogprob",
]

_ids = itertools.count()


class FinishReason(str, enum.Enum):
    STOP = "stop"
    """An end-of-sequence token or a stop string."""
    LENGTH = "length"
    """``max_tokens`` reached, or the context is full."""
    ABORT = "abort"
    """Aborted (client gone, shutdown, or an error)."""


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """A progress report: all tokens so far, the new text since the last report.

    ``logprobs`` (None unless the request asked for them): one :class:`TokenLogprob` per
    entry of ``output_ids``, in order (a stop token or EOS included, as in ``output_ids``).
    ``prompt_logprobs`` (None unless asked): one entry per prompt token, the first None
    (nothing precedes it), and those before ``logprob_start_len`` (not asked); complete in every report, since reports start after the prompt
    was computed.

    Timing, in seconds from the request's arrival at the engine: ``ttft_s`` to its first
    token, ``queue_s`` to its first admission (cache matched, L1 pages given); None until
    then. ``ttft_s - queue_s`` is the request's own prefill work, the part a cache hit
    shortens; ``queue_s`` is the wait for the step in progress and for room in the batch.
    """

    rid: str
    output_ids: list[int]
    delta_text: str
    text: str
    finished: bool
    finish_reason: FinishReason | None
    prompt_tokens: int
    cached: CachedTokens
    ttft_s: float | None
    error: str | None = None
    queue_s: float | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)


OutputCallback = Callable[[RequestOutput], None]


@dataclass(eq=False)
class Request:
    """Mutable state of one request; touched only by the engine's thread after submit."""

    prompt_ids: list[int]
    params: SamplingParams
    rid: str = field(default_factory=lambda: f"req-{next(_ids)}")
    cache_salt: str = ""
    session: SessionHint | None = None
    """The agent session it belongs to (None: none); carried, not read by the cache yet."""
    # progress
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    """The output's text so far, cut at a stop string (see :mod:`hicache.engine.step.output`)."""
    detok: IncrementalText | None = None
    """The incremental decode of ``output_ids`` behind ``text``."""
    sent_chars: int = 0
    finish_reason: FinishReason | None = None
    final_reported: bool = False
    """The final report (``finished``) was made (:mod:`hicache.engine.step.ends`): nothing is
    reported after it."""
    error: str | None = None
    aborted: bool = False
    priority: int = 0
    """Higher is admitted first (before any other order the scheduler applies), and stays
    longer in the cache under the ``priority`` eviction policy."""
    group: str = ""
    """The client request this sequence belongs to (every ``n`` copy and every prompt of
    one HTTP request share it): the scheduler's per-group limits count its sequences
    together. Empty: a group of its own (``rid``)."""
    queue_slot: QueueSlot | None = None
    """Its place in the bounded waiting queue, given back at the first admission or when
    it ends (None: not counted)."""
    # cache state
    cache: CacheRequest | None = None
    kv_len: int = 0
    retracted: int = 0
    generator: torch.Generator | None = None
    # log probabilities, when asked for (see RequestOutput)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # timing
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    admitted_at: float | None = None
    """When the scheduler first admitted it (``time.perf_counter``; a retraction keeps it)."""
    # prefill/decode disaggregation
    bootstrap: Bootstrap | None = None
    """Its room and the prefill instance's bootstrap server, on a PD instance (None: a
    plain request)."""
    remote_cached: CachedTokens | None = None
    """On a decode instance: the prompt tokens the prefill instance's cache served."""

    def __post_init__(self) -> None:
        if not self.group:
            self.group = self.rid
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * len(self.prompt_ids)

    def leave_queue(self) -> None:
        """Give back its queue place, if it holds one (idempotent)."""
        if self.queue_slot is not None:
            self.queue_slot.release()

    @property
    def all_ids(self) -> list[int]:
        """Prompt and output so far."""
        return self.prompt_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival

    @property
    def queue_s(self) -> float | None:
        """Seconds from arrival to the first admission (None before it)."""
        return None if self.admitted_at is None else self.admitted_at - self.arrival

    @property
    def cached(self) -> CachedTokens:
        """Prompt tokens each tier served (counted at the first admission; on a decode
        instance, the prefill instance's)."""
        if self.remote_cached is not None:
            return self.remote_cached
        return CachedTokens() if self.cache is None else self.cache.cached
