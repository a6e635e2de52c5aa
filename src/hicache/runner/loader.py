"""load_model: a checkpoint (see :mod:`hicache.runner.checkpoints`) -> model + tokenizer.

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

from hicache.memory import torch_dtype
from hicache.runner.checkpoints import offline, resolve_checkpoint
from hicache.runner.models import DecoderConfig, DecoderLM, build_model
from hicache.runner.models.hybrid import HybridLM
from hicache.runner.models.registry import (
    HYBRID_FAMILIES,
    build_hybrid_model,
    check_supported,
    check_tensor_parallel,
    hybrid_config_from_hf,
)
from hicache.runner.parallel import Narrowable, TPGroup
from hicache.spec import DTYPES
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
    """A ready model: ``model`` (eval, on its device; a Llama-style :class:`DecoderLM` or a
    :class:`~hicache.runner.models.hybrid.HybridLM`), its ``tokenizer``, the Hugging Face
    ``hf_config``, a display ``name``, the local ``path`` it was read from, its ``dtype``
    name and ``fingerprint`` (see :func:`weights_fingerprint`)."""

    model: DecoderLM | HybridLM
    tokenizer: PreTrainedTokenizerBase
    hf_config: Any
    name: str
    path: Path
    dtype: str
    fingerprint: str


@dataclass(frozen=True)
class LoadedHybridModel(LoadedModel):
    """A :class:`LoadedModel` of a hybrid-family checkpoint (``model`` a
    :class:`~hicache.runner.models.hybrid.HybridLM`)."""

    model: HybridLM


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


class _UnreadTensor:
    """A checkpoint tensor of an open safetensors file, not read yet: its full ``shape``,
    and :meth:`narrow` reads only the rows asked for (a tensor-parallel rank's slice).
    Valid while its file is open (:func:`_iter_unread` closes it after the last name)."""

    def __init__(self, piece: Any) -> None:
        self._piece = piece
        self._shape = torch.Size(piece.get_shape())

    @property
    def shape(self) -> torch.Size:
        return self._shape

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self._shape)
        index[dim] = slice(start, start + length)
        out: torch.Tensor = self._piece[tuple(index)]
        return out


def _iter_unread(files: list[Path], device: torch.device) -> Iterator[tuple[str, Narrowable]]:
    """The checkpoint's tensors unread, each to be consumed before the next is taken."""
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt", device=str(device)) as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, _UnreadTensor(st.get_slice(name))


def _open(
    model_path: str | os.PathLike[str] | None,
    dtype: str | None,
    device: torch.device | str,
    tp: TPGroup,
) -> tuple[Any, Any, Any, str, torch.device]:
    """Resolve the checkpoint, read its config and tokenizer and check the architecture
    and that it splits over ``tp``'s ranks."""
    dtype = dtype or default_dtype(device)
    require(dtype in DTYPES, "dtype", dtype, f"choose one of {DTYPES}")
    ckpt = resolve_checkpoint(model_path)
    offline()
    from transformers import AutoConfig, AutoTokenizer

    hf_config = AutoConfig.from_pretrained(ckpt.path, local_files_only=True)
    check_supported(hf_config)  # one clear error, before the tokenizer or any weight
    check_tensor_parallel(hf_config, tp.size)
    tokenizer = AutoTokenizer.from_pretrained(ckpt.path, local_files_only=True)
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return ckpt, hf_config, tokenizer, dtype, dev


def _load(
    model_path: str | os.PathLike[str] | None,
    dtype: str | None,
    device: torch.device | str,
    *,
    tp: TPGroup,
) -> LoadedModel:
    ckpt, hf_config, tokenizer, dtype, dev = _open(model_path, dtype, device, tp)
    if hf_config.model_type in HYBRID_FAMILIES:
        return _load_hybrid(ckpt, hf_config, tokenizer, dtype, dev, tp)
    model = build_model(
        DecoderConfig.from_hf(hf_config), dtype=torch_dtype(dtype), device=dev, tp=tp
    )
    files = _safetensors_files(ckpt.path)
    # on several ranks, each reads its slices only
    model.load_weights(_iter_unread(files, dev) if tp.size > 1 else _iter_tensors(files, dev))
    fingerprint = weights_fingerprint(ckpt.path)
    return LoadedModel(model, tokenizer, hf_config, ckpt.name, ckpt.path, dtype, fingerprint)


def _load_hybrid(
    ckpt: Any, hf_config: Any, tokenizer: Any, dtype: str, dev: torch.device, tp: TPGroup
) -> LoadedHybridModel:
    model = build_hybrid_model(
        hybrid_config_from_hf(hf_config), dtype=torch_dtype(dtype), device=dev, tp=tp
    )
    model.load_weights(_iter_tensors(_safetensors_files(ckpt.path), dev))
    fingerprint = weights_fingerprint(ckpt.path)
    return LoadedHybridModel(model, tokenizer, hf_config, ckpt.name, ckpt.path, dtype, fingerprint)


def load_model(
    model_path: str | os.PathLike[str] | None = None,
    *,
    dtype: str | None = None,
    device: torch.device | str = "cpu",
    tp: TPGroup | None = None,
) -> LoadedModel:
    """Load a checkpoint of any supported architecture for the engine (on a rank of a
    tensor-parallel group ``tp``: this rank's shard of it).

    ``model_path``: None (the bundled SmolLM2-135M-Instruct), a tiny test model name
    (:data:`~hicache.runner.checkpoints.TINY_MODELS` or
    :data:`~hicache.runner.checkpoints.TINY_HYBRID_MODELS`), a ``.gguf`` file or a Hugging
    Face directory (see :func:`hicache.runner.checkpoints.resolve_checkpoint`). ``dtype``:
    one of ``float32``/``float16``/``bfloat16``, default :func:`default_dtype`. Never
    downloads. Llama / Qwen2 / Qwen3 load as a :class:`DecoderLM`; Gemma 3 text, GPT-OSS,
    Qwen3-Next and Nemotron-H as a :class:`HybridLM` (a :class:`LoadedHybridModel`). An
    unsupported architecture raises UnsupportedModelError listing the supported ones.

    ``tp`` (default: one rank): a Llama / Qwen2 / Qwen3 model is split over its ranks (see
    :mod:`hicache.runner.models.decoder`), a DeepSeek-V2/V3 one by heads and MLP/expert
    columns (:mod:`hicache.runner.models.deepseek`), a Qwen3-Next / Nemotron-H one by
    heads, DeltaNet value heads / Mamba2 heads with their key heads / groups (replicated
    when fewer than the ranks; with their recurrent state) and MLP / expert columns (:mod:`hicache.runner.models.qwen3_next`, :mod:`hicache.runner.models.nemotron_h`);
    each rank reads only its slice of each
    split tensor (and the whole ones whole), no collective runs, and its KV spec
    (:func:`~hicache.runner.model_runner.cache_spec_of`) has its own K/V heads. The
    fingerprint is the checkpoint's, the same on every rank. K/V heads fewer than the
    ranks are replicated (each rank reads the one its query heads read). A size that
    cannot split the heads (it must divide the query heads, and divide the K/V heads or
    be a multiple of them) or does not divide the intermediate size raises ValueError
    naming them (a hybrid family: what its config's ``check_tensor_parallel`` names), a
    hybrid family with no sharded model and ``size > 1`` UnsupportedModelError, both
    before any weight is read.
    """
    return _load(model_path, dtype, device, tp=tp or TPGroup.single())


def load_hybrid_model(
    model_path: str | os.PathLike[str] | None = None,
    *,
    dtype: str | None = None,
    device: torch.device | str = "cpu",
) -> LoadedHybridModel:
    """Load a Gemma 3 text / GPT-OSS / Qwen3-Next / Nemotron-H checkpoint (arguments as in
    :func:`load_model`); any other architecture raises UnsupportedModelError."""
    tp = TPGroup.single()
    return _load_hybrid(*_open(model_path, dtype, device, tp), tp)
