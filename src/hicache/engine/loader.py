"""load_model: a checkpoint (see :mod:`hicache.engine.checkpoints`) -> model + tokenizer.

Weights are read straight from the directory's ``*.safetensors`` files into a model built on
the meta device, so loading costs one read of the file (about a second for 135M params).
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hicache.config import DTYPES
from hicache.engine.checkpoints import offline, resolve_checkpoint
from hicache.engine.models import DecoderConfig, DecoderLM, UnsupportedModelError, build_model
from hicache.engine.models.hybrid import HybridLM
from hicache.engine.models.registry import (
    HYBRID_FAMILIES,
    build_hybrid_model,
    check_supported,
    hybrid_config_from_hf,
)
from hicache.memory import torch_dtype
from hicache.validate import require

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "FULL_HASH_LIMIT_BYTES",
    "LoadedHybridModel",
    "LoadedModel",
    "default_dtype",
    "load_hybrid_model",
    "load_model",
    "weights_fingerprint",
]

FULL_HASH_LIMIT_BYTES = 1 << 30
"""Checkpoints up to this size (1 GiB) are fingerprinted over every byte."""
_SAMPLES_PER_FILE = 256
_SAMPLE_BYTES = 1 << 16


@dataclass(frozen=True)
class LoadedModel:
    """A ready model: ``model`` (eval, on its device), its ``tokenizer``, the Hugging Face
    ``hf_config``, a display ``name``, the local ``path`` it was read from, its ``dtype``
    name and ``fingerprint`` (see :func:`weights_fingerprint`)."""

    model: DecoderLM
    tokenizer: PreTrainedTokenizerBase
    hf_config: Any
    name: str
    path: Path
    dtype: str
    fingerprint: str


@dataclass(frozen=True)
class LoadedHybridModel:
    """Like :class:`LoadedModel`, for a hybrid-family checkpoint (``model`` a
    :class:`~hicache.engine.models.hybrid.HybridLM`)."""

    model: HybridLM
    tokenizer: PreTrainedTokenizerBase
    hf_config: Any
    name: str
    path: Path
    dtype: str
    fingerprint: str


def default_dtype(device: torch.device | str) -> str:
    """``bfloat16`` on CUDA, ``float32`` elsewhere."""
    return "bfloat16" if torch.device(device).type == "cuda" else "float32"


def _safetensors_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return files


def weights_fingerprint(path: Path) -> str:
    """A stable identity of the weights in directory ``path`` (for L3 key namespaces).

    SHA-256 over, per ``*.safetensors`` file in name order: its name and size, then either
    all its bytes (total up to :data:`FULL_HASH_LIMIT_BYTES`: about 0.5 s for 135M fp32
    params) or, above that, its header (tensor names, dtypes, shapes, offsets) plus 256
    evenly spaced 64 KiB windows, which stays ~0.1 s for any size. Returned as
    ``"sha256-full:<hex>"`` or ``"sha256-sampled:<hex>"``.
    """
    files = _safetensors_files(path)
    full = sum(f.stat().st_size for f in files) <= FULL_HASH_LIMIT_BYTES
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}\0{size}\0".encode())
        with f.open("rb") as fh:
            if full:
                while chunk := fh.read(1 << 24):
                    h.update(chunk)
                continue
            header_len = struct.unpack("<Q", fh.read(8))[0]
            h.update(fh.read(header_len))
            span = max(size - _SAMPLE_BYTES, 0)
            for i in range(_SAMPLES_PER_FILE):
                fh.seek(span * i // (_SAMPLES_PER_FILE - 1))
                h.update(fh.read(_SAMPLE_BYTES))
    return f"sha256-{'full' if full else 'sampled'}:{h.hexdigest()}"


def _iter_tensors(files: list[Path], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt", device=str(device)) as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, st.get_tensor(name)


def _open(
    model_path: str | os.PathLike[str] | None, dtype: str | None, device: torch.device | str
) -> tuple[Any, Any, Any, str, torch.device]:
    """Resolve the checkpoint, read its config and tokenizer and check the architecture."""
    dtype = dtype or default_dtype(device)
    require(dtype in DTYPES, "dtype", dtype, f"choose one of {DTYPES}")
    ckpt = resolve_checkpoint(model_path)
    offline()
    from transformers import AutoConfig, AutoTokenizer

    hf_config = AutoConfig.from_pretrained(ckpt.path, local_files_only=True)
    check_supported(hf_config)  # one clear error, before the tokenizer or any weight
    tokenizer = AutoTokenizer.from_pretrained(ckpt.path, local_files_only=True)
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return ckpt, hf_config, tokenizer, dtype, dev


def load_model(
    model_path: str | os.PathLike[str] | None = None,
    *,
    dtype: str | None = None,
    device: torch.device | str = "cpu",
) -> LoadedModel:
    """Load a Llama / Qwen2 / Qwen3 checkpoint for the engine.

    ``model_path``: None (the bundled SmolLM2-135M-Instruct), a tiny test model name, a
    ``.gguf`` file or a Hugging Face directory (see
    :func:`hicache.engine.checkpoints.resolve_checkpoint`). ``dtype``: one of
    ``float32``/``float16``/``bfloat16``, default :func:`default_dtype`. Never downloads.
    An unsupported architecture raises UnsupportedModelError listing the supported ones; a
    hybrid family (see :func:`load_hybrid_model`) is refused with that hint, since the
    engine's runner does not serve them yet.
    """
    ckpt, hf_config, tokenizer, dtype, dev = _open(model_path, dtype, device)
    if hf_config.model_type in HYBRID_FAMILIES:
        raise UnsupportedModelError(
            f"model_type={hf_config.model_type!r} is a hybrid model the engine cannot serve "
            "yet; load it with hicache.engine.loader.load_hybrid_model"
        )
    cfg = DecoderConfig.from_hf(hf_config)
    model = build_model(cfg, dtype=torch_dtype(dtype), device=dev)
    model.load_weights(_iter_tensors(_safetensors_files(ckpt.path), dev))
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        hf_config=hf_config,
        name=ckpt.name,
        path=ckpt.path,
        dtype=dtype,
        fingerprint=weights_fingerprint(ckpt.path),
    )


def load_hybrid_model(
    model_path: str | os.PathLike[str] | None = None,
    *,
    dtype: str | None = None,
    device: torch.device | str = "cpu",
) -> LoadedHybridModel:
    """Load a Gemma 3 text / GPT-OSS / Qwen3-Next / Nemotron-H checkpoint (arguments as in
    :func:`load_model`, e.g. a name in :data:`~hicache.engine.checkpoints.TINY_HYBRID_MODELS`)."""
    ckpt, hf_config, tokenizer, dtype, dev = _open(model_path, dtype, device)
    cfg = hybrid_config_from_hf(hf_config)
    model = build_hybrid_model(cfg, dtype=torch_dtype(dtype), device=dev)
    model.load_weights(_iter_tensors(_safetensors_files(ckpt.path), dev))
    return LoadedHybridModel(
        model=model,
        tokenizer=tokenizer,
        hf_config=hf_config,
        name=ckpt.name,
        path=ckpt.path,
        dtype=dtype,
        fingerprint=weights_fingerprint(ckpt.path),
    )
