"""``hicache bench write-policies`` runs end to end on a tiny trace: every policy serves the
same requests, and each sample counts a page once across the tiers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache.bench import write_policies


def test_every_policy_serves_the_same_trace_and_the_union_counts_pages_once(
    tmp_path: Path,
) -> None:
    out = tmp_path / "wp.json"
    argv = ["--sessions", "3", "--turns", "3", "--system", "64", "--tool", "48"]
    argv += ["--answer", "16", "--one-off", "128", "--device-tokens", "256"]
    argv += ["--hicache-ratio", "2", "--l3-tokens", "512", "--step-ms", "0"]
    argv += ["--sample-every", "2", "--repeats", "2", "--json", str(out)]
    argv += ["--policies", "write_through,write_back,watermark,watermark:0.5"]
    argv += ["--plot", str(tmp_path / "wp.png")]
    assert write_policies.main(argv) == 0
    doc = json.loads(out.read_text())
    assert len(doc["rounds"]) == 2
    for rr in doc["rounds"]:
        assert [r["policy"] for r in rr] == ["write_through", "write_back", "watermark",
                                             "watermark:0.5"]  # fmt: skip
        assert {r["requests"] for r in rr} == {doc["requests"]}
        for r in rr:
            for s in r["samples"]:
                tiers = (s["device"], s["host"], s["l3"])
                assert max(tiers) <= s["union"] <= sum(tiers)
            assert r["l3_bytes_per_request"] == r["l3_bytes_written"] / r["requests"]
        assert rr[0]["l3_bytes_written"] > 0  # write_through writes every L2 run
    assert (tmp_path / "wp.png").stat().st_size > 0


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="nope"):
        write_policies.main(["--policies", "nope"])
