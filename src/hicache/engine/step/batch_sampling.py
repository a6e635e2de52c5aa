"""A batch's new tokens from one forward's logits: :class:`BatchSampler`.

Which rows of a forward need logits (:meth:`BatchSampler.logit_rows`: each sequence's last
token, and the prompt positions a request scores with ``prompt_logprobs``); the prompt log
probabilities (:meth:`BatchSampler.prompt_logprobs`); one token per finished sequence
(:meth:`BatchSampler.draw`): raw logits -> token log probabilities when asked, penalties
and bias (:func:`~hicache.engine.logits.adjust_logits`), the draw
(:func:`~hicache.engine.sampling.sample_rows`). A row that fails fails alone.

Under tensor parallelism rank 0 samples and every follower takes rank 0's tokens and
failed rows (:meth:`~hicache.engine.ranks.StepChannel.agree_tokens`): a follower neither
samples nor computes log probabilities (its requests report nothing).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch

from hicache.engine.logits import TokenLogprob, adjust_logits, token_logprobs
from hicache.engine.ranks import StepChannel
from hicache.engine.request import Request
from hicache.engine.sampling import sample_rows
from hicache.engine.step.batch import Chunk


@dataclass(frozen=True, slots=True)
class PromptRow:
    """Prompt position ``pos`` (>= 1) of ``req`` is scored by logits row ``row`` (the
    position before it)."""

    req: Request
    pos: int
    row: int


@dataclass(frozen=True, slots=True)
class LogitRows:
    """Which new tokens of a batch need logits. ``rows``: indices into the batch's new
    tokens, each sequence's last one and the prompt positions in ``prompt``;
    ``last[i]``: where sequence ``i``'s last token is in ``rows``. Without ``prompt``,
    ``rows`` is each sequence's last token, in order (the runner's default)."""

    rows: list[int]
    last: list[int]
    prompt: list[PromptRow]


@dataclass(frozen=True, slots=True)
class Drawn:
    """One token per sampled row (``tokens``, rank 0's under tensor parallelism), why
    each failed row failed (``errors``, by row: its request ends), and each row's token
    log probability when its request asked (``logprobs``; rank 0 only)."""

    tokens: list[int]
    errors: dict[int, str]
    logprobs: dict[int, TokenLogprob] = field(default_factory=dict)


class BatchSampler:
    """Samples a forward's rows; see the module docstring. ``channel``: this rank's end of
    the step exchange (None with one rank)."""

    def __init__(self, eos_token_ids: Collection[int], channel: StepChannel | None = None) -> None:
        self.eos_token_ids = eos_token_ids
        self.channel = channel
        self.follower = channel is not None and not channel.leader
        """Whether this rank takes rank 0's tokens instead of sampling."""

    @staticmethod
    def logit_rows(batch: Sequence[Chunk]) -> LogitRows:
        """The :class:`LogitRows` of ``batch`` (each request's new tokens from its ``kv_len``):
        for a request with ``prompt_logprobs``, every prompt position whose next prompt
        token's logprob it still lacks, from ``logprob_start_len - 1`` on (positions
        recomputed after a retraction are not repeated)."""
        rows: list[int] = []
        last: list[int] = []
        prompt: list[PromptRow] = []
        offset = 0
        for chunk in batch:
            req, n = chunk.req, chunk.tokens
            scored = req.prompt_logprobs
            if scored is not None:
                first = max(req.kv_len, req.params.logprob_start_len - 1)
                for pos in range(first, min(req.kv_len + n, len(req.prompt_ids) - 1)):
                    if scored[pos + 1] is None:
                        prompt.append(PromptRow(req, pos + 1, len(rows)))
                        rows.append(offset + pos - req.kv_len)
            if not rows or rows[-1] != offset + n - 1:
                rows.append(offset + n - 1)
            last.append(len(rows) - 1)
            offset += n
        return LogitRows(rows, last, prompt)

    def prompt_logprobs(self, logits: torch.Tensor, prompt: list[PromptRow]) -> dict[Request, str]:
        """Store the prompt log probabilities of ``prompt`` in their requests; returns why
        each request whose computation failed failed (it ends alone). Nothing on a
        follower (its requests report nothing)."""
        if not prompt or self.follower:
            return {}
        got = _logprobs_by_row(
            logits,
            [p.row for p in prompt],
            [p.req.prompt_ids[p.pos] for p in prompt],
            [_top(p.req) for p in prompt],
        )
        failed: dict[Request, str] = {}
        for p in prompt:
            lp = got[p.row]
            if isinstance(lp, str):
                failed.setdefault(p.req, f"prompt logprobs failed: {lp}")
            elif p.req.prompt_logprobs is not None and p.req not in failed:
                p.req.prompt_logprobs[p.pos] = lp.cut(p.req.params.prompt_logprobs or 0)
                handle = p.req.cache
                if handle is not None and handle.scores is not None:
                    handle.scores.records[p.pos] = lp  # what the cache keeps with the pages
        return failed

    def draw(self, logits: torch.Tensor, reqs: list[Request]) -> Drawn:
        """One new token per row of ``logits (R, V)`` (raw), row ``j`` for ``reqs[j]``."""
        if self.follower:
            assert self.channel is not None
            tokens, failed = self.channel.agree_tokens([0] * len(reqs), [])
            return Drawn(tokens, {j: "sampling failed on rank 0" for j in failed})
        params = [r.params for r in reqs]
        adjusted = adjust_logits(
            logits,
            params,
            [r.prompt_ids for r in reqs],
            [r.output_ids for r in reqs],
            self.eos_token_ids,
        )
        picked = sample_rows(adjusted.logits, params, [r.generator for r in reqs])
        errors = {j: f"sampling failed: {why}" for j, why in picked.errors.items()}
        errors |= {j: f"logit processing failed: {why}" for j, why in adjusted.errors.items()}
        tokens = list(picked.token_ids)
        want = [j for j, r in enumerate(reqs) if r.logprobs is not None and j not in errors]
        got = _logprobs_by_row(
            logits, want, [tokens[j] for j in want], [reqs[j].params.logprobs or 0 for j in want]
        )
        logprobs: dict[int, TokenLogprob] = {}
        for j, lp in got.items():
            if isinstance(lp, str):
                errors[j] = f"logprobs failed: {lp}"
            else:
                logprobs[j] = lp
        if self.channel is not None:  # rank 0: every follower takes these tokens and rows
            tokens, _ = self.channel.agree_tokens(tokens, sorted(errors))
        return Drawn(tokens, errors, logprobs)


def _top(req: Request) -> int:
    """The alternatives to compute at ``req``'s scored positions: what it asks, and at
    least what the cache keeps of them (its scoring entries') when it keeps them."""
    k = req.params.prompt_logprobs or 0
    handle = req.cache
    return k if handle is None or handle.scores is None else max(k, handle.scores.keep)


def _logprobs_by_row(
    logits: torch.Tensor, rows: list[int], token_ids: list[int], top: list[int]
) -> dict[int, TokenLogprob | str]:
    """:func:`token_logprobs` of ``logits[rows]`` keyed by row; a row whose computation
    fails (alone) maps to why."""
    if not rows:
        return {}
    try:
        lps = token_logprobs(logits[rows], token_ids, top)
        return dict(zip(rows, lps, strict=True))
    except Exception:
        out: dict[int, TokenLogprob | str] = {}
        for r, t, k in zip(rows, token_ids, top, strict=True):
            try:
                out[r] = token_logprobs(logits[[r]], [t], [k])[0]
            except Exception as exc:
                out[r] = f"{type(exc).__name__}: {exc}"
        return out


__all__ = ["BatchSampler", "Drawn", "LogitRows", "PromptRow"]
