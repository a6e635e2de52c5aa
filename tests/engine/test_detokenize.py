"""Incremental detokenization is exactly ``tokenizer.decode(ids, skip_special_tokens=True)``.

Hypothesis draws id sequences (multi-byte characters cut into byte pieces, special
tokens, runs of spaces, ids past the vocabulary) for the tokenizer the engine and every
tiny test checkpoint use (SmolLM2's byte-level BPE), a SentencePiece-style one with byte
fallback, and a WordPiece one whose decode rewrites text across ids (not incremental: the
probe says so and the output processor decodes it in full). The output processor's
reports (streamed deltas, stop strings, ``min_tokens``, stop ids, EOS, ``max_tokens``)
are the same whichever way it decodes.
"""

from __future__ import annotations

import dataclasses
import logging
from functools import cache
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache.engine.detokenize import IncrementalText, decode_function, decodes_incrementally
from hicache.engine.request import FinishReason, Request, RequestOutput
from hicache.engine.sampling import SamplingParams
from hicache.engine.step.output import OutputProcessor
from hicache.runner.checkpoints import (
    DEFAULT_MODEL,
    TINY_HYBRID_MODELS,
    TINY_MODELS,
    models_dir,
    resolve_checkpoint,
)
from tests.helpers.fake_runner import SpaceTokenizer

EXAMPLES = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MULTILINGUAL = ["é", "ü", "世界", "日本語", "🙂", "👍🏽", "🇫🇷", "Ελλ", " naïve", "e\u0301", "—"]


@cache
def smollm2() -> Any:
    """The SmolLM2 tokenizer: the default model's and every tiny checkpoint's."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_checkpoint(None).path, local_files_only=True)


SENTENCEPIECE = ["<unk>", "<s>", "</s>", "▁", "▁▁", "▁hello", "▁world", "ing", "a", "▁a", "."]
SENTENCEPIECE += ["é", "▁é", "世界", "🙂", "\n"]


@cache
def sentencepiece_like(byte_fallback: bool) -> Any:
    """A BPE tokenizer with a SentencePiece decoder (``▁`` for spaces, a leading space
    stripped), as Llama 2 and Mistral have; with ``byte_fallback``, 256 byte pieces
    ``<0x..>`` after :data:`SENTENCEPIECE`, decoded run by run (not incremental)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    pieces = SENTENCEPIECE + ([f"<0x{b:02X}>" for b in range(256)] if byte_fallback else [])
    vocab = {p: i for i, p in enumerate(pieces)}
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=byte_fallback))
    steps = [decoders.Replace("▁", " ")]
    steps += [decoders.ByteFallback()] if byte_fallback else []
    tok.decoder = decoders.Sequence([*steps, decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        clean_up_tokenization_spaces=False,
    )


WORDPIECE_WORDS = ["[UNK]", "[CLS]", "[SEP]", "hello", "world", "##ing", ".", ",", "'", "t"]


@cache
def wordpiece() -> Any:
    """A WordPiece tokenizer whose decoder cleans up spaces ("hello ' hello" decodes as
    "hello'hello"): a text that depends on ids on both sides, not incremental."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(
        models.WordPiece({w: i for i, w in enumerate(WORDPIECE_WORDS)}, unk_token="[UNK]")
    )
    tok.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        clean_up_tokenization_spaces=True,
    )


def full(tokenizer: Any, ids: list[int]) -> str:
    return str(tokenizer.decode(ids, skip_special_tokens=True))


@cache
def smollm2_pieces() -> tuple[list[int], list[int], list[int]]:
    """SmolLM2 ids of single bytes (the 256 byte-level tokens), of multi-byte text and of
    whitespace runs."""
    from tokenizers import pre_tokenizers

    tok = smollm2()
    single = [int(tok.convert_tokens_to_ids(c)) for c in pre_tokenizers.ByteLevel.alphabet()]
    text = [t for s in MULTILINGUAL for t in tok.encode(s, add_special_tokens=False)]
    spaces = [
        t
        for s in [" ", "  ", "\n", "\n\n", "\t", " a", "a "]
        for t in tok.encode(s, add_special_tokens=False)
    ]
    return single, text, spaces


def smollm2_ids() -> st.SearchStrategy[list[int]]:
    tok = smollm2()
    single, text, spaces = smollm2_pieces()
    one = st.one_of(
        st.integers(0, len(tok) - 1),
        st.sampled_from(tok.all_special_ids),
        st.sampled_from(single),
        st.sampled_from(text),
        st.sampled_from(spaces),
        st.integers(len(tok), len(tok) + 3),  # past the tokenizer: decodes to nothing
    )
    return st.lists(one, max_size=40)


# ---------------------------------------------------------------- IncrementalText


def assert_every_prefix_exact(tokenizer: Any, ids: list[int]) -> None:
    inc = IncrementalText(decode_function(tokenizer))
    for k in range(len(ids) + 1):
        assert inc.text(ids, k) == full(tokenizer, ids[:k]), (ids, k)


@EXAMPLES
@given(ids=smollm2_ids())
def test_smollm2_incremental_text_is_the_full_decode(ids: list[int]) -> None:
    assert_every_prefix_exact(smollm2(), ids)


@EXAMPLES
@given(ids=st.lists(st.integers(0, len(SENTENCEPIECE) - 1), max_size=30))
def test_sentencepiece_incremental_text_is_the_full_decode(ids: list[int]) -> None:
    assert_every_prefix_exact(sentencepiece_like(byte_fallback=False), ids)


@EXAMPLES
@given(ids=smollm2_ids(), steps=st.lists(st.integers(0, 3), min_size=1, max_size=40))
def test_incremental_text_in_uneven_steps(ids: list[int], steps: list[int]) -> None:
    """``n`` may stay (an ending stop id is left out) or jump by several ids."""
    tok = smollm2()
    inc = IncrementalText(decode_function(tok))
    n = 0
    for step in steps:
        n = min(len(ids), n + step)
        assert inc.text(ids, n) == full(tok, ids[:n])


def test_incremental_text_refuses_to_go_back() -> None:
    inc = IncrementalText(lambda ids: "".join(map(str, ids)))
    assert inc.text([1, 2, 3], 3) == "123"
    with pytest.raises(ValueError):
        inc.text([1, 2, 3], 2)
    with pytest.raises(ValueError):
        inc.text([1, 2, 3], 4)


def test_the_window_stays_short() -> None:
    """Each new token decodes a few ids, not the whole output."""
    tok = smollm2()
    seen: list[int] = []

    def decode(ids: list[int]) -> str:
        seen.append(len(ids))
        return full(tok, ids)

    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 20, add_special_tokens=False)
    inc = IncrementalText(decode)
    for k in range(1, len(ids) + 1):
        inc.text(ids, k)
    assert len(ids) > 150 and max(seen) <= 2
    assert inc.text(ids, len(ids)) == full(tok, ids)


# ---------------------------------------------------------------- the probe


def test_probe_accepts_the_tokenizers_the_engine_uses() -> None:
    from transformers import AutoTokenizer

    assert decodes_incrementally(smollm2())
    assert decodes_incrementally(sentencepiece_like(byte_fallback=False))
    # every tiny checkpoint saves the SmolLM2 tokenizer again: check that copy too
    for name in (DEFAULT_MODEL, *TINY_MODELS, *TINY_HYBRID_MODELS):
        if name == DEFAULT_MODEL or name == TINY_MODELS[0] or (models_dir() / name).is_dir():
            path = resolve_checkpoint(name).path  # (tiny-random-llama built if need be)
            tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
            assert decodes_incrementally(tok), name


class BrokenTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        raise RuntimeError("no")


def test_probe_refuses_what_does_not_decode_incrementally() -> None:
    assert decodes_incrementally(SpaceTokenizer())
    assert not decodes_incrementally(wordpiece())
    assert not decodes_incrementally(sentencepiece_like(byte_fallback=True))
    assert not decodes_incrementally(BrokenTokenizer())
    assert OutputProcessor(wordpiece(), [], 1024).incremental is False
    assert OutputProcessor(smollm2(), [], 1024).incremental is True


# ---------------------------------------------------------------- OutputProcessor


def drive(
    processor: OutputProcessor, ids: list[int], params: SamplingParams, prompt_len: int = 3
) -> list[RequestOutput]:
    """Feed ``ids`` one by one as the scheduler does (token check, text, report) until the
    request ends; every report."""
    req = Request(list(range(1, prompt_len + 1)), params)
    outs: list[RequestOutput] = []
    for token in ids:
        req.output_ids.append(token)
        processor.check_token(req)
        processor.update_text(req)
        outs.append(processor.report(req))
        if req.finished:
            break
    return outs


def assert_stream_consistent(outs: list[RequestOutput]) -> None:
    assert "".join(o.delta_text for o in outs) == outs[-1].text
    assert all(not o.finished for o in outs[:-1])


@st.composite
def generation(draw: st.DrawFn) -> tuple[list[int], SamplingParams, frozenset[int]]:
    tok = smollm2()
    ids = draw(smollm2_ids().filter(bool))
    text = full(tok, ids)
    stops: list[str] = []
    for _ in range(draw(st.integers(0, 2))):  # pieces of the text, or anything
        if text and draw(st.booleans()):
            i = draw(st.integers(0, len(text) - 1))
            stops.append(text[i : i + draw(st.integers(1, 4))])
        else:
            stops.append(draw(st.text(min_size=1, max_size=3)))
    max_tokens = draw(st.integers(1, 50))
    params = SamplingParams(
        max_tokens=max_tokens,
        stop=stops,
        min_tokens=draw(st.integers(0, min(max_tokens, 6))),
        stop_token_ids=draw(st.lists(st.sampled_from(ids), max_size=1)),
        ignore_eos=draw(st.booleans()),
    )
    eos = frozenset(draw(st.lists(st.sampled_from([*ids, *tok.all_special_ids]), max_size=2)))
    return ids, params, eos


@EXAMPLES
@given(case=generation())
def test_reports_are_the_same_whichever_way_the_text_is_decoded(
    case: tuple[list[int], SamplingParams, frozenset[int]],
) -> None:
    ids, params, eos = case
    inc = OutputProcessor(smollm2(), eos, 1024, incremental=True)
    ref = OutputProcessor(smollm2(), eos, 1024, incremental=False)
    got, want = drive(inc, ids, params), drive(ref, ids, params)
    assert [dataclasses.replace(o, rid="") for o in got] == [
        dataclasses.replace(o, rid="") for o in want
    ]
    assert inc.incremental  # no mismatch was found at the end
    if params.min_tokens <= 1:  # (a stop string streamed before min_tokens may be cut
        assert_stream_consistent(got)  # later: the semantics as they were)
    assert all(not o.finished for o in got[:-1])
    final = got[-1]
    if final.finished and final.finish_reason is not FinishReason.STOP:
        assert final.text == full(smollm2(), final.output_ids)


def test_a_tokenizer_that_fails_the_probe_is_decoded_in_full() -> None:
    tok = wordpiece()
    ids = [3, 8, 3, 5, 6, 4, 8, 9]  # hello ' hello ##ing . world ' t
    processor = OutputProcessor(tok, [], 1024)
    assert not processor.incremental
    outs = drive(processor, ids, SamplingParams(max_tokens=len(ids)))
    assert outs[-1].text == full(tok, ids) == "hello'helloing. world't"


@EXAMPLES
@given(ids=st.lists(st.integers(0, len(SENTENCEPIECE) + 255), min_size=1, max_size=30))
def test_byte_fallback_is_decoded_in_full(ids: list[int]) -> None:
    """A stray byte piece after a complete character changes that character: no
    incremental decode; every intermediate text is still the full decode."""
    tok = sentencepiece_like(byte_fallback=True)
    processor = OutputProcessor(tok, [], 1024)
    assert not processor.incremental
    req = Request([1], SamplingParams(max_tokens=len(ids)))
    for token in ids:
        req.output_ids.append(token)
        processor.on_token(req)
        assert req.text == full(tok, req.output_ids)


def test_a_mismatch_at_the_end_switches_to_full_decodes(caplog: pytest.LogCaptureFixture) -> None:
    """Forced incremental on a tokenizer that is not: the finished text is checked
    against a full decode, the full decode wins and later requests decode in full."""
    tok = wordpiece()
    processor = OutputProcessor(tok, [], 1024, incremental=True)
    ids = [3, 8, 3]
    with caplog.at_level(logging.WARNING, logger="hicache.engine.step.output"):
        outs = drive(processor, ids, SamplingParams(max_tokens=3))
    assert outs[-1].text == "hello'hello" and outs[-1].finish_reason is FinishReason.LENGTH
    assert not processor.incremental and "decoding in full" in caplog.text
    assert drive(processor, ids, SamplingParams(max_tokens=3))[-1].text == "hello'hello"


def test_a_stop_id_at_the_end_is_left_out_without_a_decode() -> None:
    tok = smollm2()
    ids = [*tok.encode("Hello world", add_special_tokens=False), tok.eos_token_id]
    calls: list[int] = []
    processor = OutputProcessor(tok, [tok.eos_token_id], 1024)
    fast = processor._fast_decode

    def counting(window: list[int]) -> str:
        calls.append(len(window))
        return fast(window)

    processor._fast_decode = counting
    outs = drive(processor, ids, SamplingParams(max_tokens=10))
    assert outs[-1].text == "Hello world" and outs[-1].finish_reason is FinishReason.STOP
    assert outs[-1].output_ids == ids
    # two decodes per token while the text moves on; the EOS adds none (one full check)
    assert len(calls) == 2 * (len(ids) - 1)
