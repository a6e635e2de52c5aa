"""The model's tokenizer as one zip, for smg's ``GetTokenizer``: smg then tokenizes prompts
and renders chat templates itself, with the worker's own tokenizer.

:func:`tokenizer_bundle` zips, once, the tokenizer files of the directory the model was
loaded from (those a Hugging Face tokenizer reads, the chat template and the model's
configs) and adds the chat template the loaded tokenizer holds when no file carries it.
The zip's SHA-256 goes with its last chunk (smg checks it).
"""

from __future__ import annotations

import hashlib
import io
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["BUNDLE_CHUNK_BYTES", "TokenizerBundle", "tokenizer_bundle"]

BUNDLE_CHUNK_BYTES = 1 << 20
"""Bytes of zip per ``GetTokenizerChunk`` (1 MiB: well under gRPC's 4 MiB message limit)."""

_NAMES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "config.json",
    "generation_config.json",
    "chat_template.json",
    "chat_template.jinja",
)
"""Files taken by name from the model's directory when present."""
_PATTERNS = ("*.jinja", "*.model", "*.tiktoken")
"""Files taken by pattern (chat templates, SentencePiece and tiktoken vocabularies)."""
_TEMPLATE_FILE = "chat_template.jinja"


@dataclass(frozen=True)
class TokenizerBundle:
    """The zip (``data``, bytes), its lowercase hex ``sha256``, and the names of the files
    in it (``files``, sorted)."""

    data: bytes
    sha256: str
    files: tuple[str, ...]

    def chunks(self, size: int = BUNDLE_CHUNK_BYTES) -> Iterator[tuple[bytes, str]]:
        """``(bytes, sha256)`` per chunk of at most ``size`` bytes, in order; the SHA-256
        only on the last chunk ("" before it)."""
        total = len(self.data)
        for start in range(0, total, size):
            end = min(total, start + size)
            yield self.data[start:end], self.sha256 if end == total else ""


def tokenizer_bundle(model_dir: Path, tokenizer: Any) -> TokenizerBundle:
    """The bundle of the tokenizer files in ``model_dir``, plus ``tokenizer``'s chat
    template (its ``chat_template`` attribute) as ``chat_template.jinja`` when no file
    there is one and the tokenizer config does not carry it. FileNotFoundError when the
    directory has no ``tokenizer.json`` nor any vocabulary file (nothing smg could load)."""
    found: dict[str, Path] = {}
    for name in _NAMES:
        if (model_dir / name).is_file():
            found[name] = model_dir / name
    for pattern in _PATTERNS:
        for path in sorted(model_dir.glob(pattern)):
            if path.is_file():
                found.setdefault(path.name, path)
    vocab = {"tokenizer.json", "vocab.json", "vocab.txt"} | {
        n for n in found if n.endswith((".model", ".tiktoken"))
    }
    if not vocab & found.keys():
        raise FileNotFoundError(f"{model_dir} holds no tokenizer files (tokenizer.json, vocab.*)")
    template = getattr(tokenizer, "chat_template", None)
    extra: dict[str, bytes] = {}
    if isinstance(template, str) and template and not _has_template(found):
        extra[_TEMPLATE_FILE] = template.encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in sorted(found):
            zf.writestr(name, found[name].read_bytes())
        for name, data in extra.items():
            zf.writestr(name, data)
    data = buf.getvalue()
    return TokenizerBundle(
        data=data,
        sha256=hashlib.sha256(data).hexdigest(),
        files=tuple(sorted({*found, *extra})),
    )


def _has_template(found: dict[str, Path]) -> bool:
    """Whether the files carry a chat template: a template file, or ``chat_template`` in
    the tokenizer config."""
    if any(n.endswith(".jinja") or n == "chat_template.json" for n in found):
        return True
    config = found.get("tokenizer_config.json")
    return config is not None and b'"chat_template"' in config.read_bytes()
