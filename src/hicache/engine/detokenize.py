"""Incremental detokenization: the text of a growing list of output ids at O(1) tokenizer
work per new token, exactly ``tokenizer.decode(ids, skip_special_tokens=True)``.

The prefix/read-offset method. For ids ``x[0:n]`` it keeps ``read`` (ids after which the
text is complete: no unfinished UTF-8 sequence), ``stable`` (the text of ``x[:read]``), and
``prefix`` < ``read`` with ``prefix_text``, the text of ``x[prefix:read]`` (the context the
tokenizer needs to render the next id). Invariant: the text of ``x[:n]`` is ``stable`` +
what ``x[prefix:n]`` adds to ``prefix_text``; a window is a few ids long, however long the
output. Exact for a tokenizer whose decode of ``x[p:]`` is that of ``x[p:r]`` followed by
the text of ``x[r:]`` whenever ``x[:r]`` decodes to complete characters (byte-level BPE,
SentencePiece without byte fallback); not for one that rewrites text across ids
(``clean_up_tokenization_spaces``) or decodes byte pieces as a run (byte fallback).
:func:`decodes_incrementally` checks a tokenizer on probe sequences; the caller falls back
to full decodes for one that fails. How the window moves: docs/architecture.md, "Outputs
and a request's end".
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["Decode", "IncrementalText", "decode_function", "decodes_incrementally"]

Decode = Callable[[list[int]], str]
"""Token ids -> text, special tokens skipped."""

REPLACEMENT = "\ufffd"
PROBE_LENGTH = 48
"""Ids per probe sequence of :func:`decodes_incrementally`."""
_PROBE_TEXT = (
    "Hello, wörld! 世界 🙂👍🏽 naïve café — ok\n\n  two  spaces\ttab ÅÄÖ Ελληνικά "
    "日本語のテキスト 🇫🇷 e\u0301 . , ? ! don't I'm x"
)
_RARE_CHARS = ("é", "€", "世", "🙂", "𝔘", "ꙮ", "🀄")
"""Characters a tokenizer may spell as several byte pieces; the probe follows each spelling
with a stray piece of it, which a decode must not let change the character before it (a
byte-fallback decoder turns a whole run of byte pieces into U+FFFDs when the run is not
valid UTF-8: not incremental)."""


def decode_function(tokenizer: Any) -> Decode:
    """``tokenizer.decode(ids, skip_special_tokens=True)`` as a callable.

    For a Hugging Face tokenizer backed by the Rust ``tokenizers`` library that adds
    nothing to its backend's text (``clean_up_tokenization_spaces`` off), the backend's
    ``decode`` itself: the same text at a tenth of the cost for short windows, which is
    what incremental decoding calls. :func:`decodes_incrementally` compares it with
    ``tokenizer.decode`` anyway.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (
        backend is not None
        and callable(getattr(backend, "decode", None))
        and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False
    ):

        def fast(ids: list[int]) -> str:
            return str(backend.decode(ids, skip_special_tokens=True))

        return fast

    def full(ids: list[int]) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=True))

    return full


class IncrementalText:
    """The text of one growing id list, kept incrementally (see the module docstring).

    Invariants, with ``x`` the ids given so far: ``stable`` is the text of ``x[:read]``
    and ends on a complete character; ``prefix_text`` is the text of ``x[prefix:read]``
    decoded on its own; ``prefix <= read <= n`` (``n``: the count of ids the last
    :meth:`text` covered). Ids already given must not change.
    """

    __slots__ = ("_decode", "_last", "_n", "prefix", "prefix_text", "read", "stable")

    def __init__(self, decode: Decode) -> None:
        self._decode = decode
        self.prefix = 0
        self.read = 0
        self.stable = ""
        self.prefix_text = ""
        self._n = 0
        self._last = ""

    def text(self, ids: Sequence[int], n: int) -> str:
        """The text of ``ids[:n]``; ``n`` never below the last call's (a smaller one, or
        ``ids`` shorter than ``n``, is a caller bug: ValueError). Decodes a window of the
        last few ids (two decodes when the complete text moves on, one otherwise)."""
        if n == self._n:
            return self._last
        if n < self._n or n > len(ids):
            raise ValueError(f"text of {n} ids asked after {self._n}, of {len(ids)} given")
        new = self._decode(list(ids[self.prefix : n]))
        tail = new[len(self.prefix_text) :] if len(new) > len(self.prefix_text) else ""
        text = self.stable + tail
        if tail and not tail.endswith(REPLACEMENT):  # complete up to n: move the window
            self.stable = text
            self.prefix_text = self._decode(list(ids[self.read : n]))
            self.prefix, self.read = self.read, n
        self._n, self._last = n, text
        return text


def _probe_sequences(tokenizer: Any) -> list[list[int]]:
    """Deterministic id sequences that stress an incremental decode: random ids over the
    vocabulary (with special ids among them), the ids of mixed-script text with multi-byte
    characters and runs of spaces, and those ids shuffled (byte pieces out of order)."""
    rng = random.Random(0)
    vocab = len(tokenizer) if hasattr(tokenizer, "__len__") else 256
    special = [int(t) for t in getattr(tokenizer, "all_special_ids", ()) or ()]
    seqs = [[rng.randrange(vocab) for _ in range(PROBE_LENGTH)] for _ in range(3)]
    encode = getattr(tokenizer, "encode", None)
    if callable(encode):
        try:
            text_ids = [int(t) for t in encode(_PROBE_TEXT, add_special_tokens=False)]
            stray: list[int] = []
            for c in _RARE_CHARS:
                pieces = [int(t) for t in encode(c, add_special_tokens=False)]
                if len(pieces) > 1:  # a complete character, then a piece of it again
                    stray += [*pieces, pieces[-1], *pieces, pieces[0], *pieces[1:]]
        except Exception:  # a tokenizer that encodes otherwise: random ids only
            text_ids, stray = [], []
        if text_ids:
            seqs.append(text_ids)
            mixed = text_ids[:]
            rng.shuffle(mixed)
            seqs.append(mixed[:PROBE_LENGTH])
            seqs.append(text_ids[1::2] + text_ids[::2])
        if stray:
            seqs.append(stray)
    if special:
        for seq in seqs[:]:
            with_special = seq[:]
            for _ in range(max(1, len(seq) // 8)):
                with_special.insert(rng.randrange(len(with_special) + 1), rng.choice(special))
            seqs.append(with_special)
    return seqs


def decodes_incrementally(tokenizer: Any, decode: Decode | None = None) -> bool:
    """Whether :class:`IncrementalText` over ``decode`` (default :func:`decode_function`)
    gives exactly ``tokenizer.decode(ids[:k], skip_special_tokens=True)`` for every prefix
    ``k`` of the probe sequences (a few dozen ids each; milliseconds). A tokenizer whose
    decode raises on them counts as not incremental."""
    decode = decode or decode_function(tokenizer)
    try:
        for seq in _probe_sequences(tokenizer):
            inc = IncrementalText(decode)
            for k in range(1, len(seq) + 1):
                want = str(tokenizer.decode(seq[:k], skip_special_tokens=True))
                if inc.text(seq, k) != want:
                    return False
    except Exception:
        return False
    return True
