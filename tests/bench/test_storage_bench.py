"""Smoke test of the L3 microbenchmark (file backend only, tiny sizes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache.bench.storage import main


def test_bench_file_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    argv = ["--backends", "file", "--objects", "4", "--object-mib", "0.0625", "--repeat", "1"]
    assert main([*argv, "--dir", str(tmp_path / "d"), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["object_bytes"] == 64 << 10 and doc["objects"] == 4
    assert [(r["backend"], r["op"]) for r in doc["results"]] == [("file", "put"), ("file", "get")]
    assert all(r["hicache_gbps"] > 0 and r["raw_gbps"] > 0 for r in doc["results"])
    assert doc["token_bytes"] == 32 << 10  # the default --spec
    for r in doc["results"]:  # the rate in tokens of that shape
        assert r["hicache_tokens_per_s"] == r["hicache_gbps"] * 1e9 / doc["token_bytes"]
    assert "hicache / raw" in capsys.readouterr().out


def test_bench_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--backends", "s3"]) == 2
    assert main(["--object-mib", "0.001"]) == 2
    assert "error:" in capsys.readouterr().err


def test_bench_aibrix_runs_beside_raw_aibrix(tmp_path: Path) -> None:
    from tests.helpers.storage_fixtures import require_aibrix

    require_aibrix()
    out = tmp_path / "bench.json"
    argv = ["--backends", "aibrix-shfs,aibrix-rocksdb", "--objects", "4", "--object-mib", "0.0625"]
    assert main([*argv, "--repeat", "1", "--dir", str(tmp_path / "d"), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [(r["backend"], r["op"]) for r in doc["results"]] == [
        ("aibrix-shfs", "put"),
        ("aibrix-shfs", "get"),
        ("aibrix-rocksdb", "put"),
        ("aibrix-rocksdb", "get"),
    ]
    assert all(r["hicache_gbps"] > 0 and r["raw_gbps"] > 0 for r in doc["results"])


def test_bench_nixl_runs_beside_raw_nixl(tmp_path: Path) -> None:
    from tests.helpers.storage_fixtures import require_nixl

    require_nixl()
    out = tmp_path / "bench.json"
    argv = ["--backends", "nixl", "--objects", "4", "--object-mib", "0.0625", "--repeat", "1"]
    assert main([*argv, "--dir", str(tmp_path / "d"), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [(r["backend"], r["op"]) for r in doc["results"]] == [("nixl", "put"), ("nixl", "get")]
    assert all(r["hicache_gbps"] > 0 and r["raw_gbps"] > 0 for r in doc["results"])
    raw = sorted(p.stat().st_size for p in (tmp_path / "d" / "raw-nixl").iterdir())
    assert raw == [64 << 10] * 8  # the page bytes alone, one file each (warm-up round too)
    records = [p for p in (tmp_path / "d" / "hicache-nixl").rglob("hc*") if p.is_file()]
    assert sorted(p.stat().st_size for p in records) == [(64 << 10) + 64] * 8


def test_bench_head_records_beside_page_records(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    argv = ["--backends", "file", "--objects", "4", "--repeat", "1"]
    argv += ["--records", "page,head,head:2", "--spec", "3,2,16,float32", "--page-tokens", "4"]
    assert main([*argv, "--dir", str(tmp_path / "d"), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["object_bytes"] == 4 * 2 * 3 * 2 * 16 * 4  # tokens x K,V x L x H x D x fp32
    got = [(r["records"], r["records_per_page"], r["op"]) for r in doc["results"]]
    assert got == [
        ("page", 1, "put"),
        ("page", 1, "get"),
        ("head", 2, "put"),
        ("head", 2, "get"),
        ("head:2", 1, "put"),
        ("head:2", 1, "get"),
    ]
    records = [p for p in (tmp_path / "d" / "hicache").rglob("hc3-*") if p.is_file()]
    sizes = sorted(p.stat().st_size for p in records)
    # 4 pages a round (a warm-up and one timed): 2 head records each, or 1 record of both
    # heads, or 1 page record
    assert sizes == [64 + 1536] * 16 + [64 + 3072] * 16


def test_bench_rejects_bad_records_or_spec(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--backends", "file", "--records", "rank"]) == 2
    assert main(["--backends", "file", "--records", "head:3", "--spec", "3,2,16"]) == 2
    assert main(["--backends", "file", "--records", "page:2"]) == 2
    assert main(["--backends", "file", "--records", "page,head,page"]) == 2
    assert main(["--backends", "file", "--spec", "3,2"]) == 2
    assert main(["--backends", "file", "--spec", "3,2,16,int8"]) == 2
    assert "error:" in capsys.readouterr().err
