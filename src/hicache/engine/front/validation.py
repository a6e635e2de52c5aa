"""Whether a request can be served, checked once: :func:`validate_request` makes the
:class:`ValidRequest` that :meth:`Engine.submit_valid
<hicache.engine.front.engine.Engine.submit_valid>` takes as it is (the server validates each of
an HTTP request's sequences before it reserves queue places, then submits the records)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from hicache.disagg.config import Bootstrap, DisaggMode
from hicache.engine.restore_book import DEFAULT_TTL_MS
from hicache.engine.sampling import InvalidRequest, SamplingParams
from hicache.engine.session import SessionHint, check_session_id, check_ttl_ms

MAX_CACHE_SALT_CHARS = 256
"""Longest ``cache_salt`` accepted: each distinct salt is tenant state kept by the cache."""
PRIORITY_MIN = -(2**63)
PRIORITY_MAX = 2**63 - 1
"""``priority`` is a signed 64-bit int (SGLang's field); larger = more important."""


@dataclass(frozen=True, slots=True)
class ValidRequest:
    """A request :func:`validate_request` found servable: the prompt's token ids, its
    sampling parameters, its ``cache_salt`` (tenant) and ``priority``, its agent
    ``session`` hint (None: none), and on a prefill/decode instance its ``bootstrap`` room. Made only there (through
    :meth:`Engine.validate <hicache.engine.front.engine.Engine.validate>`); submitted as it is,
    never checked again."""

    prompt_ids: tuple[int, ...]
    params: SamplingParams
    cache_salt: str = ""
    priority: int = 0
    bootstrap: Bootstrap | None = None
    session: SessionHint | None = None


def validate_request(
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    vocab: int,
    context_length: int,
    cache_salt: str = "",
    priority: int = 0,
    role: DisaggMode = DisaggMode.NULL,
    bootstrap: Bootstrap | None = None,
    session: SessionHint | None = None,
) -> ValidRequest:
    """The :class:`ValidRequest` of these fields; raises :class:`InvalidRequest` (a
    ValueError) naming the problem and its field (``prompt``, ``cache_salt``,
    ``priority``, ``session_id``, ``bootstrap_room``,
    ``logprob_start_len``) when the request cannot be served by a model of ``vocab``
    token ids and ``context_length`` positions, on an instance of ``role``. ``session``:
    its agent-session hint (validated when made), carried as it is. A prefill instance's
    request needs a ``bootstrap`` room, and generates one token there (the decode
    instance the room names generates the rest); so does a decode instance's; a plain
    instance ignores one."""
    if not isinstance(params, SamplingParams):
        raise InvalidRequest(f"params must be SamplingParams, got {type(params).__name__}")
    check_prompt_ids(prompt_ids, vocab, "prompt")
    params.check_vocab(vocab)  # logit_bias and stop_token_ids
    if len(prompt_ids) >= context_length:
        raise InvalidRequest(
            f"the prompt has {len(prompt_ids)} tokens; the context length is"
            f" {context_length} (at least one token must be generated)",
            param="prompt",
        )
    if params.logprob_start_len > len(prompt_ids):
        raise InvalidRequest(
            f"logprob_start_len={params.logprob_start_len} is invalid; must be a position in"
            f" the prompt, 0 to {len(prompt_ids)} (the prompt has {len(prompt_ids)} tokens)",
            param="logprob_start_len",
        )
    check_cache_salt(cache_salt)
    if (
        isinstance(priority, bool)
        or not isinstance(priority, int)
        or not PRIORITY_MIN <= priority <= PRIORITY_MAX
    ):
        raise InvalidRequest(
            f"priority={priority!r} is invalid; must be an int in [{PRIORITY_MIN}, {PRIORITY_MAX}]",
            param="priority",
        )
    if session is not None and not isinstance(session, SessionHint):
        raise InvalidRequest(
            f"session must be a SessionHint, got {type(session).__name__}", param="session_id"
        )
    if role is DisaggMode.NULL:
        bootstrap = None
    else:
        params = _pd_params(params, role, bootstrap)
    return ValidRequest(tuple(prompt_ids), params, cache_salt, priority, bootstrap, session)


def check_prompt_ids(prompt_ids: Sequence[int], vocab: int, param: str) -> None:
    """:class:`InvalidRequest` naming ``param`` for an empty prompt or a token id outside
    ``[0, vocab)``."""
    if not prompt_ids:
        raise InvalidRequest("the prompt is empty", param=param)
    bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise InvalidRequest(
            f"token id {bad[0]!r} is outside the vocabulary [0, {vocab})", param=param
        )


def check_cache_salt(cache_salt: object) -> None:
    """:class:`InvalidRequest` naming ``cache_salt`` unless a short enough string."""
    if not isinstance(cache_salt, str) or len(cache_salt) > MAX_CACHE_SALT_CHARS:
        shown = len(cache_salt) if isinstance(cache_salt, str) else type(cache_salt).__name__
        raise InvalidRequest(
            f"cache_salt ({shown}) is invalid; must be a string of at most"
            f" {MAX_CACHE_SALT_CHARS} characters",
            param="cache_salt",
        )


@dataclass(frozen=True, slots=True)
class ValidRestore:
    """A restore :func:`validate_restore` found servable: the whole pages of its prefix
    (``prompt_ids``), its tenant (``cache_salt``), ``session_id`` and ``ttl_ms``."""

    prompt_ids: tuple[int, ...]
    cache_salt: str
    session_id: str
    ttl_ms: int


def validate_restore(
    prompt_ids: Sequence[int],
    *,
    vocab: int,
    context_length: int,
    page_size: int,
    session_id: object,
    ttl_ms: object,
    cache_salt: object = "",
    param: str = "input_ids",
) -> ValidRestore:
    """The :class:`ValidRestore` of a ``POST /hicache/prefetch``'s fields; raises
    :class:`InvalidRequest` naming ``param`` (the prompt: empty, a token outside the
    vocabulary, not one whole page, longer than the context), ``session_id``, ``ttl_ms``
    (a session's TTL: :func:`~hicache.engine.session.check_ttl_ms`; None:
    :data:`~hicache.engine.restore_book.DEFAULT_TTL_MS`) or ``cache_salt``."""
    check_prompt_ids(prompt_ids, vocab, param)
    if len(prompt_ids) > context_length:
        raise InvalidRequest(
            f"the prompt has {len(prompt_ids)} tokens; the context length is {context_length}",
            param=param,
        )
    whole = len(prompt_ids) // page_size * page_size
    if not whole:
        raise InvalidRequest(
            f"the prompt has {len(prompt_ids)} tokens, less than one page ({page_size});"
            " only whole pages are restored",
            param=param,
        )
    sid = check_session_id(session_id, "session_id")
    ttl = check_ttl_ms(ttl_ms, "ttl_ms")
    check_cache_salt(cache_salt)
    assert isinstance(cache_salt, str)
    ttl = DEFAULT_TTL_MS if ttl is None else ttl
    return ValidRestore(tuple(prompt_ids[:whole]), cache_salt, sid, ttl)


def _pd_params(
    params: SamplingParams, role: DisaggMode, bootstrap: Bootstrap | None
) -> SamplingParams:
    """``params`` as a ``role`` instance serves them (one token on a prefill instance);
    InvalidRequest without a room."""
    if bootstrap is None:
        raise InvalidRequest(
            f"a {role.value} instance serves a request only with bootstrap_host,"
            " bootstrap_port and bootstrap_room (send it through the router, which adds them)",
            param="bootstrap_room",
        )
    if role is DisaggMode.PREFILL and bootstrap.transfers:
        return dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
    return params


__all__ = [
    "MAX_CACHE_SALT_CHARS",
    "PRIORITY_MAX",
    "PRIORITY_MIN",
    "ValidRequest",
    "validate_request",
]
