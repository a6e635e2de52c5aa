"""A lower bound on how many tokens a text encodes to, known before encoding it.

Premise: if no step of the tokenizer's pipeline drops characters, every character of the
normalized text lies in some token, so ``c`` characters make at least ``ceil(c / L)``
tokens, ``L`` the longest vocabulary entry in characters (each entry is at least as long as
the text it covers), times the factor a normalizer may shorten a text by (``NFC`` / ``NFKC``:
:data:`MAX_COMPOSED`). :func:`token_bound` reads the pipeline and gives a bound only when
it can vouch for every step (normalizers that never shorten the text or shorten it by a
known factor, pre-tokenizers that keep every character, a BPE model, added tokens that do
not strip whitespace); an ASCII byte a byte-level vocabulary lacks is dropped and not
counted (:attr:`TokenBound.dropped`). Anything else gives no bound, and every text is then
tokenized to learn its length. Which steps qualify and why: ``docs/api.md``, "Bad input".
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_COMPOSED = 4
"""Most code points one NFC/NFKC-composed character stands for: the longest canonical
decomposition in Unicode (e.g. U+1F82 is four code points; a Hangul syllable three)."""

_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "Split", "Punctuation"})


class NoBound(Exception):
    """The tokenizer has a step that may drop or merge characters; the message says which."""


@dataclass(frozen=True, slots=True)
class TokenBound:
    """``min_tokens(text) = ceil(kept / (max_token_chars * shrink))`` where ``kept`` is
    ``len(text)`` less its characters in :attr:`dropped`: a lower bound on the number of
    tokens ``text`` encodes to (without special tokens added)."""

    max_token_chars: int
    """The longest vocabulary entry, in characters (>= 1)."""
    shrink: int = 1
    """How many times shorter the normalizer may make a text (>= 1)."""
    dropped: frozenset[str] = frozenset()
    """Characters the model may drop without a token (bytes its vocabulary lacks)."""

    def __post_init__(self) -> None:
        if self.max_token_chars < 1 or self.shrink < 1:
            raise ValueError(
                f"max_token_chars={self.max_token_chars}, shrink={self.shrink}: both must be >= 1"
            )

    @property
    def chars_per_token(self) -> int:
        """Most characters of the original text one token can stand for."""
        return self.max_token_chars * self.shrink

    def min_tokens(self, text: str) -> int:
        """The fewest tokens ``text`` can encode to."""
        kept = len(text) - sum(text.count(c) for c in self.dropped)
        return -(-kept // self.chars_per_token)


def token_bound(tokenizer: Any) -> TokenBound:
    """The bound for a Hugging Face fast tokenizer; :class:`NoBound` naming the step that
    rules it out (also for a tokenizer without a ``backend_tokenizer``)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise NoBound(f"{type(tokenizer).__name__} is not a Hugging Face fast tokenizer")
    shrink = _normalizer_shrink(_spec(backend.normalizer))
    _check_pre_tokenizer(_spec(backend.pre_tokenizer))
    model = backend.model
    kind = type(model).__name__
    if kind != "BPE":
        raise NoBound(f"the {kind} model may encode a long unknown word as one token")
    if model.fuse_unk and not model.byte_fallback and model.unk_token:
        raise NoBound("the BPE model fuses runs of unknown characters into one token")
    dropped: frozenset[str] = frozenset()
    if not model.byte_fallback and not model.unk_token:
        dropped = _dropped_chars(_spec(backend.pre_tokenizer), tokenizer.get_vocab())
    added = list(backend.get_added_tokens_decoder().values())
    for token in added:
        if token.lstrip or token.rstrip:
            raise NoBound(f"the added token {token.content!r} absorbs whitespace")
    strings = [*tokenizer.get_vocab(), *(str(t.content) for t in added)]
    longest = max((len(s) for s in strings), default=0)
    if longest < 1:
        raise NoBound("the vocabulary is empty")
    return TokenBound(max_token_chars=longest, shrink=shrink, dropped=dropped)


def _byte_chars() -> dict[int, str]:
    """``ByteLevel``'s byte -> character map (printable bytes stand for themselves, the
    others for U+0100 on, in byte order)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    rest = [b for b in range(256) if b not in printable]
    return {
        **{b: chr(b) for b in printable},
        **{b: chr(0x100 + i) for i, b in enumerate(rest)},
    }


def _dropped_chars(pre: Mapping[str, Any] | None, vocab: Mapping[str, int]) -> frozenset[str]:
    """The characters a BPE model without byte fallback or unknown token may drop whole:
    behind ``ByteLevel``, the ASCII characters whose byte symbol the vocabulary lacks.
    :class:`NoBound` when a multi-byte character could vanish too, or when the symbols are
    not bytes (any character may be missing from the vocabulary)."""
    if not _has_byte_level(pre):
        raise NoBound("the BPE model drops characters its vocabulary lacks (no byte fallback)")
    missing = {b for b, c in _byte_chars().items() if c not in vocab}
    leads = {b for b in missing if 0xC2 <= b <= 0xF4}  # bytes that start a UTF-8 character
    if leads and any(0x80 <= b <= 0xBF for b in missing):
        raise NoBound("the BPE model may drop whole multi-byte characters (bytes missing)")
    return frozenset(chr(b) for b in missing if b < 0x80)


def _has_byte_level(spec: Mapping[str, Any] | None) -> bool:
    if spec is None:
        return False
    if spec.get("type") == "Sequence":
        return any(_has_byte_level(step) for step in spec.get("pretokenizers") or [])
    return spec.get("type") == "ByteLevel"


def _spec(component: Any) -> dict[str, Any] | None:
    """A pipeline step's JSON spec (its ``type`` and options), None for no step."""
    return None if component is None else dict(json.loads(component.__getstate__()))


def _normalizer_shrink(spec: Mapping[str, Any] | None) -> int:
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind in ("NFD", "NFKD", "Lowercase", "Prepend"):
        return 1
    if kind in ("NFC", "NFKC"):
        return MAX_COMPOSED
    if kind == "Replace":
        pattern = spec.get("pattern") or {}
        content = str(spec.get("content", ""))
        if "String" not in pattern or not content:
            raise NoBound("a Replace normalizer with a regex or an empty replacement")
        return max(1, math.ceil(len(str(pattern["String"])) / len(content)))
    if kind == "Sequence":
        factor = 1
        for step in spec.get("normalizers") or []:
            factor *= _normalizer_shrink(step)
        return factor
    raise NoBound(f"the {kind} normalizer may drop characters")


def _check_pre_tokenizer(spec: Mapping[str, Any] | None) -> None:
    if spec is None:
        return
    kind = spec.get("type")
    if kind == "Sequence":
        for step in spec.get("pretokenizers") or []:
            _check_pre_tokenizer(step)
        return
    if kind not in _KEEPING_PRE_TOKENIZERS or spec.get("behavior") == "Removed":
        raise NoBound(f"the {kind} pre-tokenizer may drop characters")
