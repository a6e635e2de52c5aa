"""Tokenization cannot stall the server (issue 17): a text whose lower bound on tokens
(characters / the longest token) reaches the context length is refused before it is
encoded, and one large prompt being tokenized does not hold up other text requests."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from hicache.server.app import create_app
from hicache.server.prompt_bound import MAX_COMPOSED, NoBound, TokenBound, token_bound
from hicache.server.state import TOKENIZE_THREADS, ServerState
from tests.helpers.api_fixtures import CONTEXT, make_engine, post, serve_app
from tests.helpers.engine_fixtures import engine_model

TOKENIZER = engine_model("tiny-random-llama").tokenizer
BOUND = token_bound(TOKENIZER)


# ---------------------------------------------------------------------- the bound


def test_bound_of_the_byte_level_tokenizer() -> None:
    bound = BOUND
    assert bound.shrink == 1
    assert bound.max_token_chars == max(len(s) for s in TOKENIZER.get_vocab()) == 81
    assert bound.min_tokens("") == 0 and bound.min_tokens("a") == 1
    assert bound.min_tokens("a" * 81) == 1 and bound.min_tokens("a" * 82) == 2


_ADVERSARIAL = [
    "#" * 5000,
    " " * 5000,
    "\n" + " " * 4000,
    "\n\n\n" * 700,
    "é" * 900 + "日本語" * 300,
    "😀" * 700,
    "<|im_start|>" * 200,
    "hello world " * 400,
    "\x16" * 500,  # a byte SmolLM2's vocabulary lacks: dropped without a token
    "a\x16\x04" * 300,
]


def test_bytes_the_vocabulary_lacks_are_not_counted() -> None:
    """SmolLM2's byte-level BPE has no byte fallback and no unknown token, and its
    vocabulary lacks six ASCII control bytes: they encode to nothing (hypothesis found
    ``"\x16"`` -> 0 tokens against a bound of 1), so the bound leaves them out."""
    assert {"\x16", "\x04"} <= BOUND.dropped
    assert TOKENIZER.encode("\x16" * 100, add_special_tokens=False) == []
    assert BOUND.min_tokens("\x16" * 100) == 0
    assert BOUND.min_tokens("a" * 100 + "\x16") == BOUND.min_tokens("a" * 100)


@pytest.mark.parametrize("text", _ADVERSARIAL, ids=range(len(_ADVERSARIAL)))
def test_bound_holds_on_adversarial_texts(text: str) -> None:
    assert len(TOKENIZER.encode(text, add_special_tokens=False)) >= BOUND.min_tokens(text)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.sampled_from(["#", " ", "\n", "\t", "a", "hello", "é", "\u0301", "日", "😀", "0"])
        | st.text(max_size=8),
        max_size=400,
    )
)
def test_bound_never_exceeds_the_token_count(pieces: list[str]) -> None:
    text = "".join(pieces).encode("utf-8", "replace").decode("utf-8")
    assert len(TOKENIZER.encode(text, add_special_tokens=False)) >= BOUND.min_tokens(text)


class _Wrapped:
    """The two things :func:`token_bound` reads of a Hugging Face tokenizer."""

    def __init__(self, tok: Tokenizer) -> None:
        self.backend_tokenizer = tok

    def get_vocab(self) -> dict[str, int]:
        return dict(self.backend_tokenizer.get_vocab())


def _bpe(**steps: Any) -> _Wrapped:
    vocab = {"a": 0, "b": 1, "ab": 2, "aab": 3, "[UNK]": 4}
    tok = Tokenizer(models.BPE(vocab, [("a", "b"), ("a", "ab")], unk_token="[UNK]"))
    if "normalizer" in steps:
        tok.normalizer = steps["normalizer"]
    if "pre_tokenizer" in steps:
        tok.pre_tokenizer = steps["pre_tokenizer"]
    return _Wrapped(tok)


def test_pipelines_that_keep_every_character_have_a_bound() -> None:
    assert token_bound(_bpe()) == TokenBound(max_token_chars=5)  # "[UNK]"
    nfc = _bpe(normalizer=normalizers.NFC())
    assert token_bound(nfc).shrink == MAX_COMPOSED
    seq = normalizers.Sequence([normalizers.Replace("  ", "_"), normalizers.NFKC()])
    assert token_bound(_bpe(normalizer=seq)).shrink == 2 * MAX_COMPOSED
    meta = pre_tokenizers.Sequence([pre_tokenizers.Metaspace(), pre_tokenizers.Digits()])
    assert token_bound(_bpe(pre_tokenizer=meta)).shrink == 1


@pytest.mark.parametrize(
    ("steps", "why"),
    [
        ({"normalizer": normalizers.Replace(" ", "")}, "Replace"),
        ({"normalizer": normalizers.StripAccents()}, "StripAccents"),
        ({"normalizer": normalizers.BertNormalizer()}, "BertNormalizer"),
        ({"pre_tokenizer": pre_tokenizers.Whitespace()}, "Whitespace"),
        ({"pre_tokenizer": pre_tokenizers.Split(" ", "removed")}, "Split"),
    ],
)
def test_pipelines_that_may_drop_characters_have_none(steps: dict[str, Any], why: str) -> None:
    with pytest.raises(NoBound, match=why):
        token_bound(_bpe(**steps))


def test_wordpiece_and_fused_unknowns_have_no_bound() -> None:
    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    with pytest.raises(NoBound, match="WordPiece"):
        token_bound(_Wrapped(wordpiece))
    fused = Tokenizer(models.BPE({"a": 0, "[UNK]": 1}, [], unk_token="[UNK]", fuse_unk=True))
    with pytest.raises(NoBound, match="fuses"):
        token_bound(_Wrapped(fused))
    with pytest.raises(NoBound, match="fast tokenizer"):
        token_bound(object())


def test_a_bpe_that_drops_unknown_characters_has_no_bound_unless_they_are_bytes() -> None:
    """No byte fallback and no unknown token: a character missing from the vocabulary
    encodes to nothing. Behind ByteLevel only single bytes can vanish (counted out); a
    lead byte and a continuation byte both missing could drop whole characters."""
    dropping = Tokenizer(models.BPE({"a": 0, "b": 1}, []))
    assert dropping.encode("c").ids == []
    with pytest.raises(NoBound, match="drops characters"):
        token_bound(_Wrapped(dropping))
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    full = {c: i for i, c in enumerate(sorted(alphabet))}
    byte_level = Tokenizer(models.BPE(dict(full), []))
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    assert token_bound(_Wrapped(byte_level)).dropped == frozenset()
    lead, cont = "\u00c3", "\u00a9"  # the symbols of bytes 0xC3 and 0xA9 ("é" is C3 A9)
    kept = sorted(alphabet - {lead, cont})
    holes = Tokenizer(models.BPE({c: i for i, c in enumerate(kept)}, []))
    holes.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    assert holes.encode("é").ids == []
    with pytest.raises(NoBound, match="multi-byte"):
        token_bound(_Wrapped(holes))


# ---------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, ServerState]]:
    engine = make_engine()
    app = create_app(engine, "tiny")
    with serve_app(app) as url:
        yield url, app.state.hicache
    engine.close()


@pytest.fixture
def encoded(server: tuple[str, ServerState]) -> Iterator[list[str]]:
    """Every text the server encodes during the test, as it is about to encode it."""
    _, state = server
    seen: list[str] = []
    state.before_encode = seen.append
    yield seen
    state.before_encode = None


def test_over_bound_text_is_refused_without_encoding(
    server: tuple[str, ServerState], encoded: list[str]
) -> None:
    url, state = server
    assert state.token_bound is not None
    per = state.token_bound.chars_per_token
    over = "a" * (CONTEXT * per)  # at least CONTEXT tokens
    r = post(url, "/v1/completions", {"prompt": over, "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt"
    for part in (f"{len(over)} characters", f"at least {CONTEXT} tokens", f"is {CONTEXT}"):
        assert part in err["message"], err["message"]
    r = post(url, "/v1/completions", {"prompt": ["hi", over], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = post(url, "/generate", {"text": over, "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text", r.text
    chat = {"messages": [{"role": "user", "content": over}], "max_tokens": 2}
    r = post(url, "/v1/chat/completions", chat)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    huge = "word " * (7 * 2**20 // 5)  # just under the 8 MiB body limit
    r = post(url, "/v1/completions", {"prompt": huge, "max_tokens": 2})
    assert r.status_code == 400 and "at least" in r.json()["error"]["message"]
    assert encoded == []  # none of them reached the tokenizer
    under = "a" * ((CONTEXT - 1) * per)  # the bound allows it: encoded, then measured
    r = post(url, "/v1/completions", {"prompt": under, "max_tokens": 2})
    assert r.status_code == 400 and "the prompt has" in r.json()["error"]["message"], r.text
    assert encoded == [under]


def test_a_large_prompt_does_not_hold_up_small_ones(server: tuple[str, ServerState]) -> None:
    """The large prompt is held while it is being tokenized; small text and chat requests
    are answered meanwhile, then the large one gets its answer."""
    url, state = server
    big = "hello world " * 800  # within the bound, 1601 tokens: more than the context
    entered, release = threading.Event(), threading.Event()

    def hold(text: str) -> None:
        if text == big:
            entered.set()
            release.wait(60)

    state.before_encode = hold
    answers: list[httpx.Response] = []
    client = threading.Thread(
        target=lambda: answers.append(post(url, "/v1/completions", {"prompt": big}))
    )
    client.start()
    try:
        assert entered.wait(30), "the large prompt never reached the tokenizer"
        for i in range(2 * TOKENIZE_THREADS):
            r = post(url, "/v1/completions", {"prompt": f"Hi {i}", "max_tokens": 2}, timeout=30)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
            chat = {"messages": [{"role": "user", "content": f"Hi {i}"}], "max_tokens": 2}
            r = post(url, "/v1/chat/completions", chat, timeout=30)
            assert r.status_code == 200, r.text
        r = post(url, "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200, r.text
        assert client.is_alive() and not answers  # the large one is still being tokenized
    finally:
        release.set()
        client.join(60)
        state.before_encode = None
    assert answers and answers[0].status_code == 400, answers
    tokens = len(TOKENIZER.encode(big, add_special_tokens=False))
    assert f"the prompt has {tokens} tokens" in answers[0].json()["error"]["message"]
