"""``hicache bench agentic`` end to end on the tiny preset: two configs against real
servers (tiny random model, CPU, ~20 s), the JSON's figures, the table, a config the
server lacks reported (never dropped), and the configs' server flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache.bench import agentic
from hicache.bench.agentic_trace import TraceShape, make_trace
from hicache.bench.runner import TOKEN_HI, TOKEN_LO
from hicache.bench.serverproc import ConfigSkippedError


def test_tiny_run_two_configs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "agentic.json", tmp_path / "agentic.png"
    argv = ["--configs", "l1_l2,l3", "--setting", "file-l3", "--json", str(out),
            "--plot", str(png)]  # fmt: skip
    assert agentic.main(argv) == 0
    doc = json.loads(out.read_text())
    assert set(doc["configs"]) == {"l1_l2", "l3"} and not doc["problems"]
    assert doc["order"] == [["l1_l2", "l3"]]
    shape = TraceShape(
        **{k: tuple(v) if isinstance(v, list) else v for k, v in doc["shape"].items()}
    )
    trace = make_trace(shape, 0, 0, (TOKEN_LO, TOKEN_HI))
    for name, c in doc["configs"].items():
        assert 0 < c["session_ttft"][0] <= c["session_ttft"][1] <= c["session_ttft"][2], name
        assert 0 < c["oneoff_ttft"][0] <= c["oneoff_ttft"][2]
        assert c["requests_per_s"] > 0 and c["restores"] == 0
        assert 0 < sum(c["hit_share"].values()) <= 1
        # what a perfect cache computes: each turn's new tokens and every one-off whole
        assert c["bound_tokens"] >= trace.working_set_tokens() - len(trace.system) - sum(
            trace.shape.output_tokens * s.turns for s in trace.sessions
        )
        assert c["computed_tokens"] >= c["bound_tokens"] - 16 * trace.requests()  # whole pages
    assert doc["configs"]["l1_l2"]["l3_written_bytes"] is None  # no L3: no counter
    assert doc["configs"]["l3"]["l3_written_bytes"] > 0
    assert "--hicache-storage-backend" in doc["server_flags"]["l3"]
    assert "--enable-hierarchical-cache" in doc["server_flags"]["l1_l2"]
    table = capsys.readouterr().out
    assert "| l1_l2 |" in table and "| l3 |" in table
    assert png.stat().st_size > 0


def test_a_flag_the_server_rejects_skips_the_config() -> None:
    spec = agentic.AgenticSpec(model_path="tiny-random-llama", page_size=16, l1_tokens=256,
                               l2_ratio=2.0, setting="file-l3", slow_l3_read_s=0.0,
                               session_ttl_ms=1000, extra_flags=("--no-such-flag",))  # fmt: skip
    with (
        pytest.raises(ConfigSkippedError, match="--no-such-flag"),
        agentic.agentic_server("l1", spec),
    ):
        pass


def test_flags_of_each_config() -> None:
    spec = agentic.AgenticSpec(model_path="m", page_size=16, l1_tokens=256, l2_ratio=2.0,
                               setting="slow-l3", slow_l3_read_s=1.5, session_ttl_ms=9000)  # fmt: skip
    flags = {n: spec.flags(n, "/tmp/l3") for n in agentic.AGENTIC_CONFIGS}
    assert "--enable-hierarchical-cache" not in flags["l1"]
    assert "--hicache-storage-backend" not in flags["l1_l2"]
    extra = json.loads(flags["l3"][flags["l3"].index("--hicache-storage-backend-extra-config") + 1])
    assert extra["get_delay_s"] == 1.5 and flags["l3"][flags["l3"].index(
        "--hicache-storage-backend") + 1] == "memory"  # fmt: skip
    assert flags["watermark"][-4:] == ["--hicache-write-policy", "watermark",
                                       "--hicache-write-back-threshold", "0.8"]  # fmt: skip
    assert flags["hints"] == flags["hints_restore"]  # the same server; the client differs
    assert flags["hints"][: len(flags["l3"])] == flags["l3"]
    assert "--hicache-session-ratio" in flags["hints"]
