"""A second process for the sharing tests: ``python -m tests.integrations.sglang.peer JSON``.

JSON: ``extra`` (the extra config), ``kind`` / ``layout`` (the host pool), ``seed`` (its
bytes, :func:`~tests.integrations.sglang.pools.fill`), ``keys`` and ``pages``. It attaches
HiCacheL3 through SGLang's factory, writes those pages under those keys
(``batch_set_v1``), prints the result as JSON and exits (closing the backend).
"""

from __future__ import annotations

import json
import sys

from hicache.integrations import pinned
from hicache.lifecycle import skip_final_collection


def main(argv: list[str]) -> int:
    args = json.loads(argv[0])
    if not pinned.enable("sglang"):
        print(json.dumps({"error": "sglang not installed"}))
        return 2
    from tests.integrations.sglang.pools import attach, fill, host_pool, indices

    pool = host_pool(args["kind"], args["layout"])
    fill(pool, seed=args["seed"])
    be = attach(pool, args["extra"], mla=args["kind"] == "mla")
    ok = be.batch_set_v1(args["keys"], indices(args["pages"]))
    be.close()
    print(json.dumps({"ok": ok}))
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    skip_final_collection()  # SGLang's objects too: seconds, while the test waits
    sys.exit(code)
