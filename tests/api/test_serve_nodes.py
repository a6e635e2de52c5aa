"""Tensor parallelism across nodes: ``hicache serve --nnodes 2 --node-rank R
--dist-init-addr 127.0.0.1:P``, two "nodes" as two process trees on loopback (real rank
processes, gloo, CPU, tiny-random-llama: 4 query heads, 2 K/V heads).

* greedy answers equal a single-node server's at the same TP size (TP 2 as 2 x 1; TP 4 as
  2 x 2, which replicates the K/V heads, in the ``matrix`` marker), with an L3 (``file``)
  that serves the prefix back after a flush; node 0 stopped, node 1 stops with it (0);
* node 1 frozen (SIGSTOP) turns node 0's ``/health`` 503 naming its rank and node within
  the heartbeat bound, and 200 again once resumed (SIGCONT), same answers; node 1 killed
  makes node 0 name its rank lost (``/health``, then its exit, code 1);
* bad starts fail within a bound, naming the node: ``--node-rank`` out of range,
  ``--nnodes`` that differ between nodes, an unreachable ``--dist-init-addr``, a node 1
  that never comes, ``--tp-size`` not divisible by ``--nnodes``;
* a PD prefill instance spanning both nodes, paired with a decode instance, answers as a
  plain server.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from hicache.bench.serverproc import ADMIN_KEY, ServerProcess
from hicache.config import CacheConfig
from hicache.engine.front.engine import Engine, EngineConfig
from hicache.server.app import create_app
from hicache.services.process import free_port
from tests.api.test_serve_tp import rank_pids
from tests.disagg.test_pd_tp import body, generate, through_pair
from tests.helpers.api_fixtures import serve_app

HICACHE = [sys.executable, "-m", "hicache.cli", "serve"]
TINY = ["--model-path", "tiny-random-llama", "--device", "cpu", "--dtype", "float32"]
BASE = [*TINY, "--page-size", "4", "--context-length", "256"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}
START_S = 240.0
PROMPT = [5, 17, 29, 3, 41, 8, 12, 99, 7, 51, 60, 22, 33, 44, 1, 2, 3]
BAD_START_S = 60.0
"""Bound on a start that fails: the interpreter's and torch's import on a busy 2-core
host, plus the ``--dist-init-timeout 5`` of those that wait."""
pytestmark = [
    pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two nodes need 2 CPU cores"),
    pytest.mark.timeout(900),
]


def node_flags(tp: int, port: int, rank: int, *, timeout_s: float = 120.0) -> list[str]:
    return [
        "--tp-size",
        str(tp),
        "--nnodes",
        "2",
        "--node-rank",
        str(rank),
        "--dist-init-addr",
        f"127.0.0.1:{port}",
        "--dist-init-timeout",
        str(timeout_s),
    ]


@contextmanager
def other_node(argv: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``hicache serve *argv`` as a node other than node 0 (no HTTP); its output goes to
    ``log``; killed (its ranks too) on the way out if still running."""
    with log.open("wb") as out:
        proc = subprocess.Popen([*HICACHE, *argv], stdout=out, stderr=subprocess.STDOUT, env=ENV)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
            proc.wait(timeout=30)


def tree(pid: int) -> list[int]:
    """``pid`` and its spawned ranks."""
    return [pid, *rank_pids(pid)]


def kill_tree(pid: int) -> None:
    for p in tree(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGCONT)
            os.kill(p, signal.SIGKILL)


@contextmanager
def two_nodes(
    flags: list[str], tp: int, log: Path
) -> Iterator[tuple[ServerProcess, subprocess.Popen[bytes]]]:
    """Node 0 (a :class:`ServerProcess`, serving HTTP) and node 1 of a ``tp``-rank
    group over two process trees; node 1 started first (it waits for node 0)."""
    port = free_port()
    with other_node([*flags, *node_flags(tp, port, 1)], log) as node1:
        node0 = ServerProcess([*flags, *node_flags(tp, port, 0)], startup_timeout_s=START_S)
        try:
            node0.start()
            yield node0, node1
        finally:
            node0.close()


def complete(url: str, prompt: list[int] = PROMPT, timeout: float = 120.0) -> httpx.Response:
    body = {"model": "tiny-random-llama", "prompt": prompt, "max_tokens": 6}
    body |= {"temperature": 0, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout)


def answer(url: str, prompt: list[int] = PROMPT) -> tuple[str, int]:
    """The completion's text and its tokens served from L3."""
    r = complete(url, prompt)
    assert r.status_code == 200, r.text
    out = r.json()
    return str(out["choices"][0]["text"]), int(out["usage"]["cached_tokens_details"]["storage"])


def flush(url: str) -> None:
    r = httpx.post(
        f"{url}/flush_cache", headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=60
    )
    assert r.status_code == 200, r.text


def l3_flags(path: Path) -> list[str]:
    extra = json.dumps({"file_path": str(path), "prefetch_threshold": 0})
    return [
        "--enable-hierarchical-cache",
        "--hicache-storage-backend",
        "file",
        "--hicache-storage-backend-extra-config",
        extra,
        "--hicache-load-back-threshold",
        "0",
    ]


@contextmanager
def one_node(tp: int) -> Iterator[str]:
    """A single-node engine of ``BASE``'s settings at ``tp`` ranks, served in this process
    (the reference answers: a ``hicache serve`` process would add its start-up)."""
    config = EngineConfig(
        model_path="tiny-random-llama",
        device="cpu",
        dtype="float32",
        tp_size=tp,
        context_length=256,
        cache=CacheConfig(page_size=4),
    )
    with (
        Engine(config).start() as engine,
        serve_app(create_app(engine, "tiny-random-llama")) as url,
    ):
        yield url


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.matrix)])
def test_two_nodes_answer_as_one_with_an_l3(tmp_path: Path, tp: int) -> None:
    prompts = [PROMPT, [*PROMPT[:12], 90, 91, 92, 93, 94]]
    with one_node(tp) as url:
        want = [answer(url, p)[0] for p in prompts]
    flags = [*BASE, *l3_flags(tmp_path / "l3")]
    log = tmp_path / "node1.log"
    with two_nodes(flags, tp, log) as (node0, node1):
        got = [answer(node0.url, p) for p in prompts]
        assert [t for t, _ in got] == want
        flush(node0.url)  # L1 and L2 emptied on every rank of both nodes: L3 serves the prefix
        text, storage = answer(node0.url)
        assert text == want[0]
        assert storage >= 12, storage
        node0.close()  # SIGTERM: node 0 stops its ranks, node 1's among them
        assert node1.wait(timeout=60) == 0, log.read_text()
    assert "Traceback" not in log.read_text()


def test_a_frozen_then_killed_node_is_named(tmp_path: Path) -> None:
    log = tmp_path / "node1.log"
    with two_nodes(BASE, 2, log) as (node0, node1):
        want = answer(node0.url)[0]
        pids = tree(node1.pid)
        assert len(pids) == 2, pids  # node 1's hicache serve and its rank
        for p in pids:
            os.kill(p, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            reason = ""
            while time.monotonic() - stopped < 30:
                r = httpx.get(f"{node0.url}/health", timeout=5)
                if r.status_code == 503:
                    reason = r.text
                    break
                time.sleep(0.3)
            took = time.monotonic() - stopped
            assert "rank 1 (node 1) has not answered" in reason, reason
            assert took < 15, took
        finally:
            for p in pids:
                os.kill(p, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while httpx.get(f"{node0.url}/health", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, "node 0 did not become healthy again"
            time.sleep(0.3)
        assert answer(node0.url)[0] == want

        kill_tree(node1.pid)  # the whole node: its hicache serve and its rank
        assert_named_lost(node0, "node 1 (rank 1) was lost")


@pytest.mark.matrix
def test_a_killed_rank_of_node_1_is_named(tmp_path: Path) -> None:
    log = tmp_path / "node1.log"
    with two_nodes(BASE, 2, log) as (node0, node1):
        answer(node0.url)
        (rank,) = rank_pids(node1.pid)
        os.kill(rank, signal.SIGKILL)
        assert_named_lost(node0, f"node 1: rank 1 (pid {rank}) exited with code -9")
        assert node1.wait(timeout=60) == 1
    assert "rank 1" in log.read_text()


def assert_named_lost(node0: ServerProcess, named: str) -> None:
    """Node 0 names the loss: ``/health`` (503 until its port closes; it may exit before
    a probe lands, or first say that its own collective failed) and its exit (1) with the
    reason on stderr, within seconds."""
    killed = time.monotonic()
    said = []
    while time.monotonic() - killed < 30:
        try:
            r = httpx.get(f"{node0.url}/health", timeout=5)
        except httpx.HTTPError:
            break  # the port is closed: the server has exited
        if r.status_code != 200:
            said.append(r.text)  # first, perhaps, rank 0's own failed collective
            if named in r.text:
                break
        time.sleep(0.05)
    assert not said or named in said[-1], said
    assert node0.proc is not None
    assert node0.proc.wait(timeout=60) == 1
    assert time.monotonic() - killed < 30
    tail = node0.log_tail(80)
    assert f"hicache serve: error: {named}" in tail, tail


def bad_start(argv: list[str], *, http: bool = False) -> subprocess.CompletedProcess[str]:
    extra = ["--port", str(free_port())] if http else []
    began = time.monotonic()
    r = subprocess.run(
        [*HICACHE, *argv, *extra], capture_output=True, text=True, timeout=300, env=ENV
    )
    took = time.monotonic() - began
    assert r.returncode == 2, r.stderr
    assert took < BAD_START_S, f"{took:.0f} s: {r.stderr}"
    assert "Traceback" not in r.stderr, r.stderr
    return r


def error_line(r: subprocess.CompletedProcess[str]) -> str:
    errors = [ln for ln in r.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1, r.stderr
    return errors[0]


@pytest.mark.matrix
def test_bad_node_flags_fail_the_start_naming_the_node() -> None:
    port = free_port()
    # --node-rank out of range: refused at once, before any rendezvous
    argv = [*BASE, *node_flags(2, port, 2)]
    line = error_line(bad_start(argv))
    assert "node 2: --node-rank 2 is invalid; must be in [0, 1]" in line, line
    # --tp-size that the nodes cannot share
    argv = [*BASE, *node_flags(3, port, 0)]
    line = error_line(bad_start(argv, http=True))
    assert "--tp-size 3 is invalid with nnodes=2" in line, line
    # node 1 with no node 0 at --dist-init-addr
    argv = [*BASE, *node_flags(2, port, 1, timeout_s=5)]
    line = error_line(bad_start(argv))
    assert f"node 1 could not reach node 0's --dist-init-addr 127.0.0.1:{port}" in line, line
    # node 0 at an address that is not its own
    argv = [*BASE, *node_flags(2, port, 0)]
    argv[argv.index(f"127.0.0.1:{port}")] = f"203.0.113.7:{port}"
    line = error_line(bad_start(argv, http=True))
    assert f"node 0 cannot listen on --dist-init-addr 203.0.113.7:{port}" in line, line
    # node 0 whose node 1 never comes
    argv = [*BASE, *node_flags(2, port, 0, timeout_s=5)]
    line = error_line(bad_start(argv, http=True))
    assert "node 1 did not reach --dist-init-addr in time" in line, line


def test_nodes_started_with_other_nnodes_both_fail_naming_the_node(tmp_path: Path) -> None:
    port = free_port()
    node1 = [*BASE, "--tp-size", "4", "--nnodes", "4", "--node-rank", "1"]
    node1 += ["--dist-init-addr", f"127.0.0.1:{port}", "--dist-init-timeout", "30"]
    with other_node(node1, tmp_path / "node1.log") as proc:
        r = bad_start([*BASE, *node_flags(2, port, 0, timeout_s=30)], http=True)
        line = error_line(r)
        assert "node 1 was started with --nnodes 4, node 0 with --nnodes 2" in line, line
        assert proc.wait(timeout=60) == 2
    text = (tmp_path / "node1.log").read_text()
    assert "node 1 was started with --nnodes 4, node 0 with --nnodes 2" in text, text


@pytest.mark.matrix
def test_a_prefill_instance_spanning_two_nodes_pairs_with_a_decode_instance(
    tmp_path: Path,
) -> None:
    with ServerProcess(BASE, startup_timeout_s=START_S) as plain:
        want = generate(plain.url, body())
    bootstrap = free_port()
    pd = ["--disaggregation-transfer-backend", "mooncake"]
    prefill = [*BASE, *pd, "--disaggregation-mode", "prefill"]
    prefill += ["--disaggregation-bootstrap-port", str(bootstrap)]
    decode = [*BASE, *pd, "--disaggregation-mode", "decode"]
    with (
        two_nodes(prefill, 2, tmp_path / "node1.log") as (node0, _),
        ServerProcess(decode, startup_timeout_s=START_S) as dec,
    ):
        for room, stream in ((11, False), (12, True)):
            got = through_pair(node0, dec, bootstrap, room, stream)
            assert got == want
