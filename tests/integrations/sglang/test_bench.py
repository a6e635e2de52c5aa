"""Smoke test of ``hicache bench storage --sglang`` (file and nixl stores, tiny sizes)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hicache.bench.storage import main
from tests.helpers.storage_fixtures import require_nixl


def test_sglang_bench_file_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    argv = ["--sglang", "--backends", "file", "--objects", "8", "--object-mib", "0.03125"]
    assert main([*argv, "--repeat", "1", "--layout", "page_head", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert (doc["objects"], doc["layout"], doc["object_bytes"]) == (8, "page_head", 32 << 10)
    assert [(r["store"], r["op"]) for r in doc["results"]] == [("file", "put"), ("file", "get")]
    assert all(r["hicache_gbps"] > 0 and r["sglang_gbps"] > 0 for r in doc["results"])
    assert "HiCacheL3 / SGLang" in capsys.readouterr().out


def test_sglang_bench_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--sglang", "--backends", "redis"]) == 2
    assert main(["--sglang", "--object-mib", "0.001"]) == 2
    assert "error:" in capsys.readouterr().err


def test_sglang_bench_nixl_beside_sglangs_nixl(tmp_path: Path) -> None:
    """HiCacheL3 over hicache's nixl backend beside SGLang's ``HiCacheNixl`` (POSIX), each
    in a folder of the bench's directory (SGLang's from its environment variable, put back)."""
    require_nixl()
    out = tmp_path / "bench.json"
    argv = ["--sglang", "--backends", "nixl", "--objects", "4", "--object-mib", "0.03125"]
    var = "SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR"
    before = os.environ.get(var)
    assert main([*argv, "--repeat", "1", "--dir", str(tmp_path / "d"), "--json", str(out)]) == 0
    assert os.environ.get(var) == before
    doc = json.loads(out.read_text())
    assert [(r["store"], r["op"]) for r in doc["results"]] == [("nixl", "put"), ("nixl", "get")]
    assert all(r["hicache_gbps"] > 0 and r["sglang_gbps"] > 0 for r in doc["results"])
    assert any((tmp_path / "d" / "sglang-nixl").iterdir())
    assert [p for p in (tmp_path / "d" / "hicache-nixl").rglob("hc*") if p.is_file()]
