"""One sequence's engine outputs as smg's ``GenerateResponse`` messages.

Streamed (``stream``): a ``chunk`` with the token ids new since the last one (every
``stream_interval`` tokens, and at the end), the cumulative counts (``prompt_tokens``,
``completion_tokens``, ``cached_tokens``: prompt tokens served from L1, L2 or L3) and the
new tokens' logprobs, the prompt's logprobs in the first chunk; then a ``complete``. Not
streamed: one ``complete`` with every output id, the counts, the logprobs asked for, the
finish reason (``stop``, ``length``, ``abort``) and what stopped it (a token id, or a
stop string). Every message carries the sequence's ``index`` (its choice, for ``n`` > 1).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from hicache.engine.request import FinishReason, RequestOutput
from hicache.engine.sampling import SamplingParams
from hicache.server.responses import LogprobEntry, output_logprobs, prompt_logprobs

__all__ = ["SequenceReply", "matched_stop"]

Decode = Callable[[list[int]], str]
"""Token ids -> text, as the engine makes ``RequestOutput.text`` (special tokens skipped)."""


def _top(entries: Sequence[LogprobEntry]) -> list[pb.TopLogProbs]:
    return [
        pb.TopLogProbs(values=list(e.top.values()), token_ids=list(e.top.keys())) for e in entries
    ]


def _output_logprobs(entries: Sequence[LogprobEntry]) -> pb.OutputLogProbs:
    return pb.OutputLogProbs(
        token_logprobs=[e.logprob if e.logprob is not None else 0.0 for e in entries],
        token_ids=[e.token_id for e in entries],
        top_logprobs=_top(entries),
    )


def _input_logprobs(entries: Sequence[LogprobEntry]) -> pb.InputLogProbs:
    return pb.InputLogProbs(
        token_logprobs=[
            pb.InputTokenLogProb() if e.logprob is None else pb.InputTokenLogProb(value=e.logprob)
            for e in entries
        ],
        token_ids=[e.token_id for e in entries],
        top_logprobs=_top(entries),
    )


def matched_stop(
    out: RequestOutput, params: SamplingParams, eos_ids: Collection[int], decode: Decode
) -> int | str | None:
    """What ended ``out`` (finished ``stop``): its last token when that is a stop token or
    an end-of-sequence id, else the stop string that begins where its text was cut; None
    for another finish."""
    if out.finish_reason is not FinishReason.STOP or not out.output_ids:
        return None
    last = out.output_ids[-1]
    if last in params.stop_token_ids or (last in eos_ids and not params.ignore_eos):
        return last
    if params.stop:
        full = decode(list(out.output_ids))
        for stop in params.stop:
            if full.startswith(stop, len(out.text)):
                return stop
    return None


class SequenceReply:
    """The messages of sequence ``index`` of request ``request_id`` (see the module
    docstring). ``params``: its sampling parameters; ``prompt``: its token ids;
    ``logprobs`` / ``prompt_logprobs``: whether they were asked; ``logprob_start``: the
    first prompt position answered; ``eos_ids`` and ``decode``: to tell what stopped it."""

    def __init__(
        self,
        request_id: str,
        index: int,
        *,
        params: SamplingParams,
        prompt: Sequence[int],
        stream: bool,
        stream_interval: int,
        logprobs: bool,
        prompt_logprobs: bool,
        logprob_start: int,
        eos_ids: Collection[int],
        decode: Decode,
    ) -> None:
        self.request_id = request_id
        self.index = index
        self.params = params
        self.prompt = list(prompt)
        self.stream = stream
        self.stream_interval = stream_interval
        self.logprobs = logprobs
        self.prompt_logprobs = prompt_logprobs
        self.logprob_start = logprob_start
        self.eos_ids = eos_ids
        self.decode = decode
        self._sent = 0
        """Output tokens already sent in chunks."""
        self._sent_input = False

    def messages(self, out: RequestOutput) -> list[pb.GenerateResponse]:
        """The messages ``out`` (the sequence's latest output) calls for: none, a chunk,
        and/or the complete (when it finished)."""
        msgs: list[pb.GenerateResponse] = []
        new = len(out.output_ids) - self._sent
        if self.stream and new > 0 and (new >= self.stream_interval or out.finished):
            msgs.append(self._chunk(out))
        if out.finished:
            msgs.append(self._complete(out))
        return msgs

    def _input(self, out: RequestOutput) -> pb.InputLogProbs | None:
        if not self.prompt_logprobs:
            return None
        return _input_logprobs(prompt_logprobs(out, self.prompt)[self.logprob_start :])

    def _chunk(self, out: RequestOutput) -> pb.GenerateResponse:
        start, self._sent = self._sent, len(out.output_ids)
        chunk = pb.GenerateStreamChunk(
            token_ids=list(out.output_ids[start:]),
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            cached_tokens=out.cached.total,
            index=self.index,
        )
        if self.logprobs:
            chunk.output_logprobs.CopyFrom(_output_logprobs(output_logprobs(out, start)))
        if not self._sent_input:
            self._sent_input = True
            inp = self._input(out)
            if inp is not None:
                chunk.input_logprobs.CopyFrom(inp)
        return pb.GenerateResponse(request_id=self.request_id, chunk=chunk)

    def _complete(self, out: RequestOutput) -> pb.GenerateResponse:
        reason = out.finish_reason or FinishReason.ABORT
        done = pb.GenerateComplete(
            output_ids=list(out.output_ids),
            finish_reason=reason.value,
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            cached_tokens=out.cached.total,
            index=self.index,
        )
        if self.logprobs:
            done.output_logprobs.CopyFrom(_output_logprobs(output_logprobs(out)))
        inp = self._input(out)
        if inp is not None:
            done.input_logprobs.CopyFrom(inp)
        matched = matched_stop(out, self.params, self.eos_ids, self.decode)
        if isinstance(matched, int):
            done.matched_token_id = matched
        elif isinstance(matched, str):
            done.matched_stop_str = matched
        return pb.GenerateResponse(request_id=self.request_id, complete=done)
