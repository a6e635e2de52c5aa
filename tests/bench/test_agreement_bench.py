"""``hicache bench agreement`` runs real ranks and reports a median per rank and op count."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hicache.bench.agreement import main

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="2 ranks need 2 CPU cores")


def test_the_agreement_bench_reports_every_rank(tmp_path: Path) -> None:
    out = tmp_path / "agreement.json"
    assert main(["--ranks", "2", "--ops", "0,4", "--iters", "20", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["ranks"] == 2 and [r["ops"] for r in doc["rows"]] == [0, 4]
    for row in doc["rows"]:
        assert len(row["sync_us_by_rank"]) == 2 and all(v > 0 for v in row["sync_us_by_rank"])
        assert row["all_reduce_tensor_us"] > 0 and row["all_reduce_int_us"] > 0


def test_bad_flags_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--ranks", "1"])
    assert "at least 2 ranks" in capsys.readouterr().err
