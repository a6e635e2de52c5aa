"""Turning sampled tokens into text: end-of-sequence, stop strings, max_tokens, streaming.

Two halves, so the scheduler can run the second off the critical path:
:meth:`OutputProcessor.check_token` decides from the token alone (end-of-sequence, stop
ids, ``max_tokens``, the context length) and touches no text;
:meth:`OutputProcessor.update_text` brings ``req.text`` up to date and applies stop
strings; :meth:`OutputProcessor.on_token` is both, in that order. Invariant: ``req.text``
is ``tokenizer.decode(output ids, skip_special_tokens=True)`` (an ending stop or
end-of-sequence id left out), cut at the first stop string; decoded incrementally
(:mod:`hicache.engine.detokenize`) when the tokenizer passes :func:`decodes_incrementally`,
else in full. Every finished text is checked against a full decode (a mismatch switches
to full decodes for good). Streamed text holds back a possible stop-string start and a
trailing incomplete UTF-8 character. Flow: docs/architecture.md, "Outputs and a request's
end".
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from hicache.engine.detokenize import IncrementalText, decode_function, decodes_incrementally
from hicache.engine.request import FinishReason, Request, RequestOutput

log = logging.getLogger(__name__)


class OutputProcessor:
    """Checks finish conditions after each new token, keeps the text, builds the reports.

    ``incremental``: decode incrementally (True), in full (False), or as the tokenizer's
    probe says (None, the default).
    """

    def __init__(
        self,
        tokenizer: Any,
        eos_token_ids: Iterable[int],
        context_length: int,
        *,
        incremental: bool | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.context_length = context_length
        self._fast_decode = decode_function(tokenizer)
        if incremental is None:
            incremental = decodes_incrementally(tokenizer, self._fast_decode)
            if not incremental:
                log.info("the tokenizer does not decode incrementally: full decodes per token")
        self.incremental = incremental

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def on_token(self, req: Request) -> None:
        """:meth:`check_token` then :meth:`update_text`: ``req``'s finish state and text
        after a token was appended."""
        self.check_token(req)
        self.update_text(req)

    def ends_on_token(self, req: Request) -> bool:
        """Whether ``req``'s last token ends it by itself: one of ``stop_token_ids`` or an
        end-of-sequence id (unless ``ignore_eos``), once ``min_tokens`` were generated.
        Such a token stays in ``output_ids`` but not in the text."""
        params = req.params
        ids = req.output_ids
        return bool(
            ids
            and len(ids) >= params.min_tokens
            and (
                ids[-1] in params.stop_token_ids
                or (ids[-1] in self.eos_token_ids and not params.ignore_eos)
            )
        )

    def check_token(self, req: Request) -> None:
        """The token-level finish checks after a token was appended (no text work): ``stop``
        when :meth:`ends_on_token`, else ``length`` at ``max_tokens`` or the context length.
        A stop string found by :meth:`update_text` for the same token wins over ``length``.
        """
        if self.ends_on_token(req):
            req.finish_reason = FinishReason.STOP
        elif len(req.output_ids) >= req.params.max_tokens or req.seq_len >= self.context_length:
            req.finish_reason = FinishReason.LENGTH

    def update_text(self, req: Request) -> None:
        """Bring ``req.text`` up to ``req.output_ids`` and apply stop strings: the text is cut
        before the first stop string found (searched from a stop string's length before
        what was reported) and ``req`` ends (``stop``). Before ``min_tokens`` tokens were
        generated no stop string ends it (one found earlier stays in the text). Calling it
        again for the same ids changes nothing.

        A token the tokenizer cannot decode ends ``req`` alone (abort, ``error`` set).
        """
        try:
            self._update_text(req)
        except Exception as exc:
            req.error = f"decoding the output failed: {type(exc).__name__}: {exc}"
            req.finish_reason = FinishReason.ABORT

    def _update_text(self, req: Request) -> None:
        ids = req.output_ids
        n = len(ids) - 1 if self.ends_on_token(req) else len(ids)
        full = self._decoded(req, n)
        text, stopped = self._cut(req, full)
        if self.incremental and (stopped or req.finished):  # the last text: check it
            reference = self.decode(ids[:n])
            if reference != full:
                log.warning(
                    "incremental detokenization of %s gave %r, a full decode %r: decoding in"
                    " full from now on",
                    req.rid,
                    full[-40:],
                    reference[-40:],
                )
                self.incremental = False
                text, stopped = self._cut(req, reference)
        if stopped:
            req.finish_reason = FinishReason.STOP
        req.text = text

    def _decoded(self, req: Request, n: int) -> str:
        """The text of ``req.output_ids[:n]``."""
        if not self.incremental:
            return self.decode(req.output_ids[:n])
        if req.detok is None:
            req.detok = IncrementalText(self._fast_decode)
        return req.detok.text(req.output_ids, n)

    @staticmethod
    def _cut(req: Request, text: str) -> tuple[str, bool]:
        """``text`` cut before its first stop string (searched where :meth:`update_text`
        says), and whether one was found."""
        params = req.params
        if not params.stop or len(req.output_ids) < params.min_tokens:
            return text, False
        start = max(0, req.sent_chars - max(len(s) for s in params.stop))
        hits = [(i, s) for s in params.stop if (i := text.find(s, start)) >= 0]
        if not hits:
            return text, False
        return text[: min(hits)[0]], True

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
            queue_s=req.queue_s,
            error=req.error,
            logprobs=None if req.logprobs is None else list(req.logprobs),
            prompt_logprobs=None if req.prompt_logprobs is None else list(req.prompt_logprobs),
        )
