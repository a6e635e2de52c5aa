"""A ``GenerateRequest`` of smg's protocol made into engine requests, through the very
validation ``POST /generate`` runs (:class:`~hicache.server.native.GenerateRequest`,
:func:`~hicache.server.native_routes.native_plan`).

:func:`native_fields` maps the message onto the ``/generate`` body (the prompt is token
ids: smg tokenizes); what the protocol carries and this server does not serve is refused
naming its field (multimodal inputs, embeddings, LoRA, hidden states, constrained
decoding, custom logit processors, ``token_ids_logprob``, a data-parallel rank other
than 0). Fields that only shape detokenized text (``skip_special_tokens``,
``spaces_between_special_tokens``, ``no_stop_trim``) change nothing here: the worker
answers token ids and smg makes the text. :class:`GrpcInvalid` names the field as the
protocol spells it (``sampling_params.top_p``, ``tokenized.input_ids``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from google.protobuf.json_format import MessageToDict
from pydantic import ValidationError
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from hicache.engine.sampling import InvalidRequest
from hicache.server.http_base import native_param, param_of
from hicache.server.native import GenerateRequest
from hicache.server.native_routes import NativePlan, native_plan
from hicache.server.state import ServerState

__all__ = ["GrpcInvalid", "GrpcPlan", "grpc_param", "native_fields", "plan_generate"]

PROMPT_PARAM = "tokenized.input_ids"
"""The prompt as the protocol names it."""

_PROTO_NAMES = {
    "input_ids": PROMPT_PARAM,
    "text": PROMPT_PARAM,
    "prompt": PROMPT_PARAM,
    "bootstrap_host": "disaggregated_params.bootstrap_host",
    "bootstrap_port": "disaggregated_params.bootstrap_port",
    "bootstrap_room": "disaggregated_params.bootstrap_room",
    "sampling_params.sampling_seed": "sampling_params",
}


class GrpcInvalid(ValueError):
    """A ``GenerateRequest`` that cannot be served: ``param`` is the field (the protocol's
    spelling); the message starts with it (``"<param>: "``)."""

    def __init__(self, message: str, param: str) -> None:
        lead = f"{param}: "
        super().__init__(message if message.startswith(lead) else lead + message)
        self.param = param


def grpc_param(param: str | None) -> str:
    """The protocol's name of a field ``/generate`` names ``param`` (None: the request)."""
    native = native_param(param) or "request"
    return _PROTO_NAMES.get(native, native)


@dataclass(frozen=True)
class GrpcPlan:
    """A ``GenerateRequest`` made into engine requests: the ``/generate`` ``plan``, its
    ``prompt`` (token ids), whether to ``stream``, every how many tokens a chunk goes
    (``stream_interval`` >= 1), and the first prompt position whose logprob is answered
    (``logprob_start``)."""

    plan: NativePlan
    prompt: list[int]
    stream: bool
    stream_interval: int
    logprob_start: int


def _refuse(param: str, why: str) -> GrpcInvalid:
    return GrpcInvalid(f"{param} is not supported: {why}", param)


def _sampling(sp: pb.SamplingParams) -> dict[str, Any]:
    """``sampling_params`` of the ``/generate`` body (SGLang's names)."""
    kind = sp.WhichOneof("constraint")
    if kind == "structural_tag":
        raise _refuse("sampling_params.structural_tag", "constrained decoding is not implemented")
    if sp.HasField("custom_params") and MessageToDict(sp.custom_params):
        raise _refuse("sampling_params.custom_params", "no custom parameters are read")
    out: dict[str, Any] = {
        "temperature": sp.temperature,
        "top_p": sp.top_p,
        "top_k": sp.top_k,
        "min_p": sp.min_p,
        "frequency_penalty": sp.frequency_penalty,
        "presence_penalty": sp.presence_penalty,
        "repetition_penalty": sp.repetition_penalty,
        "min_new_tokens": sp.min_new_tokens,
        "ignore_eos": sp.ignore_eos,
        "n": sp.n or 1,  # proto3's 0: not set
    }
    if sp.HasField("max_new_tokens"):
        out["max_new_tokens"] = sp.max_new_tokens
    if sp.stop:
        out["stop"] = list(sp.stop)
    if sp.stop_token_ids:
        out["stop_token_ids"] = list(sp.stop_token_ids)
    if sp.logit_bias:
        out["logit_bias"] = dict(sp.logit_bias)
    if kind is not None:  # regex, json_schema, ebnf_grammar: refused by /generate's check
        out["ebnf" if kind == "ebnf_grammar" else kind] = getattr(sp, kind)
    return out


def native_fields(req: pb.GenerateRequest) -> dict[str, Any]:
    """The ``/generate`` body of ``req`` (a dict for
    :class:`~hicache.server.native.GenerateRequest`); :class:`GrpcInvalid` for a field
    the protocol has and ``/generate`` does not serve."""
    if not req.HasField("tokenized"):
        raise GrpcInvalid("the prompt is missing (token ids: smg tokenizes)", "tokenized")
    if req.HasField("mm_inputs") and req.mm_inputs.ByteSize():
        raise _refuse("mm_inputs", "text-only models")
    if req.input_embeds:
        raise _refuse("input_embeds", "prompts are token ids")
    if req.lora_id:
        raise _refuse("lora_id", "no LoRA adapters are loaded")
    if req.custom_logit_processor:
        raise _refuse("custom_logit_processor", "custom logit processors are not run")
    if req.token_ids_logprob:
        raise _refuse("token_ids_logprob", "logprobs of chosen token ids are not computed")
    if req.HasField("data_parallel_rank") and req.data_parallel_rank != 0:
        raise GrpcInvalid(
            f"data_parallel_rank={req.data_parallel_rank} is invalid: this worker has one"
            " data-parallel rank, 0",
            "data_parallel_rank",
        )
    body: dict[str, Any] = {
        "input_ids": list(req.tokenized.input_ids),
        "sampling_params": _sampling(req.sampling_params),
        "stream": req.stream,
        "return_logprob": req.return_logprob,
        "logprob_start_len": req.logprob_start_len,
        "top_logprobs_num": req.top_logprobs_num,
        "return_hidden_states": req.return_hidden_states,
    }
    if req.HasField("disaggregated_params"):
        d = req.disaggregated_params
        body["bootstrap_host"] = d.bootstrap_host or None
        body["bootstrap_port"] = d.bootstrap_port or None
        body["bootstrap_room"] = d.bootstrap_room
    return body


def plan_generate(state: ServerState, req: pb.GenerateRequest) -> GrpcPlan:
    """The engine requests of ``req``, validated as ``/generate`` validates its body;
    :class:`GrpcInvalid` naming the field otherwise."""
    fields = native_fields(req)
    if not fields["input_ids"]:
        raise GrpcInvalid("the prompt is empty", PROMPT_PARAM)
    interval = req.sampling_params.stream_interval
    if req.sampling_params.HasField("stream_interval") and interval < 1:
        raise GrpcInvalid(
            f"stream_interval={interval} is invalid: at least 1 token per chunk",
            "sampling_params.stream_interval",
        )
    try:
        body = GenerateRequest.model_validate(fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = grpc_param(param_of(first.get("loc", ())))
        raise GrpcInvalid(f"{param}: {first.get('msg')}", param) from None
    try:
        body.prompts()
        prompt = list(req.tokenized.input_ids)
        plan = native_plan(state, body, [prompt], "input_ids")
    except InvalidRequest as exc:
        raise GrpcInvalid(str(exc), grpc_param(exc.param)) from None
    return GrpcPlan(
        plan=plan,
        prompt=prompt,
        stream=req.stream,
        stream_interval=max(1, interval),
        logprob_start=max(0, req.logprob_start_len),
    )
