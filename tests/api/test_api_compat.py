"""The server driven by the official ``openai`` package, parameter by parameter, asserting
what each one does (not just the status). A parameter the engine does not serve yet must be
refused with a 400 naming it; the tests check whichever holds."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from hicache.engine.front.engine import Engine
from hicache.server.protocol import engine_supports
from tests.helpers.api_fixtures import CONTEXT, assert_clean, make_engine, serve

openai = pytest.importorskip("openai")

PROMPT = [(13 * i + 5) % 3000 + 200 for i in range(30)]
MSGS = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def env() -> Iterator[tuple[Any, Engine]]:
    engine = make_engine()
    with serve(engine, api_key="sk-test") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-test", max_retries=0)
        yield client, engine
    engine.close()


def refused(exc: Any, param: str) -> None:
    assert exc.value.status_code == 400
    assert exc.value.param == param, exc.value.body


def tokens_of(client: Any, **kw: Any) -> list[int]:
    """Generated token ids, read from ``/generate`` with the same sampling."""
    import httpx

    base = str(client.base_url).removesuffix("/v1/")
    r = httpx.post(
        f"{base}/generate", json=kw, headers={"authorization": "Bearer sk-test"}, timeout=60
    )
    assert r.status_code == 200, r.text
    return list(r.json()["output_ids"])


def complete(client: Any, **kw: Any) -> Any:
    args = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, **kw}
    return client.completions.create(**args)


# ---------------------------------------------------------------------- basics


def test_api_key_is_required(env: tuple[Any, Engine]) -> None:
    client, _ = env
    bad = openai.OpenAI(base_url=str(client.base_url), api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert client.models.list().data[0].id == "tiny"
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_completion_basics(env: tuple[Any, Engine]) -> None:
    client, engine = env
    r = complete(client)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 6
    assert r.usage.prompt_tokens == len(PROMPT)
    again = complete(client)
    assert again.choices[0].text == r.choices[0].text  # temperature 0: greedy
    assert again.usage.prompt_tokens_details.cached_tokens == 28  # 7 whole pages
    shorter = complete(client, max_tokens=3)
    assert shorter.usage.completion_tokens == 3
    assert r.choices[0].text.startswith(shorter.choices[0].text)
    a = complete(client, temperature=1.0, seed=7, top_p=0.9)
    b = complete(client, temperature=1.0, seed=7, top_p=0.9)
    assert a.choices[0].text == b.choices[0].text  # seed: reproducible
    assert_clean(engine)


def test_stop_strings(env: tuple[Any, Engine]) -> None:
    client, _ = env
    full = complete(client, max_tokens=8).choices[0].text
    cut = full[3:6]
    r = complete(client, max_tokens=8, stop=[cut])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[: full.index(cut)]


def test_streaming_and_usage_chunk(env: tuple[Any, Engine]) -> None:
    client, _ = env
    full = complete(client).choices[0].text
    chunks = list(complete(client, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    chunks = list(complete(client, stream=True))
    assert all(c.choices for c in chunks)


def test_n_and_batched_prompts(env: tuple[Any, Engine]) -> None:
    client, engine = env
    r = complete(client, n=3, temperature=1.0, seed=1)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 18
    r = complete(client, prompt=["Hello there", "The sky is"], max_tokens=2)
    assert [c.index for c in r.choices] == [0, 1]
    solo = complete(client, prompt="The sky is", max_tokens=2)
    assert r.choices[1].text == solo.choices[0].text
    assert_clean(engine)


def test_chat_basics_and_parts(env: tuple[Any, Engine]) -> None:
    client, _ = env
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=5, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens == 5
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say something."}]}]
    p = client.chat.completions.create(model="tiny", messages=parts, max_tokens=5, temperature=0)
    assert p.choices[0].message.content == r.choices[0].message.content
    m = client.chat.completions.create(
        model="tiny", messages=MSGS, max_completion_tokens=2, temperature=0
    )
    assert m.usage.completion_tokens == 2
    stream = client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=5, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream) == r.choices[0].message.content
    n = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=2, n=2)
    assert sorted(c.index for c in n.choices) == [0, 1]


def test_max_tokens_beyond_the_context_is_refused(env: tuple[Any, Engine]) -> None:
    client, _ = env
    with pytest.raises(openai.BadRequestError) as exc:
        complete(client, max_tokens=CONTEXT)
    refused(exc, "max_tokens")
    assert str(CONTEXT) in exc.value.message


# ---------------------------------------------------------------------- refused


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"suffix": "end"}, "suffix"),
        ({"best_of": 2}, "best_of"),
        ({"extra_body": {"response_format": {"type": "json_object"}}}, "response_format"),
    ],
)
def test_completion_refusals(env: tuple[Any, Engine], kw: dict[str, Any], param: str) -> None:
    client, _ = env
    with pytest.raises(openai.BadRequestError) as exc:
        complete(client, **kw)
    refused(exc, param)


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)
def test_chat_refusals(env: tuple[Any, Engine], kw: dict[str, Any], param: str) -> None:
    client, _ = env
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=2, **kw)
    refused(exc, param)


# ---------------------------------------------------------------------- engine-side parameters


def test_logprobs_completions_and_echo(env: tuple[Any, Engine]) -> None:
    client, _ = env
    if not engine_supports("logprobs"):
        with pytest.raises(openai.BadRequestError) as exc:
            complete(client, logprobs=2)
        refused(exc, "logprobs")
        return
    r = complete(client, logprobs=2, max_tokens=4)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 4 and "".join(lp.tokens) == r.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen <= 0 and len(top) <= 2
        assert chosen == pytest.approx(max(top.values()), abs=1e-4)  # greedy: the top one
    # log-likelihood as lm-eval asks for it: echo + logprobs + max_tokens 1
    text = "The quick brown fox jumps"
    e = complete(client, prompt=text, echo=True, logprobs=1, max_tokens=1)
    elp = e.choices[0].logprobs
    n_prompt = e.usage.prompt_tokens
    assert e.choices[0].text.startswith(text)
    assert len(elp.token_logprobs) == n_prompt + 1
    assert elp.token_logprobs[0] is None and all(x <= 0 for x in elp.token_logprobs[1:])
    assert "".join(elp.tokens) == e.choices[0].text
    # the prompt token's logprob agrees with generating after the shorter prefix
    ids = e.choices[0].logprobs.tokens
    prefix_text = "".join(ids[:2])
    g = complete(client, prompt=prefix_text, logprobs=1, max_tokens=1)
    top_at_2 = max(elp.top_logprobs[2].values())
    assert g.choices[0].logprobs.token_logprobs[0] == pytest.approx(top_at_2, abs=1e-3)
    stream = list(complete(client, logprobs=2, max_tokens=4, stream=True))
    streamed = [
        t
        for c in stream
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.token_logprobs
    ]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-5)


def test_logprobs_chat(env: tuple[Any, Engine]) -> None:
    client, _ = env
    kw: dict[str, Any] = {"model": "tiny", "messages": MSGS, "max_tokens": 4, "temperature": 0}
    if not engine_supports("logprobs"):
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(**kw, logprobs=True)
        refused(exc, "logprobs")
        return
    r = client.chat.completions.create(**kw, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert len(item.top_logprobs) == 3
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=1e-4)
    none = client.chat.completions.create(**kw)
    assert none.choices[0].logprobs is None


def _needs(client: Any, field: str, **kw: Any) -> bool:
    """True when the engine serves ``field``; else checks that it is refused."""
    if engine_supports(field):
        return True
    with pytest.raises(openai.BadRequestError) as exc:
        complete(client, **kw)
    refused(exc, field)
    return False


def test_logit_bias_and_stop_token_ids(env: tuple[Any, Engine]) -> None:
    client, engine = env
    if not _needs(client, "logit_bias", logit_bias={"42": 5}):
        return
    word = engine.model.tokenizer.encode(" hello", add_special_tokens=False)[0]
    r = complete(client, logit_bias={str(word): 100}, max_tokens=4)
    assert r.choices[0].text == " hello" * 4
    if not _needs(client, "stop_token_ids", extra_body={"stop_token_ids": [word]}):
        return
    r = complete(
        client, logit_bias={str(word): 100}, max_tokens=4, extra_body={"stop_token_ids": [word]}
    )
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1


def test_ignore_eos_and_min_tokens(env: tuple[Any, Engine]) -> None:
    client, engine = env
    eos = engine.model.tokenizer.eos_token_id
    if not _needs(client, "logit_bias", logit_bias={"42": 5}):
        return
    to_eos = {"logit_bias": {str(eos): 100}, "max_tokens": 6}
    r = complete(client, **to_eos)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1
    if _needs(client, "ignore_eos", extra_body={"ignore_eos": True}):
        r = complete(client, **to_eos, extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 6
    if _needs(client, "min_tokens", extra_body={"min_tokens": 3}):
        r = complete(client, **to_eos, extra_body={"min_tokens": 3})
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 4


def test_penalties(env: tuple[Any, Engine]) -> None:
    client, engine = env
    word = engine.model.tokenizer.encode(" hello", add_special_tokens=False)[0]
    if not _needs(client, "frequency_penalty", frequency_penalty=1.0):
        return
    biased = {"logit_bias": {str(word): 20}, "max_tokens": 16}
    plain = complete(client, **biased).choices[0].text
    assert plain == " hello" * 16
    freq = complete(client, **biased, frequency_penalty=2.0).choices[0].text
    assert freq.count(" hello") < 16
    if _needs(client, "repetition_penalty", extra_body={"repetition_penalty": 1.5}):
        rep = complete(client, **biased, extra_body={"repetition_penalty": 100.0})
        assert rep.choices[0].text.count(" hello") < 16
    if _needs(client, "presence_penalty", presence_penalty=1.0):
        base = tokens_of(
            client, input_ids=PROMPT, sampling_params={"max_new_tokens": 24, "temperature": 0}
        )
        pres = tokens_of(
            client,
            input_ids=PROMPT,
            sampling_params={"max_new_tokens": 24, "temperature": 0, "presence_penalty": 2.0},
        )
        repeats = len(base) - len(set(base))
        assert len(pres) - len(set(pres)) <= repeats
        if repeats:
            assert pres != base
    if _needs(client, "top_k", extra_body={"top_k": 1}):
        k1 = complete(client, temperature=1.5, seed=3, extra_body={"top_k": 1})
        assert k1.choices[0].text == complete(client).choices[0].text  # top_k 1 = greedy


# ---------------------------------------------------------------------- OpenAI's shapes (issue 17)


def _summed_usage(chunks: list[Any]) -> tuple[int, int]:
    """What a client that adds up every chunk's usage counts: (prompt, completion)."""
    used = [c.usage for c in chunks if c.usage is not None]
    return sum(u.prompt_tokens for u in used), sum(u.completion_tokens for u in used)


@pytest.mark.parametrize("n", [1, 3])
def test_stream_usage_only_on_the_final_chunk(env: tuple[Any, Engine], n: int) -> None:
    """With include_usage, usage rides only on the last, choice-less chunk (null on the
    others), counting the prompt once for all n choices; a client summing usage over the
    chunks gets the request's usage."""
    client, _ = env
    kw: dict[str, Any] = {"n": n, "temperature": 1.0, "seed": 4, "max_tokens": 8}
    if engine_supports("ignore_eos"):
        kw["extra_body"] = {"ignore_eos": True}
    whole = complete(client, **kw)
    chunks = list(complete(client, stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(c.usage is None for c in chunks[:-1]) and all(c.choices for c in chunks[:-1])
    assert chunks[-1].usage.prompt_tokens == len(PROMPT) == whole.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert _summed_usage(chunks) == (len(PROMPT), whole.usage.completion_tokens)
    chat = list(
        client.chat.completions.create(
            model="tiny",
            messages=MSGS,
            max_tokens=4,
            n=n,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chat[-1].choices == [] and all(c.usage is None for c in chat[:-1])
    prompt, completion = _summed_usage(chat)
    assert prompt == chat[-1].usage.prompt_tokens and completion <= 4 * n


def test_unknown_model_is_model_not_found(env: tuple[Any, Engine]) -> None:
    """A model the server does not serve is OpenAI's 404 model_not_found, on the
    inference routes as on /v1/models/{id}; what is accepted is what /v1/models lists."""
    client, _ = env
    for call in (
        lambda: complete(client, model="gpt-4o"),
        lambda: client.chat.completions.create(model="gpt-4o", messages=MSGS, max_tokens=2),
        lambda: client.models.retrieve("gpt-4o"),
    ):
        with pytest.raises(openai.NotFoundError) as exc:
            call()
        err = exc.value.body
        assert exc.value.code == "model_not_found" and exc.value.param == "model", err
        assert err["type"] == "invalid_request_error" and "'gpt-4o'" in err["message"]
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert complete(client, model="tiny").model == "tiny"


def test_model_aliases_are_listed_and_served() -> None:
    engine = make_engine()
    try:
        with serve(engine, model_aliases=["smol", "tiny"]) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
            assert [m.id for m in client.models.list().data] == ["tiny", "smol"]
            assert client.models.retrieve("smol").root == "tiny"
            r = complete(client, model="smol", max_tokens=2)
            assert r.model == "tiny" and r.usage.completion_tokens == 2  # responses: the name
            with pytest.raises(openai.NotFoundError):
                complete(client, model="gpt-4o")
            # the model's own name is accepted (SGLang's default served name is the
            # path), though not listed
            own = engine.model.name
            assert own not in ("tiny", "smol")
            r = complete(client, model=own, max_tokens=2)
            assert r.model == "tiny" and client.models.retrieve(own).root == "tiny"
    finally:
        engine.close()


def test_error_codes_are_strings_or_null(env: tuple[Any, Engine]) -> None:
    """OpenAI types error.code as a string or null, never the HTTP status."""
    client, _ = env
    bad = openai.OpenAI(base_url=str(client.base_url), api_key="nope", max_retries=0)
    errors: list[Any] = []
    for call in (
        lambda: bad.models.list(),
        lambda: complete(client, max_tokens=CONTEXT),
        lambda: complete(client, model="gpt-4o"),
        lambda: complete(client, n=0),
    ):
        with pytest.raises(openai.APIStatusError) as exc:
            call()
        errors.append(exc.value)
    assert [e.status_code for e in errors] == [401, 400, 404, 400]
    assert all(e.code is None or isinstance(e.code, str) for e in errors), [e.code for e in errors]
