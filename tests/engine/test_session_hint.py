"""The agent-session hint (issue 35, item 1): validated when made, carried from
:func:`validate_request` to the request and through the step-input record every rank
applies (pickled under tensor parallelism)."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from hicache.engine.front.validation import validate_request
from hicache.engine.request import Request
from hicache.engine.sampling import InvalidRequest, SamplingParams
from hicache.engine.session import (
    MAX_SESSION_ID_CHARS,
    SessionHint,
    SessionKind,
    session_hint,
    session_kind,
)
from hicache.engine.step_inputs import NewRequest

GREEDY = SamplingParams(temperature=0.0, max_tokens=2)


def test_kinds() -> None:
    assert session_kind(None) is SessionKind.NONE
    assert session_hint(None, None) is None
    assert session_kind(session_hint("a", None)) is SessionKind.SESSION
    assert session_kind(session_hint("b", "a")) is SessionKind.SUBAGENT
    assert SessionHint("s" * MAX_SESSION_ID_CHARS, "a b é 🤖").kind is SessionKind.SUBAGENT


@pytest.mark.parametrize(
    ("session_id", "parent", "param"),
    [
        ("", None, "session_id"),
        ("s" * (MAX_SESSION_ID_CHARS + 1), None, "session_id"),
        (5, None, "session_id"),
        (b"abc", None, "session_id"),
        ("a\nb", None, "session_id"),
        ("a\x00b", None, "session_id"),
        ("\ud800", None, "session_id"),
        ("a", "", "parent_session_id"),
        ("a", 1.5, "parent_session_id"),
        ("a", "p\x1b", "parent_session_id"),
        ("a", "a", "parent_session_id"),
        (None, "a", "parent_session_id"),
    ],
)
def test_bad_fields_name_themselves(session_id: Any, parent: Any, param: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        session_hint(session_id, parent)
    assert err.value.param == param and param in str(err.value)


def test_the_hint_travels_from_validation_to_every_rank() -> None:
    hint = SessionHint("agent-1/sub", "agent-1")
    valid = validate_request([1, 2, 3], GREEDY, vocab=100, context_length=16, session=hint)
    assert valid.session is hint
    plain = validate_request([1, 2, 3], GREEDY, vocab=100, context_length=16)
    assert plain.session is None
    with pytest.raises(InvalidRequest) as err:
        validate_request(
            [1, 2, 3],
            GREEDY,
            vocab=100,
            context_length=16,
            session="agent-1",  # type: ignore[arg-type]
        )
    assert err.value.param == "session_id"
    req = Request(list(valid.prompt_ids), valid.params, session=valid.session)
    record = NewRequest.of_request(req)
    back = pickle.loads(pickle.dumps(record))
    assert back == record and back.session == hint
    assert NewRequest.of_request(Request([1], GREEDY)).session is None
