"""The policy for top-level fields of an OpenAI body that its model does not declare.

Three kinds (all listed in ``docs/api.md``):

- **refused** (:data:`REFUSED`): fields of OpenAI's or SGLang's schemas that would change
  the answer and that this server does not serve: function calling, audio, predicted
  outputs, constrained decoding, LoRA ... A value that changes nothing (``functions: []``,
  ``modalities: ["text"]``, ``min_p: 0``) is accepted; any other is a 400 naming the field.
- **known** (:data:`KNOWN_NO_OPS`): fields that change nothing here, OpenAI's
  (``metadata``, ``store`` ...) and those SGLang's router and clients add (``rid``,
  ``bootstrap_host`` ...): accepted silently.
- **unknown**: anything else. Accepted (clients send many optional fields), and logged at
  debug level the first time each name is seen in this process.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from hicache.engine.sampling import InvalidRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Refused:
    """A field refused unless ``no_op(value)``; ``why`` ends the 400's message."""

    no_op: Callable[[Any], bool]
    why: str


def _absent(value: Any) -> bool:
    return value is None


def _empty(value: Any) -> bool:
    return not value


def _false(value: Any) -> bool:
    return value is None or value is False


def _text_only(value: Any) -> bool:
    return value is None or (isinstance(value, list) and all(m == "text" for m in value))


_CONSTRAINED = "constrained decoding (regex, EBNF, JSON schema) is not implemented"

REFUSED: Mapping[str, Refused] = {
    # OpenAI's
    "functions": Refused(
        _empty, "function calling (the deprecated form of tools) is not supported"
    ),
    "function_call": Refused(
        lambda v: v in (None, "none"), "function calling is not supported; only 'none'"
    ),
    "audio": Refused(_absent, "audio output is not supported: text-only models"),
    "modalities": Refused(_text_only, "only the 'text' modality is served"),
    "prediction": Refused(_absent, "predicted outputs are not supported"),
    # SGLang's
    "regex": Refused(_absent, _CONSTRAINED),
    "ebnf": Refused(_absent, _CONSTRAINED),
    "json_schema": Refused(_absent, _CONSTRAINED),
    "lora_path": Refused(_empty, "no LoRA adapters are loaded"),
    "min_p": Refused(lambda v: v in (None, 0, 0.0), "min_p sampling is not implemented"),
    "skip_special_tokens": Refused(
        lambda v: v in (None, True), "special tokens are always skipped in the text"
    ),
    "no_stop_trim": Refused(
        lambda v: v in (None, False), "the stop string is always trimmed from the text"
    ),
    "continue_final_message": Refused(
        lambda v: v in (None, False), "continuing the final assistant message is not supported"
    ),
    "chat_template_kwargs": Refused(
        _empty, "extra chat template arguments are not passed to the template"
    ),
    "return_hidden_states": Refused(_empty, "hidden states are not returned"),
    "custom_logit_processor": Refused(_absent, "custom logit processors are not supported"),
    # what SGLang's router (smg) may add, false on every request it forwards
    "return_entropy": Refused(_false, "per-token entropy is not computed"),
    "return_bytes": Refused(_false, "token bytes are not returned"),
    "background": Refused(
        _false, "background requests are not supported; the answer comes in the response"
    ),
}
"""Fields refused unless their value changes nothing, with why."""

KNOWN_NO_OPS: frozenset[str] = frozenset(
    {
        # OpenAI's: bookkeeping, or meaningful only with what is refused
        "metadata",
        "store",
        "service_tier",
        "parallel_tool_calls",  # only with tools, which are refused
        "safety_identifier",
        "prompt_cache_key",
        "reasoning_effort",  # no reasoning model has a parser here
        "verbosity",
        # SGLang's, and what its router and clients add
        "rid",
        "bootstrap_host",
        "bootstrap_port",
        "bootstrap_room",
        "bootstrap_pair_key",
        "return_text_in_logprobs",
        "log_metrics",
        "no_logs",
        "separate_reasoning",
        "stream_reasoning",
        "session_params",
        "extra_key",
        "data_parallel_rank",
    }
)
"""Fields accepted silently: they change nothing this server answers."""

_seen: set[str] = set()
_seen_lock = threading.Lock()


def check_extra_fields(extra: Mapping[str, Any] | None) -> None:
    """Refuse the first field of ``extra`` (a body's undeclared fields) in :data:`REFUSED`
    with a value that changes the answer (:class:`InvalidRequest` naming it); log each
    unknown one at debug level, once per name per process."""
    if not extra:
        return
    for name, value in extra.items():
        rule = REFUSED.get(name)
        if rule is not None and not rule.no_op(value):
            raise InvalidRequest(f"{name}={value!r} is not supported: {rule.why}", param=name)
    _log_unknown(n for n in extra if n not in REFUSED and n not in KNOWN_NO_OPS)


def _log_unknown(names: Iterable[str]) -> None:
    with _seen_lock:
        new = [n for n in names if n not in _seen]
        _seen.update(new)
    for name in new:
        log.debug("request field %r is not one of OpenAI's or SGLang's: accepted, ignored", name)
