"""Make the pinned SGLang importable in this process, without touching the main venv.

``make`` installs ``requirements/sglang.txt`` with ``pip install --no-deps --target
.venv/sglang`` (SGLang pins a CUDA torch, and importing it patches transformers
globally, so it stays out of the main site-packages and its tests run in a pytest
process of their own). :func:`enable` puts that directory on ``sys.path``
(``HICACHE_SGLANG_PATH`` overrides it) after this one workaround:

PyPI's torchvision 0.28.0 is a CUDA build whose ``_C.so`` does not load with the CPU
torch; its ``_meta_registrations.py`` then fails at import with "operator
torchvision::nms does not exist" (pytorch/vision#9337, fix pending in
pytorch/vision#9649). SGLang imports torchvision through its model configs, so the two
op schemas are defined first (calling nms still fails, as it should). Test setup only.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
ENV = "HICACHE_SGLANG_PATH"
_done = False


def sglang_dir() -> Path | None:
    """Where the pinned SGLang is installed, or None."""
    for cand in (os.environ.get(ENV), ROOT / ".venv" / "sglang", Path(sys.prefix) / "sglang"):
        if cand and (Path(cand) / "sglang" / "__init__.py").is_file():
            return Path(cand)
    return None


def enable() -> bool:
    """Put SGLang on ``sys.path`` (once); False when it is not installed."""
    global _done
    if _done:
        return True
    where = sglang_dir()
    if where is None:
        return False
    import torch

    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    globals()["_torchvision_lib"] = lib  # the schemas live as long as the library object
    sys.path.append(str(where))
    _done = True
    return True
