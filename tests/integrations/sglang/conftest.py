"""SGLang tests: the pinned package on ``sys.path`` (see :mod:`hicache.integrations.pinned`); not
collected when it is not installed (an error under ``CI=true``)."""

from __future__ import annotations

import os
import warnings

from hicache.integrations import pinned

collect_ignore_glob: list[str] = []
if not pinned.enable("sglang"):
    if os.environ.get("CI") == "true":
        raise RuntimeError("SGLang is not installed: run `make venv` (requirements/sglang.txt)")
    collect_ignore_glob = ["test_*.py"]
else:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import sglang.srt.mem_cache.storage.backend_factory  # noqa: F401  (once, quietly)
    from tests.integrations.sglang.controller import make  # noqa: F401  (the fixture)
