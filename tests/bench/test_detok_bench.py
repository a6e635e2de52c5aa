"""``hicache bench detok`` runs end to end on a small batch and writes its figures."""

from __future__ import annotations

import json
from pathlib import Path

from hicache.bench import detok


def test_detok_bench_writes_both_modes(tmp_path: Path) -> None:
    out = tmp_path / "detok.json"
    argv = ["--requests", "2", "--tokens", "80", "--repeat", "1", "--json", str(out)]
    assert detok.main(argv) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["mode"] for r in runs] == ["full", "incremental"]
    assert all(r["requests"] == 2 and r["tokens"] == 80 and r["step_ms_mean"] > 0 for r in runs)
