"""``hicache bench pd`` and the benchmarks' ``/generate`` client, on the tiny random model.

* ``hicache bench pd`` with its smallest settings: every row of the table is there, with
  the request and token counts the workload implies, sane times and hit rates, and a PD
  pair (with and without decode offload) generating exactly the tokens one plain
  instance generates;
* ``hicache bench multiturn --api generate --url SMG``: the multi-turn bench through
  SGLang's router in front of two instances (smg's ``/v1/completions`` refuses token
  ids; its ``/generate`` forwards them) gives the prompt counts of the workload and
  hits in round 2;
* a setup that cannot start is reported and nothing it started is left running;
  ``--time-limit`` stops setups from starting;
* :func:`stream_generate` and :func:`stream_completion` on one instance: the same prompt
  and output counts and the same cache report for the same prompt.

Skipped without ``smg`` (failed under ``CI=true``), like the router tests.
"""

from __future__ import annotations

import asyncio
import json
import os
from contextlib import ExitStack
from pathlib import Path

import pytest

from hicache.bench import multiturn, pd
from hicache.bench.httpclient import flush_cache, stream_completion, stream_generate
from hicache.bench.runner import bench_client
from hicache.bench.serverproc import ADMIN_KEY, ServerProcess
from hicache.bench.smgproc import Smg
from tests.helpers.smg import require_smg

TINY = ("--model-path", "tiny-random-llama", "--device", "cpu", "--page-size", "8")


@pytest.mark.matrix
@pytest.mark.timeout(120)
def test_pd_bench_smallest_settings_every_row_sane(tmp_path: Path) -> None:
    require_smg()
    out, png = tmp_path / "pd.json", tmp_path / "pd.png"
    argv = ["--conversations", "2", "--turns", "2", "--user-tokens", "16", "--max-tokens", "4",
            "--clients", "2", "--tenants", "3", "--questions", "2", "--prefix-tokens", "32",
            "--question-tokens", "8", "--json", str(out), "--plot", str(png)]  # fmt: skip
    assert pd.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["problems"] == {}
    rows = {(r["workload"], r["setup"]): r for r in doc["rows"]}
    assert set(rows) == {("multiturn", s) for s in pd.MULTITURN_SETUPS} | {
        ("shared-prefix", s) for s in pd.SHARED_PREFIX_SETUPS
    }
    # turn 1: 16 ids; turn 2: 16 + 4 generated + 16; two conversations
    mt_prompt = 2 * (16 + 36)
    for (workload, setup), r in rows.items():
        multi = workload == "multiturn"
        assert r["requests"] == (4 if multi else 6), (workload, setup)
        assert r["prompt_tokens"] == (mt_prompt if multi else 6 * 40)
        assert r["output_tokens"] == r["requests"] * 4  # ignore_eos: exactly max_tokens
        assert 0 < r["ttft_mean_s"] < 10 and 0 < r["itl_mean_s"] < 5
        assert 0 <= r["hit_rate"] < 1 and r["req_per_s"] > 0 and r["wall_s"] > 0
        assert r["ttft_ratio"] > 0 and r["req_per_s_ratio"] > 0
        if setup == "plain":
            assert r["ttft_ratio"] == r["itl_ratio"] == r["req_per_s_ratio"] == 1.0
            assert r["same_outputs"] == [r["requests"], r["requests"]]
        else:  # greedy: the same tokens as one plain instance, through PD or smg
            assert r["same_outputs"] == [r["requests"], r["requests"]], (workload, setup)
        assert (len(r["split"]), sum(r["split"])) == ((2, 6) if "smg_" in setup else (0, 0))
        # 4 answer tokens after a 16-id prompt fill no page of their own (page 8)
        assert r["next_turn_hits"] == ([0, 0] if multi else None)
    # turn 2 hits at least the first turn's 16 prompt ids (2 pages) on every setup
    for setup in pd.MULTITURN_SETUPS:
        assert rows["multiturn", setup]["hit_rate"] >= 16 / 36
    # on one instance a tenant's second question hits its 32-id prefix (unless it ran
    # beside the first)
    assert 0 < rows["shared-prefix", "plain"]["hit_rate"] <= 3 * 32 / (6 * 40)
    assert png.stat().st_size > 0


def _children() -> list[str]:
    """This process's live children (``pid comm``), from ``/proc``."""
    me, found = os.getpid(), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            pid_comm, rest = stat.read_text().rsplit(")", 1)
        except OSError:
            continue
        fields = rest.split()
        if int(fields[1]) == me and fields[0] != "Z":
            found.append(pid_comm.replace(" (", " "))
    return found


@pytest.mark.matrix  # 10 s
@pytest.mark.timeout(120)
def test_pd_bench_reports_failed_setups_and_leaves_nothing_running(tmp_path: Path) -> None:
    require_smg()
    before = _children()
    out = tmp_path / "pd.json"
    argv = ["--model-path", "no-such-model", "--startup-timeout", "20", "--json", str(out)]
    assert pd.main(argv) == 1
    doc = json.loads(out.read_text())
    assert doc["rows"] == []
    assert set(doc["problems"]) == {
        "plain", "multiturn/pd", "multiturn/pd_offload", "shared-prefix/smg"
    }  # fmt: skip
    assert all(why.startswith("ServerError") for why in doc["problems"].values())
    assert _children() == before
    argv = ["--time-limit", "0.5", "--setups", "pd", "--json", str(out)]
    assert pd.main(argv) == 1
    assert json.loads(out.read_text())["problems"] == {
        "multiturn/pd": "TimeLimitError: the time limit (--time-limit) was reached before it ran"
    }


@pytest.mark.timeout(120)
def test_multiturn_through_smg_with_generate(tmp_path: Path) -> None:
    require_smg()
    out = tmp_path / "mt.json"
    with ExitStack() as stack:
        a = stack.enter_context(ServerProcess(TINY))
        b = stack.enter_context(ServerProcess(TINY))
        smg = stack.enter_context(
            Smg(worker_urls=[a.url, b.url], policy="cache_aware", api_key=ADMIN_KEY)
        )
        argv = ["--url", smg.url, "--api", "generate", "--num-clients", "2",
                "--num-rounds", "2", "--request-length", "32", "--output-length", "4",
                "--repeats", "1", "--page-size", "8", "--json", str(out)]  # fmt: skip
        assert multiturn.main(argv) == 0
    doc = json.loads(out.read_text())
    (c,) = doc["configs"].values()
    rounds = c["rounds"]
    assert [r["prompt_tokens"] for r in rounds] == [2 * 32, 2 * (32 + 4 + 32)]
    assert c["hit_tokens"]["device"] >= 2 * 32  # round 2 hits round 1's prompt
    assert c["ttft_mean_s"] > 0


@pytest.mark.timeout(60)
def test_generate_and_completions_report_the_same() -> None:
    ids = list(range(1000, 1040))

    async def both(url: str) -> None:
        async with bench_client(2, 30.0) as client:
            gen = await stream_generate(client, url, ids, 5, group=0, client_id=0)
            comp = await stream_completion(client, url, ids, 5, group=0, client_id=0)
            await flush_cache(client, url)
            again = await stream_generate(client, url, ids, 5, group=1, client_id=0)
        assert (gen.prompt_tokens, gen.output_tokens, len(gen.output_ids)) == (40, 5, 5)
        assert (comp.prompt_tokens, comp.output_tokens) == (40, 5)
        assert gen.cached == {"device": 0, "host": 0, "storage": 0}
        assert comp.cached == {"device": 32, "host": 0, "storage": 0}  # whole pages
        assert again.cached == gen.cached and again.output_ids == gen.output_ids
        assert gen.itl_s is not None and gen.itl_s > 0 and comp.itl_s is None
        assert 0 < gen.ttft_s <= gen.latency_s

    with ServerProcess(TINY) as server:
        asyncio.run(both(server.url))
