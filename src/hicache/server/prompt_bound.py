"""A lower bound on how many tokens a text encodes to, known before encoding it.

A tokenizer's pipeline (normalizer, pre-tokenizer, model) cuts the text into pieces, each
one vocabulary entry. If no step drops characters, every character of the normalized text
lies in some token, so a text of ``c`` characters has at least ``ceil(c / L)`` tokens,
where ``L`` is the longest vocabulary entry in characters. The vocabulary's own strings are
used for ``L``: each is at least as long as the stretch of normalized text it covers (a
byte-level BPE entry has one character per byte and a character is at least one byte; a
byte-fallback entry ``<0xAB>`` covers one byte; a Metaspace entry maps ``▁`` to one space).

The bound is only as safe as that premise, so :func:`token_bound` reads the tokenizer's
pipeline and gives a bound only when every step is one it can vouch for:

- normalizers that never shorten the text (none, ``NFD``, ``NFKD``, ``Lowercase``,
  ``Prepend``), that shorten it by a known factor (``NFC``/``NFKC``: a composed character
  stands for at most :data:`MAX_COMPOSED` code points of its decomposition; ``Replace`` of
  a literal string by a non-empty one: by at most ``ceil(len(pattern) / len(content))``),
  and sequences of these (factors multiply);
- pre-tokenizers that keep every character (``ByteLevel``, ``Metaspace``, ``Digits``,
  ``Split`` and ``Punctuation`` unless their behaviour is ``Removed``, sequences of these);
- a BPE model (a run of unknown characters is fused into one token only with
  ``fuse_unk`` and no byte fallback: then there is no bound), and added tokens that do not
  swallow the whitespace around them (``lstrip`` / ``rstrip``);
- a BPE model without byte fallback and without an unknown token *drops* a symbol its
  vocabulary lacks. Behind ``ByteLevel`` the symbols are bytes: an ASCII character whose
  byte is missing vanishes (SmolLM2's vocabulary lacks six control characters, among them
  ``\x16``), and such characters are not counted (:attr:`TokenBound.dropped`); a
  multi-byte character vanishes only if every byte of it may be missing, which rules the
  bound out. Without ``ByteLevel`` any character may be missing: no bound.

Anything else (WordPiece, whose unknown words of any length are one token; whitespace
splitting, which drops spaces; stripping normalizers ...) gives no bound, and every text
is then tokenized to learn its length.
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
