"""Turning sampled tokens into text: end-of-sequence, stop strings, max_tokens, streaming.

Text is re-decoded from all output ids at each step (cheap at these lengths and always
right at multi-byte boundaries). While a request runs, the streamed text holds back what
could still turn out to be the start of a stop string, and any trailing replacement
character of an incomplete UTF-8 sequence.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from hicache.engine.request import FinishReason, Request, RequestOutput


class OutputProcessor:
    """Checks finish conditions after each new token and builds the reports."""

    def __init__(self, tokenizer: Any, eos_token_ids: Iterable[int], context_length: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.context_length = context_length

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def on_token(self, req: Request) -> None:
        """Update ``req.text`` and maybe ``req.finish_reason`` after a token was appended.

        The last token ends the request (``stop``) when it is one of ``stop_token_ids`` or
        an end-of-sequence id (unless ``ignore_eos``); it is then left out of the text.
        Before ``min_tokens`` tokens were generated nothing stops it (sampling masks the
        stop ids then; a stop string found earlier stays in the text).

        A token the tokenizer cannot decode ends ``req`` alone (abort, ``error`` set).
        """
        try:
            self._on_token(req)
        except Exception as exc:
            req.error = f"decoding the output failed: {type(exc).__name__}: {exc}"
            req.finish_reason = FinishReason.ABORT

    def _on_token(self, req: Request) -> None:
        params = req.params
        ids = req.output_ids
        may_stop = len(ids) >= params.min_tokens
        if (
            ids
            and may_stop
            and (
                ids[-1] in params.stop_token_ids
                or (ids[-1] in self.eos_token_ids and not params.ignore_eos)
            )
        ):
            req.finish_reason = FinishReason.STOP
            ids = ids[:-1]
        req.text = self.decode(ids)
        if params.stop and may_stop:
            start = max(0, req.sent_chars - max(len(s) for s in params.stop))
            hits = [(i, s) for s in params.stop if (i := req.text.find(s, start)) >= 0]
            if hits:
                req.text = req.text[: min(hits)[0]]
                req.finish_reason = FinishReason.STOP
        if req.finish_reason is None and (
            len(req.output_ids) >= params.max_tokens or req.seq_len >= self.context_length
        ):
            req.finish_reason = FinishReason.LENGTH

    def report(self, req: Request) -> RequestOutput:
        """The next report of ``req``: new text since the last one (advances ``sent_chars``)."""
        text = req.text
        end = len(text)
        if not req.finished:
            if req.params.stop:
                end -= max(len(s) for s in req.params.stop) - 1
            while end > 0 and text[end - 1] == "\ufffd":
                end -= 1
        end = max(end, req.sent_chars)
        delta = text[req.sent_chars : end]
        req.sent_chars = end
        return RequestOutput(
            rid=req.rid,
            output_ids=list(req.output_ids),
            delta_text=delta,
            text=text[:end],
            finished=req.finished,
            finish_reason=req.finish_reason,
            prompt_tokens=len(req.prompt_ids),
            cached=req.cached,
            ttft_s=req.ttft_s,
            error=req.error,
            logprobs=None if req.logprobs is None else list(req.logprobs),
            prompt_logprobs=None if req.prompt_logprobs is None else list(req.prompt_logprobs),
        )
