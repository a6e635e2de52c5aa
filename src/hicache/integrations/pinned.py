"""The pinned SGLang and vLLM packages, installed beside the venv, and how a process
imports them.

``make venv`` installs ``requirements/sglang.txt`` and ``requirements/vllm.txt`` with ``pip
install --no-deps --target <venv>/sglang`` (and ``<venv>/vllm``): both pin a CUDA torch and
SGLang patches transformers globally, so neither goes into the venv's site-packages. A
process that needs one (their tests, ``hicache bench storage --sglang``) calls
:func:`enable`, which appends that folder to ``sys.path`` after the site-packages (hicache's
own packages win). Enabling SGLang without CUDA, :func:`enable` first defines the two
torchvision op schemas PyPI's CUDA torchvision 0.28.0 fails to register with the CPU torch
(pytorch/vision#9337), so torchvision imports and ``nms`` still fails, as it should. A
real SGLang install on a GPU host needs none of this. Why: ``docs/integrations.md``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["PINNED", "enable", "pinned_dir"]

PINNED: dict[str, str] = {"sglang": "HICACHE_SGLANG_PATH", "vllm": "HICACHE_VLLM_PATH"}
"""The pinned packages, each with the environment variable that overrides its folder."""

_enabled: set[str] = set()
_torchvision_lib: Any = None  # the schemas live as long as this library object


def _check(package: str) -> str:
    if package not in PINNED:
        raise ValueError(f"package={package!r} is not pinned here; choose one of {sorted(PINNED)}")
    return PINNED[package]


def pinned_dir(package: str, path: str | Path | None = None) -> Path | None:
    """The folder ``package`` (``"sglang"`` or ``"vllm"``) is installed in: ``path``, else
    its environment variable (:data:`PINNED`), else ``<venv>/<package>``; None when none of
    them holds it."""
    env = _check(package)
    for cand in (path, os.environ.get(env), Path(sys.prefix) / package):
        if cand and (Path(cand) / package / "__init__.py").is_file():
            return Path(cand).resolve()
    return None


def _define_torchvision_ops() -> None:
    global _torchvision_lib
    if _torchvision_lib is not None or "torchvision" in sys.modules:
        return
    import torch

    if torch.cuda.is_available():
        return  # a CUDA torch loads torchvision's own ops
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _torchvision_lib = lib


def enable(package: str, path: str | Path | None = None) -> bool:
    """Make the pinned ``package`` importable in this process (once); False when it is not
    installed (see :func:`pinned_dir`)."""
    _check(package)
    if package in _enabled:
        return True
    where = pinned_dir(package, path)
    if where is None:
        return False
    if package == "sglang":
        _define_torchvision_ops()
    if str(where) not in sys.path:
        sys.path.append(str(where))
    _enabled.add(package)
    return True
