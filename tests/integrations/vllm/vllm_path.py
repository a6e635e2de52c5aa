"""Make the pinned vLLM importable in this process, without touching the main venv.

``make`` installs ``requirements/vllm.txt`` with ``pip install --no-deps --target
.venv/vllm`` (vLLM pins a CUDA torch 2.14; its tiering modules run on hicache's CPU torch).
:func:`enable` puts that directory on ``sys.path`` (``HICACHE_VLLM_PATH`` overrides it),
after the main site-packages so that hicache's own packages win where both have one.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
ENV = "HICACHE_VLLM_PATH"
_done = False


def vllm_dir() -> Path | None:
    """Where the pinned vLLM is installed, or None."""
    for cand in (os.environ.get(ENV), ROOT / ".venv" / "vllm", Path(sys.prefix) / "vllm"):
        if cand and (Path(cand) / "vllm" / "__init__.py").is_file():
            return Path(cand)
    return None


def enable() -> bool:
    """Put vLLM on ``sys.path`` (once); False when it is not installed."""
    global _done
    if _done:
        return True
    where = vllm_dir()
    if where is None:
        return False
    sys.path.append(str(where))
    _done = True
    return True
