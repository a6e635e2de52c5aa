"""One generation request and what it reports back.

A request's KV lives in L1 pages: ``pages`` cover its first ``len(pages) * page_size``
token positions, of which the first ``kv_len`` hold computed K/V. The first
``prefix_pages`` of them belong to the tree (matched, locked through ``prefix_node``);
the rest are the request's own until it inserts them.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hicache.cache_storage import PrefetchHandle
from hicache.engine.sampling import SamplingParams
from hicache.transfer import LayerProgress
from hicache.tree import TreeNode
from hicache.tree.node import PageIds, page_ids

_ids = itertools.count()


class FinishReason(str, enum.Enum):
    STOP = "stop"
    """An end-of-sequence token or a stop string."""
    LENGTH = "length"
    """``max_tokens`` reached, or the context is full."""
    ABORT = "abort"
    """Aborted (client gone, shutdown, or an error)."""


@dataclass(frozen=True, slots=True)
class CachedTokens:
    """Prompt tokens served from each tier instead of being prefilled."""

    device: int = 0
    host: int = 0
    storage: int = 0

    @property
    def total(self) -> int:
        return self.device + self.host + self.storage


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """A progress report: all tokens so far, the new text since the last report."""

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

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)


OutputCallback = Callable[[RequestOutput], None]


@dataclass(eq=False)
class Request:
    """Mutable state of one request; touched only by the engine's thread after submit."""

    prompt_ids: list[int]
    params: SamplingParams
    on_output: OutputCallback | None = None
    rid: str = field(default_factory=lambda: f"req-{next(_ids)}")
    cache_salt: str = ""
    # progress
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    sent_chars: int = 0
    finish_reason: FinishReason | None = None
    error: str | None = None
    aborted: bool = False
    # cache state
    pages: PageIds = field(default_factory=page_ids)
    prefix_pages: int = 0
    prefix_node: TreeNode | None = None
    kv_len: int = 0
    progress: LayerProgress | None = None
    cached: CachedTokens = CachedTokens()
    retracted: int = 0
    prefetch: PrefetchHandle | None = None
    prefetch_done: bool = False
    storage_tokens: int = 0
    generator: torch.Generator | None = None
    # timing
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None

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

    def slots(self, page_size: int, upto: int) -> torch.Tensor:
        """Token slots of positions ``[0, upto)``: ``page * page_size + offset``, int64."""
        pages = torch.frombuffer(self.pages, dtype=torch.int64) if len(self.pages) else None
        if pages is None:
            return torch.empty(0, dtype=torch.int64)
        offsets = torch.arange(page_size, dtype=torch.int64)
        return (pages[:, None] * page_size + offsets).reshape(-1)[:upto]
