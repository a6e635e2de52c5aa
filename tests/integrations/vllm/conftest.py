"""vLLM tests: the pinned package on ``sys.path`` (see :mod:`hicache.integrations.pinned`); not collected
when it is not installed (an error under ``CI=true``)."""

from __future__ import annotations

import logging
import os

from hicache.integrations import pinned

collect_ignore_glob: list[str] = []
if not pinned.enable("vllm"):
    if os.environ.get("CI") == "true":
        raise RuntimeError("vLLM is not installed: run `make venv` (requirements/vllm.txt)")
    collect_ignore_glob = ["test_*.py"]
else:
    import vllm.v1.kv_offload.tiering.spec  # noqa: F401  (once: its import takes seconds)

    logging.getLogger("vllm").setLevel(logging.WARNING)
