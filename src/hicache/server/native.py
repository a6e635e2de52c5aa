"""SGLang's native API: the ``POST /generate`` body and its responses.

A body carries ``text`` or ``input_ids`` (one prompt, or a batch), ``sampling_params``
with SGLang's names, ``stream`` and ``return_logprob``; a response carries ``text``,
``output_ids`` and ``meta_info`` with SGLang's cache report (``cached_tokens`` and
``cached_tokens_details`` per tier). Parameters SGLang defines that this server does not
serve are refused with a 400 naming them, as are keys SGLang does not know.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from hicache.engine.front.engine import MAX_CACHE_SALT_CHARS, PRIORITY_MAX, PRIORITY_MIN
from hicache.engine.request import FinishReason, RequestOutput
from hicache.engine.sampling import InvalidRequest
from hicache.server.bootstrap_fields import BootstrapFields
from hicache.server.protocol import MAX_BATCH, MAX_LOGPROBS, MAX_N, SamplingFields, TokenIds
from hicache.server.responses import LogprobEntry, tier_details

DEFAULT_MAX_NEW_TOKENS = 128
"""SGLang's default ``max_new_tokens`` for ``/generate``."""


class NativeSamplingParams(BaseModel):
    """``sampling_params`` of ``/generate`` (SGLang's names). Unknown keys are refused."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int | None = Field(default=None, ge=1)
    min_new_tokens: int = Field(default=0, ge=0)
    max_load_tokens: int | None = Field(default=None, ge=0)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=0.0, description="only 0 is served")
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    logit_bias: dict[str, float] | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    sampling_seed: int | None = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    def refuse_unsupported(self) -> None:
        for key in ("json_schema", "regex", "ebnf"):
            if getattr(self, key) is not None:
                raise InvalidRequest(
                    f"sampling_params.{key} is not supported: constrained decoding is not"
                    " implemented",
                    param=f"sampling_params.{key}",
                )
        if not self.skip_special_tokens:
            raise InvalidRequest(
                "sampling_params.skip_special_tokens=false is not supported",
                param="sampling_params.skip_special_tokens",
            )
        if self.no_stop_trim:
            raise InvalidRequest(
                "sampling_params.no_stop_trim=true is not supported",
                param="sampling_params.no_stop_trim",
            )

    def as_openai(
        self, *, logprobs: int | None, prompt_logprobs: int | None, logprob_start: int = 0
    ) -> SamplingFields:
        """The same request in the OpenAI model's terms (one conversion path);
        ``logprob_start``: the first prompt position whose logprob is asked."""
        body = _NativeAsOpenAI(
            max_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop=self.stop,
            seed=self.sampling_seed,
            n=self.n,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=self.logit_bias,
            min_tokens=self.min_new_tokens,
            max_load_tokens=self.max_load_tokens,
            ignore_eos=self.ignore_eos,
            stop_token_ids=self.stop_token_ids,
        )
        body.counts = (logprobs, prompt_logprobs)
        body.start = logprob_start
        return body


class _NativeAsOpenAI(SamplingFields):
    counts: tuple[int | None, int | None] = (None, None)
    start: int = 0

    def logprob_counts(self) -> tuple[int | None, int | None]:
        return self.counts

    def logprob_start(self) -> int:
        return self.start


class GenerateRequest(BootstrapFields):
    """``POST /generate``: exactly one of ``text`` and ``input_ids``."""

    model_config = ConfigDict(extra="ignore")

    text: str | list[str] | None = None
    input_ids: TokenIds | list[TokenIds] | None = None
    sampling_params: NativeSamplingParams = Field(default_factory=NativeSamplingParams)
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = Field(default=0, ge=0, le=MAX_LOGPROBS)
    return_text_in_logprobs: bool = False
    rid: str | None = None
    lora_path: str | None = None
    image_data: Any = None
    return_hidden_states: bool = False
    cache_salt: str = Field(default="", max_length=MAX_CACHE_SALT_CHARS)
    priority: StrictInt | None = Field(default=None, ge=PRIORITY_MIN, le=PRIORITY_MAX)
    session_id: str | None = None
    """The agent session the request belongs to (:mod:`hicache.engine.session`)."""
    parent_session_id: str | None = None
    """A subagent's parent session (needs ``session_id``)."""
    session_ttl_ms: Any = None
    """How long the session's KV is kept idle after this request (ms; needs ``session_id``)."""
    # what SGLang's router (smg) adds to every body it forwards
    model: str | None = None
    """Not checked: ``/generate`` serves the one model whatever this names, as SGLang's
    does (smg sends ``"unknown"`` when its client gave none)."""
    log_metrics: bool = True
    """Changes nothing: every request is counted in ``/metrics``."""
    no_logs: bool = False
    """Changes nothing: requests are not logged above debug level."""
    background: bool = False
    """Only false: the answer comes in the response."""
    return_bytes: bool = False
    """Only false: token bytes are not returned."""
    return_entropy: bool = False
    """Only false: per-token entropy is not computed."""

    def refuse_router_flags(self) -> None:
        """Refuse ``background``, ``return_bytes`` or ``return_entropy`` set true
        (:class:`InvalidRequest` naming it): their false values, which smg sends on every
        request, change nothing."""
        why = {
            "background": "background requests are not supported; the answer comes in the response",
            "return_bytes": "token bytes are not returned",
            "return_entropy": "per-token entropy is not computed",
        }
        for key, reason in why.items():
            if getattr(self, key):
                raise InvalidRequest(f"{key}=true is not supported: {reason}", param=key)

    def prompts(self) -> tuple[list[str | list[int]], bool]:
        """``(prompts, batched)``; raises :class:`InvalidRequest` naming the field."""
        if (self.text is None) == (self.input_ids is None):
            raise InvalidRequest("give exactly one of text and input_ids", param="text")
        if self.lora_path:
            raise InvalidRequest(
                "lora_path is not supported: no LoRA adapters are loaded", param="lora_path"
            )
        if self.image_data:
            raise InvalidRequest(
                "image_data is not supported: text-only models", param="image_data"
            )
        if self.return_hidden_states:
            raise InvalidRequest(
                "return_hidden_states is not supported", param="return_hidden_states"
            )
        self.refuse_router_flags()
        self.sampling_params.refuse_unsupported()
        if self.text is not None:
            if isinstance(self.text, str):
                return [self.text], False
            prompts: list[str | list[int]] = list(self.text)
            batched = True
        else:
            ids = self.input_ids or []
            if ids and all(isinstance(t, int) for t in ids):
                return [list(ids)], False  # type: ignore[arg-type]
            prompts = [list(p) if isinstance(p, list) else [p] for p in ids]
            batched = True
        if not prompts:
            raise InvalidRequest("the batch is empty", param="text")
        if len(prompts) > MAX_BATCH:
            raise InvalidRequest(
                f"the batch has {len(prompts)} prompts; at most {MAX_BATCH}", param="text"
            )
        return prompts, batched

    def check_logprob_start(self, prompt_lens: list[int]) -> None:
        """Refuse a ``logprob_start_len`` outside ``-1`` (SGLang's default: output tokens
        only) and, with ``return_logprob``, ``0 .. len(prompt)`` (the prompt's positions;
        its length: no prompt logprobs), for the shortest prompt of a batch."""
        start = self.logprob_start_len
        shortest = min(prompt_lens, default=0)
        if start < -1 or (self.return_logprob and start > shortest):
            raise InvalidRequest(
                f"logprob_start_len={start} is invalid: -1 (the default: logprobs of the"
                f" output tokens only) or a position in the prompt, 0 to {shortest} (the"
                f" prompt{' (the shortest of the batch)' if len(prompt_lens) > 1 else ''} has"
                f" {shortest} tokens)",
                param="logprob_start_len",
            )

    def logprob_counts(self) -> tuple[int | None, int | None]:
        if not self.return_logprob:
            return None, None
        k = self.top_logprobs_num
        return k, (k if self.logprob_start_len >= 0 else None)

    def logprob_start(self) -> int:
        """The first prompt position scored (0 when no prompt logprobs are asked)."""
        return max(0, self.logprob_start_len) if self.return_logprob else 0

    @property
    def request_priority(self) -> int:
        return 0 if self.priority is None else self.priority


def finish_reason(out: RequestOutput) -> dict[str, Any] | None:
    """SGLang's ``meta_info.finish_reason`` object."""
    if not out.finished or out.finish_reason is None:
        return None
    if out.finish_reason is FinishReason.LENGTH:
        return {"type": "length", "length": out.completion_tokens}
    if out.finish_reason is FinishReason.STOP:
        return {"type": "stop", "matched": None}
    return {"type": "abort", "message": out.error or "aborted"}


def _logprob_list(
    entries: list[LogprobEntry], text: Any
) -> tuple[list[list[Any]], list[list[list[Any]] | None]]:
    chosen = [[e.logprob, e.token_id, text(e.token_id) if text else None] for e in entries]
    top = [[[lp, tid, text(tid) if text else None] for tid, lp in e.top.items()] for e in entries]
    return chosen, top  # type: ignore[return-value]


def generate_body(
    rid: str,
    out: RequestOutput,
    *,
    e2e_latency: float,
    output_entries: list[LogprobEntry] | None = None,
    input_entries: list[LogprobEntry] | None = None,
    text: Any = None,
    index: int | None = None,
) -> dict[str, Any]:
    """One ``/generate`` result (or streamed chunk, cumulative as SGLang's are)."""
    c = out.cached
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish_reason(out),
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "cached_tokens": c.total,
        "cached_tokens_details": tier_details(c),
        "e2e_latency": e2e_latency,
    }
    if out.ttft_s is not None:
        meta["ttft"] = out.ttft_s
    if output_entries is not None:
        chosen, top = _logprob_list(output_entries, text)
        meta["output_token_logprobs"] = chosen
        meta["output_top_logprobs"] = top
    if input_entries is not None:
        chosen, top = _logprob_list(input_entries, text)
        meta["input_token_logprobs"] = chosen
        meta["input_top_logprobs"] = top
    body: dict[str, Any] = {"text": out.text, "output_ids": list(out.output_ids), "meta_info": meta}
    if index is not None:
        body["index"] = index
    return body
