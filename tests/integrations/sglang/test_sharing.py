"""Two processes share SGLang pages through hicache's L3: Redis, Mooncake, and the file
backend after the writer has exited (a restart)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.sglang.pools import attach, fill, host_pool, indices, page_bytes

ROOT = Path(__file__).resolve().parents[3]

KEYS = [f"{i:064x}" for i in range(3)]


def _write_in_other_process(extra: dict[str, Any], kind: str, layout: str, seed: int) -> None:
    args = {
        "extra": extra,
        "kind": kind,
        "layout": layout,
        "seed": seed,
        "keys": KEYS,
        "pages": [1, 2, 3],
    }
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    out = subprocess.run(
        [sys.executable, "-m", "tests.integrations.sglang.peer", json.dumps(args)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"ok": [True, True, True]}


def _read_here(extra: dict[str, Any], kind: str, layout: str, seed: int) -> None:
    src = host_pool(kind, layout)
    fill(src, seed=seed)  # what the other process wrote
    dst = host_pool(kind, layout)
    be = attach(dst, extra, mla=kind == "mla")
    assert be.batch_exists(KEYS) == 3
    assert be.batch_get_v1(KEYS, indices([5, 6, 7])) == [True, True, True]
    assert [page_bytes(dst, p) for p in (5, 6, 7)] == [page_bytes(src, p) for p in (1, 2, 3)]
    be.close()


def test_file_records_survive_the_writer_process(tmp_path: Path) -> None:
    extra = {"hicache_backend": "file", "file_path": str(tmp_path)}
    _write_in_other_process(extra, "mha", "page_head", seed=31)
    _read_here(extra, "mha", "page_head", seed=31)


def test_two_processes_share_through_redis(request: pytest.FixtureRequest) -> None:
    server = request.getfixturevalue("redis_service")
    extra = {"hicache_backend": "redis", "url": server.url, "key_prefix": "sglang-share:"}
    _write_in_other_process(extra, "mla", "page_first", seed=32)
    _read_here(extra, "mla", "page_first", seed=32)


def test_two_processes_share_through_mooncake(request: pytest.FixtureRequest) -> None:
    svc = request.getfixturevalue("mooncake_service")
    extra = {"hicache_backend": "mooncake", **svc.extra_config}
    _write_in_other_process(extra, "mha", "layer_first", seed=33)
    _read_here(extra, "mha", "layer_first", seed=33)
