"""``hicache bench routing`` with its smallest settings, on the tiny random model: three
arms (event-driven over gRPC, round robin over HTTP, the oracle: both protocols, both
policies and no router), through two routers joined in smg's mesh with a share of the
requests sent straight to a worker, answer every request; the table's figures are there
and sane (shares within [0, 1], the answers' prompt tokens those of the workload, each
arm's requests all counted by the workers, the direct requests where the workload sent
them), the oracle's requests each go where most of their prefix was, and the JSON and
the plot are written. Skipped without ``smg`` (failed under ``CI=true``), like the
router tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache.bench import routing
from tests.helpers.smg import require_smg

ARMS = ("grpc_cache_aware", "http_round_robin", "oracle")


@pytest.mark.timeout(180)
def test_routing_bench_smallest_settings(tmp_path: Path) -> None:
    require_smg()
    out, png = tmp_path / "routing.json", tmp_path / "routing.png"
    argv = ["--tenants", "3", "--active-tenants", "2", "--shift-every", "2",
            "--system-tokens", "32", "--question-tokens", "8", "--max-tokens", "2",
            "--requests", "6", "--concurrency", "2", "--l1-tokens", "128",
            "--routers", "2", "--smg-mesh", "--direct-share", "0.2", "--arms", ",".join(ARMS),
            "--json", str(out), "--plot", str(png)]  # fmt: skip
    assert routing.main(argv) == 0
    doc = json.loads(out.read_text())
    summary = doc["summary"]
    assert list(summary) == list(ARMS)
    spec = routing.RoutingSpec(
        tenants=3, active_tenants=2, shift_every=2, system_tokens=32, question_tokens=8,
        max_tokens=2, requests=6, concurrency=2, l1_tokens=128, routers=2, smg_mesh=True,
        direct_share=0.2,
    )  # fmt: skip
    requests = routing.workload(spec)
    assert [len(r.ids) for r in requests] == [40] * 6
    direct = [r.direct for r in requests]
    assert 0 < sum(d is not None for d in direct) < 6, direct  # both kinds in the run
    for run in doc["runs"]:
        sent = [x["worker"] if x["direct"] else None for x in run["results"]]
        assert sent == direct, run["arm"]
    for arm, s in summary.items():
        assert (s["ok"], s["errors"]) == (6, 0), (arm, s["first_errors"])
        assert sum(s["worker_requests"]) == 6, arm
        assert 0.0 <= s["cached_share"] <= 1.0, arm
        assert 0.0 <= s["direct_cached_share"] <= 1.0, arm
        assert 0.0 <= s["worker_cached_share"] <= 1.0, arm
        assert 0 < s["ttft_p50_s"] <= s["ttft_p99_s"], arm
        assert s["requests_per_s"] > 0, arm
    (run,) = [r for r in doc["runs"] if r["arm"] == "oracle"]
    assert all(x["prompt_tokens"] == 40 and x["worker"] in (0, 1) for x in run["results"])
    # a tenant's second request finds its 2 whole pages of system prompt where it went
    assert summary["oracle"]["cached_share"] > 0
    assert png.stat().st_size > 0
