"""``hicache bench pd-transfer`` on tiny pools: every method runs and its bytes verify."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache.bench.pd_transfer import main
from tests.helpers.services import missing


@pytest.mark.timeout(120)
def test_pd_transfer_bench_writes_verified_figures(tmp_path: Path) -> None:
    out = tmp_path / "pd.json"
    argv = ["--pages", "4", "--page-size", "2", "--layers", "2", "--heads", "2",
            "--head-dim", "4", "--repeat", "2", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    for name, why in doc["skipped"].items():
        missing(f"the {name} transport", why)
    got = {(f["method"], f["pattern"]) for f in doc["figures"]}
    assert got == {
        ("torch-pages", "contiguous"),
        ("torch-pages", "scattered"),
        ("memcpy", "contiguous"),
        ("mooncake", "contiguous"),
        ("mooncake", "scattered"),
        ("nixl", "contiguous"),
        ("nixl", "scattered"),
    }
    page_bytes = 2 * (2 * 2 * 2 * 4 * 2)  # 2 tokens x (K,V x 2 layers x 2 heads x 4 x bf16)
    for f in doc["figures"]:
        assert f["verified"] is True and f["gbps"] > 0
        if f["method"] != "memcpy":
            assert f["nbytes"] == 4 * page_bytes
