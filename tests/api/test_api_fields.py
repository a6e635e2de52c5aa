"""Request fields outside what the OpenAI routes serve.

OpenAI fields that change the answer and are not served (``functions``, ``function_call``,
``audio``, ``modalities`` beyond text, ``prediction``, ``tools`` with
``parallel_tool_calls``), and SGLang's fields of the same kind, are refused with a 400
naming them. Fields routers add (``bootstrap_host``, ``return_text_in_logprobs``,
``log_metrics`` ...) are served as before. A field no OpenAI or SGLang schema defines is
accepted and logged once, at debug level.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import pytest

from hicache.engine.front.engine import Engine
from tests.helpers.api_fixtures import post

PROMPT = list(range(300, 345))
CHAT = [{"role": "user", "content": "Say something."}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def request(url: str, route: str, **fields: Any) -> Any:
    if route == "completions":
        body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, **fields}
        return post(url, "/v1/completions", body)
    body = {"messages": CHAT, "max_tokens": 4, "temperature": 0, **fields}
    return post(url, "/v1/chat/completions", body)


REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("chat", {"functions": [{"name": "f", "parameters": {"type": "object"}}]}, "functions"),
    ("chat", {"function_call": "auto"}, "function_call"),
    ("chat", {"function_call": {"name": "f"}}, "function_call"),
    ("chat", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("chat", {"modalities": ["text", "audio"]}, "modalities"),
    ("chat", {"modalities": ["audio"]}, "modalities"),
    ("chat", {"modalities": [{"type": "audio"}]}, "modalities"),
    ("chat", {"prediction": {"type": "content", "content": "Hello"}}, "prediction"),
    ("chat", {"tools": [TOOL], "parallel_tool_calls": True}, "tools"),
    ("completions", {"functions": [{"name": "f"}]}, "functions"),
    ("completions", {"regex": "a+"}, "regex"),
    ("chat", {"json_schema": '{"type": "object"}'}, "json_schema"),
    ("chat", {"ebnf": 'root ::= "a"'}, "ebnf"),
    ("chat", {"chat_template_kwargs": {"enable_thinking": True}}, "chat_template_kwargs"),
    ("completions", {"lora_path": "adapter"}, "lora_path"),
    ("completions", {"min_p": 0.1}, "min_p"),
    ("completions", {"skip_special_tokens": False}, "skip_special_tokens"),
    ("completions", {"no_stop_trim": True}, "no_stop_trim"),
    ("chat", {"continue_final_message": True}, "continue_final_message"),
    ("completions", {"return_hidden_states": True}, "return_hidden_states"),
]


@pytest.mark.parametrize(
    ("route", "fields", "param"), REFUSED, ids=[f"{p}-{i}" for i, (_, _, p) in enumerate(REFUSED)]
)
def test_answer_changing_fields_are_refused(
    server: tuple[str, Engine], route: str, fields: dict[str, Any], param: str
) -> None:
    url, engine = server
    r = request(url, route, **fields)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert param in err["message"], err
    assert err["type"] == "invalid_request_error"
    assert engine.alive


NO_OPS: list[dict[str, Any]] = [
    {"modalities": ["text"]},
    {"parallel_tool_calls": True},
    {"function_call": "none"},
    {"functions": []},
    {"audio": None, "prediction": None},
    {"min_p": 0.0, "skip_special_tokens": True, "no_stop_trim": False},
    # what routers and SGLang's clients add
    {"bootstrap_host": "10.0.0.2", "bootstrap_port": 8998, "bootstrap_room": 12345},
    {"return_text_in_logprobs": True, "log_metrics": True, "rid": "req-1"},
    {"user": "u", "metadata": {"k": "v"}, "store": False, "service_tier": "auto"},
]


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_fields_that_change_nothing_are_served(server: tuple[str, Engine], route: str) -> None:
    url, _ = server
    base = request(url, route)
    assert base.status_code == 200, base.text
    text = base.json()["choices"][0]
    for fields in NO_OPS:
        r = request(url, route, **fields)
        assert r.status_code == 200, (fields, r.text)
        assert r.json()["choices"][0] == text, fields


def test_an_unknown_field_is_served_and_logged_once_at_debug(
    server: tuple[str, Engine], caplog: pytest.LogCaptureFixture
) -> None:
    url, _ = server
    name = f"x_field_{uuid.uuid4().hex[:8]}"
    caplog.set_level(logging.DEBUG, logger="hicache.server")
    base = request(url, "chat")
    for route in ("chat", "completions", "chat"):
        r = request(url, route, **{name: {"any": "value"}, "bootstrap_host": "10.0.0.2"})
        assert r.status_code == 200, r.text
    assert request(url, "chat", **{name: 1}).json()["choices"] == base.json()["choices"]
    mentions = [rec for rec in caplog.records if name in rec.getMessage()]
    assert len(mentions) == 1, [rec.getMessage() for rec in mentions]
    assert mentions[0].levelno == logging.DEBUG
    # a field an SGLang router sends is known, not "unknown"
    assert not [rec for rec in caplog.records if "bootstrap_host" in rec.getMessage()]
