"""The TP stress bench's code path, small (``hicache bench tp-stress``, issue 18 item 6):
2 ranks through a shared-prefix workload with L1 and L2 far smaller than it and a file L3.

Asserted at the end: every request finished (none failed) within the wall-clock bound,
rank 0's pools hold only cached pages (nothing held by a request or in flight), every
rank's digest of its tree and scheduler is rank 0's, and L1 and L2 really evicted (so the
agreement ran over evictions, L2 copies and L3 traffic). One run on the tiny Llama
(MHA, a shard of the K/V heads per rank), one on the tiny DeepSeek-V3.2 (MLA latent,
whole on every rank, plus the DSA indexer component) and one per hybrid family (Gemma 3
and GPT-OSS: full and SWA pages; Qwen3-Next and Nemotron-H: full pages and recurrent-state
snapshots), each component sharded by heads.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from hicache.bench.tp_stress import StressConfig, run_stress

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="TP 2 needs 2 CPU cores")

BOUND_S = 120.0


HYBRIDS = {
    "tiny-random-gemma3": "swa",
    "tiny-random-gpt-oss": "swa",
    "tiny-random-qwen3-next": "mamba",
    "tiny-random-nemotron-h": "mamba",
}


SAME_SPLIT = ("tiny-random-gpt-oss", "tiny-random-nemotron-h")
"""Split as Gemma 3 (full + SWA) and Qwen3-Next (full + recurrent) are: ``make test-matrix``."""


def small(tmp_path: Path, **kwargs: Any) -> StressConfig:
    """2 ranks, 3 system prompts over 2 rounds, L1 and L2 far below the workload."""
    base: dict[str, Any] = dict(
        ranks=2, systems=3, rounds=2, system_tokens=24, output_tokens=3, parallel=8,
        max_running=4, l1_tokens=128, hicache_ratio=1.5, timeout_s=BOUND_S, l3_dir=str(tmp_path),
    )  # fmt: skip
    return StressConfig(**{**base, **kwargs})


@pytest.mark.parametrize(
    ("model", "prompts"),
    [("tiny-random-llama", 48), ("tiny-random-deepseek-v32", 48)]
    + [
        pytest.param(name, 48, marks=pytest.mark.matrix if name in SAME_SPLIT else ())
        for name in HYBRIDS
    ],
)
def test_two_ranks_end_idle_and_equal(model: str, prompts: int, tmp_path: Path) -> None:
    r = run_stress(small(tmp_path, model=model, prompts=prompts))
    assert not r.hung and r.failed == 0
    assert r.wall_s < BOUND_S
    assert r.idle_problems == []
    assert len(r.digests) == 2 and r.digests[0] == r.digests[1]
    assert r.output_tokens == prompts * 3
    assert r.l1_evicted_tokens > 0 and r.l2_evicted_tokens > 0
    assert r.l3_backup_tokens > 0
    assert len(r.peak_rss_mib) == 2 and all(m > 0 for m in r.peak_rss_mib)
    assert r.agreement_us_per_step is not None and r.agreement_us_per_step > 0
    if model in HYBRIDS:
        assert HYBRIDS[model] in r.components
    if model == "tiny-random-deepseek-v32":
        assert "indexer" in r.components and r.l3_backup_indexer_pages > 0
    assert any(Path(tmp_path).rglob("*")), "nothing was written to L3"


@pytest.mark.matrix
def test_two_nodes_end_idle_and_equal(tmp_path: Path) -> None:
    """The same run with its 2 ranks on 2 "nodes" (node 1 a process tree of its own that
    joins node 0's rendezvous, as ``hicache serve --node-rank 1`` does)."""
    r = run_stress(small(tmp_path, model="tiny-random-llama", nnodes=2, prompts=24))
    assert not r.hung and r.failed == 0 and r.idle_problems == []
    assert r.nnodes == 2 and len(r.digests) == 2 and r.digests[0] == r.digests[1]
    assert r.output_tokens == 24 * 3 and r.l1_evicted_tokens > 0
    assert len(r.peak_rss_mib) == 2 and all(m > 0 for m in r.peak_rss_mib)
    with pytest.raises(ValueError, match=r"nnodes=3 is invalid; must divide ranks \(4\)"):
        StressConfig(ranks=4, nnodes=3)
